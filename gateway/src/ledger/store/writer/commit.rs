//! A batch's end: its `COMMIT` (by the committer task, or by a lone
//! write on its own thread), answering its writes, and undoing an
//! abandoned write or a failed batch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use tokio::sync::{Notify, OwnedMutexGuard};

use super::super::super::dialect::{Conn, Dialect, sql};
use super::{ABANDONED_FIRST, Batch, Failed, Shared, UNDONE, stalled, sync, within};

/// Rolls an abandoned write back to its savepoint and releases it.
pub(super) async fn rollback_savepoint<D: Dialect>(conn: &mut Conn<D>) -> Result<(), sqlx::Error> {
    sql::<D>("ROLLBACK TO SAVEPOINT effectgate_write")
        .execute(&mut *conn)
        .await?;
    sql::<D>("RELEASE SAVEPOINT effectgate_write")
        .execute(conn)
        .await?;
    Ok(())
}

/// Drops the write connection for good (out of the pool, whatever
/// state it is in); the next write takes a fresh one.
pub(super) fn discard<D: Dialect>(b: &mut Batch<D>) {
    if let Some(conn) = b.conn.take() {
        D::discard(conn);
    }
    b.open = false;
    b.writing = false;
    b.bare = false;
}

/// Rolls the open batch back and answers its writes with `why` (`undone`:
/// for another write's failure, see [`Failed::undone`]). The connection
/// is dropped when even the rollback fails or stalls (`stall`).
pub(super) async fn abort<D: Dialect>(
    b: &mut Batch<D>,
    why: &str,
    stall: Option<std::time::Duration>,
    undone: bool,
) {
    if b.open
        && let Some(conn) = b.conn.as_mut()
        && within(stall, sql::<D>("ROLLBACK").execute(conn))
            .await
            .is_err()
    {
        discard(b);
    }
    b.ended();
    let failed = Failed {
        why: why.into(),
        undone,
    };
    let n = b.waiting.len();
    for w in b.waiting.drain(..) {
        let _ = w.send(Err(failed.clone()));
    }
    if n > 0 {
        crate::metrics::ledger_batch_failed();
    }
}

/// Commits the open batch and answers its writes.
pub(super) async fn commit_batch<D: Dialect>(shared: &Shared<D>, b: &mut Batch<D>) {
    if !b.open {
        return;
    }
    let stall = shared.limits.stall;
    let Some(conn) = b.conn.as_mut() else {
        abort(b, "the ledger's write connection was lost", stall, false).await;
        return;
    };
    if b.writing {
        if !D::SAVEPOINT_EACH_WRITE {
            abort(b, UNDONE, stall, true).await;
            return;
        }
        if b.bare {
            abort(b, ABANDONED_FIRST, stall, false).await;
            return;
        }
        if let Err(e) = within(stall, rollback_savepoint::<D>(conn)).await {
            let why = e
                .as_ref()
                .map_or_else(|| stalled(stall), ToString::to_string);
            if e.is_none() {
                // Stalled: no ROLLBACK on a connection that still owes a reply.
                discard(b);
            }
            abort(b, &why, stall, false).await;
            return;
        }
        b.writing = false;
    }
    let size = b.waiting.len();
    if b.crash_before && size >= 2 {
        crate::failpoint::crash("batch-before-commit");
    }
    let started = Instant::now();
    let mut ticket = None;
    let result = if b.poisoned {
        Err("injected commit failure (ledger-commit-fail)".to_owned())
    } else {
        ticket = D::sync_ticket(conn);
        // Without a sync, the COMMIT runs here, not on a blocking thread.
        let here = match ticket {
            Some(_) => D::commit_unsynced(conn).await,
            None => None,
        };
        let r = match here {
            Some(r) => r.map_err(Some),
            None => within(stall, D::run_durable("COMMIT", conn)).await,
        };
        match r {
            Ok(_) => Ok(()),
            Err(Some(e)) => Err(e.to_string()),
            Err(None) => {
                // Whether the COMMIT took effect is unknown: the writes are
                // told it failed (a claim it held is found by the
                // reconciler when its lease ends), and the connection,
                // with the reply still owed on it, is dropped.
                discard(b);
                Err(format!(
                    "{}; the batch's COMMIT may or may not have taken effect",
                    stalled(stall)
                ))
            }
        }
    };
    match (result, ticket) {
        // With a ticket, answered by the syncer once the WAL is synced; the
        // connection goes on to the next batch meanwhile.
        (Ok(()), ticket) => committed(shared, b, started, ticket),
        (Err(why), ticket) => {
            if let Some(t) = ticket {
                let _ = shared.syncs.send(t.void());
            }
            tracing::error!(batch_size = size, error = %why, "ledger batch commit failed");
            abort(b, &why, stall, false).await;
        }
    }
}

