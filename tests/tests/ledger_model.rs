//! Model-based tests of the effect ledger: proptest generates sequences of
//! ledger commands from three simulated owners (A, B, C) over the ledger's
//! clock, runs each sequence against a real ledger (SQLite, and PostgreSQL
//! when `TEST_POSTGRES_URL` is set) and against a small in-memory
//! reference model of the state machine, and compares them after every
//! command. A failing sequence is shrunk to a minimal one.
//!
//! Commands: reserve (with or without an approval), claim, record an
//! outcome (COMPLETED, FAILED, FAILED as a dead letter, UNKNOWN) from
//! EXECUTING or from UNKNOWN (a read-back's found / error, an operator's
//! resolve), note a retry, extend a lease, the clock jumping past every
//! lease, lease expiry, a reconciliation lease, a new attempt after an
//! absent read-back, requeue of a dead letter, approval decisions and
//! their use, compensation, and the retention sweep. Version-guarded
//! commands are sent with the current version or a stale one; fenced
//! commands with the token the owner last got (which may be stale).
//!
//! Checked after every command:
//! - the ledger's answer (applied, lost the compare-and-swap, refused as
//!   an illegal transition) is the model's;
//! - every row (state, version, fence, attempts, lease owner, dead letter)
//!   is the model's;
//! - at most one owner holds a live lease on an operation, and it is the
//!   row's lease owner;
//! - every lease granted carries a fence larger than any before it;
//! - the transition history replays to the current row: it starts with
//!   `∅ → RESERVED`, each step leaves the state the previous one entered,
//!   is allowed by the state machine, versions count up by one, fences
//!   never go down, and it ends at the row's state and version;
//! - a terminal state never changes, except COMPLETED → COMPENSATED (and
//!   its COMPLETED → COMPLETED audit) and a dead letter's requeue.
//!
//! Cases: `PROPTEST_CASES` (default 64 on SQLite, 16 on PostgreSQL), each
//! up to 40 commands.

use std::collections::HashMap;
use std::sync::Arc;

use effectgate::ledger::{
    ApprovalDecision, Claim, CompensationReservation, Ledger, LedgerError, ManualClock,
    NewApproval, NewCompensation, NewOperation, Outcome, Reservation, State,
};
use effectgate_tests::pg;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const TENANT: &str = "t";
const OWNERS: [&str; 3] = ["A", "B", "C"];
/// Base operations; operation `i + BASE` is the compensation of `i`.
const BASE: usize = 3;
const LEASE_MS: i64 = 10_000;
/// A clock jump: past every lease (and far from any lease's end, so the
/// database clock's own movement during a case never matters).
const JUMP_MS: i64 = 25_000;

fn op_id(i: usize) -> String {
    if i < BASE {
        format!("op{i}")
    } else {
        format!("op{}#compensation", i - BASE)
    }
}

/// One ledger command.
#[derive(Debug, Clone)]
enum Cmd {
    Reserve {
        op: usize,
        approval: bool,
    },
    Claim {
        op: usize,
        owner: usize,
        stale: bool,
    },
    Record {
        op: usize,
        owner: usize,
        from_unknown: bool,
        to: To,
    },
    NoteRetry {
        op: usize,
        owner: usize,
    },
    Extend {
        op: usize,
        owner: usize,
    },
    Jump,
    Expire {
        op: usize,
        stale: bool,
    },
    ReconcileLease {
        op: usize,
        owner: usize,
        stale: bool,
    },
    Reattempt {
        op: usize,
        owner: usize,
    },
    Requeue {
        op: usize,
        to_unknown: bool,
        stale: bool,
    },
    Decide {
        op: usize,
        approve: bool,
    },
    UseApproval {
        op: usize,
        owner: usize,
    },
    Compensate {
        op: usize,
    },
    Sweep,
}

