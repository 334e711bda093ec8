//! Durability after the `COMMIT`: the WAL's sync, off the write
//! connection's path.
//!
//! On SQLite with `storage.synchronous = full`, a batch's `COMMIT` writes
//! its WAL frames without waiting for the disk, and the batch's writes are
//! answered only once an `fdatasync` of the WAL that began after that
//! `COMMIT` returned. The sync runs on a blocking thread while the next
//! batch already runs its statements and commits: the connection no
//! longer waits for the disk, and one sync covers every batch committed
//! before it began. What a caller is told is as durable as before: a write
//! is answered after its transition is on disk.
//!
//! What the connection commits is visible to readers before it is synced.
//! A point read that found a row ([`Durability::settled`]) therefore waits
//! until every commit before it was synced: a duplicate is never answered
//! from a transition that a power cut could still take back. Reads of
//! lists (the admin API, the console) don't wait: they may show a
//! transition up to one sync (a fraction of a millisecond to a few
//! milliseconds) before it is durable.
//!
//! If the sync fails, the batch's writes are told their commit failed, and
//! that its outcome is unknown (the rows are in the ledger, but the disk
//! may not hold them): as after a stalled `COMMIT`, a claim it held is
//! found by the reconciler when its lease ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};

use super::{Answer, Failed};

/// The commits of one ledger file whose sync was left to the syncer, and
/// how far the syncs have come.
#[derive(Debug)]
pub(in crate::ledger) struct Durability {
    /// Tickets handed out: one per `COMMIT` run without a sync, taken
    /// before it runs.
    committed: AtomicU64,
    /// The highest ticket whose commit is durable (or did not happen).
    synced: watch::Sender<u64>,
    /// Held by a test (a write guard) to keep the syncer from syncing.
    #[cfg(test)]
    pub(in crate::ledger) hold: tokio::sync::RwLock<()>,
    /// Set by a test: the syncer's next sync fails.
    #[cfg(test)]
    pub(in crate::ledger) fail_next: std::sync::atomic::AtomicBool,
}

impl Default for Durability {
    fn default() -> Self {
        Self {
            committed: AtomicU64::new(0),
            synced: watch::Sender::new(0),
            #[cfg(test)]
            hold: tokio::sync::RwLock::new(()),
            #[cfg(test)]
            fail_next: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl Durability {
    /// A ticket for a `COMMIT` about to run without a sync; `wal` is the
    /// file whose sync makes it durable.
    pub(in crate::ledger) fn ticket(self: &Arc<Self>, wal: Arc<std::fs::File>) -> SyncTicket {
        SyncTicket {
            n: self.committed.fetch_add(1, Ordering::AcqRel) + 1,
            wal,
            durability: self.clone(),
        }
    }

    /// Notes every ticket up to `n` as durable (or as not committed).
    fn mark(&self, n: u64) {
        self.synced.send_if_modified(|s| {
            let moved = *s < n;
            *s = (*s).max(n);
            moved
        });
    }

    /// Waits until every commit that ran before this call is durable: call
    /// it after a read, before answering from what it found. Returns at
    /// once when no sync is pending (the usual case outside of load).
    pub(in crate::ledger) async fn settled(&self) {
        let upto = self.committed.load(Ordering::Acquire);
        if *self.synced.borrow() >= upto {
            return;
        }
        let mut rx = self.synced.subscribe();
        // The sender lives as long as `self`.
        let _ = rx.wait_for(|s| *s >= upto).await;
    }

    /// Commits whose sync is still pending (tests).
    #[cfg(test)]
    pub(in crate::ledger) fn pending(&self) -> u64 {
        self.committed.load(Ordering::Acquire) - *self.synced.borrow()
    }
}

/// One `COMMIT` run without a sync: its number and the file to sync.
#[derive(Debug)]
pub(in crate::ledger) struct SyncTicket {
    n: u64,
    wal: Arc<std::fs::File>,
    durability: Arc<Durability>,
}

impl SyncTicket {
    /// Syncs the WAL on the calling thread and marks the ticket (and every
    /// one before it) durable: for a lone write that commits on its own
    /// thread.
    ///
    /// Errors: the sync's.
    pub(in crate::ledger) fn sync_now(self) -> std::io::Result<()> {
        let result = self.wal.sync_data();
        self.durability.mark(self.n);
        result
    }

    /// The `COMMIT` did not happen: nothing to wait for (marked in turn by
    /// the syncer, so that no earlier commit is marked before its sync).
    pub(super) fn void(self) -> Pending {
        Pending {
            ticket: self,
            waiting: Vec::new(),
            started: Instant::now(),
            crash_after: false,
        }
    }
}

/// A committed batch waiting for its sync.
pub(super) struct Pending {
    pub(super) ticket: SyncTicket,
    /// Its writes (none for [`SyncTicket::void`]).
    pub(super) waiting: Vec<oneshot::Sender<Answer>>,
    /// When its `COMMIT` began (the commit latency metric runs to the end
    /// of the sync).
    pub(super) started: Instant,
    /// Crash point `batch-after-commit`: after the sync, before any answer.
    pub(super) crash_after: bool,
}

/// The syncer of one write connection: takes every committed batch
/// waiting, syncs the WAL once on a blocking thread, then answers their
/// writes in commit order. Ends when the writer is dropped.
pub(super) async fn syncer(mut rx: mpsc::UnboundedReceiver<Pending>) {
    let mut group = Vec::new();
    while rx.recv_many(&mut group, usize::MAX).await > 0 {
        let mut files: Vec<Arc<std::fs::File>> = Vec::new();
        for p in group.iter().filter(|p| !p.waiting.is_empty()) {
            if !files.iter().any(|f| Arc::ptr_eq(f, &p.ticket.wal)) {
                files.push(p.ticket.wal.clone());
            }
        }
        #[cfg(test)]
        let durability = group.first().map(|p| p.ticket.durability.clone());
        #[cfg(test)]
        let (_held, failing) = match &durability {
            Some(d) => (
                Some(d.hold.read().await),
                d.fail_next.swap(false, Ordering::AcqRel),
            ),
            None => (None, false),
        };
        #[cfg(not(test))]
        let failing = false;
        let result = if failing {
            Err(std::io::Error::other("injected sync failure"))
        } else if files.is_empty() {
            Ok(())
        } else {
            tokio::task::spawn_blocking(move || files.iter().try_for_each(|f| f.sync_data()))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
        };
        if let Some(last) = group.last() {
            last.ticket.durability.mark(last.ticket.n);
        }
        let failed = result.err().map(|e| Failed {
            why: format!(
                "the ledger's WAL could not be synced to disk ({e}); the batch's commit may or may not be durable"
            )
            .into(),
            undone: false,
        });
        for p in group.drain(..) {
            let size = p.waiting.len();
            if size == 0 {
                continue;
            }
            if p.crash_after && size >= 2 {
                crate::failpoint::crash("batch-after-commit");
            }
            match &failed {
                None => {
                    crate::metrics::ledger_batch(size, p.started.elapsed());
                    for w in p.waiting {
                        let _ = w.send(Ok(size));
                    }
                }
                Some(f) => {
                    tracing::error!(batch_size = size, error = %f.why, "ledger batch sync failed");
                    crate::metrics::ledger_batch_failed();
                    for w in p.waiting {
                        let _ = w.send(Err(f.clone()));
                    }
                }
            }
        }
    }
}
