//! The commands of approvals: noted, refused, used.

use super::super::State;
use super::super::dialect::clean;
use super::executor::Lease;
use super::{Command, Guard, OpRef, Record, Set};

use State::{AwaitingApproval, Executing, Failed};

/// AWAITING_APPROVAL → AWAITING_APPROVAL: its approval was granted (the
/// operation waits until it is executed).
pub(crate) struct NoteApproval<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The decider.
    pub actor: &'a str,
    /// Why.
    pub reason: &'a str,
}

impl Command for NoteApproval<'_> {
    const SOURCES: &'static [State] = &[AwaitingApproval];
    const TARGETS: &'static [State] = &[AwaitingApproval];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(AwaitingApproval)
    }
    fn target(&self) -> State {
        AwaitingApproval
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

/// AWAITING_APPROVAL → FAILED with a stored 403: its approval was
/// rejected or expired.
pub(crate) struct RefuseApproval<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The fingerprint the approval is bound to.
    pub fingerprint: &'a str,
    /// The decider, or the reconciler.
    pub actor: &'a str,
    /// Why (also the stored error detail).
    pub reason: &'a str,
    /// The stored problem response body.
    pub body: &'a [u8],
}

impl Command for RefuseApproval<'_> {
    const SOURCES: &'static [State] = &[AwaitingApproval];
    const TARGETS: &'static [State] = &[Failed];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(AwaitingApproval)
    }
    fn target(&self) -> State {
        Failed
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fingerprint(self.fingerprint)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "response_status = 403, response_headers = ?, response_body_bytes = ?, response_body = ?, \
             error_kind = 'approval-refused', error_detail = ?, updated_at = ?",
            vec![
                r#"[["content-type","application/problem+json"]]"#.into(),
                (self.body.len() as i64).into(),
                self.body.into(),
                clean(self.reason).into(),
                now.into(),
            ],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.reason))
    }
}

/// AWAITING_APPROVAL → EXECUTING: its approved approval was spent (in the
/// same transaction) and the lease claimed.
pub(crate) struct UseApproval<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The fingerprint the approval is bound to.
    pub fingerprint: &'a str,
    /// The lease to take.
    pub lease: Lease<'a>,
    /// The approval spent.
    pub approval_id: &'a str,
}

impl Command for UseApproval<'_> {
    const SOURCES: &'static [State] = &[AwaitingApproval];
    const TARGETS: &'static [State] = &[Executing];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(AwaitingApproval)
    }
    fn target(&self) -> State {
        Executing
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fingerprint(self.fingerprint)
    }
    fn set(&self, now: i64) -> Set<'_> {
        self.lease.claim_set(now)
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(
            self.lease.owner,
            format!(
                "approval {} used: executing the approved request",
                self.approval_id
            ),
        ))
    }
}
