//! [`Ledger`]: the effect ledger's one interface, over SQLite or
//! PostgreSQL (`enum Db`). Both backends run the same statements (see
//! `store/`), so they implement the same state machine; the differences
//! are where time comes from and how work claims lock rows. Each method
//! that changes a state builds its command (`command/`) and the store
//! applies it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::command::{
    ClaimLease, ExpireLease, ExtendLease, Lease, LeaseForReconcile, NoteRetry, OpRef, Reattempt,
    RecordOutcome, Requeue, SelfAudit, Unschedule,
};
use super::postgres::PgDialect;
use super::sqlite::SqliteDialect;
use super::store::Store;
use super::{Claim, Clock, DecisionRecord, LedgerError, NewOperation, Outcome, Reservation, State};

/// The effect ledger. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    db: Db,
    clock: Arc<dyn Clock>,
    call_timeout: Duration,
    replay: Arc<super::replay_cache::ReplayCache>,
    settle: Arc<super::SettleWindows>,
    /// The SQLite ledger file (`None` on PostgreSQL).
    sqlite_path: Option<std::path::PathBuf>,
    /// The lock [`Ledger::hold_exclusively`] took (until
    /// [`Ledger::release_exclusive`] or the last clone is dropped).
    exclusive: Arc<Exclusive>,
}

#[derive(Debug, Clone)]
enum Db {
    Sqlite(Store<SqliteDialect>),
    Postgres(Store<PgDialect>),
}

/// Runs one store method on the open backend; PostgreSQL calls are
/// bounded by `storage.call_timeout_ms` ([`Ledger::bounded`]). Inside a request or
/// reconciliation span it runs in a child span `ledger <method>` (command
/// and result as attributes); outside one (the workers' periodic scans) it
/// runs without, so idle scans export nothing.
macro_rules! dispatch {
    ($self:ident, $m:ident($($a:expr),*)) => {{
        let run = async {
            match &$self.db {
                Db::Sqlite(s) => s.$m($($a),*).await,
                // Boxed: a PostgreSQL call's future (sqlx's, the time
                // limit's, the retries') is kilobytes, and every caller's
                // future, the SQLite ledger's included, would otherwise
                // hold room for it (a request's grew to 33 KB).
                Db::Postgres(p) => {
                    Box::pin($self
                        .bounded(async {
                            // A write that lost a deadlock with another
                            // instance's batch, or whose batch was undone
                            // for another write of it, changed nothing: it
                            // runs again, in the writer's next batch (an
                            // undone one within the call's time limit,
                            // which `bounded` holds it to again).
                            let (mut deadlocks, mut undone) = (0, 0);
                            loop {
                                match p.$m($($a),*).await {
                                    Err(e) if deadlocks < $crate::ledger::DEADLOCK_RETRIES && e.is_deadlock() => {
                                        deadlocks += 1;
                                        tracing::debug!(deadlocks, error = %e, "ledger write run again after a deadlock");
                                    }
                                    Err($crate::ledger::LedgerError::BatchUndone(why))
                                        if undone < $crate::ledger::UNDONE_RETRIES =>
                                    {
                                        undone += 1;
                                        tracing::debug!(undone, why = %why, "ledger write run again after its batch was undone");
                                    }
                                    r => break r,
                                }
                            }
                        }))
                        .await
                }
            }
        };
        // One place for the call's future whether or not it has a span of
        // its own (a disabled span costs a check on each poll).
        let span = if tracing::Span::current().is_none() {
            tracing::Span::none()
        } else {
            tracing::debug_span!(
                "ledger command",
                otel.name = concat!("ledger ", stringify!($m)),
                db.system.name = $self.backend_name(),
                effectgate.ledger.command = stringify!($m),
                effectgate.ledger.result = tracing::field::Empty,
                effectgate.batch_size = tracing::field::Empty,
            )
        };
        let r = tracing::Instrument::instrument(run, span.clone()).await;
        if !span.is_none() {
            span.record("effectgate.ledger.result", if r.is_ok() { "ok" } else { "error" });
        }
        r
    }};
}

mod approvals;
mod compensation;
mod inbox;
mod lock;
mod open;
mod reads;

use lock::Exclusive;

impl Ledger {
    /// The writer's terminal epoch: commits of this process that changed or
    /// deleted a COMPLETED or FAILED operation.
    fn terminal_epoch(&self) -> u64 {
        match &self.db {
            Db::Sqlite(s) => s.terminal_epoch(),
            Db::Postgres(p) => p.terminal_epoch(),
        }
    }

