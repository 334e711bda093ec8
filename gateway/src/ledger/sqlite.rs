//! The SQLite effect ledger: one file, for one gateway process.
//!
//! Writes go through a pool of one connection (SQLite serialises writers;
//! one connection avoids `SQLITE_BUSY` on transaction upgrade), reads
//! through a separate pool. The file runs in WAL mode with
//! `synchronous = FULL`, so a committed transition survives a crash of the
//! process or the machine. Times come from the gateway's clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::approval::{Approval, Decision, NewApproval, OutboxEvent};
use super::dialect::clean;
use super::{
    Attempt, Claim, LedgerClock, LedgerError, NewOperation, Operation, Outcome, Reservation, State,
    Transition,
};

type Db = sqlx::Sqlite;
type DbRow = sqlx::sqlite::SqliteRow;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// How rows of one table are ordered by insertion.
const ROW_ORDER: &str = "rowid";
/// SQLite has one writer at a time: work claims need no row locks.
const SKIP_LOCKED: &str = "";

/// The statement as SQLite takes it (`?` and `?N` placeholders as written).
fn q(sql: &str) -> &'static str {
    super::dialect::cached(sql, str::to_owned)
}

/// The SQLite store. Cheap to clone.
#[derive(Debug, Clone)]
pub(super) struct Store {
    write: sqlx::SqlitePool,
    read: sqlx::SqlitePool,
    pub(super) clock: Arc<LedgerClock>,
    stale_fence_rejections: Arc<AtomicU64>,
}

impl Store {
    /// Opens (creating if missing) the file and applies `migrations/sqlite`.
    pub(super) async fn open(
        storage: &crate::config::StorageSpec,
        clock: Arc<LedgerClock>,
    ) -> Result<Self, LedgerError> {
        let synchronous = match storage.synchronous {
            crate::config::Synchronous::Full => SqliteSynchronous::Full,
            crate::config::Synchronous::Normal => SqliteSynchronous::Normal,
        };
        let opts = SqliteConnectOptions::new()
            .filename(&storage.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_millis(storage.busy_timeout_ms));
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts.clone())
            .await?;
        MIGRATOR.run(&write).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(storage.max_read_connections)
            .connect_with(opts)
            .await?;
        Ok(Self {
            write,
            read,
            clock,
            stale_fence_rejections: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Now, in ms since the Unix epoch: the gateway's clock.
    async fn now(&self) -> Result<i64, sqlx::Error> {
        use super::Clock;
        Ok(self.clock.now_ms())
    }

    /// Now, read inside a transaction (after it got its connection, so a
    /// wait for the connection doesn't shorten the leases it stamps).
    async fn now_in(&self, _tx: &mut sqlx::Transaction<'_, Db>) -> Result<i64, sqlx::Error> {
        self.now().await
    }

    /// Moves the ledger's clock forward by `ms`.
    pub(super) async fn shift_clock(&self, ms: i64) -> Result<(), LedgerError> {
        self.clock.shift(ms);
        Ok(())
    }

    pub(super) fn stale_fence_rejections(&self) -> u64 {
        self.stale_fence_rejections.load(Ordering::Relaxed)
    }
}

include!("store/reads.rs");
include!("store/writes.rs");
include!("store/reconcile.rs");
include!("store/approvals.rs");
