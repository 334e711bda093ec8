//! Group commit: every ledger write shares its transaction, and its
//! fsync, with the writes waiting beside it.
//!
//! The [`Writer`] owns the write connection (on PostgreSQL, one or more:
//! `storage.write_connections`, each with its own batch; a write takes the
//! next one in turn, or the next idle one). A write ([`Writer::begin`])
//! waits for its turn on it (turns are handed out first come, first
//! served) and runs its statements in the open batch transaction. On
//! SQLite each write after the batch's first has a `SAVEPOINT` of its own
//! ([`Dialect::SAVEPOINT_EACH_WRITE`]; no round trip there): a write that
//! fails, or is dropped half-way, is rolled back to it, so it never takes
//! the others down with it. The first write needs none: while it runs,
//! nothing else is in the transaction, and undoing it is rolling the batch
//! back (a lone caller's writes are all first writes, and a savepoint
//! copies every page a write changes). On PostgreSQL the writes share the
//! transaction without savepoints, which saves each write a round trip
//! (the database clock is read once, with `BEGIN`, and each write's time
//! is that plus the monotonic time since): a write that fails (an error
//! ends a PostgreSQL transaction) or is dropped after a statement rolls
//! the whole batch back, and the writes already waiting for its commit
//! are answered [`LedgerError::BatchUndone`](crate::ledger::LedgerError::BatchUndone) (nothing of them was kept)
//! and run again (the ledger does, as after a deadlock). A write that
//! wrote nothing (it lost its compare-and-swap before its first change)
//! says so ([`BatchTx::unchanged`]) and leaves the batch as it was. The
//! writer's task then commits the batch once, with every
//! write that queued up meanwhile, and only after that commit is durable
//! answers each write: on PostgreSQL when its `COMMIT` returned; on SQLite
//! with `synchronous = FULL`, once an fsync of the WAL that began after
//! the `COMMIT` returned ([`sync`]: the `COMMIT` itself doesn't sync, and
//! the connection goes on to the next batch while the sync runs). A batch
//! is committed at once when it holds `storage.write_batch_max` writes or
//! `storage.write_batch_bytes` of bodies. A lone write (none queued behind it, and the last batch held
//! one write too: a gateway with one caller at a time) commits itself on
//! its own thread where the backend allows it (SQLite:
//! [`Dialect::commit_now`]), without waking the committer or a blocking
//! thread; once writes overlap, batches form again. Not on a runtime of
//! one worker thread (`TOKIO_WORKER_THREADS=1`, or a container held to one
//! CPU): there no write ever queues behind another, and every write would
//! commit alone.
//!
//! A `COMMIT` that fails fails every write of its batch: each gets
//! [`LedgerError::BatchCommit`](crate::ledger::LedgerError::BatchCommit) (503 `ledger-unavailable` for a request)
//! and none of them happened (except after a stalled `COMMIT`, below,
//! whose outcome is unknown).
//!
//! What a caller can't interrupt: once a write has its turn on the
//! connection, it is opened in a task of its own (a caller that
//! gives up drops only its wait), and the commit runs in the committer's; a write of a call
//! that [`bounded`] runs is not cut off once it waits for its commit. On
//! PostgreSQL each of the writer's own statements is bounded instead
//! ([`BatchLimits::stall`]): a connection that stalls is dropped and its
//! batch's writes are told the commit failed (for a stalled `COMMIT`, with
//! its outcome unknown: a claim it held is found by the reconciler when
//! its lease ends).

mod commit;
mod sync;
mod tx;

use commit::{abort, committer, discard, rollback_savepoint};
pub(in crate::ledger) use sync::{Durability, SyncTicket};
pub(in crate::ledger) use tx::BatchTx;

use std::future::Future as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Instant;

use tokio::sync::{Mutex, Notify, OwnedMutexGuard, oneshot};

use super::super::dialect::{Conn, Dialect};

/// What one write of a batch hears back: the batch's size, or why its
/// commit failed.
type Answer = Result<usize, Failed>;

