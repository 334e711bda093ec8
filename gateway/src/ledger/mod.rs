//! The effect ledger: operations, their state machine and the append-only
//! transition history.
//!
//! The state machine (docs/design.md):
//!
//! ```text
//! RESERVED ──► EXECUTING ──2xx──► COMPLETED ──► COMPENSATED
//!    │             │ ──permanent error──► FAILED
//!    │             └──timeout / reset after send / 5xx──► UNKNOWN
//!    └──► AWAITING_APPROVAL ──► EXECUTING | FAILED
//! UNKNOWN ──read-back found──► COMPLETED
//! UNKNOWN ──read-back absent──► EXECUTING (same operation, new fence token)
//! UNKNOWN ──read-back error──► UNKNOWN (backoff) ──past the bound──► FAILED (dead letter)
//! FAILED (dead letter) ──operator requeue──► UNKNOWN (read back first) | RESERVED
//! COMPLETED ──its compensating operation `<id>#compensation` COMPLETED
//!             (same transaction)──► COMPENSATED
//! ```
//!
//! A compensation is an operation of its own, with its own provider key,
//! lease, fence, read-back and dead letter; its reservation appends a
//! COMPLETED → COMPLETED audit row to the original, and the transaction
//! that records it COMPLETED moves the original to COMPENSATED
//! (`command/compensation.rs`).
//!
//! The only way to change an operation's state is a method of [`Ledger`],
//! and each of them applies one command of the transition table
//! (`command/`): one SQL compare-and-swap (`INSERT … ON CONFLICT DO
//! NOTHING`, `UPDATE … WHERE version = ?` or `… WHERE fence = ?`) plus a
//! row in `transitions`, in one transaction, refused before any write if
//! the state machine has no such transition. Application code never
//! checks-then-acts.
//!
//! Layout: `db/` is [`Ledger`], the interface; `command/` the transition
//! table; `store/` the statements, written once and generic over a
//! `dialect::Dialect` that `sqlite.rs` and `postgres.rs` implement.

/// The test suites' record of tests skipped for a missing component (the
/// same file `tests/` and `gateway/tests/` use): under `CI` a skip fails.
#[cfg(test)]
#[path = "../../../tests/src/skips.rs"]
pub mod test_skips;

mod approval;
mod command;
mod compensation;
mod db;
mod dialect;
mod inbox;
mod postgres;
mod replay_cache;
mod settle;
mod sqlite;
mod store;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use serde::Serialize;

pub use approval::{Approval, DeadEvent, Decision as ApprovalDecision, NewApproval, OutboxEvent};
pub use compensation::{CompensationLink, CompensationReservation, NewCompensation};
pub use db::Ledger;
pub use inbox::{
    INBOX_STATES, InboxEvent, Naming, NewInboxEvent, Ordering as InboxOrdering, Received,
    Resolution, Resolve, Resolved, Resolving, Says, delivery_id,
};
pub use settle::{SettleVerdict, SettleWindows};
pub use store::{
    QuarantineAction, QuarantineDecision, Subscriptions, event_type as operation_event_type,
};

/// A source of time in ms since the Unix epoch. Injected so tests can
/// drive lease expiry without sleeping.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now, in ms since the Unix epoch.
    fn now_ms(&self) -> i64;

    /// Now on a clock that never steps, in ms from an arbitrary origin
    /// (the first reading in this process): for durations measured within
    /// one process, such as the read-back settle window, which a step of
    /// the wall clock must not shorten. By default tokio's
    /// [`tokio::time::Instant`], so a test can drive it with
    /// `tokio::time::pause` and `advance`; a [`ManualClock`] answers its
    /// own reading (its `advance` is time passing, for both readings).
    fn monotonic_ms(&self) -> i64 {
        monotonic_now_ms()
    }
}

/// ms on tokio's monotonic clock since the first call in this process.
fn monotonic_now_ms() -> i64 {
    static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(tokio::time::Instant::now);
    i64::try_from(
        tokio::time::Instant::now()
            .saturating_duration_since(origin)
            .as_millis(),
    )
    .unwrap_or(i64::MAX)
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock at `start_ms`.
    pub fn new(start_ms: i64) -> Arc<Self> {
        Arc::new(Self(AtomicI64::new(start_ms)))
    }
    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: i64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }

    fn monotonic_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The ledger's clock: a base clock plus an offset. On SQLite the offset
