//! Grouped writes ([`Dialect::GROUPS_WRITES`]: PostgreSQL).
//!
//! An effectful call makes two durable writes: its reservation with its
//! claim, and its outcome, one statement each. On PostgreSQL most of such
//! a statement's cost on the server is the statement's own (its protocol
//! messages, the executor's start and end), not its row's: five
//! statements cost about as much as one that writes five rows. So the
//! reservations, and the outcomes, that queue up while one is being
//! written are written together:
//!
//! - A call's write goes into a queue (one for reservations, one for
//!   outcomes). The first call to find no leader for its queue starts
//!   one, a task of its own.
//! - The leader takes a write in the writer's open batch (it waits for its
//!   turn like any write), then takes every write queued by then, up to
//!   [`MAX_ROWS`] rows, `storage.write_batch_max` and
//!   `storage.write_batch_bytes` of bodies, and writes them with one
//!   statement ([`command::reserve_claimed_rows`],
//!   [`command::record_outcome_rows`]), with what each writes after it
//!   (policy decisions, operation events). It hands the write to a task
//!   that waits for the batch's commit and answers each call, and goes
//!   back for the next group.
//! - A call is answered only after the commit that holds its row, as any
//!   write is. Durability and the batch are the writer's, unchanged.
//! - What the group doesn't write is written by the call itself, as
//!   without grouping: a key already taken (the call then finds the
//!   operation there, or an expired one to replace), an outcome whose
//!   fencing token is not current (the call then reports it), and every
//!   row of a group whose statement failed or whose batch was undone for
//!   another write (nothing of it was kept). An operation twice in one
//!   queue waits for the next group. Never queued: an approval wait, an
//!   outcome that logs no attempt, a compensation's outcome.
//! - A batch whose `COMMIT` fails fails every call of the group, as it
//!   fails every write of the batch.
//! - A group is one write of its batch: `storage.write_batch_max` bounds
//!   the writes a batch holds and the rows a group holds, so a batch may
//!   hold more rows than that, in groups.
//!
//! Time limits (`storage.call_timeout_ms`, [`super::bounded`]): a call
//! waiting in the queue is dropped at its limit like a call waiting for
//! its turn on the connection, and its write is not made (the leader
//! takes each write from the queue in one atomic step with the call's
//! mark: [`Joining::take`]). Once taken, it is waited for past its limit,
//! as a write that joined a batch is: it may be in a statement that then
//! commits, and its caller must not be told "timed out" about a claim or
//! an outcome that commits. Then the wait is bounded by the writer's
//! stall limit on the group's statement and on its `COMMIT`.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::oneshot;

use super::writer::{BatchTx, Joining, within};
use super::writes::{DecisionsFor, insert_decisions};
use super::{Store, command};
use crate::ledger::command::{Applied, AttemptLog, Lease, OpRef, RecordOutcome};
use crate::ledger::dialect::Dialect;
use crate::ledger::{LedgerError, NewOperation, Operation, Outcome, State};

/// Most writes one statement makes. One statement text is kept for each
/// group size, so the sizes are bounded (PostgreSQL would take up to
/// 65,535 values in one statement: 2,730 reservations).
pub(super) const MAX_ROWS: usize = 64;

/// What a queued write hears back.
pub(super) enum Grouped<T> {
    /// Written by the group, committed.
    Done(T),
    /// Not written by the group: the call writes it itself.
    Alone,
    /// The batch that held the row did not commit.
    Failed(LedgerError),
}

/// A write waiting for its queue's leader.
trait Waiting: Sized + Send + Sync + 'static {
    /// Its operation: `(tenant_id, operation_id)`.
    fn key(&self) -> (&str, &str);
    /// Its body bytes, for `storage.write_batch_bytes`.
    fn bytes(&self) -> usize;
    /// Whether it can be written with `first`, the group's first.
    fn joins(&self, first: &Self) -> bool;
    /// What its call hears when it is written.
    type Done: Send + 'static;
    /// Its call.
    fn call(&self) -> &Call<Self::Done>;
    /// Its call, taken to be answered.
    fn into_call(self) -> Call<Self::Done>;
    /// Whether its call gave up.
    fn closed(&self) -> bool {
        self.call().answer.is_closed()
    }
    /// Answers the call with [`Grouped::Alone`].
    fn alone(self) {
        let _ = self.into_call().answer.send(Grouped::Alone);
    }
}

