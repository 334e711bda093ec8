//! The commands of compensation: reserve the compensating operation,
//! note the request on the original, and move the original COMPLETED →
//! COMPENSATED when its compensation completes.
//!
//! ```text
//! original:      COMPLETED ──(compensation requested: audit)──► COMPLETED
//! compensation:  ∅ ──► RESERVED ──► … like any operation … ──► COMPLETED
//! original:      COMPLETED ──(in the compensation's COMPLETED transaction)──► COMPENSATED
//! ```

use super::super::{NewOperation, State};
use super::{Command, Guard, OpRef, Record, Set};

use State::{Compensated, Completed, Reserved};

/// ∅ → RESERVED (or, with the reservation's approval, on to
/// AWAITING_APPROVAL by [`super::AwaitApproval`]): records a compensating
/// operation, if its key is free, with a transition naming the operator and
/// the original.
pub(crate) struct ReserveCompensation<'a> {
    /// The compensating operation to record.
    pub new: &'a NewOperation,
    /// The transition reason (the original, the operator's reason).
    pub reason: String,
}

impl Command for ReserveCompensation<'_> {
    const SOURCES: &'static [State] = &[];
    const TARGETS: &'static [State] = &[Reserved];
    fn op(&self) -> OpRef<'_> {
        OpRef::new(&self.new.tenant_id, &self.new.operation_id)
    }
    fn source(&self) -> Option<State> {
        None
    }
    fn target(&self) -> State {
        Reserved
    }
    fn guard(&self) -> Guard<'_> {
        Guard::NewKey(self.new)
    }
    fn set(&self, _now: i64) -> Set<'_> {
        Set::none()
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(&self.new.principal, self.reason.as_str()))
    }
}

/// COMPLETED → COMPLETED: an audit row on the original, in the
/// compensation's reservation transaction (the reservation's insert is the
/// guard; this write fails only if the original is no longer COMPLETED).
pub(crate) struct NoteCompensation<'a> {
    /// The original operation.
    pub op: OpRef<'a>,
    /// The operator.
    pub actor: &'a str,
    /// Why (names the compensating operation and the operator's reason).
    pub reason: &'a str,
}

impl Command for NoteCompensation<'_> {
    const SOURCES: &'static [State] = &[Completed];
    const TARGETS: &'static [State] = &[Completed];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Completed)
    }
    fn target(&self) -> State {
        Completed
    }
    fn guard(&self) -> Guard<'_> {
        Guard::SourceState
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new("updated_at = ?", vec![now.into()])
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.reason))
    }
}

/// COMPLETED → COMPENSATED: the original's compensation completed, in the
/// same transaction (whose fenced write of the compensation's outcome is
/// the guard). The transition names the compensation, the operator who
/// asked and the reason.
pub(crate) struct CompleteCompensation<'a> {
    /// The original operation.
    pub op: OpRef<'a>,
    /// The operator who asked for the compensation.
    pub actor: &'a str,
    /// Why (names the compensating operation and the operator's reason).
    pub reason: String,
}

impl Command for CompleteCompensation<'_> {
    const SOURCES: &'static [State] = &[Completed];
    const TARGETS: &'static [State] = &[Compensated];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Completed)
    }
    fn target(&self) -> State {
        Compensated
    }
    fn guard(&self) -> Guard<'_> {
        Guard::SourceState
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new("updated_at = ?", vec![now.into()])
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.reason.as_str()))
    }
}
