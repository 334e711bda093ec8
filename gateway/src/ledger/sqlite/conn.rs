//! The connections SQLite statements run on: a read pool's (through sqlx,
//! whose connection thread runs each statement), the point readers'
//! (`point.rs`) and the writer's own.
//!
//! The writer's connection runs a write's statements on the calling
//! thread, without a hand-off to a connection thread per statement: the
//! writer holds the batch's one connection while a write runs, so each
//! hand-off (two thread wake-ups) was time no other write could use it. A
//! point statement on a page in cache takes microseconds. What waits for
//! the disk or another process runs on Tokio's blocking threads
//! ([`Conn::run_durable`]): a `COMMIT` that syncs, the writer's
//! checkpoint at `storage.wal_checkpoint_pages`, and `BEGIN IMMEDIATE`
//! when another process holds the file's write lock (it is tried on the
//! calling thread first, without waiting). With `storage.synchronous =
//! full` a batch's `COMMIT` doesn't sync ([`deferred_sync`]): it runs on
//! the calling thread ([`Conn::commit_unsynced`]), and the writer's syncer
//! syncs the WAL after it. The writer's
//! connection never waits for a lock on the calling thread: its busy
//! timeout is zero there, and `storage.busy_timeout_ms` only on a
//! blocking thread.
//!
//! Checkpoints are `checkpoint.rs`'s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::types::Value;

use super::super::dialect::{Arg, Stmt};
use super::super::store::writer::{Durability, SyncTicket};
use super::SqliteDialect;
use super::checkpoint::{self, Checkpointer, WAL_PAGES, note_wal};
use super::point::PointConn;
use super::row::{Row, db_error};

/// Prepared statements the writer's connection keeps (the ledger's write
/// statements are a fixed set of a few dozen texts).
const STATEMENT_CACHE: usize = 256;

/// What the writer opens its SQLite connection from: the file and the
/// settings every connection of the ledger has (`storage.path`,
/// `storage.synchronous`, `storage.busy_timeout_ms`).
#[derive(Debug, Clone)]
pub(in crate::ledger) struct WriterOptions {
    /// The ledger file.
    pub path: PathBuf,
    /// `FULL` or `NORMAL`.
    pub synchronous: &'static str,
    /// How long a statement waits for another process's lock.
    pub busy_timeout: Duration,
    /// The page cache, in KiB (`storage.page_cache_bytes`).
    pub cache_kib: u64,
    /// WAL pages past which the checkpointer runs
    /// (`storage.wal_checkpoint_pages`, at least 1).
    pub checkpoint_pages: u32,
    /// The commits whose WAL sync is pending (shared by the writer's
    /// connections over time and the point readers, which wait for it).
    pub durability: Arc<Durability>,
}

impl WriterOptions {
    /// Opens the writer's connection: WAL, `synchronous` and the page
    /// cache as configured, temporary data (a write's savepoint journal) in memory, foreign
    /// keys on (as sqlx sets them for the read pool).
    ///
    /// Errors: the file can't be opened or a pragma fails.
    pub(super) fn open(&self) -> Result<rusqlite::Connection, sqlx::Error> {
        let conn = rusqlite::Connection::open(&self.path).map_err(db_error)?;
        conn.busy_timeout(self.busy_timeout).map_err(db_error)?;
        conn.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = {}; \
             PRAGMA temp_store = MEMORY; PRAGMA foreign_keys = ON; \
             PRAGMA cache_size = -{};",
            self.synchronous, self.cache_kib
        ))
        .map_err(db_error)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(conn)
    }
}

/// Runs `text`, statements without binds or rows (`BEGIN IMMEDIATE`,
/// `COMMIT`), on `conn`. A single statement is kept prepared in the
/// connection's statement cache: `BEGIN` and `COMMIT` run twice per
/// effectful call, and compiling them each time was 7,000 instructions of
/// the call. Several statements run as a batch, compiled each time.
///
/// Errors: the database's.
fn run_plain(conn: &rusqlite::Connection, text: &str) -> rusqlite::Result<()> {
    if text.trim_end().trim_end_matches(';').contains(';') {
        return conn.execute_batch(text);
    }
    conn.prepare_cached(text)?.execute([]).map(drop)
}

