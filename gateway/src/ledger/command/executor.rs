//! The executor's commands: reserve, wait for approval, claim, record an
//! outcome, retry, extend the lease.

use super::super::dialect::{Arg, clean};
use super::super::{NewOperation, Outcome, State};
use super::{Command, Guard, LeaseCheck, OpRef, Record, Set};

use State::{AwaitingApproval, Completed, Executing, Failed, Reserved, Unknown};

/// A lease to take: its owner (gateway instance) and length in ms.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease<'a> {
    /// Gateway instance id.
    pub owner: &'a str,
    /// Length in ms (a negative length is taken as 0).
    pub ms: i64,
}

impl Lease<'_> {
    /// When the lease ends if taken at `now` (ms since epoch).
    pub(crate) fn expires_at(&self, now: i64) -> i64 {
        now.saturating_add(self.ms.max(0))
    }

    /// A claim's columns: a new fencing token, one more attempt, the lease
    /// and the change time.
    pub(super) fn claim_set(&self, now: i64) -> Set<'_> {
        Set::new(
            "fence = fence + 1, attempts = attempts + 1, lease_owner = ?, lease_expires_at = ?, updated_at = ?",
            vec![self.owner.into(), self.expires_at(now).into(), now.into()],
        )
    }
}

/// ∅ → RESERVED: records a new operation, if its key is free.
pub(crate) struct Reserve<'a> {
    /// The operation to record.
    pub new: &'a NewOperation,
}

impl Command for Reserve<'_> {
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
        Some(Record::new(&self.new.principal, "reserved"))
    }
}

/// RESERVED → AWAITING_APPROVAL, in the reservation's transaction (a
/// policy asked for approval).
pub(crate) struct AwaitApproval<'a> {
    /// The operation just reserved.
    pub new: &'a NewOperation,
    /// Why (the policies that asked, and their reasons).
    pub reason: String,
}

impl Command for AwaitApproval<'_> {
    const SOURCES: &'static [State] = &[Reserved];
    const TARGETS: &'static [State] = &[AwaitingApproval];
    fn op(&self) -> OpRef<'_> {
        OpRef::new(&self.new.tenant_id, &self.new.operation_id)
    }
    fn source(&self) -> Option<State> {
        Some(Reserved)
    }
    fn target(&self) -> State {
        AwaitingApproval
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(1)
    }
    fn set(&self, _now: i64) -> Set<'_> {
        Set::none()
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(
            &self.new.principal,
            format!("approval required: {}", self.reason),
        ))
    }
}

/// `from` → EXECUTING: claims the lease for a new attempt (new fencing
/// token, attempts + 1). A claim from EXECUTING or UNKNOWN needs the old
/// lease to have lapsed.
pub(crate) struct ClaimLease<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its state now.
    pub from: State,
    /// Its version now.
    pub version: i64,
    /// The lease to take.
    pub lease: Lease<'a>,
    /// Transition reason.
    pub reason: &'a str,
}

impl Command for ClaimLease<'_> {
    const SOURCES: &'static [State] = &[Reserved, AwaitingApproval, Executing, Unknown];
    const TARGETS: &'static [State] = &[Executing];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(self.from)
    }
    fn target(&self) -> State {
        Executing
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Version(self.version)
    }
    fn lease_check(&self) -> LeaseCheck {
        if matches!(self.from, Executing | Unknown) {
            LeaseCheck::NotLive
        } else {
            LeaseCheck::Any
        }
    }
    fn set(&self, now: i64) -> Set<'_> {
        self.lease.claim_set(now)
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.lease.owner, self.reason))
    }
}

/// EXECUTING | UNKNOWN → COMPLETED | FAILED | UNKNOWN under the fencing
/// token: an attempt ended, or a reconciliation resolved (or failed to
/// resolve) it. The lease is released.
pub(crate) struct RecordOutcome<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// Its state now.
    pub from: State,
    /// The fencing token the writer holds.
    pub fence: i64,
    /// Who records it.
    pub actor: &'a str,
    /// What to record.
    pub outcome: &'a Outcome,
}