/// The call a queued write is made for: its [`Joining`], and where its
/// answer goes.
struct Call<T> {
    joining: Joining,
    answer: oneshot::Sender<Grouped<T>>,
}

/// A kind of write that is made in groups on backend `D`.
trait Member<D: Dialect>: Waiting {
    /// What the group's statement wrote.
    type Written: Send + Sync + 'static;
    /// Its queue.
    fn queue(store: &Store<D>) -> &Groups<Self>;
    /// Writes `group` in `tx` at `now`.
    fn write<'a>(
        store: &'a Store<D>,
        tx: &'a mut BatchTx<D>,
        group: &'a [Self],
        now: i64,
    ) -> impl Future<Output = Result<Self::Written, LedgerError>> + Send + 'a;
    /// Whether `written` holds anything.
    fn wrote(written: &Self::Written) -> bool;
    /// Answers the call, once its batch's commit ended as `committed`.
    fn answer(self, committed: &Result<usize, LedgerError>, written: &Self::Written, now: i64);
    /// Marks `tx` for the failure injections that name this write's
    /// operation, where its one-row write does.
    fn inject(&self, _tx: &mut BatchTx<D>) {}
}

/// A queue of writes of one kind, and whether its leader is running.
pub(super) struct Groups<T> {
    queue: Mutex<Queue<T>>,
    /// Writes taken into a group of two or more, since start.
    shared: AtomicU64,
}

impl<T> Default for Groups<T> {
    fn default() -> Self {
        Self {
            queue: Mutex::new(Queue {
                items: Vec::new(),
                leading: false,
            }),
            shared: AtomicU64::new(0),
        }
    }
}

struct Queue<T> {
    items: Vec<T>,
    leading: bool,
}

impl<T> Groups<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<T>> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `item`; `true` when the caller must start the leader.
    fn push(&self, item: T) -> bool {
        let mut q = self.lock();
        q.items.push(item);
        !std::mem::replace(&mut q.leading, true)
    }

    /// Whether anything is queued; with nothing, the leader stops (in the
    /// same lock, so that the next push starts another).
    fn go_on(&self) -> bool {
        let mut q = self.lock();
        if q.items.is_empty() {
            q.leading = false;
        }
        q.leading
    }

    /// The next group: queued writes that join the first, no operation
    /// twice, at most `rows` of them, and none more once `bytes` of
    /// bodies are taken (the first is always taken), in the order of
    /// their keys (two instances' groups lock the rows they share in one
    /// order, so they don't deadlock on them). Each write taken is
    /// [`Joining::take`]n: its call waits for it from here on. Writes whose
    /// calls gave up (dropped, or past their time limit) are dropped.
    /// Empty when every write queued was of a call that gave up.
    fn take(&self, rows: usize, bytes: usize) -> Vec<T>
    where
        T: Waiting,
    {
        let mut q = self.lock();
        let mut group: Vec<T> = Vec::new();
        let mut size = 0_usize;
        let mut rest = Vec::with_capacity(q.items.len());
        for p in q.items.drain(..) {
            if p.closed() {
                continue;
            }
            let fits = group.first().is_none_or(|first| {
                group.len() < rows
                    && size < bytes
                    && p.joins(first)
                    && !group.iter().any(|g| g.key() == p.key())
            });
            if !fits {
                rest.push(p);
            } else if p.call().joining.take() {
                size = size.saturating_add(p.bytes());
                group.push(p);
            }
        }
        q.items = rest;
        if group.len() > 1 {
            self.shared.fetch_add(group.len() as u64, Ordering::Relaxed);
        }
        group.sort_by(|a, b| a.key().cmp(&b.key()));
        group
    }
}