/// What an outcome records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum To {
    Completed,
    Failed,
    DeadLetter,
    Unknown,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    let op = 0..2 * BASE;
    let base = 0..BASE;
    let owner = 0..OWNERS.len();
    let to = prop_oneof![
        Just(To::Completed),
        Just(To::Failed),
        Just(To::DeadLetter),
        Just(To::Unknown)
    ];
    prop_oneof![
        3 => (base.clone(), any::<bool>()).prop_map(|(op, approval)| Cmd::Reserve { op, approval }),
        4 => (op.clone(), owner.clone(), prop::bool::weighted(0.2))
            .prop_map(|(op, owner, stale)| Cmd::Claim { op, owner, stale }),
        4 => (op.clone(), owner.clone(), any::<bool>(), to)
            .prop_map(|(op, owner, from_unknown, to)| Cmd::Record { op, owner, from_unknown, to }),
        1 => (op.clone(), owner.clone()).prop_map(|(op, owner)| Cmd::NoteRetry { op, owner }),
        1 => (op.clone(), owner.clone()).prop_map(|(op, owner)| Cmd::Extend { op, owner }),
        2 => Just(Cmd::Jump),
        2 => (op.clone(), prop::bool::weighted(0.2)).prop_map(|(op, stale)| Cmd::Expire { op, stale }),
        2 => (op.clone(), owner.clone(), prop::bool::weighted(0.2))
            .prop_map(|(op, owner, stale)| Cmd::ReconcileLease { op, owner, stale }),
        2 => (op.clone(), owner.clone()).prop_map(|(op, owner)| Cmd::Reattempt { op, owner }),
        1 => (op.clone(), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(op, to_unknown, stale)| Cmd::Requeue { op, to_unknown, stale }),
        1 => (op.clone(), any::<bool>()).prop_map(|(op, approve)| Cmd::Decide { op, approve }),
        1 => (op.clone(), owner).prop_map(|(op, owner)| Cmd::UseApproval { op, owner }),
        1 => base.prop_map(|op| Cmd::Compensate { op }),
        1 => Just(Cmd::Sweep),
    ]
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Res {
    /// It wrote (a reservation that created, a won compare-and-swap).
    Applied,
    /// It wrote nothing: the row was not as required.
    Lost,
    /// A reservation that found the operation.
    Existing,
    /// A compensation of an operation that is not COMPLETED.
    NotCompleted,
    /// Refused before any write: no such transition.
    Illegal,
}

/// The model's operation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MOp {
    state: State,
    version: i64,
    fence: i64,
    attempts: i64,
    lease_owner: Option<String>,
    /// The clock epoch (count of jumps) in which the lease was last set.
    lease_epoch: Option<u32>,
    dead_letter: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ApprovalStatus {
    Pending,
    Approved,
    Rejected,
    Used,
}

#[derive(Debug, Default)]
struct Model {
    ops: HashMap<usize, MOp>,
    approvals: HashMap<usize, ApprovalStatus>,
    epoch: u32,
    /// The fence each owner last got for each operation.
    tokens: HashMap<(usize, usize), i64>,
}

impl Model {
    fn live(&self, o: &MOp) -> bool {
        o.lease_owner.is_some() && o.lease_epoch == Some(self.epoch)
    }

    fn lease(&mut self, op: usize, owner: usize) {
        let epoch = self.epoch;
        let o = self.ops.get_mut(&op).unwrap();
        o.lease_owner = Some(OWNERS[owner].to_owned());
        o.lease_epoch = Some(epoch);
        o.fence += 1;
        let fence = o.fence;
        self.tokens.insert((owner, op), fence);
    }

    fn claim_like(&mut self, op: usize, owner: usize) {
        let o = self.ops.get_mut(&op).unwrap();
        o.state = State::Executing;
        o.version += 1;
        o.attempts += 1;
        self.lease(op, owner);
    }
}

