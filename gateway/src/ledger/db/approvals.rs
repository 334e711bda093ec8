//! [`Ledger`]'s approvals and outbox methods.

use super::super::approval::{Approval, DeadEvent, Decision, NewApproval, OutboxEvent};
use super::super::command::{Lease, OpRef, UseApproval};
use super::super::{Claim, LedgerError, Operation};
use super::{Db, Ledger};

impl Ledger {
    /// One approval of `tenant` (another tenant's is `None`).
    pub async fn approval(&self, tenant: &str, id: &str) -> Result<Option<Approval>, LedgerError> {
        dispatch!(self, approval(tenant, id))
    }

    /// The newest approval of an operation, of `kind`.
    pub async fn approval_for(
        &self,
        tenant: &str,
        operation_id: &str,
        kind: &str,
    ) -> Result<Option<Approval>, LedgerError> {
        dispatch!(self, approval_for(tenant, operation_id, kind))
    }

    /// Approvals of `tenant`, optionally by status, oldest first.
    pub async fn approvals(
        &self,
        tenant: &str,
        status: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Approval>, LedgerError> {
        dispatch!(self, approvals(tenant, status, limit))
    }

    /// Creates a `replay` approval for an existing operation (an operator
    /// asked to replay and the verdict is manual), with its outbox event.
    pub async fn create_replay_approval(
        &self,
        op: &Operation,
        a: &NewApproval,
        requested_by: &str,
    ) -> Result<(), LedgerError> {
        dispatch!(self, create_replay_approval(op, a, requested_by))
    }

    /// Decides a pending, unexpired approval of `tenant`. Approving leaves a
    /// `request` operation AWAITING_APPROVAL until it is executed (by the
    /// caller's re-send, or by the gateway when the route says so);
    /// rejecting moves it to FAILED with a stored 403 that duplicates
    /// replay. Both append a transition (actor = the decider) and an outbox
    /// event, in one transaction.
    ///
    /// Returns `None` if the approval is not pending any more (decided,
    /// used or expired): a decision happens once.
    pub async fn decide(
        &self,
        tenant: &str,
        id: &str,
        decision: Decision,
        by: &str,
        comment: Option<&str>,
    ) -> Result<Option<Approval>, LedgerError> {
        dispatch!(self, decide(tenant, id, decision, by, comment))
    }

    /// Spends an approved `request` approval on its own operation and claims
    /// the operation (AWAITING_APPROVAL → EXECUTING), in one transaction:
    /// both compare-and-swaps must win or neither happens. Returns `None`
    /// when the approval is not `approved` (already used, rejected, expired)
    /// or the operation moved on.
    pub async fn use_approval(
        &self,
        tenant: &str,
        approval_id: &str,
        operation_id: &str,
        fingerprint: &str,
        owner: &str,
        lease_ms: i64,
    ) -> Result<Option<Claim>, LedgerError> {
        let cmd = UseApproval {
            op: OpRef::new(tenant, operation_id),
            fingerprint,
            lease: Lease {
                owner,
                ms: lease_ms,
            },
            approval_id,
        };
        dispatch!(self, use_approval(approval_id, &cmd))
    }

    /// Marks a `replay` approval used (single use). Returns whether it was
    /// `approved` and is now `used`.
    pub async fn use_replay_approval(
        &self,
        tenant: &str,
        approval_id: &str,
    ) -> Result<bool, LedgerError> {
        dispatch!(self, use_replay_approval(tenant, approval_id))
    }

    /// Expires pending or approved-but-unused approvals past their expiry (the reconciler's scan):
    /// the approval becomes `expired`, a `request` operation FAILED with a
    /// stored 403, and an event is queued. Returns how many expired.
    pub async fn expire_approvals(&self, limit: u32) -> Result<usize, LedgerError> {
        dispatch!(self, expire_approvals(limit))
    }

    /// Claims up to `limit` due outbox events for delivery by `owner` for
    /// `lease_ms` (an event claimed by a live owner is skipped).
    pub async fn claim_events(
        &self,
        owner: &str,
        lease_ms: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>, LedgerError> {
        dispatch!(self, claim_events(owner, lease_ms, limit))
    }

    /// Records a delivery attempt of `event_id` by `owner`, the relay that
    /// claimed it: delivered, or failed with the next attempt at
    /// `next_attempt_at` (ms since epoch). Returns `false`, changing
    /// nothing, when `owner` no longer holds the claim (it lapsed and
    /// another relay took the event) or the event was delivered already.
    pub async fn event_attempted(
        &self,
        event_id: &str,
        owner: &str,
        delivered: bool,
        error: Option<&str>,
        next_attempt_at: i64,
    ) -> Result<bool, LedgerError> {
        dispatch!(
            self,
            event_attempted(event_id, owner, delivered, error, next_attempt_at)
        )
    }

    /// Outbox events of `tenant`, oldest first: (event id, type, delivered
    /// at, attempts).
    pub async fn events(
        &self,
        tenant: &str,
    ) -> Result<Vec<(String, String, Option<i64>, i64)>, LedgerError> {
        dispatch!(self, events(tenant))
    }

    /// Ends the delivery of `event_id` for good (its retry budget is
    /// spent): the event becomes a dead-lettered event, never claimed
    /// again. Returns `false` when `owner` no longer holds the claim.
    pub async fn event_given_up(
        &self,
        event_id: &str,
        owner: &str,
        error: &str,
    ) -> Result<bool, LedgerError> {
        dispatch!(self, event_given_up(event_id, owner, error))
    }

    /// `tenant`'s dead-lettered events, newest first, at most `limit`.
    pub async fn dead_events(
        &self,
        tenant: &str,
        limit: u32,
    ) -> Result<Vec<DeadEvent>, LedgerError> {
        dispatch!(self, dead_events(tenant, limit))
    }

    /// Deletes up to `batch` events delivered more than `retention_ms` ago;
    /// returns how many. Undelivered and dead-lettered events are kept.
    pub async fn sweep_delivered_events(
        &self,
        retention_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        dispatch!(self, sweep_delivered_events(retention_ms, batch))
    }

    /// Undelivered events still to be delivered (all tenants; dead-lettered
    /// ones not counted), for tests and the console.
    pub async fn pending_events(&self) -> Result<i64, LedgerError> {
        dispatch!(self, pending_events())
    }

    /// When the oldest outbox event not yet delivered (nor dead-lettered)
    /// was written, in ms since epoch; `None` when the outbox is empty.
    pub async fn oldest_pending_event_at(&self) -> Result<Option<i64>, LedgerError> {
        dispatch!(self, oldest_pending_event_at())
    }
}
