//! Approvals and outbox events: the shared types.
//!
//! An approval is bound to the exact immutable intent of one operation:
//! tenant, operation id, method, route, path and fingerprint. It is
//! single-use: `pending → approved → used`, or `pending → rejected |
//! expired`; every other change is refused by the SQL (`WHERE status = …`).
//! Each decision is written in the same transaction as the operation's
//! transition and an outbox event, so a crash can't lose the notification.

use serde::Serialize;
/// One approval.
#[derive(Debug, Clone, Serialize)]
pub struct Approval {
    /// `apr_<hex>`.
    pub id: String,
    /// Tenant.
    pub tenant_id: String,
    /// The operation it authorises (only this one).
    pub operation_id: String,
    /// `request` (a policy asked before the first attempt) or `replay` (an
    /// operator asked to replay).
    pub kind: String,
    /// Method of the request.
    pub method: String,
    /// Route name.
    pub route: String,
    /// Path below the route prefix.
    pub path: String,
    /// The request fingerprint (args hash) the approval is bound to.
    pub fingerprint: String,
    /// Policy that asked (name).
    pub policy: String,
    /// Its content hash.
    pub policy_hash: String,
    /// Why it asked.
    pub reason: String,
    /// Principal that made the request.
    pub requested_by: String,
    /// `pending`, `approved`, `rejected`, `expired`, `used`.
    pub status: String,
    /// Created (ms since epoch).
    pub created_at: i64,
    /// Expires (ms since epoch).
    pub expires_at: i64,
    /// Approver or rejecter.
    pub decided_by: Option<String>,
    /// When decided.
    pub decided_at: Option<i64>,
    /// The decider's comment.
    pub comment: Option<String>,
    /// When it authorised its execution.
    pub used_at: Option<i64>,
    /// For a `replay` approval: the operation's version when it was asked for.
    pub operation_version: Option<i64>,
}

/// What a new approval records.
#[derive(Debug, Clone)]
pub struct NewApproval {
    /// `apr_<hex>`.
    pub id: String,
    /// `request` or `replay`.
    pub kind: String,
    /// Policy name.
    pub policy: String,
    /// Policy content hash.
    pub policy_hash: String,
    /// Reason.
    pub reason: String,
    /// Lifetime in ms.
    pub ttl_ms: i64,
}

/// An event to deliver.
#[derive(Debug, Clone, Serialize)]
pub struct OutboxEvent {
    /// Event id (stable across redeliveries).
    pub event_id: String,
    /// Tenant.
    pub tenant_id: String,
    /// `approval.created`, `approval.approved`, …
    pub event_type: String,
    /// JSON payload, as stored.
    pub payload: String,
    /// Delivery attempts so far.
    pub attempts: i64,
    /// When the event was written, ms since epoch (its age bounds retries).
    pub created_at: i64,
}

/// An outbox event whose delivery gave up (a dead-lettered event).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadEvent {
    /// Event id.
    pub event_id: String,
    /// `approval.created`, …
    pub event_type: String,
    /// Delivery attempts made.
    pub attempts: i64,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// When the event was written, ms since epoch.
    pub created_at: i64,
    /// When delivery gave up, ms since epoch.
    pub dead_lettered_at: i64,
}

/// How a decision ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Approve.
    Approve,
    /// Reject.
    Reject,
}

/// A stored problem response for an operation whose approval was refused.
pub(super) fn refused_response(
    kind: &str,
    detail: &str,
    operation_id: &str,
    approval_id: &str,
) -> Vec<u8> {
    serde_json::json!({
        "type": format!("urn:effectgate:problem:{kind}"),
        "title": "Forbidden",
        "status": 403,
        "detail": detail,
        "operation_id": operation_id,
        "approval_id": approval_id,
    })
    .to_string()
    .into_bytes()
}
