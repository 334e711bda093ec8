//! The SQLite effect ledger: one file, for one gateway process.
//!
//! Writes go through the group-commit writer (`store/writer.rs`) on a pool
//! of one connection (SQLite serialises writers; its batches start with
//! `BEGIN IMMEDIATE`, so no statement has to upgrade a lock), reads through
//! a separate pool. The file runs in WAL mode with
//! `synchronous = FULL`, so a committed transition survives a crash of the
//! process or the machine. Times come from the gateway's clock.

use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::dialect::{Conn, Dialect, Pool, ledger_row, sqlx_glue};
use super::store::{BatchLimits, Store};
use super::{Clock, LedgerClock, LedgerError};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// SQLite: statements as written, time from the gateway's clock, one
/// writer (so work claims need no row locks).
#[derive(Debug, Clone, Copy)]
pub(super) struct SqliteDialect;

ledger_row!(sqlx::sqlite::SqliteRow);

impl Dialect for SqliteDialect {
    type Db = sqlx::Sqlite;
    type Row = sqlx::sqlite::SqliteRow;
    const NAME: &'static str = "sqlite";
    const ROW_ORDER: &'static str = "rowid";
    const SKIP_LOCKED: &'static str = "";
    /// Takes the write lock up front (another process holding it is waited
    /// for `busy_timeout_ms`), so no statement of the batch has to upgrade.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";

    const TRANSITION_NAMES_THE_ROW: bool = true;

    fn q(sql: &str) -> &'static str {
        super::dialect::cached(sql, str::to_owned)
    }

    /// Two statements in one text, run by one call on the connection's
    /// thread (sqlx binds the values of each in turn): the
    /// compare-and-swap, then an `INSERT … SELECT` of the row that holds
    /// only when the compare-and-swap changed it (`changes()` is the count
    /// of the statement completed just before).
    fn with_transition(cas: &str, _returning: &str) -> String {
        // sqlx hands out anonymous `?` values statement by statement; a
        // numbered one (`?1`) would not advance them.
        debug_assert!(
            !cas.as_bytes()
                .windows(2)
                .any(|w| w[0] == b'?' && w[1].is_ascii_digit()),
            "a compare-and-swap with numbered placeholders: {cas}"
        );
        format!(
            "{cas}; INSERT INTO transitions ({}) SELECT ?, ?, ?, ?, version, fence, ?, ?, ? \
             FROM operations WHERE tenant_id = ? AND operation_id = ? AND changes() = 1",
            super::dialect::TRANSITION_COLUMNS
        )
    }

    sqlx_glue!();

    async fn now(_pool: &Pool<Self>, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        Ok(clock.now_ms())
    }

    async fn now_in(_conn: &mut Conn<Self>, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        Ok(clock.now_ms())
    }

    async fn open_savepoint(
        conn: &mut Conn<Self>,
        begin: bool,
    ) -> Result<Option<i64>, sqlx::Error> {
        if begin {
            // `BEGIN` and the savepoint in one call on the connection's
            // thread.
            const OPEN: &str = "BEGIN IMMEDIATE; SAVEPOINT effectgate_write";
            debug_assert!(OPEN.starts_with(Self::BEGIN));
            sqlx::raw_sql(OPEN).execute(&mut *conn).await?;
        } else {
            super::dialect::sql::<Self>("SAVEPOINT effectgate_write")
                .execute(conn)
                .await?;
        }
        Ok(None)
    }

    async fn shift_clock(
        _pool: &Pool<Self>,
        clock: &LedgerClock,
        ms: i64,
    ) -> Result<(), sqlx::Error> {
        clock.shift(ms);
        Ok(())
    }
}

/// `storage.write_batch_max` and `storage.write_batch_bytes`.
pub(super) fn batch_limits(storage: &crate::config::StorageSpec) -> BatchLimits {
    BatchLimits {
        max_writes: storage.write_batch_max as usize,
        max_bytes: usize::try_from(storage.write_batch_bytes).unwrap_or(usize::MAX),
        // SQLite has one writer at a time.
        connections: 1,
        stall: None,
    }
}

impl Store<SqliteDialect> {
    /// Opens (creating if missing) the file and applies `migrations/sqlite`.
    ///
    /// Errors: the file can't be opened or a migration fails.
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
            // A write's savepoint journal (the pages it may have to undo)
            // in memory, not in a temporary file: it is never needed after
            // the batch's COMMIT or a crash, and writing it to a file cost
            // every write system calls on the connection's thread.
            .pragma("temp_store", "memory")
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
        Ok(Self::new(write, read, clock, batch_limits(storage)))
    }
}