/// Queues `item` (answered on `heard`; its call's [`Joining`] is
/// `joining`), starting its queue's leader if none runs, and waits for its
/// answer. Until the leader takes it, the call may be dropped at its time
/// limit; after, it waits for the answer.
async fn queued<D: Dialect, M: Member<D>, T>(
    store: &Store<D>,
    item: M,
    joining: Joining,
    heard: oneshot::Receiver<Grouped<T>>,
) -> Grouped<T> {
    if M::queue(store).push(item) {
        tokio::spawn(lead::<D, M>(store.clone()));
    }
    // A leader that stopped without an answer wrote nothing of it.
    let heard = heard.await.unwrap_or(Grouped::Alone);
    if matches!(heard, Grouped::Alone) {
        joining.leave();
    }
    heard
}

/// Stops a leader that ends otherwise than by finding its queue empty (a
/// panic, the runtime shutting down): its queue gets no leader and every
/// write queued in it is answered [`Grouped::Alone`], so that the next
/// write queued starts another leader and none waits for ever.
struct Stop<'a, D: Dialect, M: Member<D>> {
    store: &'a Store<D>,
    armed: bool,
    kind: std::marker::PhantomData<M>,
}

impl<D: Dialect, M: Member<D>> Drop for Stop<'_, D, M> {
    fn drop(&mut self) {
        if self.armed {
            let items = {
                let mut q = M::queue(self.store).lock();
                q.leading = false;
                std::mem::take(&mut q.items)
            };
            items.into_iter().for_each(M::alone);
        }
    }
}

/// The leader of `M`'s queue: writes groups until the queue is empty.
async fn lead<D: Dialect, M: Member<D>>(store: Store<D>) {
    let mut stop = Stop::<D, M> {
        store: &store,
        armed: true,
        kind: std::marker::PhantomData,
    };
    let limits = store.writer.limits();
    let rows = limits.max_writes.clamp(1, MAX_ROWS);
    while M::queue(&store).go_on() {
        let begun = store.begin().await;
        // Taken with the turn in hand: what queued while it waited joins.
        let group = M::queue(&store).take(rows, limits.max_bytes);
        let (mut tx, now) = match begun {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, "grouped writes made alone: no write connection");
                group.into_iter().for_each(M::alone);
                continue;
            }
        };
        if group.is_empty() {
            // Every call queued gave up while the leader waited.
            tx.unchanged();
            continue;
        }
        for p in &group {
            tx.add_bytes(p.bytes());
            p.inject(&mut tx);
        }
        let written = within(limits.stall, async {
            M::write(&store, &mut tx, &group, now)
                .await
                .map_err(|e| match e {
                    LedgerError::Db(e) => e,
                    other => sqlx::Error::Protocol(other.to_string()),
                })
        })
        .await;
        match written {
            Ok(written) if M::wrote(&written) => {
                tokio::spawn(async move {
                    let committed = tx.commit().await;
                    for p in group {
                        p.answer(&committed, &written, now);
                    }
                });
            }
            Ok(_) => {
                tx.unchanged();
                group.into_iter().for_each(M::alone);
            }
            Err(e) => {
                // Dropped: the batch is undone, nothing of the group kept.
                drop(tx);
                tracing::debug!(error = ?e, "grouped writes made alone: the statement failed");
                group.into_iter().for_each(M::alone);
            }
        }
    }
    // The queue was found empty, and its leader marked gone, in one lock.
    stop.armed = false;
}

/// What a call whose row its group wrote hears, once the batch's commit
/// ended as `committed`.
fn heard<T>(committed: &Result<usize, LedgerError>, done: Option<T>) -> Grouped<T> {
    match (committed, done) {
        (Ok(_), Some(done)) => Grouped::Done(done),
        // Undone for another write, or not written: nothing of it was
        // kept; the call writes it.
        (Err(LedgerError::BatchUndone(_)), _) | (_, None) => Grouped::Alone,
        (Err(e), Some(_)) => Grouped::Failed(LedgerError::BatchCommit(match e {
            LedgerError::BatchCommit(why) => why.clone(),
            other => other.to_string(),
        })),
    }
}

/// A reservation with its claim.
struct Reserving {
    call: Call<(i64, Applied)>,
    new: NewOperation,
    owner: String,
    lease_ms: i64,
    reason: String,
}