/// After the batch's `COMMIT` (begun at `started`) returned: counts it
/// and answers its writes; with `ticket` (the `COMMIT` did not sync the
/// WAL), hands them to the syncer instead, which answers them once the WAL
/// is synced.
fn committed<D: Dialect>(
    shared: &Shared<D>,
    b: &mut Batch<D>,
    started: Instant,
    ticket: Option<sync::SyncTicket>,
) {
    let size = b.waiting.len();
    let crash_after = b.crash_after;
    if size > 0 {
        // (None: the batch held only an abandoned write.)
        shared.commits.fetch_add(1, Ordering::Relaxed);
        shared.last_size.store(size, Ordering::Relaxed);
    }
    if std::mem::take(&mut b.terminal) {
        // After the COMMIT, before any write of it is answered: a reader
        // that saw the old epoch re-reads the row.
        shared.terminal_epoch.fetch_add(1, Ordering::AcqRel);
    }
    b.ended();
    let waiting = std::mem::take(&mut b.waiting);
    if let Some(ticket) = ticket {
        let _ = shared.syncs.send(sync::Pending {
            ticket,
            waiting,
            started,
            crash_after,
        });
        return;
    }
    if crash_after && size >= 2 {
        crate::failpoint::crash("batch-after-commit");
    }
    if size > 0 {
        crate::metrics::ledger_batch(size, started.elapsed());
    }
    for w in waiting {
        let _ = w.send(Ok(size));
    }
}

/// Commits a batch of one write (`b`, its write waiting) on the calling
/// thread when nothing else is going on: no write queued for the
/// connection and the last batch held one write too (a gateway under
/// load batches; a lone caller's call would otherwise wait for the
/// committer task and two thread hand-offs of its fsync), on a runtime of
/// more than one worker thread (on one, no write can queue behind
/// another while this one runs, so "nothing else" can't be told).
/// Nothing in it awaits, so a caller that gives up can't stop it
/// half-way; a failed `COMMIT` is rolled back by a task of its own.
/// Gives `b` back when it did not commit it (the backend can't, or the
/// batch is marked by a failure injection or crash point).
pub(super) fn commit_alone<D: Dialect>(
    shared: &Arc<Shared<D>>,
    mut b: OwnedMutexGuard<Batch<D>>,
) -> Option<OwnedMutexGuard<Batch<D>>> {
    let quiet = shared.alone_allowed
        && b.waiting.len() == 1
        && shared.queued.load(Ordering::Relaxed) == 0
        && shared.last_size.load(Ordering::Relaxed) <= 1
        && !(b.poisoned || b.crash_before || b.crash_after || b.writing);
    if !quiet {
        return Some(b);
    }
    let started = Instant::now();
    let Some(result) = b.conn.as_mut().and_then(D::commit_now) else {
        return Some(b);
    };
    match result {
        Ok(()) => committed(shared, &mut b, started, None),
        Err(e) => {
            let why = e.to_string();
            tracing::error!(batch_size = 1, error = %why, "ledger batch commit failed");
            let stall = shared.limits.stall;
            tokio::spawn(async move { abort(&mut b, &why, stall, false).await });
        }
    }
    None
}

/// The committer: commits a batch whenever a write is waiting for one.
pub(super) async fn committer<D: Dialect>(shared: Weak<Shared<D>>, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // Queues behind the writes already waiting for the connection:
        // they join this batch first.
        let mut b = shared.batch.clone().lock_owned().await;
        commit_batch(&shared, &mut b).await;
    }
}