fn new_op(i: usize, approval: bool) -> NewOperation {
    NewOperation {
        tenant_id: TENANT.into(),
        operation_id: op_id(i),
        route: "r".into(),
        method: "POST".into(),
        path: "/x".into(),
        query: None,
        fingerprint: "fp".into(),
        provider_key: format!("pk{i}"),
        effect_class: None,
        request_content_type: None,
        request_body: b"{}".to_vec(),
        request_headers: vec![],
        trace_context: None,
        principal: "p".into(),
        // Never past retention within a case: the sweep must delete nothing.
        retention_ms: 1_000_000_000_000,
        awaiting_approval: approval,
        decisions: vec![],
        approval: approval.then(|| NewApproval {
            id: format!("apr_{i}"),
            kind: "request".into(),
            policy: "p".into(),
            policy_hash: "h".into(),
            reason: "needs a human".into(),
            ttl_ms: 1_000_000_000_000,
        }),
    }
}

fn outcome(to: To) -> Outcome {
    let state = match to {
        To::Completed => State::Completed,
        To::Failed | To::DeadLetter => State::Failed,
        To::Unknown => State::Unknown,
    };
    let mut o = Outcome::new(state, "model");
    o.response_status = Some(200);
    o.response_body = Some(b"ok".to_vec());
    if to == To::DeadLetter {
        o.dead_letter = Some(effectgate::ledger::DeadLetter {
            reason: "read-back-exhausted".into(),
            operator_check: "check".into(),
        });
    }
    if to == To::Unknown {
        o.next_reconcile_at = Some(0);
    }
    o
}

fn illegal<T>(r: Result<T, LedgerError>, ok: impl FnOnce(T) -> Res) -> Result<Res, String> {
    match r {
        Ok(v) => Ok(ok(v)),
        Err(LedgerError::IllegalTransition { .. }) => Ok(Res::Illegal),
        Err(e) => Err(format!("ledger error: {e}")),
    }
}

