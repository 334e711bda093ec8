//! The connections SQLite statements run on: a read pool's (through sqlx,
//! whose connection thread runs each statement) and the writer's own.
//!
//! The writer's connection runs a write's statements on the calling
//! thread, without a hand-off to a connection thread per statement: the
//! writer holds the batch's one connection while a write runs, so each
//! hand-off (two thread wake-ups) was time no other write could use it. A
//! point statement on a page in cache takes microseconds. What waits for
//! the disk or another process — the batch's `COMMIT` (its fsync) and
//! `BEGIN IMMEDIATE` (the file's write lock, up to
//! `storage.busy_timeout_ms`) — runs on Tokio's blocking threads
//! ([`Conn::run_durable`]).
//!
//! Checkpoints: SQLite's automatic checkpoint runs inside the `COMMIT`
//! that takes the WAL past 1000 pages and copies every page of it into
//! the file, and the writes waiting for the next batch wait for it too.
//! Here a thread of its own, on a connection of its own, runs `PASSIVE`
//! checkpoints from a quarter of `storage.wal_checkpoint_pages` on, which
//! never block the writer; at `storage.wal_checkpoint_pages` the writer
//! checkpoints inside its `COMMIT` as SQLite would, but only the pages the
//! thread has not copied yet, and the WAL then starts over at the next
//! write (a checkpoint beside a busy writer never catches up with it).

use std::borrow::Cow;
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rusqlite::types::Value;

use super::super::dialect::{Arg, LedgerRow, Stmt};
use super::SqliteDialect;

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
}

/// The part of [`WriterOptions::checkpoint_pages`] past which the
/// checkpointer thread runs (1/4).
const BACKGROUND_CHECKPOINT_DIVISOR: u32 = 4;

thread_local! {
    /// The WAL's size in pages after the last commit on this thread (the
    /// writer's WAL hook sets it; see [`note_wal`]).
    static WAL_PAGES: Cell<i32> = const { Cell::new(0) };
}

/// The writer's WAL hook: notes the WAL's size after a commit (on the
/// committing thread). Setting a hook turns SQLite's automatic
/// checkpoint off.
fn note_wal(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(pages);
    Ok(())
}

/// The writer's checkpointer: a thread with a connection of its own that
/// runs a `PASSIVE` checkpoint when told the WAL is past a quarter of
/// [`WriterOptions::checkpoint_pages`]. It ends when the writer's
/// connection is dropped.
#[derive(Debug)]
pub(in crate::ledger) struct Checkpointer {
    /// Wakes it (a wake-up already pending is enough).
    wake: SyncSender<()>,
    /// Checkpoints it ran, and the condition a test waits on.
    #[cfg(test)]
    done: Arc<(Mutex<u64>, Condvar)>,
}

impl Checkpointer {
    /// Starts the thread; `None` if it can't be started (the writer then
    /// checkpoints inside its commits, as SQLite does by default).
    fn start(options: &WriterOptions) -> Option<Self> {
        let (wake, woken) = std::sync::mpsc::sync_channel::<()>(1);
        let done = Arc::new((Mutex::new(0_u64), Condvar::new()));
        let (options, counted) = (options.clone(), done.clone());
        #[cfg(not(test))]
        drop(done);
        std::thread::Builder::new()
            .name("ledger-checkpoint".into())
            .spawn(move || {
                let mut conn = None;
                while woken.recv().is_ok() {
                    if conn.is_none() {
                        conn = options
                            .open()
                            .inspect_err(|e| tracing::warn!(error = %e, "the ledger's checkpointer can't open the file"))
                            .ok();
                    }
                    let Some(c) = &conn else { continue };
                    match c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                        Ok(()) => {
                            let (n, cv) = &*counted;
                            *n.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                            cv.notify_all();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "ledger WAL checkpoint failed");
                            conn = None;
                        }
                    }
                }
            })
            .ok()?;
        Some(Self {
            wake,
            #[cfg(test)]
            done,
        })
    }

    /// Asks for a checkpoint. Returns `false` when the thread is gone.
    fn wake(&self) -> bool {
        !matches!(self.wake.try_send(()), Err(TrySendError::Disconnected(_)))
    }

    /// Waits until it has run `n` checkpoints, at most `limit` (tests).
    #[cfg(test)]
    fn wait_for(&self, n: u64, limit: Duration) -> bool {
        let (count, cv) = &*self.done;
        let guard = count.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = cv
            .wait_timeout_while(guard, limit, |c| *c < n)
            .unwrap_or_else(|e| e.into_inner());
        *guard >= n
    }
}

