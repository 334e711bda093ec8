//! Approval decisions: an approver's approve or reject, and what an
//! approval sets going (the approved request's execution, an operator's
//! approved replay). By default the principal that made a request can't
//! approve it (`allow_self_approval`).

use serde_json::json;

use crate::config::Role;
use crate::ledger::ApprovalDecision;
use crate::ops::OpError;
use crate::policy::ReplayVerdict;
use crate::state::AppState;

/// An approval as the API and the console show it.
pub async fn approval_view(
    app: &AppState,
    tenant: &str,
    id: &str,
) -> Result<serde_json::Value, OpError> {
    let a = app
        .ledger
        .approval(tenant, id)
        .await?
        .ok_or_else(|| OpError::NotFound(format!("no approval {id:?}")))?;
    let op = app.ledger.get(tenant, &a.operation_id).await?;
    let mut v = serde_json::to_value(&a).map_err(|e| OpError::Internal(e.to_string()))?;
    if let Some(op) = op {
        v["operation_state"] = json!(op.state);
        v["request"] = json!({
            "method": op.method,
            "path": op.path,
            "query": op.query,
            "headers": crate::forward::redacted(op.request_headers.clone()),
            "content_type": op.request_content_type,
            "body": String::from_utf8_lossy(&op.request_body),
        });
    }
    crate::times::annotate(&mut v);
    Ok(v)
}

/// Approves (`decision = Approve`) or rejects approval `id` as principal `p`.
///
/// Errors: 403 unless `p` is an approver of `tenant`, or when it made the
/// request itself (unless the tenant allows self-approval); 404 for an
/// unknown approval; 409 when it is no longer pending, or past its
/// expiry (the detail names the time) before it is marked expired.
pub async fn decide_as(
    app: &AppState,
    p: &crate::config::Principal,
    tenant: &str,
    id: &str,
    decision: ApprovalDecision,
    comment: Option<String>,
) -> Result<serde_json::Value, OpError> {
    if p.tenant != tenant {
        return Err(OpError::NotFound(format!("no approval {id:?}")));
    }
    if p.role != Role::Approver {
        return Err(OpError::Forbidden {
            role: p.role.as_str(),
            action: "decide approvals".into(),
        });
    }
    let a = app
        .ledger
        .approval(tenant, id)
        .await?
        .ok_or_else(|| OpError::NotFound(format!("no approval {id:?}")))?;
    if a.requested_by == p.name && !app.settings().self_approval.contains(tenant) {
        return Err(OpError::Forbidden {
            role: "approver",
            action: "decide a request it made itself".into(),
        });
    }
    crate::ops::operator::check_reason(app, "body.comment", comment.as_deref())?;
    let Some(decided) = app
        .ledger
        .decide(tenant, id, decision, &p.name, comment.as_deref())
        .await?
    else {
        // Read again: a decision that raced this one and won is what the
        // approval is now (the read above may still say pending).
        let status = match app.ledger.approval(tenant, id).await? {
            Some(now) => now.status,
            None => a.status,
        };
        // Pending past its expiry: no decision can be taken any more (the
        // reconciler's scan marks it expired on its next pass).
        let now = app.ledger.clock().now_ms();
        if status == "pending" && a.expires_at <= now {
            return Err(OpError::Conflict(format!(
                "approval {id:?} expired at {} and can't be decided any more",
                crate::times::human(a.expires_at, now)
            )));
        }
        // Still pending to a read: the winning decision is not committed
        // yet (it shares its batch's commit).
        return Err(OpError::Conflict(if status == "pending" {
            format!(
                "approval {id:?} is being decided by another request and can't be decided again"
            )
        } else {
            format!("approval {id:?} is {status} and can't be decided again")
        }));
    };
    if decision == ApprovalDecision::Approve {
        after_approval(app, &decided).await?;
    }
    approval_view(app, tenant, id).await
}

async fn after_approval(app: &AppState, a: &crate::ledger::Approval) -> Result<(), OpError> {
    let rt = app.settings();
    let Some(route) = rt.route_named(&a.route).cloned() else {
        return Ok(());
    };
    if a.kind == "replay" {
        // An operator's manual replay: now approved, run it (single use).
        if app.ledger.use_replay_approval(&a.tenant_id, &a.id).await?
            && let Some(op) = app.ledger.get(&a.tenant_id, &a.operation_id).await?
        {
            if a.operation_version.is_some_and(|v| v != op.version) {
                // The operation moved on since the operator asked (another
                // replay, a resolution): this approval authorises nothing now.
                tracing::warn!(tenant = %a.tenant_id, operation_id = %a.operation_id, approval = %a.id,
                    "replay approval spent without effect: the operation changed since it was requested");
                return Ok(());
            }
            let ran = crate::ops::replay::run_replay(
                app,
                &route,
                op,
                ReplayVerdict::SameOperationOnly,
                false,
                &a.decided_by.clone().unwrap_or_default(),
            )
            .await;
            match ran {
                // The decision is committed and the approval spent: an
                // operation found in flight, or changed meanwhile, is
                // logged, not answered as a conflict the approver could
                // retry.
                Err(e @ (OpError::InFlight { .. } | OpError::Conflict(_))) => {
                    tracing::warn!(tenant = %a.tenant_id, operation_id = %a.operation_id, approval = %a.id,
                        error = %e, "replay approval spent without effect");
                }
                other => {
                    other?;
                }
            }
        }
        return Ok(());
    }
    if route.execute_on_approval {
        let lease = crate::ops::execute::lease_ms(app);
        if let Some(claim) = app
            .ledger
            .use_approval(
                &a.tenant_id,
                &a.id,
                &a.operation_id,
                &a.fingerprint,
                &app.instance_id,
                lease,
            )
            .await?
            && let Some(op) = app.ledger.get(&a.tenant_id, &a.operation_id).await?
        {
            // The stored request, byte for byte what was approved.
            app.lifecycle.executions.spawn(crate::ops::execute::run(
                app.clone(),
                route,
                op,
                claim,
                None,
            ));
        }
    }
    Ok(())
}