/// Runs `text` on the writer's connection `conn`, waiting up to `wait`
/// for another process's lock (`None`: not at all), and checkpoints what
/// the checkpointer has not copied yet when the commit left the WAL at
/// `inline` pages or more. Returns the result and the WAL's pages after a
/// commit that wrote to it (`None`: no commit wrote).
fn durable(
    conn: &rusqlite::Connection,
    text: &str,
    wait: Option<Duration>,
    inline: u32,
) -> (Result<(), sqlx::Error>, Option<u32>) {
    // Still negative after it: no commit wrote to the WAL.
    WAL_PAGES.set(-1);
    let result = match wait {
        Some(wait) => conn.busy_timeout(wait).and_then(|()| run_plain(conn, text)),
        None => run_plain(conn, text),
    }
    .map_err(db_error);
    let pages = u32::try_from(WAL_PAGES.get()).ok();
    if wait.is_some()
        && let Err(e) = conn.busy_timeout(Duration::ZERO)
    {
        tracing::warn!(error = %e, "the ledger writer's busy timeout can't be reset");
    }
    if pages.is_some_and(|p| p >= inline) {
        // What the checkpointer has not copied yet, with no write beside
        // it: the WAL starts over next.
        if let Err(e) = checkpoint::passive(conn) {
            tracing::warn!(error = %e, "ledger WAL checkpoint failed");
        }
    }
    (result, pages)
}

/// Tells the checkpointer that a commit left the WAL at `pages` pages; if
/// its thread is gone, SQLite checkpoints in the commits again (the pragma
/// puts its own hook back) and `checkpointer` becomes `None`.
fn fed(
    conn: &rusqlite::Connection,
    checkpointer: &mut Option<Checkpointer>,
    checkpoint_pages: u32,
    pages: Option<u32>,
) {
    if let (Some(c), Some(pages)) = (checkpointer.as_mut(), pages)
        && !c.committed(pages, checkpoint_pages)
    {
        if let Err(e) = conn.pragma_update(None, "wal_autocheckpoint", checkpoint_pages) {
            tracing::warn!(error = %e, "the ledger's automatic checkpoint can't be turned back on");
        }
        *checkpointer = None;
    }
}

/// Whether `e` is SQLite's "database is locked" (`SQLITE_BUSY`, any
/// extended code).
pub(super) fn busy(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .and_then(|c| c.parse::<i32>().ok())
        .is_some_and(|c| c & 0xff == rusqlite::ffi::SQLITE_BUSY)
}

/// With `synchronous = FULL`, makes the writer's `COMMIT`s leave the
/// WAL's sync to the writer (`synchronous = NORMAL` on this connection,
/// which in WAL mode differs from `FULL` only there) and returns the WAL
/// file the writer syncs before it answers a batch's writes
/// (`store::writer`'s syncer). `None` (every `COMMIT` syncs, as
/// configured): `synchronous = NORMAL` was configured, or the WAL file
/// can't be opened beside SQLite's.
///
/// The connection opens the WAL with a read first; SQLite keeps that file
/// (the same inode) while any connection has the database open, and
/// truncating or restarting it keeps it too.
///
/// Errors: the read or the pragma fails.
fn deferred_sync(
    conn: &rusqlite::Connection,
    options: &WriterOptions,
) -> Result<Option<Arc<std::fs::File>>, sqlx::Error> {
    if !options.synchronous.eq_ignore_ascii_case("FULL") {
        return Ok(None);
    }
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))
        .map_err(db_error)?;
    let mut path = options.path.clone().into_os_string();
    path.push("-wal");
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, path = ?path, "the ledger's WAL can't be opened beside SQLite: each COMMIT syncs it");
            return Ok(None);
        }
    };
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(db_error)?;
    Ok(Some(Arc::new(file)))
}