/// is what [`Ledger::shift_clock`] added (a step of the wall clock); on
/// PostgreSQL it is the measured distance to the database clock. Its
/// monotonic reading is the base clock's: a step moves no duration.
#[derive(Debug)]
struct LedgerClock {
    base: Arc<dyn Clock>,
    offset_ms: AtomicI64,
}

impl LedgerClock {
    fn new(base: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            base,
            offset_ms: AtomicI64::new(0),
        })
    }

    /// Adds `ms` (negative: back) to the offset, saturating.
    fn shift(&self, ms: i64) {
        let _ = self
            .offset_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| {
                Some(o.saturating_add(ms))
            });
    }

    /// Sets the offset so that now is `reference_now_ms` (the database clock).
    fn follow(&self, reference_now_ms: i64) {
        self.offset_ms
            .store(reference_now_ms - self.base.now_ms(), Ordering::SeqCst);
    }
}

impl Clock for LedgerClock {
    fn now_ms(&self) -> i64 {
        self.base
            .now_ms()
            .saturating_add(self.offset_ms.load(Ordering::SeqCst))
    }

    fn monotonic_ms(&self) -> i64 {
        self.base.monotonic_ms()
    }
}

/// The state of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    /// Recorded; nothing has been sent to the provider yet.
    Reserved,
    /// Waiting for a human decision; nothing has been sent.
    AwaitingApproval,
    /// A lease holder is calling the provider.
    Executing,
    /// The provider applied the effect; the response is stored.
    Completed,
    /// The provider refused permanently (or the operation was stopped); stored.
    Failed,
    /// The provider may or may not have applied the effect.
    Unknown,
    /// A completed effect was undone by a compensating action.
    Compensated,
}

impl State {
    /// All states.
    pub const ALL: [State; 7] = [
        State::Reserved,
        State::AwaitingApproval,
        State::Executing,
        State::Completed,
        State::Failed,
        State::Unknown,
        State::Compensated,
    ];

    /// The name stored in the ledger, e.g. `EXECUTING`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Reserved => "RESERVED",
            State::AwaitingApproval => "AWAITING_APPROVAL",
            State::Executing => "EXECUTING",
            State::Completed => "COMPLETED",
            State::Failed => "FAILED",
            State::Unknown => "UNKNOWN",
            State::Compensated => "COMPENSATED",
        }
    }

    /// Whether no automatic transition leaves this state.
    pub fn is_terminal(self) -> bool {
        matches!(self, State::Completed | State::Failed | State::Compensated)
    }

    /// Whether the state machine allows `self → to`.
    pub fn can_transition_to(self, to: State) -> bool {
        use State::*;
        matches!(
            (self, to),
            (Reserved, Executing)
                | (Reserved, AwaitingApproval)
                | (AwaitingApproval, Executing)
                | (AwaitingApproval, AwaitingApproval)
                | (Completed, Completed)
                | (AwaitingApproval, Failed)
                | (Executing, Completed)
                | (Executing, Failed)
                | (Executing, Unknown)
                | (Executing, Executing)
                | (Unknown, Completed)
                | (Unknown, Executing)
                | (Unknown, Failed)
                | (Unknown, Unknown)
                | (Failed, Unknown)
                | (Failed, Reserved)
                | (Completed, Compensated)
        )
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for an unknown state name.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown operation state {0:?}; expected one of RESERVED, AWAITING_APPROVAL, EXECUTING, COMPLETED, FAILED, UNKNOWN, COMPENSATED"
)]
pub struct UnknownState(pub String);

