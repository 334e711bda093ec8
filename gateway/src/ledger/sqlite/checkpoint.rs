//! The SQLite writer's WAL checkpoints.
//!
//! SQLite's automatic checkpoint runs inside the `COMMIT` that takes the
//! WAL past 1000 pages and copies every page of it into the file, and the
//! writes waiting for the next batch wait for it too. Here a thread of its
//! own, on a connection of its own, runs `PASSIVE` checkpoints from a
//! quarter of `storage.wal_checkpoint_pages` on, which never block the
//! writer; at `storage.wal_checkpoint_pages` the writer checkpoints inside
//! its `COMMIT` as SQLite would, but only the pages the thread has not
//! copied yet, and the WAL then starts over at the next write (a checkpoint
//! beside a busy writer never catches up with it).

use std::cell::Cell;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
#[cfg(test)]
use std::time::Duration;

use super::conn::WriterOptions;

/// The part of [`WriterOptions::checkpoint_pages`] past which the
/// checkpointer thread runs (1/4).
const BACKGROUND_CHECKPOINT_DIVISOR: u32 = 4;

thread_local! {
    /// The WAL's size in pages after the last commit on this thread (the
    /// writer's WAL hook sets it; see [`note_wal`]).
    pub(super) static WAL_PAGES: Cell<i32> = const { Cell::new(0) };
}

/// The writer's WAL hook: notes the WAL's size after a commit (on the
/// committing thread). Setting a hook turns SQLite's automatic
/// checkpoint off.
pub(super) fn note_wal(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
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
    /// The WAL's size in pages when it was last woken (0: not since the
    /// WAL started over).
    woken_at: u32,
    /// Checkpoints it ran, and the condition a test waits on.
    #[cfg(test)]
    done: Arc<(Mutex<u64>, Condvar)>,
    /// Wake-ups sent (each is one pass of the thread; one that found a
    /// wake-up pending is not counted).
    #[cfg(test)]
    sent: u64,
}

impl Checkpointer {
    /// Starts the thread; `None` if it can't be started (the writer then
    /// checkpoints inside its commits, as SQLite does by default).
    pub(super) fn start(options: &WriterOptions) -> Option<Self> {
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
                            .inspect_err(|e| {
                                tracing::warn!(error = %e, "the ledger's checkpointer can't open the file");
                            })
                            .ok();
                    }
                    let Some(c) = &conn else { continue };
                    match passive(c) {
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
            woken_at: 0,
            #[cfg(test)]
            done,
            #[cfg(test)]
            sent: 0,
        })
    }

    /// Notes a commit that left the WAL at `pages` (the writer
    /// checkpoints itself at `limit`, `storage.wal_checkpoint_pages`): the
    /// thread is woken each time the WAL has grown by a quarter of `limit`
    /// since it was last woken, not on every commit (each pass ends in an
    /// fsync of the file). Returns `false` when the thread is gone.
    pub(super) fn committed(&mut self, pages: u32, limit: u32) -> bool {
        if pages < self.woken_at {
            // The WAL started over.
            self.woken_at = 0;
        }
        let step = (limit / BACKGROUND_CHECKPOINT_DIVISOR).max(1);
        if pages >= limit || pages < self.woken_at.saturating_add(step) {
            return true;
        }
        self.woken_at = pages;
        match self.wake.try_send(()) {
            Ok(()) => {
                #[cfg(test)]
                {
                    self.sent += 1;
                }
                true
            }
            Err(TrySendError::Full(())) => true,
            Err(TrySendError::Disconnected(())) => false,
        }
    }

    /// Waits until every pass it was woken for has run, at most `limit`
    /// (tests).
    #[cfg(test)]
    pub(super) fn wait_idle(&self, limit: Duration) -> bool {
        self.wait_for(self.sent, limit)
    }

    /// Waits until it has run `n` checkpoints, at most `limit` (tests).
    #[cfg(test)]
    pub(super) fn wait_for(&self, n: u64, limit: Duration) -> bool {
        let (count, cv) = &*self.done;
        let guard = count.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = cv
            .wait_timeout_while(guard, limit, |c| *c < n)
            .unwrap_or_else(|e| e.into_inner());
        *guard >= n
    }
}

/// A `PASSIVE` checkpoint on `conn`: copies what no reader still needs,
/// waits for nobody.
///
/// Errors: the database's.
pub(super) fn passive(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}