/// A failed sync of the WAL, as the error of the `COMMIT` it followed.
fn sync_failed(e: std::io::Error) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "the ledger's WAL could not be synced to disk ({e}); the commit may or may not be durable"
    ))
}

/// A connection SQLite statements run on.
pub(in crate::ledger) enum Conn {
    /// One of the read pool's, through sqlx.
    Pooled(sqlx::pool::PoolConnection<sqlx::Sqlite>),
    /// A point reader's: statements run on the calling thread.
    Point(PointConn),
    /// The writer's: statements run on the calling thread.
    Writer {
        /// The connection; `None` while [`Conn::run_durable`] has it on a
        /// blocking thread (a caller dropped half-way leaves it `None`:
        /// lost, and the writer opens another).
        conn: Option<rusqlite::Connection>,
        /// Its busy timeout (`storage.busy_timeout_ms`).
        busy: Duration,
        /// Its checkpointer (`None`: SQLite's automatic checkpoint).
        checkpointer: Option<Checkpointer>,
        /// [`WriterOptions::checkpoint_pages`].
        checkpoint_pages: u32,
        /// The WAL file, when its `COMMIT`s don't sync it and the writer
        /// does ([`deferred_sync`]); `None`: each `COMMIT` syncs.
        wal: Option<Arc<std::fs::File>>,
        /// [`WriterOptions::durability`].
        durability: Arc<Durability>,
    },
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conn::Pooled(_) => f.write_str("Conn::Pooled"),
            Conn::Point(_) => f.write_str("Conn::Point"),
            Conn::Writer { conn, .. } => write!(f, "Conn::Writer(open: {})", conn.is_some()),
        }
    }
}

impl Conn {
    /// The writer's connection, opened from `options`.
    ///
    /// Errors: as [`WriterOptions::open`].
    pub(in crate::ledger) async fn writer(options: &WriterOptions) -> Result<Self, sqlx::Error> {
        let busy = options.busy_timeout;
        let checkpoint_pages = options.checkpoint_pages.max(1);
        let options = options.clone();
        let durability = options.durability.clone();
        let (conn, checkpointer, wal) = tokio::task::spawn_blocking(move || {
            let conn = options.open()?;
            // Waits happen on blocking threads only (`run_durable`).
            conn.busy_timeout(Duration::ZERO).map_err(db_error)?;
            let wal = deferred_sync(&conn, &options)?;
            let checkpointer = Checkpointer::start(&options);
            if checkpointer.is_some() {
                conn.wal_hook(Some(note_wal));
            }
            Ok::<_, sqlx::Error>((conn, checkpointer, wal))
        })
        .await
        .map_err(|e| sqlx::Error::Protocol(format!("opening the ledger's writer failed: {e}")))??;
        Ok(Conn::Writer {
            conn: Some(conn),
            busy,
            checkpointer,
            checkpoint_pages,
            wal,
            durability,
        })
    }

    /// Runs `text` (no binds) off the async runtime's threads, on the
    /// writer's connection (a pooled one runs it through sqlx).
    ///
    /// Errors: the database's; the connection was lost.
    pub(in crate::ledger) async fn run_durable(
        &mut self,
        text: &'static str,
    ) -> Result<(), sqlx::Error> {
        match self {
            Conn::Pooled(c) => {
                sqlx::raw_sql(text).execute(&mut **c).await?;
                Ok(())
            }
            Conn::Point(c) => c.run(super::super::dialect::sql(text)).await.map(drop),
            Conn::Writer {
                conn: slot,
                busy,
                checkpointer,
                checkpoint_pages,
                ..
            } => {
                let conn = slot.take().ok_or_else(lost)?;
                let (inline, wait) = (*checkpoint_pages, *busy);
                let (conn, result, pages) = tokio::task::spawn_blocking(move || {
                    let (result, pages) = durable(&conn, text, Some(wait), inline);
                    (conn, result, pages)
                })
                .await
                .map_err(|e| {
                    sqlx::Error::Protocol(format!("the ledger's writer thread failed: {e}"))
                })?;
                fed(&conn, checkpointer, *checkpoint_pages, pages);
                *slot = Some(conn);
                result
            }
        }
    }

