//! [`BatchTx`]: one write's turn on the write connection, inside its
//! batch's transaction, until it commits with the batch or is dropped.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{OwnedMutexGuard, oneshot};

use super::super::super::LedgerError;
use super::super::super::dialect::{Conn, Dialect, sql};
use super::commit::{commit_alone, commit_batch};
use super::{Answer, Batch, Failed, JOINED, Shared};

/// One write's place in the open batch: its turn on the write connection
/// (it dereferences to the connection) inside the batch's transaction
/// (on SQLite, inside the write's savepoint).
pub(in crate::ledger) struct BatchTx<D: Dialect> {
    pub(super) guard: Option<OwnedMutexGuard<Batch<D>>>,
    pub(super) shared: Arc<Shared<D>>,
    pub(super) bytes: usize,
}

impl<D: Dialect> BatchTx<D> {
    /// Counts `bytes` more body bytes for `storage.write_batch_bytes`.
    pub(in crate::ledger) fn add_bytes(&mut self, bytes: usize) {
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Says that this write changes or deletes a COMPLETED or FAILED
    /// operation (a compensation, a requeue, a self-audit, a sweep, an
    /// expired key reused): the batch's commit bumps
    /// [`Writer::terminal_epoch`](super::Writer::terminal_epoch). A write that changes one and does not
    /// say so lets the replay cache serve the old answer on SQLite.
    pub(in crate::ledger) fn changes_terminal(&mut self) {
        if let Some(b) = self.guard.as_mut() {
            b.terminal = true;
        }
    }

    /// This write's time on the database clock (PostgreSQL: read with the
    /// batch's `BEGIN`, plus the monotonic time since), ms since the Unix
    /// epoch; `None` on SQLite.
    pub(in crate::ledger) fn db_now(&self) -> Option<i64> {
        self.guard.as_ref().and_then(|b| b.now)
    }

    /// Marks the batch to fail its commit when the `ledger-commit-fail`
    /// failure injection names a prefix of `operation_id`, or to crash at
    /// `batch-before-commit` / `batch-after-commit` (tests; a no-op
    /// without the `failpoints` feature).
    pub(in crate::ledger) fn inject(&mut self, operation_id: &str) {
        let Some(b) = self.guard.as_mut() else {
            return;
        };
        b.poisoned |= crate::failpoint::names("ledger-commit-fail", operation_id);
        b.crash_before |= crate::failpoint::names("batch-before-commit", operation_id);
        b.crash_after |= crate::failpoint::names("batch-after-commit", operation_id);
    }

    /// Ends this write, which changed nothing: it ran only reads, or lost
    /// its compare-and-swap in its first statement that writes, and no
    /// statement of it failed. On PostgreSQL the batch goes on as if the
    /// write had not been (a write dropped without this, or without
    /// [`BatchTx::commit`], undoes its batch there); on SQLite it is
    /// undone before the next write (rolled back to its savepoint, or, the
    /// batch's first write, with the batch, which holds nothing else), as
    /// for any write that ends without a commit. A write that did change something and
    /// ends with this leaves that change in the batch, to be committed
    /// with it: say it only where nothing was written.
    pub(in crate::ledger) fn unchanged(mut self) {
        if !D::SAVEPOINT_EACH_WRITE
            && let Some(b) = self.guard.as_mut()
        {
            b.writing = false;
        }
    }

    /// Ends this write (on SQLite, releasing its savepoint if it has one)
    /// and waits
    /// until the batch holding this write is committed. Returns the
    /// batch's size (writes in it); the ledger span of the call records it
    /// as `effectgate.batch_size`.
    ///
    /// Errors: the batch's `COMMIT` failed ([`LedgerError::BatchCommit`]:
    /// nothing of this write was kept); another write of the batch undid
    /// it before its commit ([`LedgerError::BatchUndone`], PostgreSQL);
    /// the savepoint's release failed (SQLite: the write is rolled back
    /// before the next one).
    pub(in crate::ledger) async fn commit(mut self) -> Result<usize, LedgerError> {
        let bare = self.guard.as_ref().is_some_and(|b| b.bare);
        if D::SAVEPOINT_EACH_WRITE && !bare {
            let b = self.guard.as_mut().expect("a write commits once");
            let conn = b.conn.as_mut().expect("a write holds the connection");
            // On failure the write stays marked abandoned (dropping `self`
            // wakes the committer for it).
            sql::<D>("RELEASE SAVEPOINT effectgate_write")
                .execute(conn)
                .await?;
        }
        let mut b = self.guard.take().expect("a write commits once");
        b.writing = false;
        b.bare = false;
        let (tx, rx) = oneshot::channel();
        b.waiting.push(tx);
        b.bytes = b.bytes.saturating_add(self.bytes);
        let _ = JOINED.try_with(|j| j.now.store(super::IN, Ordering::Release));
        let limits = self.shared.limits;
        let Some(mut b) = commit_alone(&self.shared, b) else {
            return answer(rx).await;
        };
        if b.waiting.len() >= limits.max_writes || b.bytes >= limits.max_bytes {
            // Committed at once, by a task of its own that holds the batch:
            // a caller that gives up waiting (its request was cancelled)
            // can't stop a COMMIT half-way and leave the batch's state
            // behind it.
            let shared = self.shared.clone();
            tokio::spawn(async move {
                commit_batch(&shared, &mut b).await;
            });
        } else {
            if b.waiting.len() == 1 {
                self.shared.wake.notify_one();
            }
            drop(b);
        }
        answer(rx).await
    }
}

/// What a write's commit heard back from its batch.
async fn answer(rx: oneshot::Receiver<Answer>) -> Result<usize, LedgerError> {
    match rx.await {
        Ok(Ok(size)) => {
            tracing::Span::current().record("effectgate.batch_size", size);
            Ok(size)
        }
        Ok(Err(Failed { why, undone: true })) => {
            // Out of the batch, nothing kept: the call's time limit holds
            // again ([`bounded`]).
            let _ = JOINED.try_with(|j| {
                j.now.store(super::OUT, Ordering::Release);
                j.left.notify_waiters();
            });
            Err(LedgerError::BatchUndone(why.to_string()))
        }
        Ok(Err(Failed { why, .. })) => Err(LedgerError::BatchCommit(why.to_string())),
        Err(_) => Err(LedgerError::BatchCommit(
            "the ledger writer stopped before committing".into(),
        )),
    }
}

impl<D: Dialect> Deref for BatchTx<D> {
    type Target = Conn<D>;
    fn deref(&self) -> &Conn<D> {
        self.guard
            .as_ref()
            .and_then(|b| b.conn.as_ref())
            .expect("a write holds the connection")
    }
}

impl<D: Dialect> DerefMut for BatchTx<D> {
    /// The connection, to run a statement of this write on: from here on
    /// the write is undone if it ends without a commit.
    fn deref_mut(&mut self) -> &mut Conn<D> {
        let b = self.guard.as_mut().expect("a write holds the connection");
        b.writing = true;
        b.conn.as_mut().expect("a write holds the connection")
    }
}

impl<D: Dialect> Drop for BatchTx<D> {
    fn drop(&mut self) {
        // Dropped before commit (an error, a cancelled call): it stays
        // marked abandoned and is undone before the next write or by the
        // committer, which is woken for it: the batch gets committed when
        // it has writes waiting, and with none the transaction ends, so it
        // never stays open (on PostgreSQL holding the rows the write
        // locked) until some other write comes along.
        // A write that ended unchanged wakes it only when no write waits
        // for the batch: one that does has woken it already.
        if let Some(b) = self.guard.take()
            && (b.writing || (b.open && b.waiting.is_empty()))
        {
            self.shared.wake.notify_one();
        }
    }
}