/// Why a batch did not commit.
#[derive(Debug, Clone)]
struct Failed {
    /// The database's message, or the writer's.
    why: Arc<str>,
    /// Rolled back before its `COMMIT` for another write's failure or
    /// abandonment ([`LedgerError::BatchUndone`](crate::ledger::LedgerError::BatchUndone)): nothing was kept and
    /// the write may run again.
    undone: bool,
}

/// Why the batch of an abandoned first write (SQLite, no savepoint) is
/// rolled back; no write waits for that batch, so nobody is told.
const ABANDONED_FIRST: &str = "its first write was abandoned";

/// What the writes of a batch undone for another write are told.
const UNDONE: &str =
    "another write of its batch failed or was abandoned, and the batch was rolled back";

/// The batching limits (`storage.write_batch_max`,
/// `storage.write_batch_bytes`).
#[derive(Debug, Clone, Copy)]
pub(in crate::ledger) struct BatchLimits {
    /// Most writes in one commit (at least 1).
    pub max_writes: usize,
    /// Body bytes past which a batch commits at once.
    pub max_bytes: usize,
    /// Write connections, each with its own batch and committer (at least
    /// 1; SQLite: always 1, PostgreSQL: `storage.write_connections`).
    pub connections: usize,
    /// How long the writer waits for one of its own statements (`BEGIN`,
    /// an abandoned savepoint's rollback, `COMMIT`,
    /// `ROLLBACK`) before it takes the connection for lost: it is dropped
    /// and the batch's writes are told the commit failed (PostgreSQL:
    /// `storage.call_timeout_ms`; SQLite: `None`, no limit: its statements
    /// wait only for the file).
    pub stall: Option<std::time::Duration>,
}