    /// Runs the batch's `COMMIT` on the calling thread, fsync included,
    /// when this is the writer's connection: for a batch of one write with
    /// no other waiting, where the hand-offs to a blocking thread and back
    /// (two thread wake-ups) took longer than the fsync itself. `None`:
    /// not done (another connection kind, or SQLite answered
    /// `SQLITE_BUSY`: the transaction is still open, and
    /// [`Conn::run_durable`] commits it, waiting its busy timeout).
    ///
    /// Errors: the database's (the transaction's outcome is SQLite's: a
    /// failed `COMMIT` leaves it open or rolled back, as for
    /// [`Conn::run_durable`]).
    pub(in crate::ledger) fn commit_now(&mut self) -> Option<Result<(), sqlx::Error>> {
        let ticket = self.sync_ticket();
        let done = self.commit_here(true);
        let Some(ticket) = ticket else {
            return done.map(|(result, _)| result);
        };
        // Also when the COMMIT failed or was not done: the sync is harmless
        // then, and marks the tickets before this one only once they are
        // synced.
        let synced = ticket.sync_now();
        done.map(|(result, _)| result.and_then(|()| synced.map_err(sync_failed)))
    }

    /// Runs `COMMIT` on the writer's connection on the calling thread (its
    /// busy timeout is zero here: it does not wait for a lock), with the
    /// writer's checkpoint inside it at `storage.wal_checkpoint_pages` when
    /// `checkpoint` (else only reported: the `bool`, the WAL is at the
    /// limit), and tells the checkpointer thread. `None`: not done (not the
    /// writer's connection, or `SQLITE_BUSY`: the transaction is still
    /// open).
    fn commit_here(&mut self, checkpoint: bool) -> Option<(Result<(), sqlx::Error>, bool)> {
        let Conn::Writer {
            conn: Some(conn),
            checkpointer,
            checkpoint_pages,
            ..
        } = self
        else {
            return None;
        };
        let inline = if checkpoint {
            *checkpoint_pages
        } else {
            u32::MAX
        };
        let (result, pages) = durable(conn, "COMMIT", None, inline);
        if result.as_ref().is_err_and(busy) {
            return None;
        }
        fed(conn, checkpointer, *checkpoint_pages, pages);
        Some((result, pages.is_some_and(|p| p >= *checkpoint_pages)))
    }

    /// A ticket for the `COMMIT` about to run on the writer's connection
    /// when that `COMMIT` leaves the WAL's sync to the writer
    /// ([`deferred_sync`]); `None` when it syncs itself.
    pub(in crate::ledger) fn sync_ticket(&self) -> Option<SyncTicket> {
        match self {
            Conn::Writer {
                wal: Some(wal),
                durability,
                ..
            } => Some(durability.ticket(wal.clone())),
            _ => None,
        }
    }

    /// Commits the writer's open transaction on the calling thread when
    /// its `COMMIT` does not sync the WAL ([`deferred_sync`]): writing a
    /// batch's WAL frames takes less time than the hand-offs to a blocking
    /// thread and back, during which no write could use the connection.
    /// When the commit took the WAL to `storage.wal_checkpoint_pages`, the
    /// writer's own checkpoint (which syncs the WAL and the file) then runs
    /// on a blocking thread, with no write beside it. `None`: not done (the
    /// `COMMIT` syncs, or SQLite answered `SQLITE_BUSY`); the caller
    /// commits with [`Conn::run_durable`].
    ///
    /// Errors: the database's.
    pub(in crate::ledger) async fn commit_unsynced(&mut self) -> Option<Result<(), sqlx::Error>> {
        if !matches!(self, Conn::Writer { wal: Some(_), .. }) {
            return None;
        }
        let (result, at_limit) = self.commit_here(false)?;
        if result.is_ok() && at_limit {
            self.checkpoint_off_thread().await;
        }
        Some(result)
    }