impl WriterOptions {
    /// Opens the writer's connection: WAL, `synchronous` and the page
    /// cache as configured, temporary data (a write's savepoint journal) in memory, foreign
    /// keys on (as sqlx sets them for the read pool).
    ///
    /// Errors: the file can't be opened or a pragma fails.
    fn open(&self) -> Result<rusqlite::Connection, sqlx::Error> {
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

/// A connection SQLite statements run on.
pub(in crate::ledger) enum Conn {
    /// One of the read pool's, through sqlx.
    Pooled(sqlx::pool::PoolConnection<sqlx::Sqlite>),
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
    },
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conn::Pooled(_) => f.write_str("Conn::Pooled"),
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
        let (conn, checkpointer) = tokio::task::spawn_blocking(move || {
            let conn = options.open()?;
            let checkpointer = Checkpointer::start(&options);
            if checkpointer.is_some() {
                conn.wal_hook(Some(note_wal));
            }
            Ok::<_, sqlx::Error>((conn, checkpointer))
        })
        .await
        .map_err(|e| sqlx::Error::Protocol(format!("opening the ledger's writer failed: {e}")))??;
        Ok(Conn::Writer {
            conn: Some(conn),
            busy,
            checkpointer,
            checkpoint_pages,
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
            Conn::Writer {
                conn: slot,
                checkpointer,
                checkpoint_pages,
                ..
            } => {
                let conn = slot.take().ok_or_else(lost)?;
                let inline = *checkpoint_pages;
                let (conn, result, pages) = tokio::task::spawn_blocking(move || {
                    WAL_PAGES.set(0);
                    let result = conn.execute_batch(text).map_err(db_error);
                    let pages = u32::try_from(WAL_PAGES.get()).unwrap_or(0);
                    if pages >= inline {
                        // What the checkpointer has not copied yet, with
                        // no write beside it: the WAL starts over next.
                        if let Err(e) =
                            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                        {
                            tracing::warn!(error = %e, "ledger WAL checkpoint failed");
                        }
                    }
                    (conn, result, pages)
                })
                .await
                .map_err(|e| {
                    sqlx::Error::Protocol(format!("the ledger's writer thread failed: {e}"))
                })?;
                if pages >= (*checkpoint_pages / BACKGROUND_CHECKPOINT_DIVISOR).max(1)
                    && pages < *checkpoint_pages
                    && let Some(c) = checkpointer
                    && !c.wake()
                {
                    // The thread is gone: SQLite checkpoints in the commits
                    // again (the pragma puts its own hook back).
                    if let Err(e) =
                        conn.pragma_update(None, "wal_autocheckpoint", *checkpoint_pages)
                    {
                        tracing::warn!(error = %e, "the ledger's automatic checkpoint can't be turned back on");
                    }
                    *checkpointer = None;
                }
                *slot = Some(conn);
                result
            }
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
            conn: Some(conn),
            busy,
            ..
        } = self
        {
            let busy = *busy;
            conn.busy_timeout(Duration::ZERO).map_err(db_error)?;
            let first = conn.execute_batch(text);
            conn.busy_timeout(busy).map_err(db_error)?;
            match first {
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

    /// Runs every statement of `stmt`'s text in turn on the writer's
    /// connection `conn`, handing each the next of `stmt`'s values (as
    /// many as it has placeholders: `?` in order, or `?N`, the Nth of its
    /// own). Returns the rows of all of them, in order, and the rows the
    /// statements that write changed.
    ///
    /// Errors: the database's; the values don't match the placeholders.
    fn run(
        conn: &rusqlite::Connection,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<(Vec<Row>, u64), sqlx::Error> {
        let mut args = stmt.args.into_iter();
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
            let names: Arc<[String]> = s.column_names().into_iter().map(str::to_owned).collect();
            let writes = !s.readonly();
            let mut result = s.raw_query();
            while let Some(row) = result.next().map_err(db_error)? {
                let values = (0..names.len())
                    .map(|i| row.get::<_, Value>(i))
                    .collect::<Result<Vec<Value>, _>>()
                    .map_err(db_error)?;
                rows.push(Row::Raw {
                    names: names.clone(),
                    values,
                });
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
            Conn::Writer { conn, .. } => Self::run(conn.as_ref().ok_or_else(lost)?, stmt),
        }
    }

    /// [`super::Dialect::execute`].
    pub(in crate::ledger) async fn execute(
        &mut self,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<u64, sqlx::Error> {
        match self {
            Conn::Pooled(c) => Ok(super::query(stmt).execute(&mut **c).await?.rows_affected()),
            Conn::Writer { .. } => Ok(self.all(stmt).await?.1),
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
            Conn::Writer { .. } => Ok(self.all(stmt).await?.0.into_iter().next()),
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

/// Binds `arg` to placeholder `i` of `s` (a boolean as 0 or 1, as sqlx
/// stores it).
fn bind(s: &mut rusqlite::Statement<'_>, i: usize, arg: Arg<'static>) -> rusqlite::Result<()> {
    match arg {
        Arg::Int(v) => s.raw_bind_parameter(i, v),
        Arg::Bool(v) => s.raw_bind_parameter(i, i64::from(v)),
        Arg::Text(v) => s.raw_bind_parameter(i, v.as_deref()),
        Arg::Bytes(v) => s.raw_bind_parameter(i, v.as_deref()),
    }
}

/// The writer's connection is gone (a blocking statement's caller was
/// dropped).
fn lost() -> sqlx::Error {
    sqlx::Error::Protocol("the ledger's write connection was lost".into())
}

/// A SQLite error as the ledger reports database errors.
fn db_error(e: rusqlite::Error) -> sqlx::Error {
    sqlx::Error::Database(Box::new(SqliteError(e)))
}

/// An error of the writer's connection, as sqlx reports database errors.
#[derive(Debug)]
struct SqliteError(rusqlite::Error);

impl std::fmt::Display for SqliteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SqliteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl sqlx::error::DatabaseError for SqliteError {
    fn message(&self) -> &str {
        match &self.0 {
            rusqlite::Error::SqliteFailure(_, Some(m)) => m,
            _ => "SQLite error",
        }
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        match &self.0 {
            rusqlite::Error::SqliteFailure(e, _) => Some(Cow::Owned(e.extended_code.to_string())),
            _ => None,
        }
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use rusqlite::ffi;
        match self.0.sqlite_error().map(|e| e.extended_code) {
            Some(ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY) => {
                sqlx::error::ErrorKind::UniqueViolation
            }
            Some(ffi::SQLITE_CONSTRAINT_FOREIGNKEY) => sqlx::error::ErrorKind::ForeignKeyViolation,
            Some(ffi::SQLITE_CONSTRAINT_NOTNULL) => sqlx::error::ErrorKind::NotNullViolation,
            Some(ffi::SQLITE_CONSTRAINT_CHECK) => sqlx::error::ErrorKind::CheckViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}

/// A result row: sqlx's (a read) or one the writer's connection read.
#[derive(Debug)]
pub(in crate::ledger) enum Row {
    /// Read through sqlx.
    Sqlx(sqlx::sqlite::SqliteRow),
    /// Read by the writer's connection: its column names and values.
    Raw {
        /// The statement's columns (shared by its rows).
        names: Arc<[String]>,
        /// This row's values, one per column.
        values: Vec<Value>,
    },
}

impl Row {
    /// Column `col`'s value (a raw row), or sqlx's `ColumnNotFound`.
    fn value(names: &[String], values: &[Value], col: &str) -> Result<Value, sqlx::Error> {
        names
            .iter()
            .position(|n| n == col)
            .and_then(|i| values.get(i))
            .cloned()
            .ok_or_else(|| sqlx::Error::ColumnNotFound(col.to_owned()))
    }

    /// Column `col` read by `by_sqlx` (a sqlx row) or by `raw` (a raw row's
    /// value; `None`: it does not decode as the type asked for).
    fn read<T>(
        &self,
        col: &str,
        by_sqlx: impl FnOnce(&sqlx::sqlite::SqliteRow) -> Result<T, sqlx::Error>,
        raw: impl FnOnce(Value) -> Option<T>,
    ) -> Result<T, sqlx::Error> {
        match self {
            Row::Sqlx(r) => by_sqlx(r),
            Row::Raw { names, values } => {
                let v = Self::value(names, values, col)?;
                let kind = v.data_type();
                raw(v).ok_or_else(|| sqlx::Error::ColumnDecode {
                    index: col.to_owned(),
                    source: format!("a {kind} value where another type was expected").into(),
                })
            }
        }
    }
}

impl LedgerRow for Row {
    fn int(&self, col: &str) -> Result<i64, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(i),
                _ => None,
            },
        )
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(Some(i)),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
    fn text(&self, col: &str) -> Result<String, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Text(t) => Some(t),
                _ => None,
            },
        )
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Text(t) => Some(Some(t)),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
    fn flag(&self, col: &str) -> Result<bool, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Integer(i) => Some(i != 0),
                _ => None,
            },
        )
    }
    fn bytes(&self, col: &str) -> Result<Vec<u8>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Blob(b) => Some(b),
                Value::Text(t) => Some(t.into_bytes()),
                _ => None,
            },
        )
    }
    fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        self.read(
            col,
            |r| sqlx::Row::try_get(r, col),
            |v| match v {
                Value::Blob(b) => Some(Some(b)),
                Value::Text(t) => Some(Some(t.into_bytes())),
                Value::Null => Some(None),
                _ => None,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::dialect::sql;

    fn memory() -> Conn {
        let conn = rusqlite::Connection::open_in_memory().expect("an in-memory database");
        conn.execute_batch(
            "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL, flag BOOLEAN, body BLOB)",
        )
        .expect("a table");
        Conn::Writer {
            conn: Some(conn),
            busy: Duration::from_secs(1),
            checkpointer: None,
            checkpoint_pages: 1000,
        }
    }

    /// Each statement of a text takes as many values as it has
    /// placeholders, in order; the rows of all of them come back in order,
    /// and the count is of the rows the writing ones changed.
    #[tokio::test]
    async fn a_text_of_several_statements_hands_each_its_own_values() {
        let mut conn = memory();
        let inserted = sql::<SqliteDialect>(
            "INSERT INTO t (id, name, flag, body) VALUES (?, ?, ?, ?); \
             INSERT INTO t (id, name) VALUES (?, ?)",
        )
        .bind(1_i64)
        .bind("one")
        .bind(true)
        .bind(&b"\x00\x01"[..])
        .bind(2_i64)
        .bind("two")
        .execute(&mut conn)
        .await
        .unwrap();
        assert_eq!(inserted, 2);
        let rows = sql::<SqliteDialect>(
            "UPDATE t SET name = ? WHERE id = ? RETURNING id, name; \
             SELECT id, name, flag, body FROM t WHERE id = ?1",
        )
        .bind("uno")
        .bind(1_i64)
        .bind(2_i64)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].int("id").unwrap(), 1);
        assert_eq!(rows[0].text("name").unwrap(), "uno");
        assert_eq!(rows[1].int("id").unwrap(), 2);
        assert_eq!(rows[1].opt_int("flag").unwrap(), None);
        assert_eq!(rows[1].opt_bytes("body").unwrap(), None);
        let one = sql::<SqliteDialect>("SELECT flag, body FROM t WHERE id = 1")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert!(one.flag("flag").unwrap());
        assert_eq!(one.bytes("body").unwrap(), b"\x00\x01");
    }

    /// Values that don't match the placeholders, a column that isn't
    /// there and a value of another type are errors, not panics, and the
    /// database's own errors keep their kind.
    #[tokio::test]
    async fn mismatches_are_errors() {
        let mut conn = memory();
        let few = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (?, ?)")
            .bind(1_i64)
            .execute(&mut conn)
            .await;
        assert!(
            matches!(&few, Err(sqlx::Error::Protocol(m)) if m.contains("too few values")),
            "{few:?}"
        );
        let many = sql::<SqliteDialect>("SELECT 1 AS one")
            .bind(1_i64)
            .fetch_all(&mut conn)
            .await;
        assert!(
            matches!(&many, Err(sqlx::Error::Protocol(m)) if m.contains("more values")),
            "{many:?}"
        );
        let row = sql::<SqliteDialect>("SELECT 'x' AS name")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert!(matches!(
            row.int("name"),
            Err(sqlx::Error::ColumnDecode { .. })
        ));
        assert!(matches!(
            row.text("other"),
            Err(sqlx::Error::ColumnNotFound(_))
        ));
        for _ in 0..2 {
            let _ = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (7, 'seven')")
                .execute(&mut conn)
                .await;
        }
        let dup = sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (7, 'again')")
            .execute(&mut conn)
            .await;
        match dup {
            Err(sqlx::Error::Database(e)) => {
                assert!(e.is_unique_violation(), "{e}");
                assert!(e.message().contains("UNIQUE"), "{}", e.message());
            }
            other => panic!("{other:?}"),
        }
    }

    /// `COMMIT` and `BEGIN` run on a blocking thread and give the
    /// connection back.
    #[tokio::test]
    async fn a_durable_statement_gives_the_connection_back() {
        let mut conn = memory();
        conn.run_durable("BEGIN IMMEDIATE").await.unwrap();
        sql::<SqliteDialect>("INSERT INTO t (id, name) VALUES (1, 'one')")
            .execute(&mut conn)
            .await
            .unwrap();
        conn.run_durable("COMMIT").await.unwrap();
        let n = sql::<SqliteDialect>("SELECT COUNT(*) AS n FROM t")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n.int("n").unwrap(), 1);
        let Conn::Writer { conn: Some(c), .. } = &conn else {
            panic!("the connection was not given back: {conn:?}");
        };
        assert!(c.is_autocommit());
    }

