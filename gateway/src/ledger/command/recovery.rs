//! The reconciler's and operators' commands: expire a lease, lease for a
//! read-back, attempt again, unschedule, read back now, audit, requeue.

use super::super::State;
use super::executor::Lease;
use super::{Command, Guard, LeaseCheck, OpRef, Record, Set};

use State::{Executing, Failed, Reserved, Unknown};

/// EXECUTING → UNKNOWN: the executing owner's lease lapsed before it
/// recorded an outcome (new fencing token, so its late write is refused).
pub(crate) struct ExpireLease<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
    /// The route's read-back settle delay in ms; `None`: no read-back, the
    /// operation waits for an operator.
    pub settle_ms: Option<i64>,
    /// Who expires it.
    pub actor: &'a str,
}

impl Command for ExpireLease<'_> {
    const SOURCES: &'static [State] = &[Executing];
    const TARGETS: &'static [State] = &[Unknown];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Executing)
    }
    fn target(&self) -> State {
        Unknown
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn lease_check(&self) -> LeaseCheck {
        LeaseCheck::Lapsed
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL, error_kind = 'lease-expired', \
             error_detail = 'the lease of the executing owner expired before it recorded an outcome', \
             next_reconcile_at = ?, settle_until = ?, updated_at = ?",
            vec![
                self.settle_ms.map(|_| now).into(),
                now.saturating_add(self.settle_ms.unwrap_or(0)).into(),
                now.into(),
            ],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, "lease expired"))
    }
}

/// UNKNOWN → UNKNOWN: takes a reconciliation lease (new fencing token).
/// The change time stays: the schedule runs from the last real change.
pub(crate) struct LeaseForReconcile<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
    /// The lease to take.
    pub lease: Lease<'a>,
    /// Transition reason.
    pub reason: &'a str,
}

impl Command for LeaseForReconcile<'_> {
    const SOURCES: &'static [State] = &[Unknown];
    const TARGETS: &'static [State] = &[Unknown];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Unknown)
    }
    fn target(&self) -> State {
        Unknown
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn lease_check(&self) -> LeaseCheck {
        LeaseCheck::NotLive
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "fence = fence + 1, lease_owner = ?, lease_expires_at = ?",
            vec![self.lease.owner.into(), self.lease.expires_at(now).into()],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.lease.owner, self.reason))
    }
}

/// UNKNOWN → EXECUTING under the reconciliation lease: the read-back came
/// back absent, so the same operation is attempted again.
pub(crate) struct Reattempt<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The reconciliation lease's fencing token.
    pub fence: i64,
    /// The lease to take.
    pub lease: Lease<'a>,
    /// Transition reason.
    pub reason: &'a str,
}

impl Command for Reattempt<'_> {
    const SOURCES: &'static [State] = &[Unknown];
    const TARGETS: &'static [State] = &[Executing];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Unknown)
    }
    fn target(&self) -> State {
        Executing
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fence(self.fence)
    }
    fn set(&self, now: i64) -> Set<'_> {
        self.lease.claim_set(now)
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.lease.owner, self.reason))
    }
}

/// UNKNOWN, kept: off the reconciler's schedule, waiting for an operator.
pub(crate) struct Unschedule<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
}

impl Command for Unschedule<'_> {
    const SOURCES: &'static [State] = &[Unknown];
    const TARGETS: &'static [State] = &[Unknown];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Unknown)
    }
    fn target(&self) -> State {
        Unknown
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn set(&self, _now: i64) -> Set<'_> {
        Set::new("next_reconcile_at = NULL", Vec::new())
    }
    fn record(&self) -> Option<Record<'_>> {
        None
    }
}

/// UNKNOWN, kept: a provider's failure event asks for a read-back now.
/// A scheduled operation's next read-back moves to now (never later than
/// it was); one off the schedule (waiting for an operator) stays off it.
pub(crate) struct ReadBackNow<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
}

impl Command for ReadBackNow<'_> {
    const SOURCES: &'static [State] = &[Unknown];
    const TARGETS: &'static [State] = &[Unknown];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Unknown)
    }
    fn target(&self) -> State {
        Unknown
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "next_reconcile_at = CASE WHEN next_reconcile_at IS NULL THEN NULL \
             WHEN next_reconcile_at > ? THEN ? ELSE next_reconcile_at END",
            vec![now.into(), now.into()],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        None
    }
}

/// `state` → `state`: an audit row (an approval decision, a forced
/// replay); only states the state machine lets stay.
pub(crate) struct SelfAudit<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
    /// Its state now, and after.
    pub state: State,
    /// Who.
    pub actor: &'a str,
    /// Why.
    pub reason: &'a str,
}

impl Command for SelfAudit<'_> {
    const SOURCES: &'static [State] = &State::ALL;
    const TARGETS: &'static [State] = &State::ALL;
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(self.state)
    }
    fn target(&self) -> State {
        self.state
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new("updated_at = ?", vec![now.into()])
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.reason))
    }
}

/// FAILED (dead letter) → UNKNOWN | RESERVED: an operator requeues it
/// with the same operation id and provider key.
pub(crate) struct Requeue<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its version now.
    pub version: i64,
    /// UNKNOWN (read back first) or RESERVED (no read-back).
    pub to: State,
    /// The operator.
    pub actor: &'a str,
    /// Why.
    pub reason: &'a str,
}

impl Command for Requeue<'_> {
    const SOURCES: &'static [State] = &[Failed];
    const TARGETS: &'static [State] = &[Unknown, Reserved];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Failed)
    }
    fn target(&self) -> State {
        self.to
    }
    fn guard(&self) -> Guard<'_> {
        Guard::DeadLetter(self.version)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "dead_letter = FALSE, requeues = requeues + 1, reconcile_attempts = 0, next_reconcile_at = ?, updated_at = ?",
            vec![now.into(), now.into()],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.reason))
    }
}