const OUTCOME_SET: &str = "lease_owner = NULL, lease_expires_at = NULL, \
     response_status = CASE WHEN ? THEN response_status ELSE ? END, \
     response_headers = CASE WHEN ? THEN response_headers ELSE ? END, \
     response_body = CASE WHEN ? THEN response_body ELSE ? END, \
     response_body_bytes = CASE WHEN ? THEN response_body_bytes ELSE ? END, \
     response_body_omitted = CASE WHEN ? THEN response_body_omitted ELSE ? END, \
     error_kind = ?, error_detail = ?, updated_at = ?, \
     reconcile_attempts = reconcile_attempts + ?, next_reconcile_at = ?, \
     dead_letter = ?, dead_letter_reason = ?, operator_check = ?, \
     provider_reference = COALESCE(?, provider_reference), \
     settle_until = COALESCE(?, settle_until)";

impl Command for RecordOutcome<'_> {
    const SOURCES: &'static [State] = &[Executing, Unknown];
    const TARGETS: &'static [State] = &[Completed, Failed, Unknown];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(self.from)
    }
    fn target(&self) -> State {
        self.outcome.state
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fence(self.fence)
    }
    fn set(&self, now: i64) -> Set<'_> {
        let o = self.outcome;
        let keep = Arg::from(o.keep_response);
        let headers = serde_json::to_string(&o.response_headers).unwrap_or_else(|_| "[]".into());
        let dl = o.dead_letter.as_ref();
        Set::new(
            OUTCOME_SET,
            vec![
                keep.clone(),
                o.response_status.map(i64::from).into(),
                keep.clone(),
                headers.into(),
                keep.clone(),
                (&o.response_body).into(),
                keep.clone(),
                o.response_body_bytes.into(),
                keep,
                o.response_body_omitted.into(),
                o.error_kind.as_deref().map(clean).into(),
                o.error_detail.as_deref().map(clean).into(),
                now.into(),
                i64::from(o.count_read_back).into(),
                o.next_reconcile_at.into(),
                dl.is_some().into(),
                dl.map(|d| clean(&d.reason)).into(),
                dl.map(|d| clean(&d.operator_check)).into(),
                o.provider_reference.as_deref().map(clean).into(),
                o.settle_until.into(),
            ],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        Some(Record::new(self.actor, self.outcome.reason.as_str()))
    }
}

/// EXECUTING, kept: a failed attempt that will be retried under the same
/// fencing token (attempts + 1, the error recorded, the lease extended).
pub(crate) struct NoteRetry<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The fencing token the writer holds.
    pub fence: i64,
    /// Short outcome of the failed attempt (`status-503`, `timeout`, …).
    pub outcome: &'a str,
    /// Its detail.
    pub detail: &'a str,
    /// The lease's new length from now, in ms.
    pub lease_ms: i64,
    /// The caller's `x-request-id`, if the attempt was made for one.
    pub request_id: Option<&'a str>,
}

impl Command for NoteRetry<'_> {
    const SOURCES: &'static [State] = &[Executing];
    const TARGETS: &'static [State] = &[Executing];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Executing)
    }
    fn target(&self) -> State {
        Executing
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fence(self.fence)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "attempts = attempts + 1, lease_expires_at = ?, error_kind = ?, error_detail = ?, updated_at = ?",
            vec![
                now.saturating_add(self.lease_ms).into(),
                clean(self.outcome).into(),
                clean(self.detail).into(),
                now.into(),
            ],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        None
    }
}

/// EXECUTING, kept: the lease holder extends its lease.
pub(crate) struct ExtendLease<'a> {
    /// The operation.
    pub op: OpRef<'a>,
    /// The fencing token the writer holds.
    pub fence: i64,
    /// The lease's new length from now, in ms.
    pub lease_ms: i64,
}

impl Command for ExtendLease<'_> {
    const SOURCES: &'static [State] = &[Executing];
    const TARGETS: &'static [State] = &[Executing];
    fn op(&self) -> OpRef<'_> {
        self.op
    }
    fn source(&self) -> Option<State> {
        Some(Executing)
    }
    fn target(&self) -> State {
        Executing
    }
    fn guard(&self) -> Guard<'_> {
        Guard::Fence(self.fence)
    }
    fn set(&self, now: i64) -> Set<'_> {
        Set::new(
            "lease_expires_at = ?",
            vec![now.saturating_add(self.lease_ms).into()],
        )
    }
    fn record(&self) -> Option<Record<'_>> {
        None
    }
}
