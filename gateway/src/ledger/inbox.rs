//! The inbox: provider webhooks received once, ordered per sequence key.
//!
//! An event is one row of `inbox`, keyed `(tenant, source, event id)`: the
//! insert is `INSERT … ON CONFLICT DO NOTHING`, so a redelivery inserts
//! nothing and is answered as a duplicate. In the same transaction the
//! event's place in its sequence is decided (`inbox_sequences` holds the
//! last applied sequence per key), if it is accepted its delivery is
//! queued in the outbox, and what it says of the operation a `resolves`
//! rule names is applied and noted on its row ([`Resolving`]): one commit,
//! so a crash never leaves the event stored and its resolution undone.
//! Ordering rows of keys idle past the source's `sequence_window_ms` are
//! swept (never a key with a held or quarantined event). States:
//!
//! - `accepted`: applied and (when the source delivers) queued for delivery;
//! - `stale`: older than, or as old as, the last applied one of its key;
//!   never delivered;
//! - `held`: after a gap, waiting up to the source's `reorder_window_ms`;
//! - `quarantined`: the gap didn't fill and the source quarantines;
//!   waits for an operator to release (deliver) or drop it;
//! - `dropped`: an operator dropped it.

use serde::Serialize;

use super::{Operation, Outcome};

/// The states of an inbox event, as stored.
pub const INBOX_STATES: [&str; 5] = ["accepted", "stale", "held", "quarantined", "dropped"];

/// What a received event records.
#[derive(Debug, Clone)]
pub struct NewInboxEvent<'a> {
    /// Tenant of the source.
    pub tenant: &'a str,
    /// Source name.
    pub source: &'a str,
    /// The provider's event id.
    pub event_id: &'a str,
    /// Its type, when the body names one.
    pub event_type: Option<&'a str>,
    /// The body as received (JSON text).
    pub payload: &'a str,
    /// Queue its delivery to the tenant when accepted.
    pub deliver: bool,
    /// Its ordering, when the source orders events.
    pub ordering: Option<Ordering<'a>>,
    /// What the event says of the operation it may name, applied in the
    /// transaction that stores it (never for a duplicate).
    pub resolve: Option<&'a Resolving<'a>>,
}

/// How a `resolves` rule names an operation of the source's tenant.
pub enum Naming<'a> {
    /// The operation with this provider key.
    ProviderKey(String),
    /// The operation with this provider reference.
    Reference(String),
    /// The first UNKNOWN operation of `route` (newest change first, at
    /// most [`Resolving::max_candidates`] looked at) that `accepts`.
    Match {
        /// The route.
        route: &'a str,
        /// Whether the event names this operation.
        accepts: Box<dyn Fn(&Operation) -> bool + Send + Sync + 'a>,
    },
}

impl std::fmt::Debug for Naming<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ProviderKey(k) => f.debug_tuple("ProviderKey").field(k).finish(),
            Self::Reference(r) => f.debug_tuple("Reference").field(r).finish(),
            Self::Match { route, .. } => f.debug_struct("Match").field("route", route).finish(),
        }
    }
}

/// What an event says of the operation it names.
#[derive(Debug, Clone)]
pub enum Says {
    /// The effect exists: an UNKNOWN operation is recorded with this
    /// outcome (COMPLETED, the event's object as the stored response),
    /// under a reconciliation lease taken in the same transaction, the
    /// fenced write of a read-back "found".
    Succeeded(Box<Outcome>),
    /// It failed: not proof of absence; an UNKNOWN operation's next
    /// read-back is moved to now.
    Failed,
}

/// One `resolves` rule that applies to the event's type.
#[derive(Debug)]
pub struct Resolve<'a> {
    /// How it names the operation.
    pub naming: Naming<'a>,
    /// What the event says.
    pub says: Says,
}