impl Waiting for Reserving {
    fn key(&self) -> (&str, &str) {
        (&self.new.tenant_id, &self.new.operation_id)
    }
    fn bytes(&self) -> usize {
        self.new.request_body.len()
    }
    fn joins(&self, first: &Self) -> bool {
        self.reason == first.reason
    }
    type Done = (i64, Applied);
    fn call(&self) -> &Call<Self::Done> {
        &self.call
    }
    fn into_call(self) -> Call<Self::Done> {
        self.call
    }
}

impl<D: Dialect> Member<D> for Reserving {
    type Written = Vec<(String, String, Applied)>;
    fn queue(store: &Store<D>) -> &Groups<Self> {
        &store.groups.reservations
    }
    async fn write<'a>(
        _store: &'a Store<D>,
        tx: &'a mut BatchTx<D>,
        group: &'a [Self],
        now: i64,
    ) -> Result<Self::Written, LedgerError> {
        let rows: Vec<(&NewOperation, Lease<'_>)> = group
            .iter()
            .map(|p| {
                let lease = Lease {
                    owner: &p.owner,
                    ms: p.lease_ms,
                };
                (&p.new, lease)
            })
            .collect();
        let created = command::reserve_claimed_rows::<D>(tx, &rows, &group[0].reason, now).await?;
        for p in group {
            if !p.new.decisions.is_empty() && find(&created, p.key()).is_some() {
                let op = OpRef::new(&p.new.tenant_id, &p.new.operation_id);
                let decisions = &p.new.decisions;
                insert_decisions::<D>(
                    tx,
                    op,
                    &p.new.fingerprint,
                    decisions,
                    DecisionsFor::Reservation,
                    now,
                )
                .await?;
            }
        }
        Ok(created)
    }
    fn wrote(written: &Self::Written) -> bool {
        !written.is_empty()
    }
    fn answer(self, committed: &Result<usize, LedgerError>, written: &Self::Written, now: i64) {
        let done = find(written, self.key()).map(|a| (now, a));
        let _ = self.call.answer.send(heard(committed, done));
    }
    fn inject(&self, tx: &mut BatchTx<D>) {
        tx.inject(&self.new.operation_id);
    }
}

/// The entry of `written` for operation `key`.
fn find<T: Clone>(written: &[(String, String, T)], key: (&str, &str)) -> Option<T> {
    written
        .iter()
        .find(|(t, o, _)| (t.as_str(), o.as_str()) == key)
        .map(|(_, _, w)| w.clone())
}

/// An outcome that logs its attempt.
struct Recording {
    call: Call<Operation>,
    tenant: String,
    operation_id: String,
    from: State,
    fence: i64,
    actor: String,
    outcome: Outcome,
}

impl Recording {
    fn cmd(&self) -> RecordOutcome<'_> {
        RecordOutcome {
            op: OpRef::new(&self.tenant, &self.operation_id),
            from: self.from,
            fence: self.fence,
            actor: &self.actor,
            outcome: &self.outcome,
        }
    }
}

impl Waiting for Recording {
    fn key(&self) -> (&str, &str) {
        (&self.tenant, &self.operation_id)
    }
    fn bytes(&self) -> usize {
        self.outcome.response_body.as_ref().map_or(0, Vec::len)
    }
    fn joins(&self, _first: &Self) -> bool {
        true
    }
    type Done = Operation;
    fn call(&self) -> &Call<Self::Done> {
        &self.call
    }
    fn into_call(self) -> Call<Self::Done> {
        self.call
    }
}

