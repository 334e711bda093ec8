//! The SQLite effect ledger: one file, for one gateway process.
//!
//! Writes go through the group-commit writer (`store/writer/`) on one
//! connection of its own (`conn.rs`: SQLite serialises writers; its
//! batches start with `BEGIN IMMEDIATE`, so no statement has to upgrade a
//! lock), reads through a separate sqlx pool; migrations run on a sqlx
//! connection when the file opens. The file runs in WAL mode with
//! `synchronous = FULL`, so a committed transition survives a crash of the
//! process or the machine. Times come from the gateway's clock.

use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::dialect::{Arg, Dialect, Pool, Query, Stmt};
use super::store::writer::SyncTicket;
use super::store::{BatchLimits, Store};
use super::{Clock, LedgerClock, LedgerError};

mod checkpoint;
mod conn;
mod point;
mod row;
#[cfg(test)]
mod tests;

pub(super) use conn::{Conn, WriterOptions};
pub(super) use point::PointReaders;
pub(super) use row::Row;

pub(in crate::ledger) static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("../migrations/sqlite");

/// SQLite: statements as written, time from the gateway's clock, one
/// writer (so work claims need no row locks).
#[derive(Debug, Clone, Copy)]
pub(super) struct SqliteDialect;

/// `stmt` as sqlx runs it (a read).
fn query(stmt: Stmt<SqliteDialect>) -> Query<SqliteDialect> {
    let mut query = sqlx::query(stmt.text);
    for arg in stmt.args {
        query = match arg {
            Arg::Int(v) => query.bind(v),
            Arg::Bool(v) => query.bind(v),
            Arg::Text(v) => query.bind(v),
            Arg::Bytes(v) => query.bind(v),
        };
    }
    query
}

impl Dialect for SqliteDialect {
    type Db = sqlx::Sqlite;
    type Row = Row;
    type Conn = Conn;
    type WriteSource = WriterOptions;
    const NAME: &'static str = "sqlite";
    const ROW_ORDER: &'static str = "rowid";
    const SKIP_LOCKED: &'static str = "";
    /// Takes the write lock up front (another process holding it is waited
    /// for `busy_timeout_ms`), so no statement of the batch has to upgrade.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const SAVEPOINT_EACH_WRITE: bool = true;
    const GROUPS_WRITES: bool = false;
    const TERMINAL_BY_CHANGE: &'static str = " INDEXED BY operations_terminal_by_change";

    const TRANSITION_ROW_NAMES: bool = true;

    const HISTORY_OF: &'static str =
        "op_seq = (SELECT op_seq FROM operations WHERE tenant_id = ? AND operation_id = ?)";
    const HISTORY_DELETED_WITH_ROW: bool = true;
    const INSERT_ATTEMPT: &'static str = "INSERT INTO attempts (op_seq, tenant_id, operation_id, attempt, \
         fence, status, outcome, detail, at, request_id) VALUES ((SELECT op_seq FROM operations \
         WHERE tenant_id = ?1 AND operation_id = ?2), ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
         ON CONFLICT DO NOTHING";