/// The rules that may resolve an operation with a newly stored event: the
/// first that names an operation of `tenant` decides.
#[derive(Debug)]
pub struct Resolving<'a> {
    /// The rules, in the source's order.
    pub rules: Vec<Resolve<'a>>,
    /// The event's type (for the recorded resolution).
    pub event_type: &'a str,
    /// Actor of the recorded outcome (`inbox:<source>`).
    pub actor: &'a str,
    /// Owner of the reconciliation lease (the instance).
    pub lease_owner: &'a str,
    /// Its length (ms).
    pub lease_ms: i64,
    /// Reason of the lease's transition row.
    pub lease_reason: &'a str,
    /// Most UNKNOWN operations a `match` rule looks at.
    pub max_candidates: u32,
}

/// What a stored event did to the operation a rule named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// The UNKNOWN operation is COMPLETED from the event.
    Completed,
    /// A failure event: its read-back was moved to now.
    ReadBack,
    /// Nothing; why (`the operation is COMPLETED`, …).
    Ignored(String),
}

/// The operation an event named and what it did to it (noted on the
/// event's row in the same transaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// The operation.
    pub operation_id: String,
    /// What happened to it.
    pub resolved: Resolved,
    /// As noted on the row (`completed: charge.succeeded`, …).
    pub note: String,
}

/// Where an event sits in its sequence.
#[derive(Debug, Clone, Copy)]
pub struct Ordering<'a> {
    /// The entity it is about.
    pub key: &'a str,
    /// Its position for that key.
    pub sequence: i64,
    /// A skipped number is a gap (counters); otherwise only older is stale.
    pub gaps: bool,
    /// The first sequence of a key never seen.
    pub start: i64,
    /// How long (ms) it is held after a gap.
    pub reorder_window_ms: i64,
}

/// What receiving an event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Stored for the first time, in this state (`accepted`, `stale`,
    /// `held`); `released` more held events of its key were accepted
    /// behind it.
    Stored {
        /// Its state.
        state: String,
        /// Held events of its key it released, in order.
        released: Vec<String>,
        /// The outbox event id its delivery was queued under, if any.
        outbox_event_id: Option<String>,
        /// The operation a `resolves` rule named, and what it did.
        resolution: Option<Resolution>,
    },
    /// Seen before (within the dedupe window): nothing changed.
    Duplicate {
        /// The outbox event id the stored event's delivery was queued
        /// under, if it was (not for a source that doesn't deliver, nor
        /// yet for an event held for its order, nor for a stale one).
        outbox_event_id: Option<String>,
    },
}

/// One stored inbox event.
#[derive(Debug, Clone, Serialize)]
pub struct InboxEvent {
    /// Tenant.
    pub tenant_id: String,
    /// Source name.
    pub source: String,
    /// The provider's event id.
    pub event_id: String,
    /// Its type.
    pub event_type: Option<String>,
    /// `accepted`, `stale`, `held`, `quarantined`, `dropped`.
    pub state: String,
    /// Sequence key, when ordered.
    pub sequence_key: Option<String>,
    /// Sequence, when ordered.
    pub sequence: Option<i64>,
    /// Delivered although an earlier event of its key never came.
    pub gap: bool,
    /// Received (ms since epoch).
    pub received_at: i64,
    /// Held until (ms since epoch), while held.
    pub held_until: Option<i64>,
    /// The outbox event its delivery went out as (the consumer's
    /// `webhook-id`).
    pub outbox_event_id: Option<String>,
    /// The operation a `resolves` rule named.
    pub operation_id: Option<String>,
    /// What the event did to it (`completed`, `read-back`, `ignored: …`).
    pub resolution: Option<String>,
    /// The operator who released or dropped it (quarantined events).
    pub decided_by: Option<String>,
    /// When (ms since epoch).
    pub decided_at: Option<i64>,
    /// The body as received.
    #[serde(skip)]
    pub payload: String,
}

/// The outbox event id of inbox event `(tenant, source, event_id)`:
/// `evt_<32 hex of sha256>`, the same on every redelivery and restart, so
/// a consumer dedupes by it (`webhook-id`).
pub fn delivery_id(tenant: &str, source: &str, event_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [tenant, source, event_id] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!("evt_{}", &hex::encode(h.finalize())[..32])
}