/// Runs one command on the ledger.
async fn run_real(
    l: &Ledger,
    m: &Model,
    c: &Cmd,
) -> Result<(Res, Option<(usize, usize, Claim)>), String> {
    let get = |op: usize| async move {
        l.get(TENANT, &op_id(op))
            .await
            .map_err(|e| format!("get: {e}"))
    };
    let version = |row: &Option<effectgate::ledger::Operation>, stale: bool| {
        row.as_ref().map_or(1, |o| o.version - i64::from(stale))
    };
    let token = |owner: usize, op: usize| m.tokens.get(&(owner, op)).copied().unwrap_or(0);
    let claimed = |op: usize, owner: usize, c: Option<Claim>| match c {
        Some(c) => (Res::Applied, Some((op, owner, c))),
        None => (Res::Lost, None),
    };
    Ok(match *c {
        Cmd::Reserve { op, approval } => {
            let r = l
                .reserve(&new_op(op, approval))
                .await
                .map_err(|e| e.to_string())?;
            match r {
                Reservation::Created(_) => (Res::Applied, None),
                Reservation::Existing(_) => (Res::Existing, None),
            }
        }
        Cmd::Claim { op, owner, stale } => {
            let row = get(op).await?;
            let from = row.as_ref().map_or(State::Reserved, |o| o.state);
            let r = l
                .claim(
                    (TENANT, &op_id(op)),
                    from,
                    version(&row, stale),
                    OWNERS[owner],
                    LEASE_MS,
                    "claim",
                )
                .await;
            match r {
                Ok(c) => claimed(op, owner, c),
                Err(LedgerError::IllegalTransition { .. }) => (Res::Illegal, None),
                Err(e) => return Err(e.to_string()),
            }
        }
        Cmd::Record {
            op,
            owner,
            from_unknown,
            to,
        } => {
            let from = if from_unknown {
                State::Unknown
            } else {
                State::Executing
            };
            let r = l
                .record_outcome(
                    TENANT,
                    &op_id(op),
                    token(owner, op),
                    from,
                    OWNERS[owner],
                    &outcome(to),
                )
                .await;
            (
                illegal(r, |w| if w { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::NoteRetry { op, owner } => {
            let r = l
                .note_retry(
                    (TENANT, &op_id(op)),
                    token(owner, op),
                    Some(503),
                    ("status-503", "busy"),
                    LEASE_MS,
                    None,
                )
                .await;
            (
                illegal(r, |w| if w { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::Extend { op, owner } => {
            let r = l
                .extend_lease(TENANT, &op_id(op), token(owner, op), LEASE_MS)
                .await;
            (
                illegal(r, |w| if w { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::Jump => {
            l.shift_clock(JUMP_MS).await.map_err(|e| e.to_string())?;
            (Res::Applied, None)
        }
        Cmd::Expire { op, stale } => {
            let row = get(op).await?;
            let r = l
                .expire_lease(
                    TENANT,
                    &op_id(op),
                    version(&row, stale),
                    Some(0),
                    "reconciler",
                )
                .await;
            (
                illegal(r, |w| if w { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::ReconcileLease { op, owner, stale } => {
            let row = get(op).await?;
            let r = l
                .lease_for_reconcile(
                    TENANT,
                    &op_id(op),
                    version(&row, stale),
                    OWNERS[owner],
                    LEASE_MS,
                    "read-back",
                )
                .await;
            match r {
                Ok(c) => claimed(op, owner, c),
                Err(LedgerError::IllegalTransition { .. }) => (Res::Illegal, None),
                Err(e) => return Err(e.to_string()),
            }
        }
        Cmd::Reattempt { op, owner } => {
            let r = l
                .reattempt(
                    TENANT,
                    &op_id(op),
                    token(owner, op),
                    OWNERS[owner],
                    LEASE_MS,
                    "absent",
                )
                .await;
            match r {
                Ok(c) => claimed(op, owner, c),
                Err(LedgerError::IllegalTransition { .. }) => (Res::Illegal, None),
                Err(e) => return Err(e.to_string()),
            }
        }
        Cmd::Requeue {
            op,
            to_unknown,
            stale,
        } => {
            let row = get(op).await?;
            let to = if to_unknown {
                State::Unknown
            } else {
                State::Reserved
            };
            let r = l
                .requeue(
                    TENANT,
                    &op_id(op),
                    version(&row, stale),
                    to,
                    "operator",
                    "requeue",
                )
                .await;
            (
                illegal(r, |v| if v.is_some() { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::Decide { op, approve } => {
            let d = if approve {
                ApprovalDecision::Approve
            } else {
                ApprovalDecision::Reject
            };
            let r = l
                .decide(TENANT, &format!("apr_{op}"), d, "approver", None)
                .await;
            (
                illegal(r, |a| if a.is_some() { Res::Applied } else { Res::Lost })?,
                None,
            )
        }
        Cmd::UseApproval { op, owner } => {
            let r = l
                .use_approval(
                    TENANT,
                    &format!("apr_{op}"),
                    &op_id(op),
                    "fp",
                    OWNERS[owner],
                    LEASE_MS,
                )
                .await;
            match r {
                Ok(c) => claimed(op, owner, c),
                Err(LedgerError::IllegalTransition { .. }) => (Res::Illegal, None),
                Err(e) => return Err(e.to_string()),
            }
        }
        Cmd::Compensate { op } => {
            let link = NewCompensation {
                operation_id: op_id(op),
                requested_by: "operator".into(),
                reason: "undo".into(),
                reference: None,
            };
            let r = l
                .reserve_compensation(&new_op(op + BASE, false), &link)
                .await
                .map_err(|e| e.to_string())?;
            let res = match r {
                CompensationReservation::Created(_) => Res::Applied,
                CompensationReservation::Existing(_) => Res::Existing,
                CompensationReservation::NotCompleted(_) => Res::NotCompleted,
                // No key is reused here (no clock moves past a retention).
                CompensationReservation::EarlierIncarnation(op) => {
                    return Err(format!("an earlier incarnation's compensation: {op:?}"));
                }
            };
            (res, None)
        }
        Cmd::Sweep => {
            let n = l.sweep_expired(100, 0).await.map_err(|e| e.to_string())?;
            (if n == 0 { Res::Lost } else { Res::Applied }, None)
        }
    })
}

/// Applies one command to the model; returns what the ledger must answer.
fn run_model(m: &mut Model, c: &Cmd) -> Res {
    use State::*;
    let token =
        |m: &Model, owner: usize, op: usize| m.tokens.get(&(owner, op)).copied().unwrap_or(0);
    match *c {
        Cmd::Reserve { op, approval } => {
            if m.ops.contains_key(&op) {
                return Res::Existing;
            }
            m.ops.insert(
                op,
                MOp {
                    state: if approval { AwaitingApproval } else { Reserved },
                    version: if approval { 2 } else { 1 },
                    fence: 0,
                    attempts: 0,
                    lease_owner: None,
                    lease_epoch: None,
                    dead_letter: false,
                },
            );
            if approval {
                m.approvals.insert(op, ApprovalStatus::Pending);
            }
            Res::Applied
        }
        Cmd::Claim { op, owner, stale } => {
            let Some(o) = m.ops.get(&op) else {
                return Res::Lost;
            };
            if !o.state.can_transition_to(Executing) {
                return Res::Illegal;
            }
            let lease_ok = match o.state {
                Executing | Unknown => !m.live(o),
                _ => true,
            };
            if stale || !lease_ok {
                return Res::Lost;
            }
            m.claim_like(op, owner);
            Res::Applied
        }
        Cmd::Record {
            op,
            owner,
            from_unknown,
            to,
        } => {
            let from = if from_unknown { Unknown } else { Executing };
            let t = token(m, owner, op);
            let Some(o) = m.ops.get_mut(&op) else {
                return Res::Lost;
            };
            if o.state != from || o.fence != t {
                return Res::Lost;
            }
            o.state = match to {
                To::Completed => Completed,
                To::Failed | To::DeadLetter => Failed,
                To::Unknown => Unknown,
            };
            o.version += 1;
            o.lease_owner = None;
            o.lease_epoch = None;
            o.dead_letter = to == To::DeadLetter;
            if op >= BASE
                && to == To::Completed
                && let Some(parent) = m.ops.get_mut(&(op - BASE))
                && parent.state == Completed
            {
                parent.state = Compensated;
                parent.version += 1;
            }
            Res::Applied
        }
        Cmd::NoteRetry { op, owner } | Cmd::Extend { op, owner } => {
            let t = token(m, owner, op);
            let epoch = m.epoch;
            let Some(o) = m.ops.get_mut(&op) else {
                return Res::Lost;
            };
            if o.state != Executing || o.fence != t {
                return Res::Lost;
            }
            if matches!(c, Cmd::NoteRetry { .. }) {
                o.attempts += 1;
            }
            o.lease_epoch = Some(epoch);
            Res::Applied
        }
        Cmd::Jump => {
            m.epoch += 1;
            Res::Applied
        }
        Cmd::Expire { op, stale } => {
            let Some(o) = m.ops.get(&op) else {
                return Res::Lost;
            };
            if o.state != Executing || stale || o.lease_owner.is_none() || m.live(o) {
                return Res::Lost;
            }
            let o = m.ops.get_mut(&op).unwrap();
            o.state = Unknown;
            o.version += 1;
            o.fence += 1;
            o.lease_owner = None;
            o.lease_epoch = None;
            Res::Applied
        }
        Cmd::ReconcileLease { op, owner, stale } => {
            let Some(o) = m.ops.get(&op) else {
                return Res::Lost;
            };
            if o.state != Unknown || stale || m.live(o) {
                return Res::Lost;
            }
            m.ops.get_mut(&op).unwrap().version += 1;
            m.lease(op, owner);
            Res::Applied
        }
        Cmd::Reattempt { op, owner } => {
            let t = token(m, owner, op);
            let Some(o) = m.ops.get(&op) else {
                return Res::Lost;
            };
            if o.state != Unknown || o.fence != t {
                return Res::Lost;
            }
            m.claim_like(op, owner);
            Res::Applied
        }
        Cmd::Requeue {
            op,
            to_unknown,
            stale,
        } => {
            let Some(o) = m.ops.get_mut(&op) else {
                return Res::Lost;
            };
            if o.state != Failed || !o.dead_letter || stale {
                return Res::Lost;
            }
            o.state = if to_unknown { Unknown } else { Reserved };
            o.version += 1;
            o.dead_letter = false;
            Res::Applied
        }
        Cmd::Decide { op, approve } => {
            if m.approvals.get(&op) != Some(&ApprovalStatus::Pending) {
                return Res::Lost;
            }
            m.approvals.insert(
                op,
                if approve {
                    ApprovalStatus::Approved
                } else {
                    ApprovalStatus::Rejected
                },
            );
            let o = m.ops.get_mut(&op).unwrap();
            if o.state == AwaitingApproval {
                o.version += 1;
                if !approve {
                    o.state = Failed;
                }
            }
            Res::Applied
        }
        Cmd::UseApproval { op, owner } => {
            if m.approvals.get(&op) != Some(&ApprovalStatus::Approved) {
                return Res::Lost;
            }
            if m.ops[&op].state != AwaitingApproval {
                // The approval's spending rolls back with the claim.
                return Res::Lost;
            }
            m.approvals.insert(op, ApprovalStatus::Used);
            m.claim_like(op, owner);
            Res::Applied
        }
        Cmd::Compensate { op } => {
            let child = op + BASE;
            if m.ops.contains_key(&child) {
                return Res::Existing;
            }
            match m.ops.get_mut(&op) {
                Some(o) if o.state == Completed => o.version += 1,
                _ => return Res::NotCompleted,
            }
            m.ops.insert(
                child,
                MOp {
                    state: Reserved,
                    version: 1,
                    fence: 0,
                    attempts: 0,
                    lease_owner: None,
                    lease_epoch: None,
                    dead_letter: false,
                },
            );
            Res::Applied
        }
        Cmd::Sweep => Res::Lost,
    }
}

/// Checks the ledger's rows and histories against the model and the
/// invariants.
async fn check_rows(l: &Ledger, m: &Model) -> Result<(), String> {
    use State::*;
    for i in 0..2 * BASE {
        let row = l.get(TENANT, &op_id(i)).await.map_err(|e| e.to_string())?;
        let Some(want) = m.ops.get(&i) else {
            if let Some(row) = row {
                return Err(format!(
                    "{} exists in the ledger ({}) but not in the model",
                    op_id(i),
                    row.state
                ));
            }
            continue;
        };
        let row = row.ok_or_else(|| format!("{} missing from the ledger", op_id(i)))?;
        let got = (
            row.state,
            row.version,
            row.fence,
            row.attempts,
            row.lease_owner.clone(),
            row.dead_letter,
        );
        let exp = (
            want.state,
            want.version,
            want.fence,
            want.attempts,
            want.lease_owner.clone(),
            want.dead_letter,
        );
        if got != exp {
            return Err(format!(
                "{}: ledger (state, version, fence, attempts, lease owner, dead letter) = {got:?}, model {exp:?}",
                op_id(i)
            ));
        }
        // At most one owner holds a live lease, and it is the row's owner.
        let holders: Vec<&str> = (0..OWNERS.len())
            .filter(|&o| m.tokens.get(&(o, i)) == Some(&row.fence) && m.live(want))
            .map(|o| OWNERS[o])
            .collect();
        if holders.len() > 1
            || holders
                .first()
                .is_some_and(|h| row.lease_owner.as_deref() != Some(h))
        {
            return Err(format!(
                "{}: live lease holders {holders:?}, row owner {:?}",
                op_id(i),
                row.lease_owner
            ));
        }
        // The history replays to the row.
        let ts = l
            .transitions(TENANT, &op_id(i))
            .await
            .map_err(|e| e.to_string())?;
        let mut state: Option<State> = None;
        let mut version = 0;
        let mut fence = 0;
        for t in &ts {
            if t.from_state != state {
                return Err(format!(
                    "{}: transition {} leaves {:?}, the state was {state:?}",
                    op_id(i),
                    t.seq,
                    t.from_state
                ));
            }
            let allowed = match t.from_state {
                None => t.to_state == Reserved,
                Some(f) => f.can_transition_to(t.to_state),
            };
            if !allowed {
                return Err(format!(
                    "{}: transition {:?} → {} is not in the state machine",
                    op_id(i),
                    t.from_state,
                    t.to_state
                ));
            }
            if let Some(f) = t.from_state
                && f.is_terminal()
                && !matches!(
                    (f, t.to_state),
                    (Completed, Completed)
                        | (Completed, Compensated)
                        | (Failed, Unknown)
                        | (Failed, Reserved)
                )
            {
                return Err(format!(
                    "{}: terminal {f} changed to {}",
                    op_id(i),
                    t.to_state
                ));
            }
            if t.version != version + 1 {
                return Err(format!(
                    "{}: version {} after {version}",
                    op_id(i),
                    t.version
                ));
            }
            if t.fence < fence {
                return Err(format!("{}: fence {} after {fence}", op_id(i), t.fence));
            }
            state = Some(t.to_state);
            version = t.version;
            fence = t.fence;
        }
        if state != Some(row.state) || version != row.version {
            return Err(format!(
                "{}: the history ends at {state:?} v{version}, the row is {} v{}",
                op_id(i),
                row.state,
                row.version
            ));
        }
    }
    Ok(())
}

/// Runs a sequence against a fresh ledger and the model.
async fn check_sequence(l: Ledger, cmds: &[Cmd]) -> Result<(), String> {
    let mut m = Model::default();
    // The largest fence granted so far, per operation.
    let mut granted: HashMap<usize, i64> = HashMap::new();
    for (n, c) in cmds.iter().enumerate() {
        let (got, claim) = run_real(&l, &m, c).await?;
        let want = run_model(&mut m, c);
        if got != want {
            return Err(format!(
                "command {n} {c:?}: the ledger answered {got:?}, the model {want:?}"
            ));
        }
        if let Some((op, _, claim)) = claim {
            let prev = granted.insert(op, claim.fence).unwrap_or(0);
            if claim.fence <= prev {
                return Err(format!(
                    "command {n} {c:?}: granted fence {} after {prev}",
                    claim.fence
                ));
            }
            if claim.fence != m.ops[&op].fence {
                return Err(format!(
                    "command {n} {c:?}: claim fence {} but model {}",
                    claim.fence, m.ops[&op].fence
                ));
            }
        }
        check_rows(&l, &m)
            .await
            .map_err(|e| format!("after command {n} {c:?}: {e}"))?;
    }
    Ok(())
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run_suite(
    default_cases: u32,
    open: impl Fn() -> std::pin::Pin<Box<dyn Future<Output = Ledger>>>,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = TestRunner::new(Config {
        cases: cases(default_cases),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(cmd(), 1..40), |cmds| {
        rt.block_on(async {
            let l = open().await;
            check_sequence(l, &cmds).await
        })
        .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn the_sqlite_ledger_agrees_with_the_model() {
    let dirs: Arc<std::sync::Mutex<Vec<tempfile::TempDir>>> = Arc::default();
    run_suite(64, move || {
        let dirs = dirs.clone();
        Box::pin(async move {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("l.db");
            {
                // Only the newest case's file is kept.
                let mut kept = dirs.lock().unwrap();
                kept.clear();
                kept.push(dir);
            }
            Ledger::open(&path, 2, 5000, ManualClock::new(1_000_000))
                .await
                .unwrap()
        })
    });
}

#[test]
fn the_postgres_ledger_agrees_with_the_model() {
    let Some(url) = pg::url() else { return };
    run_suite(16, move || {
        let url = url.clone();
        Box::pin(async move {
            let mut storage = pg::storage(&url);
            storage.max_connections = 2;
            Ledger::open_storage(&storage, Arc::new(effectgate::ledger::SystemClock))
                .await
                .unwrap()
        })
    });
}
