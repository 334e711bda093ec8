//! The effect ledger's statements, written once for both backends: a
//! [`Store`] over a [`Dialect`] (`sqlite.rs`, `postgres.rs`). State changes
//! go through the commands of `command/`; what is here reads, schedules,
//! sweeps and keeps approvals and the outbox.

mod approvals;
mod compensation;
mod events;
mod grouped;
mod inbox;
mod outbox;
#[cfg(test)]
mod plans;
mod reads;
mod reconcile;
pub(in crate::ledger) mod writer;
mod writes;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use events::{Subscriptions, event_type};
pub use inbox::{QuarantineAction, QuarantineDecision};

use super::command::{self, Command};
use super::dialect::{Dialect, Pool};
use super::{LedgerClock, LedgerError, State};
pub(super) use writer::{BatchLimits, bounded};
use writer::{BatchTx, Writer};

/// The states no automatic transition leaves, as bound for
/// `state IN (?, ?, ?)`.
const TERMINAL: [State; 3] = [State::Completed, State::Failed, State::Compensated];

/// The ledger over one backend. Cheap to clone.
pub(super) struct Store<D: Dialect> {
    /// Every write: the group-commit writer (`writer/`), on a connection
    /// of its own on SQLite and connections of the shared pool on
    /// PostgreSQL.
    writer: Writer<D>,
    /// The pool the clock is read through (PostgreSQL: the shared pool;
    /// SQLite: the read pool, unused: its clock is the gateway's).
    write: Pool<D>,
    /// Reads (PostgreSQL: the same pool).
    read: Pool<D>,
    /// Point reads (SQLite: on the calling thread; PostgreSQL: the pool).
    point: D::PointSource,
    /// The ledger's clock (PostgreSQL: follows the database clock).
    pub(super) clock: Arc<LedgerClock>,
    stale_fence_rejections: Arc<AtomicU64>,
    /// Operation events each tenant receives (set from the config).
    subscriptions: Arc<arc_swap::ArcSwap<Subscriptions>>,
    /// Writes waiting to be made in a group ([`Dialect::GROUPS_WRITES`]).
    groups: Arc<grouped::Queues>,
}

impl<D: Dialect> Clone for Store<D> {
    fn clone(&self) -> Self {
        Self {
            writer: self.writer.clone(),
            write: self.write.clone(),
            read: self.read.clone(),
            point: self.point.clone(),
            clock: self.clock.clone(),
            stale_fence_rejections: self.stale_fence_rejections.clone(),
            subscriptions: self.subscriptions.clone(),
            groups: self.groups.clone(),
        }
    }
}

impl<D: Dialect> fmt::Debug for Store<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("backend", &D::NAME)
            .field("write", &self.write)
            .field("read", &self.read)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> Store<D> {
    /// A store writing through a group-commit writer on connections from
    /// `source` (batches bounded by `limits`), reading through `read`
    /// (point reads through `point`) and the database clock through
    /// `write` (they may be the same pool), stamping rows with `clock`. Must be called inside a Tokio runtime
    /// (the writer's committer task).
    pub(super) fn new(
        write: Pool<D>,
        source: D::WriteSource,
        read: Pool<D>,
        point: D::PointSource,
        clock: Arc<LedgerClock>,
        limits: BatchLimits,
    ) -> Self {
        Self {
            writer: Writer::new(source, limits),
            write,
            read,
            point,
            clock,
            stale_fence_rejections: Arc::new(AtomicU64::new(0)),
            subscriptions: Arc::default(),
            groups: Arc::default(),
        }
    }

    /// Sets the operation events each tenant receives.
    pub(super) fn set_subscriptions(&self, subs: Subscriptions) {
        self.subscriptions.store(Arc::new(subs));
    }

    /// Now, in ms since the Unix epoch ([`Dialect::now`]).
    pub(super) async fn now(&self) -> Result<i64, sqlx::Error> {
        D::now(&self.write, &self.clock).await
    }

    /// Takes a place in the writer's open batch and reads now inside it
    /// (PostgreSQL: the writer's time for it, see `Writer`).
    async fn begin(&self) -> Result<(BatchTx<D>, i64), sqlx::Error> {
        let mut tx = self.writer.begin(0).await?;
        let now = match tx.db_now() {
            Some(db) => {
                self.clock.follow(db);
                db
            }
            None => D::now_in(&mut tx, &self.clock).await?,
        };
        Ok((tx, now))
    }

    /// [`command::check`]s `cmd` (an illegal one opens no transaction),
    /// then [`Store::begin`]s.
    async fn begin_for<C: Command>(&self, cmd: &C) -> Result<(BatchTx<D>, i64), LedgerError> {
        command::check(cmd)?;
        Ok(self.begin().await?)
    }

    /// Moves the ledger's clock forward by `ms`.
    pub(super) async fn shift_clock(&self, ms: i64) -> Result<(), LedgerError> {
        D::shift_clock(&self.write, &self.clock, ms).await?;
        self.writer.clock_moved();
        // Retention ends at other times now.
        self.writer.bump_terminal_epoch();
        Ok(())
    }

    /// Commits so far that changed or deleted a COMPLETED or FAILED
    /// operation (see `Writer::terminal_epoch`): unchanged since a row was
    /// read means no write of this process changed it.
    pub(super) fn terminal_epoch(&self) -> u64 {
        self.writer.terminal_epoch()
    }

    /// Writes refused for a stale fencing token, since start.
    pub(super) fn stale_fence_rejections(&self) -> u64 {
        self.stale_fence_rejections.load(Ordering::Relaxed)
    }

    /// Counts one write refused for a stale fencing token.
    fn count_stale_fence(&self) {
        self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
        crate::metrics::stale_fence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_is_the_terminal_states() {
        let terminal: Vec<State> = State::ALL.into_iter().filter(|s| s.is_terminal()).collect();
        assert_eq!(terminal, TERMINAL);
    }
}