/// `f`, given up after `limit` (none: waited for however long it takes).
/// `Err(None)`: it did not finish in time.
pub(in crate::ledger) async fn within<T>(
    limit: Option<std::time::Duration>,
    f: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Option<sqlx::Error>> {
    match limit {
        None => f.await.map_err(Some),
        Some(t) => match tokio::time::timeout(t, f).await {
            Ok(r) => r.map_err(Some),
            Err(_) => Err(None),
        },
    }
}

tokio::task_local! {
    /// Set by [`BatchTx::commit`] inside a call [`bounded`] runs: a write
    /// of the call joined a batch.
    static JOINED: Arc<Joined>;
}

/// Whether a write of a call [`bounded`] runs waits for its batch's
/// `COMMIT` now.
#[derive(Debug, Default)]
struct Joined {
    /// [`IN`] when the write joins a batch; [`OUT`] again when the batch
    /// was undone without it ([`LedgerError::BatchUndone`](crate::ledger::LedgerError::BatchUndone): nothing of it was kept);
    /// [`GONE`] once [`bounded`] dropped the call past its limit (a write
    /// another task would make for it then is not made: [`Joining::take`]).
    now: std::sync::atomic::AtomicU8,
    /// Notified when [`Joined::now`] is cleared.
    left: Notify,
}

/// [`Joined::now`]: the call's write is not in a batch.
const OUT: u8 = 0;
/// [`Joined::now`]: the call's write is in a batch, or being made.
const IN: u8 = 1;
/// [`Joined::now`]: the call was dropped past its limit.
const GONE: u8 = 2;

/// The call [`bounded`] runs, for a write of it that another task makes
/// (a grouped write, `store/grouped.rs`). Taken with [`Joining::current`]
/// in the call; outside [`bounded`], it holds nothing and its methods say
/// yes and do nothing.
#[derive(Clone)]
pub(in crate::ledger) struct Joining(Option<Arc<Joined>>);

impl Joining {
    /// The current call's.
    pub(in crate::ledger) fn current() -> Self {
        Self(JOINED.try_with(Arc::clone).ok())
    }

    /// Called by the task that is about to make the write: `true` (the
    /// call now waits for the write's end past its limit, as for a write
    /// of its own that joined a batch), or `false` when [`bounded`] has
    /// dropped the call already (the write must not be made). One atomic
    /// step, so the two can't both go ahead.
    pub(in crate::ledger) fn take(&self) -> bool {
        self.0.as_ref().is_none_or(|j| {
            j.now
                .compare_exchange(OUT, IN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    /// Says the write ended with nothing kept: past its limit, the call is
    /// dropped at its next wait.
    pub(in crate::ledger) fn leave(&self) {
        if let Some(j) = &self.0 {
            j.now.store(OUT, Ordering::Release);
            j.left.notify_waiters();
        }
    }
}

/// Runs `call` (one ledger call) within `limit`; `None` when it did not
/// finish in time and was dropped. Once a write of `call` has joined a
/// batch (it is waiting for the batch's `COMMIT`), it is no longer dropped
/// at `limit` but waited for to its end: the write commits whether or not
/// anyone waits for it, and its caller must not be told "timed out" about
/// a claim or an approval's use that then commits, unrun (the claim would
/// sit EXECUTING until its lease ended). The wait is still bounded, by
/// [`BatchLimits::stall`] on each of the writer's statements. A write whose
/// batch is undone without it (PostgreSQL) has left the batch with nothing
/// kept: past `limit`, the call is dropped there, not run again.
pub(in crate::ledger) async fn bounded<T>(
    limit: std::time::Duration,
    call: impl std::future::Future<Output = T>,
) -> Option<T> {
    let joined = Arc::new(Joined::default());
    let call = JOINED.scope(joined.clone(), call);
    tokio::pin!(call);
    if let Ok(r) = tokio::time::timeout(limit, &mut call).await {
        return Some(r);
    }
    loop {
        // Registered before the flag is read: a clearing in between
        // wakes it.
        let left = joined.left.notified();
        tokio::pin!(left);
        left.as_mut().enable();
        // Not joined: dropped, and marked so in the same step (a write
        // another task makes for it checks the mark: [`Joining::take`]).
        if joined
            .now
            .compare_exchange(OUT, GONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return None;
        }
        tokio::select! {
            r = &mut call => return Some(r),
            () = &mut left => {}
        }
    }
}

/// What a stalled statement is reported as.
fn stalled(limit: Option<std::time::Duration>) -> String {
    format!(
        "the ledger's write connection did not answer within {} ms",
        limit.map_or(0, |t| t.as_millis())
    )
}

/// The write connection and the open batch.
struct Batch<D: Dialect> {
    /// The connection (`None` after a failure that may have broken it:
    /// the next write takes a fresh one from the pool).
    conn: Option<Conn<D>>,
    /// Whether `BEGIN` was sent.
    open: bool,
    /// Whether a write holds the batch and has not ended: dropped before
    /// it did (abandoned), it is undone before anything else runs (SQLite:
    /// rolled back to its savepoint, or with the batch ([`abort`]) when
    /// it is [`Batch::bare`]; PostgreSQL: with the whole batch).
    writing: bool,
    /// Whether the current write is the batch's first on SQLite and runs
    /// without a savepoint: undone, it takes the batch with it, which
    /// holds nothing else.
    bare: bool,
    /// Whether a failure injection (`ledger-commit-fail`) marked this
    /// batch to fail its `COMMIT`.
    poisoned: bool,
    /// Whether crash point `batch-before-commit` / `batch-after-commit`
    /// marked this batch (see [`crate::failpoint::crash`]).
    crash_before: bool,
    crash_after: bool,
    /// The writes waiting for this batch's commit.
    waiting: Vec<oneshot::Sender<Answer>>,
    /// Their body bytes.
    bytes: usize,
    /// The database clock read with `BEGIN` (or again after the clock was
    /// moved), and when (PostgreSQL; `None` on SQLite).
    began: Option<(i64, Instant)>,
    /// [`Writer::clock_epoch`] when [`Batch::began`] was read.
    began_epoch: u64,
    /// The current write's time: [`Batch::began`]'s clock plus the time
    /// since (PostgreSQL; `None` on SQLite).
    now: Option<i64>,
    /// Whether a write of this batch changed or deleted a COMPLETED or
    /// FAILED operation ([`BatchTx::changes_terminal`]).
    terminal: bool,
}

impl<D: Dialect> Batch<D> {
    /// The batch's transaction is over (committed or rolled back): no
    /// transaction open, no write in it, its marks and byte count cleared.
    /// Its waiting writes are answered by the caller.
    fn ended(&mut self) {
        self.open = false;
        self.writing = false;
        self.bare = false;
        self.began = None;
        self.poisoned = false;
        self.crash_before = false;
        self.crash_after = false;
        self.bytes = 0;
        self.terminal = false;
    }
}

struct Shared<D: Dialect> {
    batch: Arc<Mutex<Batch<D>>>,
    source: D::WriteSource,
    limits: BatchLimits,
    /// Wakes the committer task: a batch has writes waiting.
    wake: Arc<Notify>,
    /// Committed batches whose WAL sync is left to the syncer task
    /// ([`sync`]; SQLite with `synchronous = full`).
    syncs: tokio::sync::mpsc::UnboundedSender<sync::Pending>,
    /// Writes waiting for their turn on the connection.
    queued: AtomicUsize,
    /// Batches committed since start.
    commits: AtomicU64,
    /// Writes in the last batch committed (0 before the first).
    last_size: AtomicUsize,
    /// Whether a lone write may commit on its own thread: the runtime the
    /// writer started on has more than one worker thread. On one thread,
    /// every write runs to its commit in one poll, so none ever queues
    /// behind another: each would commit (and fsync) alone, blocking the
    /// only thread, and batches would never form.
    alone_allowed: bool,
    /// Bumped after every commit that changed or deleted a COMPLETED or
    /// FAILED operation (shared by the lanes).
    terminal_epoch: Arc<AtomicU64>,
    /// Bumped when the ledger's clock is moved (shared by the lanes).
    clock_epoch: Arc<AtomicU64>,
}

impl<D: Dialect> Drop for Shared<D> {
    fn drop(&mut self) {
        // Lets the committer task see that the ledger is gone and end.
        self.wake.notify_one();
    }
}

/// The ledger's writer: one or more write connections ("lanes"), each
/// with its own open batch and committer. Cheap to clone.
pub(in crate::ledger) struct Writer<D: Dialect> {
    lanes: Arc<[Arc<Shared<D>>]>,
    /// The lane the next write starts looking at (round robin).
    next: Arc<AtomicUsize>,
    /// See [`Writer::terminal_epoch`].
    terminal_epoch: Arc<AtomicU64>,
    /// See [`Writer::clock_moved`].
    clock_epoch: Arc<AtomicU64>,
}

impl<D: Dialect> Clone for Writer<D> {
    fn clone(&self) -> Self {
        Self {
            lanes: self.lanes.clone(),
            next: self.next.clone(),
            terminal_epoch: self.terminal_epoch.clone(),
            clock_epoch: self.clock_epoch.clone(),
        }
    }
}

impl<D: Dialect> std::fmt::Debug for Writer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("limits", &self.lanes[0].limits)
            .field("connections", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> Writer<D> {
    /// A writer taking `limits.connections` connections from `pool`
    /// (SQLite: a pool of one; PostgreSQL: the shared pool), each with its
    /// committer task. Must be called inside a Tokio runtime.
    pub(in crate::ledger) fn new(source: D::WriteSource, limits: BatchLimits) -> Self {
        let terminal_epoch = Arc::new(AtomicU64::new(0));
        let clock_epoch = Arc::new(AtomicU64::new(0));
        let lanes: Vec<Arc<Shared<D>>> = (0..limits.connections.max(1))
            .map(|_| {
                Self::lane(
                    source.clone(),
                    limits,
                    terminal_epoch.clone(),
                    clock_epoch.clone(),
                )
            })
            .collect();
        Self {
            lanes: lanes.into(),
            next: Arc::new(AtomicUsize::new(0)),
            terminal_epoch,
            clock_epoch,
        }
    }

    /// The batching limits (those of one write connection).
    pub(in crate::ledger) fn limits(&self) -> BatchLimits {
        self.lanes[0].limits
    }

    /// How many commits so far changed or deleted a COMPLETED or FAILED
    /// operation (the writes that said so with
    /// [`BatchTx::changes_terminal`]). Read it before reading a terminal
    /// row: while it is unchanged, no write of this process has changed
    /// that row since (the replay cache's check on SQLite).
    pub(in crate::ledger) fn terminal_epoch(&self) -> u64 {
        self.terminal_epoch.load(Ordering::Acquire)
    }

    /// Counts a change to terminal operations made outside a batch (a
    /// step of the ledger's clock).
    pub(in crate::ledger) fn bump_terminal_epoch(&self) {
        self.terminal_epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Says that the ledger's clock was moved ([`Dialect::shift_clock`]):
    /// the next write of an open batch reads the database clock again
    /// rather than timing itself from the one read with `BEGIN`.
    pub(in crate::ledger) fn clock_moved(&self) {
        self.clock_epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// One write connection's batch and its committer task.
    fn lane(
        source: D::WriteSource,
        limits: BatchLimits,
        terminal_epoch: Arc<AtomicU64>,
        clock_epoch: Arc<AtomicU64>,
    ) -> Arc<Shared<D>> {
        let wake = Arc::new(Notify::new());
        let (syncs, synced) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(sync::syncer(synced));
        let shared = Arc::new(Shared {
            batch: Arc::new(Mutex::new(Batch {
                conn: None,
                open: false,
                writing: false,
                bare: false,
                poisoned: false,
                crash_before: false,
                crash_after: false,
                waiting: Vec::new(),
                bytes: 0,
                began: None,
                began_epoch: 0,
                now: None,
                terminal: false,
            })),
            source,
            limits: BatchLimits {
                max_writes: limits.max_writes.max(1),
                max_bytes: limits.max_bytes.max(1),
                connections: 1,
                stall: limits.stall,
            },
            wake: wake.clone(),
            syncs,
            queued: AtomicUsize::new(0),
            commits: AtomicU64::new(0),
            last_size: AtomicUsize::new(0),
            alone_allowed: tokio::runtime::Handle::current().metrics().num_workers() > 1,
            terminal_epoch,
            clock_epoch,
        });
        tokio::spawn(committer(Arc::downgrade(&shared), wake));
        shared
    }

    /// The lane for the next write: the next in turn, or the first after
    /// it with no write queued when that one has a queue.
    fn pick(&self) -> &Arc<Shared<D>> {
        let n = self.lanes.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| &self.lanes[(start + i) % n])
            .find(|l| l.queued.load(Ordering::Relaxed) == 0)
            .unwrap_or(&self.lanes[start])
    }

    /// Waits for the write connection and opens one write in the current
    /// batch (opening the batch if none is open; on SQLite, the write's
    /// savepoint). `bytes` is the size of the bodies it writes, for
    /// `storage.write_batch_bytes`.
    ///
    /// Errors: the connection can't be had, or `BEGIN` or the savepoint
    /// fails.
    pub(in crate::ledger) async fn begin(&self, bytes: usize) -> Result<BatchTx<D>, sqlx::Error> {
        let lane = self.pick().clone();
        lane.queued.fetch_add(1, Ordering::Relaxed);
        let waited = Queued(&lane.queued);
        // A caller that gives up while waiting for its turn leaves the
        // queue (the lock's wait is cancel-safe) and costs the lane nothing.
        let guard = lane.batch.clone().lock_owned().await;
        drop(waited);
        // With its turn, the rest runs in a task of its own (unless it ends
        // in its first poll, below), which a
        // caller that gives up (its request was cancelled, a timeout
        // fired) can't stop half-way: a rollback of an abandoned savepoint
        // that ran on the connection but was not yet noted in the batch
        // would otherwise run a second time, and with nested savepoints of
        // one name the second one rolls back the write below it, whose
        // caller was already told it is waiting for the commit. A caller
        // gone by the time the task ends drops its `BatchTx` like any
        // other abandoned write.
        // One poll here first: where nothing of the opening waits (SQLite
        // runs its statements on this thread), it ends in that poll, which
        // nothing can cut short, and the connection is not held across two
        // task hand-offs (the spawned task's start and this one's wake-up).
        // Otherwise the future, part-run, goes on in its task: nothing
        // between the poll and the spawn can drop it.
        let mut opening = Box::pin(open_write(lane, guard, bytes));
        let first = std::future::poll_fn(|cx| Poll::Ready(opening.as_mut().poll(cx))).await;
        if let Poll::Ready(opened) = first {
            return opened;
        }
        tokio::spawn(opening).await.unwrap_or_else(|e| {
            Err(sqlx::Error::Protocol(format!(
                "the ledger writer's task failed: {e}"
            )))
        })
    }
}

/// [`Writer::begin`]'s work on `lane` once it holds the batch (`guard`),
/// in its own task.
async fn open_write<D: Dialect>(
    lane: Arc<Shared<D>>,
    mut guard: OwnedMutexGuard<Batch<D>>,
    bytes: usize,
) -> Result<BatchTx<D>, sqlx::Error> {
    let stall = lane.limits.stall;
    if !D::SAVEPOINT_EACH_WRITE && guard.writing {
        // The write before this one was abandoned half-way: its batch
        // goes with it.
        abort(&mut guard, UNDONE, stall, true).await;
    }
    let mut tries = 0;
    // The connection may have broken (the database restarted, the network
    // dropped it) or stalled: the open batch is lost with it. Its writes
    // are told so, and this one tries once more on a fresh connection.
    loop {
        let epoch = lane.clock_epoch.load(Ordering::Acquire);
        let Err(e) = within(stall, prepare(&lane.source, &mut guard, epoch)).await else {
            return Ok(BatchTx {
                guard: Some(guard),
                shared: lane,
                bytes,
            });
        };
        let why = e
            .as_ref()
            .map_or_else(|| stalled(stall), ToString::to_string);
        if e.is_none() {
            // Stalled: no ROLLBACK on a connection that still owes a reply.
            discard(&mut guard);
        }
        abort(&mut guard, &why, stall, false).await;
        discard(&mut guard);
        tries += 1;
        if tries == 2 {
            return Err(e.unwrap_or_else(|| sqlx::Error::Protocol(why)));
        }
    }
}

impl<D: Dialect> Writer<D> {
    /// Writes waiting for their turn on the connection now.
    #[cfg(test)]
    pub(in crate::ledger) fn queued(&self) -> usize {
        self.lanes
            .iter()
            .map(|l| l.queued.load(Ordering::Relaxed))
            .sum()
    }

    /// Batches committed since start.
    #[cfg(test)]
    pub(in crate::ledger) fn commits(&self) -> u64 {
        self.lanes
            .iter()
            .map(|l| l.commits.load(Ordering::Relaxed))
            .sum()
    }
}

/// Counts a write out of the queue when it got its turn (or was dropped
/// while waiting).
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Makes the batch ready for one more write: a connection, no abandoned
/// savepoint (SQLite; on PostgreSQL [`open_write`] undid an abandoned
/// write's batch before), `BEGIN` sent, the write opened (and, on
/// PostgreSQL, its time in [`Batch::now`]; `epoch`, the writer's
/// [`Writer::clock_moved`] count now).
async fn prepare<D: Dialect>(
    source: &D::WriteSource,
    b: &mut Batch<D>,
    epoch: u64,
) -> Result<(), sqlx::Error> {
    if b.writing && b.bare {
        // An abandoned first write: its batch holds nothing else, and no
        // write waits for it (the call is bounded as a whole by the
        // caller's `within`).
        abort(b, ABANDONED_FIRST, None, false).await;
    }
    if b.conn.is_none() {
        b.conn = Some(D::connect_writer(source).await?);
    }
    let conn = b.conn.as_mut().expect("just set");
    if b.writing {
        debug_assert!(D::SAVEPOINT_EACH_WRITE);
        rollback_savepoint::<D>(conn).await?;
        b.writing = false;
    }
    let first = !b.open;
    let read_clock = b.began.is_some() && b.began_epoch != epoch;
    let now = D::open_write(conn, first, read_clock).await;
    if first && now.is_ok() {
        b.open = true;
    }
    if let Some(db) = now? {
        b.began = Some((db, Instant::now()));
        b.began_epoch = epoch;
    }
    // SQLite: the write's savepoint is open. PostgreSQL: nothing of the
    // write has run yet; its first statement marks it (`DerefMut`), so a
    // write dropped before any statement leaves the batch alone.
    b.writing = D::SAVEPOINT_EACH_WRITE;
    b.bare = D::SAVEPOINT_EACH_WRITE && first;
    b.now = b.began.map(|(db, at)| {
        db.saturating_add(i64::try_from(at.elapsed().as_millis()).unwrap_or(i64::MAX))
    });
    Ok(())
}

#[cfg(test)]
mod tests;