    fn q(sql: &str) -> &'static str {
        super::dialect::cached(sql, str::to_owned)
    }

    /// Statements in one text, run by one call on the writer's connection
    /// (each statement takes as many of the values as it has placeholders,
    /// in turn: `conn.rs`): the compare-and-swap without its `RETURNING`,
    /// one `INSERT … SELECT` per transition row that holds only when the
    /// statement before it changed a row, then a `SELECT` of `returning`
    /// by the row's key that holds only when the last transition row was
    /// appended (`changes()` is the count of the statement completed just
    /// before). SQLite collects a `RETURNING` statement's rows in a
    /// temporary b-tree opened and closed for each run; a read of the row
    /// by its key costs a fraction of that.
    fn with_transitions(cas: &str, returning: &str, rows: usize) -> String {
        // The values are handed out statement by statement, in order; a
        // numbered placeholder (`?1`) would take them out of that order.
        debug_assert!(
            !cas.as_bytes()
                .windows(2)
                .any(|w| w[0] == b'?' && w[1].is_ascii_digit()),
            "a compare-and-swap with numbered placeholders: {cas}"
        );
        // A text without that ending keeps its `RETURNING`: its row then
        // comes first, the same values as the `SELECT`'s.
        let suffix = format!(" RETURNING {returning}");
        let plain = cas.strip_suffix(suffix.as_str()).unwrap_or(cas);
        debug_assert!(
            plain.len() < cas.len(),
            "a compare-and-swap not ending in {suffix}: {cas}"
        );
        let mut text = plain.to_owned();
        for back in (0..rows.max(1)).rev() {
            text.push_str(&format!(
                "; INSERT INTO transitions (op_seq, {}) SELECT op_seq, ?, ?, ?, ?, {}, ?, ?, ? \
                 FROM operations WHERE tenant_id = ? AND operation_id = ? AND changes() = 1",
                super::dialect::TRANSITION_COLUMNS,
                Self::transition_version(back),
            ));
        }
        text.push_str(&format!(
            "; SELECT {returning} FROM operations WHERE tenant_id = ? AND operation_id = ? AND changes() = 1"
        ));
        text
    }

    fn with_transition_and_attempt(_cas: &str, _returning: &str) -> Option<String> {
        None
    }

    async fn acquire(pool: &Pool<Self>) -> Result<Conn, sqlx::Error> {
        Ok(Conn::Pooled(pool.acquire().await?))
    }

    type PointSource = Arc<PointReaders>;

    async fn acquire_point(source: &Arc<PointReaders>) -> Result<Conn, sqlx::Error> {
        source.acquire().await
    }

    async fn connect_writer(options: &WriterOptions) -> Result<Conn, sqlx::Error> {
        Conn::writer(options).await
    }

    fn discard(conn: Conn) {
        if let Conn::Pooled(c) = conn {
            drop(c.detach());
        }
    }

    async fn execute(stmt: Stmt<Self>, conn: &mut Conn) -> Result<u64, sqlx::Error> {
        conn.execute(stmt).await
    }

    async fn fetch_optional(stmt: Stmt<Self>, conn: &mut Conn) -> Result<Option<Row>, sqlx::Error> {
        conn.fetch_optional(stmt).await
    }

    async fn fetch_all(stmt: Stmt<Self>, conn: &mut Conn) -> Result<Vec<Row>, sqlx::Error> {
        conn.fetch_all(stmt).await
    }

    async fn run_durable(text: &'static str, conn: &mut Conn) -> Result<(), sqlx::Error> {
        conn.run_durable(text).await
    }

    fn sync_ticket(conn: &Conn) -> Option<SyncTicket> {
        conn.sync_ticket()
    }

    async fn commit_unsynced(conn: &mut Conn) -> Option<Result<(), sqlx::Error>> {
        conn.commit_unsynced().await
    }

    fn commit_now(conn: &mut Conn) -> Option<Result<(), sqlx::Error>> {
        conn.commit_now()
    }

    async fn now(_pool: &Pool<Self>, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        Ok(clock.now_ms())
    }

    async fn now_in(_conn: &mut Conn, clock: &LedgerClock) -> Result<i64, sqlx::Error> {
        Ok(clock.now_ms())
    }

    async fn open_write(
        conn: &mut Conn,
        first: bool,
        _read_clock: bool,
    ) -> Result<Option<i64>, sqlx::Error> {
        if first {
            // No savepoint: the batch's first write is undone by rolling
            // the batch back (on a blocking thread when `BEGIN` has to
            // wait for another process's lock).
            conn.begin(Self::BEGIN).await?;
        } else {
            if conn.outside_transaction() {
                // A bare savepoint would begin a transaction of its own,
                // outside the batch and without its write lock.
                return Err(sqlx::Error::Protocol(
                    "the ledger's write batch lost its transaction (SQLite rolled it back after an error)".into(),
                ));
            }
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
        let (synchronous, pragma) = match storage.synchronous {
            crate::config::Synchronous::Full => (SqliteSynchronous::Full, "FULL"),
            crate::config::Synchronous::Normal => (SqliteSynchronous::Normal, "NORMAL"),
        };
        let busy_timeout = Duration::from_millis(storage.busy_timeout_ms);
        let opts = SqliteConnectOptions::new()
            .filename(&storage.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(busy_timeout);
        // The migrations on a connection of their own, closed after them.
        let migrate = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts.clone())
            .await?;
        MIGRATOR.run(&migrate).await?;
        migrate.close().await;
        let read = SqlitePoolOptions::new()
            .max_connections(storage.max_read_connections)
            .connect_with(opts)
            .await?;
        let writer = WriterOptions {
            path: storage.path.clone(),
            synchronous: pragma,
            busy_timeout,
            cache_kib: storage.page_cache_bytes / 1024,
            checkpoint_pages: storage.wal_checkpoint_pages,
            durability: Default::default(),
        };
        let point = PointReaders::new(writer.clone(), storage.max_read_connections as usize);
        Ok(Self::new(
            read.clone(),
            writer,
            read,
            point,
            clock,
            batch_limits(storage),
        ))
    }
}
