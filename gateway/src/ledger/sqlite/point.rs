//! Point reads: one operation by its key (a duplicate's check, the replay
//! cache's version check), run on the calling thread on a connection of
//! [`PointReaders`]. In WAL mode a read never waits for the writer, and
//! the hand-off to sqlx's connection thread and back cost more than the
//! read. Should another process hold the file (a lock only its WAL
//! recovery takes), the read waits for it on a blocking thread. A read
//! that found a row waits for the sync of every commit before it
//! ([`Durability::settled`](super::super::store::writer::Durability::settled)).

use std::sync::Arc;
use std::time::Duration;

use super::super::dialect::Stmt;
#[cfg(test)]
use super::super::store::writer::Durability;
use super::SqliteDialect;
use super::conn::{Conn, WriterOptions, busy, lost};
use super::row::{Row, db_error};

/// Prepared statements a point reader keeps (two texts are all it runs).
const POINT_STATEMENTS: usize = 8;

/// The connections point reads run on, on the calling thread: idle ones
/// are kept (at most `storage.max_read_connections`), more are opened when
/// every one is in use. A point read holds its connection without
/// awaiting, so there are about as many in use as the runtime has threads,
/// plus those waiting out another process's lock, of which there are at
/// most `storage.max_read_connections` at a time (the others queue for a
/// turn, as they did for the read pool).
#[derive(Debug)]
pub(in crate::ledger) struct PointReaders {
    /// The file and its settings (the busy timeout is the one a read
    /// waits on another process's lock with, off the runtime's threads).
    options: WriterOptions,
    /// Idle connections.
    idle: std::sync::Mutex<Vec<rusqlite::Connection>>,
    /// Most idle connections kept.
    keep: usize,
    /// Turns to wait for a lock on a blocking thread (`keep` of them).
    waits: tokio::sync::Semaphore,
}

impl PointReaders {
    /// Point readers of the file `options` names, keeping up to `keep`
    /// idle connections.
    pub(in crate::ledger) fn new(options: WriterOptions, keep: usize) -> Arc<Self> {
        Arc::new(Self {
            options,
            idle: std::sync::Mutex::new(Vec::new()),
            keep: keep.max(1),
            waits: tokio::sync::Semaphore::new(keep.max(1)),
        })
    }

    /// The commits whose sync is pending, which a point read that found a
    /// row waits for (tests).
    #[cfg(test)]
    pub(in crate::ledger) fn durability(&self) -> &Arc<Durability> {
        &self.options.durability
    }

    /// Idle connections now (tests).
    #[cfg(test)]
    pub(super) fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// An idle connection, or a new one (opened on a blocking thread):
    /// read-only (`query_only`), never waiting for a lock on the calling
    /// thread (a zero busy timeout).
    ///
    /// Errors: the file can't be opened.
    pub(in crate::ledger) async fn acquire(self: &Arc<Self>) -> Result<Conn, sqlx::Error> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match idle {
            Some(c) => c,
            None => {
                let path = self.options.path.clone();
                tokio::task::spawn_blocking(move || {
                    let conn = rusqlite::Connection::open(&path).map_err(db_error)?;
                    conn.execute_batch("PRAGMA query_only = ON; PRAGMA foreign_keys = ON;")
                        .map_err(db_error)?;
                    conn.busy_timeout(Duration::ZERO).map_err(db_error)?;
                    conn.set_prepared_statement_cache_capacity(POINT_STATEMENTS);
                    Ok::<_, sqlx::Error>(conn)
                })
                .await
                .map_err(|e| {
                    sqlx::Error::Protocol(format!("opening a ledger point reader failed: {e}"))
                })??
            }
        };
        Ok(Conn::Point(PointConn {
            conn: Some(conn),
            home: self.clone(),
        }))
    }
}

/// A point reader's connection, given back to its [`PointReaders`] when
/// dropped.
pub(in crate::ledger) struct PointConn {
    /// `None` while a read waits on a blocking thread (a caller dropped
    /// then loses it: a new one is opened next time).
    conn: Option<rusqlite::Connection>,
    home: Arc<PointReaders>,
}

impl Drop for PointConn {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            let mut idle = self.home.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < self.home.keep {
                idle.push(c);
            }
        }
    }
}

impl PointConn {
    /// Runs `stmt` on the calling thread; if another process holds a lock
    /// it needs, once more on a blocking thread, waiting up to the busy
    /// timeout.
    pub(super) async fn run(
        &mut self,
        stmt: Stmt<SqliteDialect>,
    ) -> Result<(Vec<Row>, u64), sqlx::Error> {
        let conn = self.conn.as_ref().ok_or_else(lost)?;
        match Conn::run(conn, &stmt) {
            Err(e) if busy(&e) => {}
            Ok(found) if !found.0.is_empty() => {
                // What it found may be a commit whose sync is pending.
                self.home.options.durability.settled().await;
                return Ok(found);
            }
            done => return done,
        }
        let _turn = self
            .home
            .waits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let conn = self.conn.take().ok_or_else(lost)?;
        let wait = self.home.options.busy_timeout;
        let (conn, result) = tokio::task::spawn_blocking(move || {
            let result = conn
                .busy_timeout(wait)
                .map_err(db_error)
                .and_then(|()| Conn::run(&conn, &stmt));
            let reset = conn.busy_timeout(Duration::ZERO);
            (reset.is_ok().then_some(conn), result)
        })
        .await
        .map_err(|e| sqlx::Error::Protocol(format!("a ledger point read failed: {e}")))?;
        self.conn = conn;
        if result.as_ref().is_ok_and(|found| !found.0.is_empty()) {
            self.home.options.durability.settled().await;
        }
        result
    }
}
