//! Approvals and replays on the admin listener, and the outbox relay that
//! notifies tenants' webhooks.
//!
//! | route | roles |
//! |---|---|
//! | `GET /admin/tenants/{t}/approvals?status=pending` | approver, operator, admin of `t` |
//! | `GET /admin/tenants/{t}/approvals/{id}` | approver, operator, admin of `t` |
//! | `POST /admin/tenants/{t}/approvals/{id}/approve` | approver of `t` |
//! | `POST /admin/tenants/{t}/approvals/{id}/reject` | approver of `t` |
//!
//! Approve/reject take `{"comment": "…"}` (optional). By default the
//! principal that made a request can't approve it (`allow_self_approval`).

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use serde::Deserialize;
use serde_json::json;

use crate::app::AppState;
use crate::config::Role;
use crate::error::ApiError;
use crate::ledger::ApprovalDecision;
use crate::policy::ReplayVerdict;

const VIEWERS: &[Role] = &[Role::Approver, Role::Operator, Role::Admin];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    #[serde(default)]
    comment: Option<String>,
}

pub(crate) fn parse<T: for<'de> Deserialize<'de> + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
        field: "body".into(),
        message: format!("invalid JSON body: {e}"),
    })
}

/// Lists approvals of a tenant (`?status=pending|approved|rejected|expired|used`).
pub async fn list(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<std::collections::HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, VIEWERS)?;
    let status = q.get("status").map(String::as_str);
    if let Some(s) = status
        && !["pending", "approved", "rejected", "expired", "used"].contains(&s)
    {
        return Err(ApiError::BadRequest {
            field: "query:status".into(),
            message: format!("unknown approval status {s:?}"),
        });
    }
    let items = app
        .ledger
        .approvals(&tenant, status, app.settings().limits.max_list_limit)
        .await?;
    let mut body = json!({ "approvals": items });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

/// One approval with the exact request it is bound to (headers without
/// secrets, the body) and the operation's state.
pub async fn get(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, VIEWERS)?;
    Ok(axum::Json(approval_view(&app, &tenant, &id).await?).into_response())
}

/// An approval as the API and the console show it.
pub async fn approval_view(
    app: &AppState,
    tenant: &str,
    id: &str,
) -> Result<serde_json::Value, ApiError> {
    let a = app
        .ledger
        .approval(tenant, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no approval {id:?}")))?;
    let op = app.ledger.get(tenant, &a.operation_id).await?;
    let mut v = serde_json::to_value(&a).map_err(|e| ApiError::Internal(e.to_string()))?;
    if let Some(op) = op {
        v["operation_state"] = json!(op.state);
        v["request"] = json!({
            "method": op.method,
            "path": op.path,
            "query": op.query,
            "headers": op.request_headers,
            "content_type": op.request_content_type,
            "body": String::from_utf8_lossy(&op.request_body),
        });
    }
    crate::times::annotate(&mut v);
    Ok(v)
}

/// Approves (`decision = Approve`) or rejects an approval.
pub async fn decide(
    app: &AppState,
    headers: &HeaderMap,
    tenant: &str,
    id: &str,
    decision: ApprovalDecision,
    comment: Option<String>,
) -> Result<serde_json::Value, ApiError> {
    let p = app.authorize_admin(headers, tenant, &[Role::Approver])?;
    decide_as(app, &p, tenant, id, decision, comment).await
}

/// [`decide`] for an already authenticated principal (the console).
///
/// Errors: 403 unless `p` is an approver of `tenant`, or when it made the
/// request itself (unless the tenant allows self-approval); 404 for an
/// unknown approval; 409 when it is no longer pending.
pub async fn decide_as(
    app: &AppState,
    p: &crate::config::Principal,
    tenant: &str,
    id: &str,
    decision: ApprovalDecision,
    comment: Option<String>,
) -> Result<serde_json::Value, ApiError> {
    if p.tenant != tenant {
        return Err(ApiError::NotFound(format!("no approval {id:?}")));
    }
    if p.role != Role::Approver {
        return Err(ApiError::Forbidden {
            role: p.role.as_str(),
            action: "decide approvals",
        });
    }
    let a = app
        .ledger
        .approval(tenant, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no approval {id:?}")))?;
    if a.requested_by == p.name && !app.settings().self_approval.contains(tenant) {
        return Err(ApiError::Forbidden {
            role: "approver",
            action: "decide a request it made itself",
        });
    }
    let comment = comment.map(|c| c.chars().take(1024).collect::<String>());
    let Some(decided) = app
        .ledger
        .decide(tenant, id, decision, &p.name, comment.as_deref())
        .await?
    else {
        return Err(ApiError::Conflict(format!(
            "approval {id:?} is {} and can't be decided again",
            a.status
        )));
    };
    if decision == ApprovalDecision::Approve {
        after_approval(app, &decided).await?;
    }
    approval_view(app, tenant, id).await
}

async fn after_approval(app: &AppState, a: &crate::ledger::Approval) -> Result<(), ApiError> {
    let rt = app.settings();
    let Some(route) = rt.routes.iter().find(|r| r.name == a.route).cloned() else {
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
            let _ = crate::replay::run_replay(
                app,
                &route,
                op,
                ReplayVerdict::SameOperationOnly,
                false,
                &a.decided_by.clone().unwrap_or_default(),
            )
            .await?;
        }
        return Ok(());
    }
    if route.execute_on_approval {
        let lease = crate::execute::lease_ms(app);
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
            tokio::spawn(crate::execute::run(app.clone(), route, op, claim, None));
        }
    }
    Ok(())
}

/// `POST …/approvals/{id}/approve`.
pub async fn approve(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let b: DecisionBody = parse(&body)?;
    Ok(axum::Json(
        decide(
            &app,
            &headers,
            &tenant,
            &id,
            ApprovalDecision::Approve,
            b.comment,
        )
        .await?,
    )
    .into_response())
}

/// `POST …/approvals/{id}/reject`.
pub async fn reject(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let b: DecisionBody = parse(&body)?;
    Ok(axum::Json(
        decide(
            &app,
            &headers,
            &tenant,
            &id,
            ApprovalDecision::Reject,
            b.comment,
        )
        .await?,
    )
    .into_response())
}