    /// The writer's `PASSIVE` checkpoint on a blocking thread (a failure is
    /// logged: the next commit past the limit tries again).
    async fn checkpoint_off_thread(&mut self) {
        let Conn::Writer { conn: slot, .. } = self else {
            return;
        };
        let Some(conn) = slot.take() else { return };
        match tokio::task::spawn_blocking(move || {
            if let Err(e) = checkpoint::passive(&conn) {
                tracing::warn!(error = %e, "ledger WAL checkpoint failed");
            }
            conn
        })
        .await
        {
            Ok(conn) => *slot = Some(conn),
            Err(e) => tracing::error!(error = %e, "the ledger writer's checkpoint thread failed"),
        }
    }

    /// Runs `text` (no binds; it starts with `BEGIN IMMEDIATE`) on the
    /// calling thread when the file's write lock is free, which it is
    /// unless another process writes the file; otherwise on a blocking
    /// thread, waiting up to its busy timeout for the lock
    /// ([`Conn::run_durable`]).
    ///
    /// Errors: the database's; the connection was lost.
    pub(in crate::ledger) async fn begin(&mut self, text: &'static str) -> Result<(), sqlx::Error> {
        if let Conn::Writer {
            conn: Some(conn), ..
        } = self
        {
            // Its busy timeout is zero here: it does not wait for the lock.
            match run_plain(conn, text) {
                Ok(()) => return Ok(()),
                Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {
                    // Nothing of it ran: `BEGIN IMMEDIATE` failed to lock.
                    if !conn.is_autocommit() {
                        conn.execute_batch("ROLLBACK").map_err(db_error)?;
                    }
                }
                Err(e) => return Err(db_error(e)),
            }
        }
        self.run_durable(text).await
    }

    /// Whether this is the writer's connection and it has no transaction
    /// open: SQLite rolled one back by itself (after a disk-full or I/O
    /// error), or none was begun.
    pub(in crate::ledger) fn outside_transaction(&self) -> bool {
        matches!(self, Conn::Writer { conn: Some(c), .. } if c.is_autocommit())
    }

    /// Runs every statement of `stmt`'s text in turn on the writer's
    /// connection `conn`, handing each the next of `stmt`'s values (as
    /// many as it has placeholders: `?` in order, or `?N`, the Nth of its
    /// own). Returns the rows of all of them, in order, and the rows the
    /// statements that write changed.
    ///
    /// Errors: the database's; the values don't match the placeholders.
    pub(super) fn run(
        conn: &rusqlite::Connection,
        stmt: &Stmt<SqliteDialect>,
    ) -> Result<(Vec<Row>, u64), sqlx::Error> {
        let mut args = stmt.args.iter();
        let mut rows = Vec::new();
        let mut changed = 0;
        for text in stmt.text.split(';').filter(|t| !t.trim().is_empty()) {
            let mut s = conn.prepare_cached(text).map_err(db_error)?;
            for i in 1..=s.parameter_count() {
                let arg = args.next().ok_or_else(|| {
                    sqlx::Error::Protocol(format!("too few values for the placeholders of: {text}"))
                })?;
                bind(&mut s, i, arg).map_err(db_error)?;
            }
            let writes = !s.readonly();
            let mut result = s.raw_query();
            // Named once its first row is there: a statement SQLite had to
            // prepare again (the schema changed) has its columns only then.
            let mut named: Option<Arc<[String]>> = None;
            while let Some(row) = result.next().map_err(db_error)? {
                let names = match &named {
                    Some(names) => names.clone(),
                    None => named
                        .insert(column_names(text, row.as_ref()).map_err(db_error)?)
                        .clone(),
                };
                let values = (0..names.len())
                    .map(|i| row.get::<_, Value>(i))
                    .collect::<Result<Vec<Value>, _>>()
                    .map_err(db_error)?;
                rows.push(Row::Raw { names, values });
            }
            drop(result);
            if writes {
                changed += conn.changes();
            }
        }
        if args.next().is_some() {
            return Err(sqlx::Error::Protocol(format!(
                "more values than placeholders in: {}",
                stmt.text
            )));
        }
        Ok((rows, changed))
    }