    /// `BEGIN IMMEDIATE` while another connection holds the file's write
    /// lock waits for it on a blocking thread, up to the busy timeout, and
    /// fails with the database's error; the connection stays usable and
    /// begins once the lock is free.
    #[tokio::test]
    async fn a_begin_behind_another_writer_waits_then_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let options = WriterOptions {
            path: dir.path().join("ledger.db"),
            synchronous: "FULL",
            busy_timeout: Duration::from_millis(50),
            cache_kib: 1024,
            checkpoint_pages: 1000,
        };
        let mut conn = Conn::writer(&options).await.unwrap();
        let other = rusqlite::Connection::open(&options.path).unwrap();
        other
            .execute_batch("CREATE TABLE t (id INTEGER); BEGIN IMMEDIATE; INSERT INTO t VALUES (1)")
            .unwrap();
        let busy = conn.begin("BEGIN IMMEDIATE; SAVEPOINT s").await;
        match busy {
            Err(sqlx::Error::Database(e)) => assert!(e.message().contains("locked"), "{e}"),
            other => panic!("{other:?}"),
        }
        other.execute_batch("COMMIT").unwrap();
        conn.begin("BEGIN IMMEDIATE; SAVEPOINT s").await.unwrap();
        let n = sql::<SqliteDialect>("SELECT COUNT(*) AS n FROM t")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n.int("n").unwrap(), 1);
        conn.run_durable("COMMIT").await.unwrap();
    }

    /// Past a quarter of `checkpoint_pages` the checkpointer moves the
    /// WAL into the file (the writer's commits don't).
    #[tokio::test]
    async fn the_checkpointer_moves_the_wal_into_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let options = WriterOptions {
            path: dir.path().join("ledger.db"),
            synchronous: "FULL",
            busy_timeout: Duration::from_secs(1),
            cache_kib: 1024,
            checkpoint_pages: 1000,
        };
        let mut conn = Conn::writer(&options).await.unwrap();
        conn.begin("BEGIN IMMEDIATE; CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
            .await
            .unwrap();
        conn.run_durable("COMMIT").await.unwrap();
        // 16 KiB a commit, until the WAL is past 250 pages: one commit
        // wakes the checkpointer, once.
        let wal = dir.path().join("ledger.db-wal");
        let mut id = 0_i64;
        while std::fs::metadata(&wal).unwrap().len() < 250 * 4096 {
            conn.begin("BEGIN IMMEDIATE").await.unwrap();
            sql::<SqliteDialect>("INSERT INTO t (id, body) VALUES (?, zeroblob(16384))")
                .bind(id)
                .execute(&mut conn)
                .await
                .unwrap();
            conn.run_durable("COMMIT").await.unwrap();
            id += 1;
        }
        let Conn::Writer {
            checkpointer: Some(c),
            ..
        } = &conn
        else {
            panic!("no checkpointer: {conn:?}");
        };
        assert!(c.wait_for(1, Duration::from_secs(10)), "no checkpoint ran");
        // What the WAL held is in the file now: a copy of the file alone,
        // without its WAL, has the table and every row.
        let copy = dir.path().join("copy.db");
        std::fs::copy(&options.path, &copy).unwrap();
        let probe = rusqlite::Connection::open(&copy).unwrap();
        let n: i64 = probe
            .query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, id);
    }

    /// At `checkpoint_pages` the writer checkpoints inside its commit and
    /// the WAL starts over at the next write: it never grows much past it.
    #[tokio::test]
    async fn the_wal_starts_over_at_checkpoint_pages() {
        let dir = tempfile::tempdir().unwrap();
        let options = WriterOptions {
            path: dir.path().join("ledger.db"),
            synchronous: "NORMAL",
            busy_timeout: Duration::from_secs(1),
            cache_kib: 1024,
            checkpoint_pages: 40,
        };
        let mut conn = Conn::writer(&options).await.unwrap();
        conn.begin("BEGIN IMMEDIATE; CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
            .await
            .unwrap();
        conn.run_durable("COMMIT").await.unwrap();
        let mut largest = 0;
        for id in 0..100_i64 {
            conn.begin("BEGIN IMMEDIATE").await.unwrap();
            sql::<SqliteDialect>("INSERT INTO t (id, body) VALUES (?, zeroblob(16384))")
                .bind(id)
                .execute(&mut conn)
                .await
                .unwrap();
            conn.run_durable("COMMIT").await.unwrap();
            let wal = std::fs::metadata(dir.path().join("ledger.db-wal"))
                .unwrap()
                .len();
            largest = largest.max(wal);
        }
        // 100 commits of 5 pages or more: 500 pages written. The WAL passes
        // 40 pages while a pass of the checkpointer holds the writer's own
        // checkpoint back (how far depends on the machine's load), but it
        // starts over: it never holds what was written.
        assert!(largest < 400 * 4_096, "the WAL grew to {largest} bytes");
    }
}