impl FromStr for State {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// One operation row.
#[derive(Debug, Clone, Serialize)]
pub struct Operation {
    /// Tenant the operation belongs to.
    pub tenant_id: String,
    /// Operation id (the caller's idempotency key).
    pub operation_id: String,
    /// Route name.
    pub route: String,
    /// HTTP method.
    pub method: String,
    /// Path below the route prefix.
    pub path: String,
    /// Query string, if any.
    pub query: Option<String>,
    /// Request fingerprint (hex sha256).
    pub fingerprint: String,
    /// Key stamped on every provider attempt.
    pub provider_key: String,
    /// Effect class, when known.
    pub effect_class: Option<String>,
    /// Current state.
    pub state: State,
    /// Row version; bumped by every transition.
    pub version: i64,
    /// Provider attempts so far.
    pub attempts: i64,
    /// Current lease holder (gateway instance id).
    pub lease_owner: Option<String>,
    /// Lease expiry (ms since epoch).
    pub lease_expires_at: Option<i64>,
    /// Fencing token of the latest claim.
    pub fence: i64,
    /// Request content type.
    pub request_content_type: Option<String>,
    /// Request body as forwarded (bytes).
    #[serde(skip)]
    pub request_body: Vec<u8>,
    /// Principal that created the operation.
    pub principal: String,
    /// Stored response status.
    pub response_status: Option<i64>,
    /// Stored allow-listed response headers, `[[name, value], …]`.
    pub response_headers: Vec<(String, String)>,
    /// Stored response body (up to the route's limit).
    #[serde(skip)]
    pub response_body: Option<Vec<u8>>,
    /// Size of the provider's response body in bytes, when read whole.
    pub response_body_bytes: Option<i64>,
    /// True when the body was larger than the route's stored-response limit.
    pub response_body_omitted: bool,
    /// Error kind (`timeout`, `connection-lost`, `provider-5xx`, …).
    pub error_kind: Option<String>,
    /// Human-readable error detail.
    pub error_detail: Option<String>,
    /// Created (ms since epoch).
    pub created_at: i64,
    /// Last change (ms since epoch).
    pub updated_at: i64,
    /// Key retention end (ms since epoch): the last change plus the route's
    /// retention. Only a terminal operation that is not a dead letter is
    /// ever forgotten.
    pub expires_at: i64,
    /// Caller headers stored with the request, forwarded on every attempt.
    pub request_headers: Vec<(String, String)>,
    /// W3C `traceparent` of the request that created the operation, if any.
    pub trace_context: Option<String>,
    /// Read-backs made for this operation.
    pub reconcile_attempts: i64,
    /// Earliest time of the next reconciliation (ms since epoch).
    pub next_reconcile_at: Option<i64>,
    /// Whether the operation sits on the terminal route (dead letter).
    pub dead_letter: bool,
    /// Why it was dead-lettered.
    pub dead_letter_reason: Option<String>,
    /// What an operator must check before requeueing it.
    pub operator_check: Option<String>,
    /// The provider's reference for the effect (e.g. a charge id), when known.
    pub provider_reference: Option<String>,
    /// How often an operator requeued it.
    pub requeues: i64,
    /// A read-back's "absent" is trusted only from this time on (ms since
    /// epoch): the last attempt could have reached the provider until then
    /// plus the route's settle delay.
    pub settle_until: Option<i64>,
}

/// One recorded state change.
#[derive(Debug, Clone, Serialize)]
pub struct Transition {
    /// Sequence number: above that of every transition kept before it (an
    /// operation's history is in `seq` order). A number can come back only
    /// once every row above it is gone (SQLite numbers rows without
    /// AUTOINCREMENT, PostgreSQL from a sequence).
    pub seq: i64,
    /// State before (`None` for the reservation).
    pub from_state: Option<State>,
    /// State after.
    pub to_state: State,
    /// Row version after the change.
    pub version: i64,
    /// Fencing token after the change.
    pub fence: i64,
    /// Who made the change (principal or gateway instance).
    pub actor: String,
    /// Why.
    pub reason: String,
    /// When (ms since epoch).
    pub at: i64,
}

/// What a new reservation records.
#[derive(Debug, Clone)]
pub struct NewOperation {
    /// Tenant.
    pub tenant_id: String,
    /// Operation id.
    pub operation_id: String,
    /// Route name.
    pub route: String,
    /// Method.
    pub method: String,
    /// Path below the prefix.
    pub path: String,
    /// Query.
    pub query: Option<String>,
    /// Fingerprint.
    pub fingerprint: String,
    /// Provider key.
    pub provider_key: String,
    /// Effect class.
    pub effect_class: Option<String>,
    /// Request content type.
    pub request_content_type: Option<String>,
    /// Request body.
    pub request_body: Vec<u8>,
    /// Caller headers to forward on every attempt (already filtered; never
    /// `traceparent` or `tracestate`).
    pub request_headers: Vec<(String, String)>,
    /// W3C `traceparent` of the request span that created the operation
    /// (its trace id links later attempts and read-backs to it).
    pub trace_context: Option<String>,
    /// Principal name.
    pub principal: String,
    /// Key retention (ms).
    pub retention_ms: i64,
    /// Start in AWAITING_APPROVAL instead of RESERVED (a policy asked for
    /// approval).
    pub awaiting_approval: bool,
    /// Policy decisions to record with the reservation.
    pub decisions: Vec<DecisionRecord>,
    /// The approval to create with it (when `awaiting_approval`).
    pub approval: Option<NewApproval>,
}

/// One policy's decision, as recorded with the operation (policy_decisions
/// rows).
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// Policy name.
    pub policy: String,
    /// sha256 of the module.
    pub content_hash: String,
    /// `allow`, `deny`, `require-approval`, `failed-closed`, `failed-open`.
    pub decision: String,
    /// Reason or failure detail.
    pub reason: Option<String>,
    /// Time the call took, µs.
    pub duration_us: i64,
}