    /// Runs `stmt`; all its rows and the rows it changed.
    async fn all(&mut self, stmt: Stmt<SqliteDialect>) -> Result<(Vec<Row>, u64), sqlx::Error> {
        match self {
            Conn::Pooled(c) => {
                let rows = super::query(stmt).fetch_all(&mut **c).await?;
                Ok((rows.into_iter().map(Row::Sqlx).collect(), 0))
            }
            Conn::Point(c) => c.run(stmt).await,
            Conn::Writer { conn, .. } => Self::run(conn.as_ref().ok_or_else(lost)?, &stmt),
        }
    }

    /// [`super::Dialect::execute`].
    pub(in crate::ledger) async fn execute(
        &mut self,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<u64, sqlx::Error> {
        match self {
            Conn::Pooled(c) => Ok(super::query(stmt).execute(&mut **c).await?.rows_affected()),
            Conn::Point(_) | Conn::Writer { .. } => Ok(self.all(stmt).await?.1),
        }
    }

    /// [`super::Dialect::fetch_optional`].
    pub(in crate::ledger) async fn fetch_optional(
        &mut self,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<Option<Row>, sqlx::Error> {
        match self {
            Conn::Pooled(c) => Ok(super::query(stmt)
                .fetch_optional(&mut **c)
                .await?
                .map(Row::Sqlx)),
            Conn::Point(_) | Conn::Writer { .. } => Ok(self.all(stmt).await?.0.into_iter().next()),
        }
    }

    /// [`super::Dialect::fetch_all`].
    pub(in crate::ledger) async fn fetch_all(
        &mut self,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        Ok(self.all(stmt).await?.0)
    }
}

/// The column names of `s`, the prepared statement of `text`, shared by
/// every run of that text. The ledger's statement texts are interned
/// (`dialect::cached`), so a text's address names it; the names kept for
/// it are checked against the statement's on each use (no allocation), and
/// a statement whose columns changed (a schema change) gets its own again.
/// Called with a statement's first row, when its columns are final.
/// Building them afresh allocated every name on every run (39 for a row of
/// `operations`).
///
/// Errors: SQLite's, for a column it can't name.
fn column_names(
    text: &'static str,
    s: &rusqlite::Statement<'_>,
) -> rusqlite::Result<Arc<[String]>> {
    type Names = std::collections::HashMap<(usize, usize), Arc<[String]>>;
    static NAMES: std::sync::LazyLock<std::sync::Mutex<Names>> =
        std::sync::LazyLock::new(Default::default);
    let n = s.column_count();
    let key = (text.as_ptr() as usize, text.len());
    let kept = NAMES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .cloned();
    if let Some(kept) = kept
        && kept.len() == n
        && (0..n).all(|i| s.column_name(i).is_ok_and(|c| c == kept[i]))
    {
        return Ok(kept);
    }
    let names: Arc<[String]> = (0..n)
        .map(|i| s.column_name(i).map(str::to_owned))
        .collect::<rusqlite::Result<_>>()?;
    NAMES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, names.clone());
    Ok(names)
}

/// Binds `arg` to placeholder `i` of `s` (a boolean as 0 or 1, as sqlx
/// stores it).
fn bind(s: &mut rusqlite::Statement<'_>, i: usize, arg: &Arg<'_>) -> rusqlite::Result<()> {
    match arg {
        Arg::Int(v) => s.raw_bind_parameter(i, *v),
        Arg::Bool(v) => s.raw_bind_parameter(i, i64::from(*v)),
        Arg::Text(v) => s.raw_bind_parameter(i, v.as_deref()),
        Arg::Bytes(v) => s.raw_bind_parameter(i, v.as_deref()),
    }
}

/// The writer's connection is gone (a blocking statement's caller was
/// dropped).
pub(super) fn lost() -> sqlx::Error {
    sqlx::Error::Protocol("the ledger's write connection was lost".into())
}