    /// The PostgreSQL store under this ledger (`None` on SQLite), for
    /// tests that hold its writer.
    #[cfg(test)]
    pub(in crate::ledger) fn postgres_store(&self) -> Option<&Store<PgDialect>> {
        match &self.db {
            Db::Postgres(p) => Some(p),
            Db::Sqlite(_) => None,
        }
    }

    /// `sqlite` or `postgres`.
    pub fn backend_name(&self) -> &'static str {
        match self.db {
            Db::Sqlite(_) => "sqlite",
            Db::Postgres(_) => "postgres",
        }
    }

    /// The ledger's clock, ms since the Unix epoch: the injected clock on
    /// SQLite; on PostgreSQL, the database clock (this instance's clock
    /// plus its offset to the database, re-measured on every ledger write).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The read-back settle windows of this process on the monotonic
    /// clock (see [`super::SettleWindows`]): "absent" is trusted only once
    /// the settle delay has passed on both clocks.
    pub fn settle_windows(&self) -> &super::SettleWindows {
        &self.settle
    }

    /// Steps the ledger's clock by `ms` (negative: back), a wall-clock
    /// step: the monotonic reading does not move. On PostgreSQL this moves
    /// the database clock for every instance sharing it. For tests and
    /// failure drills: leases and expiries jump.
    pub async fn shift_clock(&self, ms: i64) -> Result<(), LedgerError> {
        dispatch!(self, shift_clock(ms))
    }

    /// Writes rejected because they carried a fencing token that was no
    /// longer current, since start.
    pub fn stale_fence_rejections(&self) -> u64 {
        match &self.db {
            Db::Sqlite(s) => s.stale_fence_rejections(),
            Db::Postgres(p) => p.stale_fence_rejections(),
        }
    }

    /// PostgreSQL: gives the ledger's busiest tables their first planner
    /// statistics once they have changed rows and were never analyzed
    /// (see `Store::first_statistics`: without them a compare-and-swap's
    /// cached plan may read a state's every row instead of the primary
    /// key). The reconciler calls it every scan. SQLite: nothing (its
    /// planner takes the key's unique index for the one-row lookup it is).
    /// Returns the tables analyzed.
    ///
    /// Errors: the database's.
    pub async fn first_statistics(&self) -> Result<Vec<String>, LedgerError> {
        match &self.db {
            Db::Sqlite(_) => Ok(Vec::new()),
            Db::Postgres(p) => p.first_statistics().await,
        }
    }

    /// Releases the scan claims `owner` holds (the reconciler calls it at
    /// the end of every scan). Returns how many rows it released.
    pub async fn release_scan(&self, owner: &str) -> Result<u64, LedgerError> {
        dispatch!(self, release_scan(owner))
    }

    /// Deletes up to `batch` terminal operations whose key retention ended
    /// (last change + retention ≤ now), with their transitions, attempts,
    /// policy decisions and approvals, in one transaction. Dead letters and
    /// non-terminal operations are never deleted. `min_retention_ms` is a
    /// lower bound of every row's retention (the shortest configured; rows
    /// changed in the last `min_retention_ms` are not even looked at).
    /// Returns how many were deleted; call again while it returns `batch`.
    pub async fn sweep_expired(
        &self,
        batch: u32,
        min_retention_ms: i64,
    ) -> Result<u64, LedgerError> {
        dispatch!(self, sweep_expired(batch, min_retention_ms))
    }

    /// `call` within `storage.call_timeout_ms` ([`LedgerError::Timeout`]
    /// after it), except a call whose write already waits for its batch's
    /// `COMMIT`: that one is waited for (see `store::bounded`).
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        super::store::bounded(self.call_timeout, call)
            .await
            .unwrap_or(Err(LedgerError::Timeout(
                self.call_timeout.as_millis() as u64
            )))
    }

    /// Checks that the database answers (readiness).
    pub async fn ping(&self) -> Result<(), LedgerError> {
        dispatch!(self, ping())
    }

    /// Returns the gateway's provider-key secret, creating a random 32-byte
    /// one on first use. Stored in the ledger so provider keys stay the same
    /// across restarts.
    pub async fn provider_key_secret(&self) -> Result<Vec<u8>, LedgerError> {
        dispatch!(self, provider_key_secret())
    }

    /// Reserves an operation: `INSERT … ON CONFLICT DO NOTHING`, plus the
    /// first transition (`∅ → RESERVED`). If the key exists, returns the
    /// existing row unchanged. A terminal operation past its key retention
    /// is deleted first, so its key starts fresh (draft §2.3).
    pub async fn reserve(&self, new: &NewOperation) -> Result<Reservation, LedgerError> {
        let epoch = self.terminal_epoch();
        let r = dispatch!(self, reserve(new, None)).map(|(r, _)| r);
        self.cache_existing(r.as_ref().ok(), new, epoch);
        r
    }

    /// Caches a COMPLETED or FAILED operation a reservation found under
    /// the key, with the caller's fingerprint (`epoch`: read before the
    /// reservation), as [`Ledger::get_for_duplicate`] caches what it reads.
    fn cache_existing(&self, r: Option<&Reservation>, new: &NewOperation, epoch: u64) {
        if let Some(Reservation::Existing(op)) = r
            && op.fingerprint == new.fingerprint
        {
            self.replay.put(op, epoch);
        }
    }

    /// [`Ledger::reserve`], and when it created the operation and it
    /// awaits no approval, claims its lease for `owner` for `lease_ms`
    /// (RESERVED → EXECUTING, fencing token 1, attempt 1) in the same
    /// transaction, so the call makes one durable write before the
    /// provider is called. Returns the reservation (the operation as
    /// reserved, before the claim) and the claim, if it was made. A
    /// COMPLETED or FAILED operation it finds under the key with the
    /// caller's fingerprint is cached for replays, as
    /// [`Ledger::get_for_duplicate`] caches one it reads.
    ///
    /// Errors: the database's.
    pub async fn reserve_and_claim(
        &self,
        new: &NewOperation,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<(Reservation, Option<Claim>), LedgerError> {
        let lease = Lease {
            owner,
            ms: lease_ms,
        };
        let epoch = self.terminal_epoch();
        let r = dispatch!(self, reserve(new, Some((lease, reason))));
        self.cache_existing(r.as_ref().ok().map(|(r, _)| r), new, epoch);
        r
    }

    /// Claims the lease on an operation and moves it `from → EXECUTING`, if
    /// its row is still at `expected_version` in state `from`. Allowed
    /// `from` states: RESERVED, AWAITING_APPROVAL (after approval), UNKNOWN
    /// (after an absent read-back) and EXECUTING whose lease has expired.
    /// The fencing token and the attempt count are incremented.
    ///
    /// Returns `None` when the compare-and-swap lost: someone else changed
    /// the row first, or the lease is still live.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] for any other `from`.
    /// `(tenant, operation_id)` names the operation; inside the ledger the
    /// arguments travel as a `ClaimLease` command.
    pub async fn claim(
        &self,
        (tenant, operation_id): (&str, &str),
        from: State,
        expected_version: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        let cmd = ClaimLease {
            op: OpRef::new(tenant, operation_id),
            from,
            version: expected_version,
            lease: Lease {
                owner,
                ms: lease_ms,
            },
            reason,
        };
        dispatch!(self, claim(&cmd))
    }

    /// Records an outcome under fencing token `fence`:
    /// `UPDATE … WHERE fence = ? AND state = from`. The lease is released.
    /// `from` is EXECUTING (an attempt ended) or UNKNOWN (a reconciliation
    /// lease holder resolved it, or a read-back failed).
    ///
    /// Returns `false` (and counts a stale-fence rejection) when the token
    /// is no longer current: a newer claim owns the operation, and this
    /// write must not land.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] unless `from → outcome.state`
    /// is in the state machine and ends in COMPLETED, FAILED or UNKNOWN.
    pub async fn record_outcome(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        from: State,
        actor: &str,
        outcome: &Outcome,
    ) -> Result<bool, LedgerError> {
        let cmd = RecordOutcome {
            op: OpRef::new(tenant, operation_id),
            from,
            fence,
            actor,
            outcome,
        };
        // Read before the write: a terminal change committed after it is
        // seen by the next duplicate.
        let epoch = self.terminal_epoch();
        let recorded = dispatch!(self, record_outcome(&cmd))?;
        if let Some(op) = &recorded {
            // The first duplicate of a COMPLETED or FAILED operation is
            // answered from memory too (a non-terminal outcome is not kept).
            self.replay.put(op, epoch);
        }
        Ok(recorded.is_some())
    }

    /// Logs a failed attempt that will be retried, under `fence`, and starts
    /// the next one: bumps `attempts`, records the error (with the caller's
    /// `request_id`, if it was made for one), and extends the
    /// lease to now + `lease_ms`. Returns `false` (counted) if the token is
    /// no longer current; the caller must then stop.
    /// `(tenant, operation_id)` names the operation, `(outcome, detail)` the
    /// failed attempt (`status-503`, and its text); inside the ledger the
    /// arguments travel as a `NoteRetry` command.
    pub async fn note_retry(
        &self,
        (tenant, operation_id): (&str, &str),
        fence: i64,
        status: Option<u16>,
        (outcome, detail): (&str, &str),
        lease_ms: i64,
        request_id: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let cmd = NoteRetry {
            op: OpRef::new(tenant, operation_id),
            fence,
            outcome,
            detail,
            lease_ms,
            request_id,
        };
        dispatch!(self, note_retry(&cmd, status))
    }

    /// Extends the lease held under `fence` to now + `lease_ms`. Returns
    /// `false` if the token is no longer current.
    pub async fn extend_lease(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, LedgerError> {
        let cmd = ExtendLease {
            op: OpRef::new(tenant, operation_id),
            fence,
            lease_ms,
        };
        dispatch!(self, extend_lease(&cmd))
    }

    /// Records the decisions of a request that did not reserve an operation
    /// (denied, or a policy failed closed), under the key it carried.
    pub async fn record_decisions(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
        decisions: &[DecisionRecord],
    ) -> Result<(), LedgerError> {
        let op = OpRef::new(tenant, operation_id);
        dispatch!(self, record_decisions(op, fingerprint, decisions))
    }

    /// Marks an EXECUTING operation whose lease has expired as UNKNOWN:
    /// its owner may have sent the request before it died. The fencing
    /// token is incremented, so the old owner's late write is rejected.
    /// Returns `false` if the row changed or the lease is still live.
    ///
    /// `settle_ms` is the route's read-back settle delay: "absent" is
    /// trusted only from now + `settle_ms` on. `None` means the route has
    /// no read-back: the operation is not scheduled for reconciliation and
    /// waits for an operator.
    pub async fn expire_lease(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        settle_ms: Option<i64>,
        actor: &str,
    ) -> Result<bool, LedgerError> {
        let cmd = ExpireLease {
            op: OpRef::new(tenant, operation_id),
            version,
            settle_ms,
            actor,
        };
        dispatch!(self, expire_lease(&cmd))
    }

    /// Takes a reconciliation lease on an UNKNOWN operation (state stays
    /// UNKNOWN, fencing token incremented), if the row is at `version` and
    /// nobody holds a live lease. Returns `None` when the compare-and-swap lost.
    pub async fn lease_for_reconcile(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        let cmd = LeaseForReconcile {
            op: OpRef::new(tenant, operation_id),
            version,
            lease: Lease {
                owner,
                ms: lease_ms,
            },
            reason,
        };
        dispatch!(self, lease_for_reconcile(&cmd))
    }

    /// Starts a new attempt of an UNKNOWN operation whose read-back came
    /// back absent, under the reconciliation lease `fence`: UNKNOWN →
    /// EXECUTING, new fencing token, attempts + 1. Same operation, same
    /// provider key. Returns `None` (counted) if `fence` is not current.
    pub async fn reattempt(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        let cmd = Reattempt {
            op: OpRef::new(tenant, operation_id),
            fence,
            lease: Lease {
                owner,
                ms: lease_ms,
            },
            reason,
        };
        dispatch!(self, reattempt(&cmd))
    }

    /// Takes an UNKNOWN operation off the reconciler's schedule (its route
    /// has no read-back, or is gone): it waits for an operator. Scheduling
    /// is not a state change; no transition is written.
    pub async fn unschedule(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
    ) -> Result<bool, LedgerError> {
        let cmd = Unschedule {
            op: OpRef::new(tenant, operation_id),
            version,
        };
        dispatch!(self, unschedule(&cmd))
    }

    /// Appends an audit transition `state → state` (an approval decision, a
    /// forced replay) if the row is still at `version` in `state`. Returns
    /// whether it was written.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] if the state machine has no
    /// such self-transition.
    pub async fn audit(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        state: State,
        actor: &str,
        reason: &str,
    ) -> Result<bool, LedgerError> {
        let cmd = SelfAudit {
            op: OpRef::new(tenant, operation_id),
            version,
            state,
            actor,
            reason,
        };
        dispatch!(self, audit(&cmd))
    }

    /// Requeues a dead letter with the same operation id and provider key:
    /// FAILED (dead letter) → `to`, where `to` is UNKNOWN (the reconciler
    /// reads back before any new attempt) or RESERVED (the route has no
    /// read-back; the caller executes it next). Returns `None` if the row
    /// is not a dead letter at `version`.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] for another `to`.
    pub async fn requeue(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        to: State,
        actor: &str,
        reason: &str,
    ) -> Result<Option<i64>, LedgerError> {
        let cmd = Requeue {
            op: OpRef::new(tenant, operation_id),
            version,
            to,
            actor,
            reason,
        };
        dispatch!(self, requeue(&cmd))
    }
}