/// Result of [`Ledger::reserve`].
#[derive(Debug)]
pub enum Reservation {
    /// This call created the operation (state RESERVED).
    Created(Operation),
    /// The operation already existed; nothing was changed.
    Existing(Operation),
}

/// A held lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Fencing token; every later write must carry it.
    pub fence: i64,
    /// Row version after the claim.
    pub version: i64,
    /// Attempt number (1-based).
    pub attempt: i64,
    /// Lease expiry (ms since epoch).
    pub lease_expires_at: i64,
}

/// The outcome an executor records under its fencing token.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// COMPLETED, FAILED or UNKNOWN.
    pub state: State,
    /// Provider status, if a response head arrived.
    pub response_status: Option<u16>,
    /// Allow-listed headers.
    pub response_headers: Vec<(String, String)>,
    /// Body if stored.
    pub response_body: Option<Vec<u8>>,
    /// Body size in bytes, when known.
    pub response_body_bytes: Option<i64>,
    /// Body larger than the stored-response limit.
    pub response_body_omitted: bool,
    /// Error kind.
    pub error_kind: Option<String>,
    /// Error detail.
    pub error_detail: Option<String>,
    /// Short outcome of the provider attempt for the attempts log, e.g.
    /// `status-201`, `timeout`, `connection-lost`; `None` when the outcome
    /// comes from a read-back or an operator, not from an attempt.
    pub attempt_outcome: Option<String>,
    /// `x-request-id` of the caller's request the attempt was made for.
    pub request_id: Option<String>,
    /// Transition reason.
    pub reason: String,
    /// Keep the stored response fields as they are (UNKNOWN → UNKNOWN).
    pub keep_response: bool,
    /// Count one more read-back.
    pub count_read_back: bool,
    /// Earliest next reconciliation (ms since epoch).
    pub next_reconcile_at: Option<i64>,
    /// Put the operation on the terminal route with this reason and check.
    pub dead_letter: Option<DeadLetter>,
    /// The provider's reference for the effect.
    pub provider_reference: Option<String>,
    /// Set `settle_until` (ms since epoch), when entering UNKNOWN.
    pub settle_until: Option<i64>,
}

impl Outcome {
    /// An outcome with no response and nothing else set.
    pub fn new(state: State, reason: impl Into<String>) -> Self {
        Self {
            state,
            response_status: None,
            response_headers: Vec::new(),
            response_body: None,
            response_body_bytes: None,
            response_body_omitted: false,
            error_kind: None,
            error_detail: None,
            attempt_outcome: None,
            request_id: None,
            reason: reason.into(),
            keep_response: false,
            count_read_back: false,
            next_reconcile_at: None,
            dead_letter: None,
            provider_reference: None,
            settle_until: None,
        }
    }
}

/// Why an operation stopped running automatically.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// The reason (`retries-exhausted`, `reconciliation-out-of-bounds`, …).
    pub reason: String,
    /// What an operator must verify before requeueing.
    pub operator_check: String,
}

/// One provider attempt, as logged.
#[derive(Debug, Clone, Serialize)]
pub struct Attempt {
    /// Attempt number (1-based).
    pub attempt: i64,
    /// Fencing token the attempt ran under.
    pub fence: i64,
    /// Provider status, if a response head arrived.
    pub status: Option<i64>,
    /// Short outcome (`status-503`, `connect-failed`, `timeout`, …).
    pub outcome: String,
    /// Detail.
    pub detail: Option<String>,
    /// When the outcome was recorded (ms since epoch).
    pub at: i64,
    /// `x-request-id` of the caller's request it was made for (none for
    /// the reconciler's attempts).
    pub request_id: Option<String>,
}

