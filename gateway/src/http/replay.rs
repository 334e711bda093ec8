//! `POST /admin/tenants/{t}/operations/{id}/replay` (role operator, body
//! `{"force": false, "reason": "…"}`): an operator's replay, decided by
//! [`crate::ops::replay::replay_as`]; and `POST …/compensate` (role
//! operator, body `{"reason": "…"}`): undoing a COMPLETED operation with
//! its route's compensation, [`crate::ops::compensate::compensate_as`].

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;

use crate::config::Role;
use crate::http::approvals::parse;
use crate::http::auth::Authenticate;
use crate::ops::OpError;
use crate::ops::replay::replay_as;
use crate::state::AppState;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    #[serde(default)]
    force: bool,
    #[serde(default)]
    reason: Option<String>,
}

/// `POST …/operations/{id}/replay` (operator): runs the tenant's replay
/// verdict for the operation's effect class.
pub async fn replay(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    // Who asks comes first: a caller without a key gets 401, not a
    // complaint about its body.
    let p = app.authorize_admin(&headers, &tenant, &[Role::Operator])?;
    let b: ReplayBody = parse(&body)?;
    let (status, v) = replay_as(&app, &p, &tenant, &operation_id, b.force, b.reason).await?;
    Ok((status, axum::Json(v)).into_response())
}

/// The replay action shared by the API and the console. Returns the status
/// and a JSON report with the verdict and what happened.
///
/// Errors: 403 for roles other than operator (a client key can never
/// replay), 404 for an unknown operation, 409 for a deny verdict or an
/// operation in flight.
pub async fn replay_operation(
    app: &AppState,
    headers: &HeaderMap,
    tenant: &str,
    operation_id: &str,
    force: bool,
    reason: Option<String>,
) -> Result<(StatusCode, serde_json::Value), OpError> {
    let p = app.authorize_admin(headers, tenant, &[Role::Operator])?;
    replay_as(app, &p, tenant, operation_id, force, reason).await
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompensateBody {
    #[serde(default)]
    reason: Option<String>,
}

/// `POST …/operations/{id}/compensate` (operator): 200 with the report once
/// the compensation COMPLETED (the operation COMPENSATED), 202 while it
/// runs or awaits an approval; see [`crate::ops::compensate::compensate_as`].
pub async fn compensate(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    let p = app.authorize_admin(&headers, &tenant, &[Role::Operator])?;
    let b: CompensateBody = parse(&body)?;
    let wait = std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
    let (status, v) =
        crate::ops::compensate::compensate_as(&app, &p, &tenant, &operation_id, b.reason, wait)
            .await?;
    Ok((status, axum::Json(v)).into_response())
}