impl<D: Dialect> Member<D> for Recording {
    type Written = Vec<(String, String, Operation)>;
    fn queue(store: &Store<D>) -> &Groups<Self> {
        &store.groups.outcomes
    }
    async fn write<'a>(
        store: &'a Store<D>,
        tx: &'a mut BatchTx<D>,
        group: &'a [Self],
        now: i64,
    ) -> Result<Self::Written, LedgerError> {
        let cmds: Vec<RecordOutcome<'_>> = group.iter().map(Recording::cmd).collect();
        let outcomes: Vec<&RecordOutcome<'_>> = cmds.iter().collect();
        let attempts: Vec<AttemptLog<'_>> = group
            .iter()
            .map(|p| attempt_log(p.fence, &p.outcome, now))
            .collect();
        let rows = command::record_outcome_rows::<D>(
            tx,
            &outcomes,
            &attempts,
            now,
            super::reads::OP_COLUMNS,
        )
        .await?;
        let subs = store.subscriptions.load_full();
        let mut written = Vec::with_capacity(rows.len());
        for (applied, row) in rows {
            let op = super::reads::op_from_row(&row)?;
            if let Some(p) = group.iter().find(|p| {
                (p.tenant.as_str(), p.operation_id.as_str())
                    == (&op.tenant_id[..], &op.operation_id[..])
            }) {
                let reported = super::events::Reported {
                    op: OpRef::new(&p.tenant, &p.operation_id),
                    from: Some(p.from),
                    to: p.outcome.state,
                    version: applied.version,
                    dead_letter: p.outcome.dead_letter.is_some(),
                    reason: &p.outcome.reason,
                    provider_reference: p.outcome.provider_reference.as_deref(),
                };
                super::events::report::<D>(tx, &subs, &reported, now).await?;
            }
            written.push((op.tenant_id.clone(), op.operation_id.clone(), op));
        }
        crate::failpoint::hit("before-outcome-commit");
        Ok(written)
    }
    fn wrote(written: &Self::Written) -> bool {
        !written.is_empty()
    }
    fn answer(self, committed: &Result<usize, LedgerError>, written: &Self::Written, _now: i64) {
        let done = find(written, self.key());
        let _ = self.call.answer.send(heard(committed, done));
    }
}

/// The attempts-log row of an attempt that ended with `outcome` under
/// `fence`, at `now` (its `attempt_outcome` must be set).
pub(super) fn attempt_log(fence: i64, outcome: &Outcome, now: i64) -> AttemptLog<'_> {
    AttemptLog {
        fence,
        status: outcome.response_status.map(i64::from),
        outcome: outcome.attempt_outcome.as_deref().unwrap_or_default(),
        detail: outcome.error_detail.as_deref(),
        at: now,
        request_id: outcome.request_id.as_deref(),
    }
}

/// The two queues of a store.
#[derive(Default)]
pub(super) struct Queues {
    reservations: Groups<Reserving>,
    outcomes: Groups<Recording>,
}

#[cfg(test)]
impl Queues {
    /// Reservations and outcomes queued now.
    fn waiting(&self) -> (usize, usize) {
        (
            self.reservations.lock().items.len(),
            self.outcomes.lock().items.len(),
        )
    }

    /// Reservations and outcomes taken in groups of two or more, since
    /// start.
    fn shared(&self) -> (u64, u64) {
        (
            self.reservations.shared.load(Ordering::Relaxed),
            self.outcomes.shared.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests;

impl<D: Dialect> Store<D> {
    /// Reserves `new` and claims it with `lease` (transition reason
    /// `reason`) in a group (see the module). `new` must await no
    /// approval. Done: the writer's time the row was stamped with (ms
    /// since the Unix epoch) and the claim's version, fencing token and
    /// attempt.
    pub(super) async fn reserve_grouped(
        &self,
        new: &NewOperation,
        lease: Lease<'_>,
        reason: &str,
    ) -> Grouped<(i64, Applied)> {
        let (answer, heard) = oneshot::channel();
        let joining = Joining::current();
        let item = Reserving {
            call: Call {
                joining: joining.clone(),
                answer,
            },
            new: new.clone(),
            owner: lease.owner.to_owned(),
            lease_ms: lease.ms,
            reason: reason.to_owned(),
        };
        queued::<D, _, _>(self, item, joining, heard).await
    }

    /// Records `cmd` (an outcome that logs an attempt, not a
    /// compensation's) in a group (see the module). Done: the operation
    /// as committed.
    pub(super) async fn record_grouped(&self, cmd: &RecordOutcome<'_>) -> Grouped<Operation> {
        let (answer, heard) = oneshot::channel();
        let joining = Joining::current();
        let item = Recording {
            call: Call {
                joining: joining.clone(),
                answer,
            },
            tenant: cmd.op.tenant.to_owned(),
            operation_id: cmd.op.operation_id.to_owned(),
            from: cmd.from,
            fence: cmd.fence,
            actor: cmd.actor.to_owned(),
            outcome: cmd.outcome.clone(),
        };
        queued::<D, _, _>(self, item, joining, heard).await
    }
}