/// One tenant's operations that need attention ([`Ledger::tenant_counts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantCounts {
    /// Tenant.
    pub tenant: String,
    /// Operations in UNKNOWN.
    pub unknown: i64,
    /// Operations on the terminal route (dead letters).
    pub dead_letters: i64,
    /// The oldest dead letter's last change, ms since epoch.
    pub oldest_dead_letter_at: Option<i64>,
    /// The last change of the UNKNOWN operation unresolved longest, ms since epoch.
    pub oldest_unknown_at: Option<i64>,
}

/// Errors of ledger writes.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The database failed. (The sqlx error is the message, not a
    /// `source`: it already carries the database's own text.)
    #[error("ledger database error: {0}")]
    Db(sqlx::Error),
    /// The database could not be reached at start (the URL is shown
    /// without its password).
    #[error("cannot reach the ledger database {url} (storage.url): {cause}")]
    Unreachable {
        /// `storage.url`, password hidden.
        url: String,
        /// The connection error.
        cause: String,
    },
    /// The requested transition is not in the state machine.
    #[error("transition {from} → {to} is not allowed")]
    IllegalTransition {
        /// From.
        from: State,
        /// To.
        to: State,
    },
    /// A migration failed.
    #[error("ledger migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A ledger call took longer than `storage.call_timeout_ms` (ms given).
    #[error("ledger call timed out after {0} ms")]
    Timeout(u64),
    /// The commit of the batch holding this write failed: nothing of it
    /// was kept (the database's message), except when the `COMMIT` itself
    /// stalled past `storage.call_timeout_ms` (PostgreSQL): then the message
    /// says its outcome is unknown, and a claim it held is found by the
    /// reconciler when its lease ends.
    #[error("ledger commit failed: {0}")]
    BatchCommit(String),
    /// Another write of the batch holding this one failed or was abandoned
    /// half-way before the batch's `COMMIT`, and the whole batch was rolled
    /// back (PostgreSQL, whose writes share the batch's transaction
    /// without savepoints): nothing of this write was kept, and it may
    /// simply run again, which the ledger does (up to [`UNDONE_RETRIES`]
    /// times, within `storage.call_timeout_ms`) before it reports this.
    #[error("ledger write undone before its commit: {0}")]
    BatchUndone(String),
    /// `[storage]` names no usable ledger.
    #[error("storage.url: {0}")]
    Config(String),
    /// Another process (or another ledger of this process) serves this
    /// SQLite ledger file ([`Ledger::hold_exclusively`]); the path.
    #[error(
        "the SQLite ledger {0} is served by another gateway process (its lock file {0}.lock is held); one process serves a SQLite ledger, several instances share PostgreSQL"
    )]
    InUse(String),
    /// The SQLite ledger's lock file can't be opened or locked.
    #[error("cannot lock the SQLite ledger: {0}")]
    LockFile(String),
    /// The SQLite ledger file doesn't exist and neither does its folder:
    /// the gateway creates the file, never the folder
    /// ([`crate::config::missing_folder_text`]).
    #[error("storage.path: {0}")]
    NoFolder(String),
}

/// How often one PostgreSQL ledger call runs again after losing a
/// deadlock (SQLSTATE 40P01) or a serialization failure (40001).
pub(crate) const DEADLOCK_RETRIES: u32 = 3;

/// How often one PostgreSQL ledger call runs again after its batch was
/// undone for another write ([`LedgerError::BatchUndone`]; the call's own
/// write did nothing wrong), within `storage.call_timeout_ms`.
pub(crate) const UNDONE_RETRIES: u32 = 16;

impl LedgerError {
    /// Whether the database refused the write for a deadlock (SQLSTATE
    /// `40P01`) or a serialization failure (`40001`): then nothing of it
    /// was kept and it may simply run again.
    pub fn is_deadlock(&self) -> bool {
        matches!(self, LedgerError::Db(sqlx::Error::Database(e))
            if matches!(e.code().as_deref(), Some("40P01" | "40001")))
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        LedgerError::Db(e)
    }
}

#[cfg(test)]
mod tests;
