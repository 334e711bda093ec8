//! The admin listener: health, readiness and the ledger's read API.
//!
//! | route | roles |
//! |---|---|
//! | `GET /healthz` | none (liveness) |
//! | `GET /readyz` | none (the ledger answers) |
//! | `GET /admin/tenants/{t}/operations/{id}` | admin, operator, approver of `t` |
//! | `GET /admin/tenants/{t}/operations?state=S&limit=N` | admin, operator, approver of `t` |
//!
//! A key of another tenant gets 404, never 403: it must not learn whether
//! the tenant or operation exists.

use std::collections::HashMap;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderMap, StatusCode};
use serde_json::json;

use crate::app::AppState;
use crate::config::Role;
use crate::error::ApiError;
use crate::ledger::State as OpState;

const READERS: &[Role] = &[Role::Admin, Role::Operator, Role::Approver];

/// The admin router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/admin/tenants/{tenant}/operations", get(list_operations))
        .route("/admin/tenants/{tenant}/operations/{operation_id}", get(get_operation))
        .fallback(|| async { ApiError::NotFound("no such admin endpoint".into()) })
        .with_state(state)
}

async fn readyz(State(app): State<AppState>) -> Response {
    match app.ledger.ping().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(e) => ApiError::LedgerUnavailable(e.to_string()).into_response(),
    }
}

async fn get_operation(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let op = app
        .ledger
        .get(&tenant, &operation_id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no operation {operation_id:?}")))?;
    let transitions = app.ledger.transitions(&tenant, &operation_id).await?;
    let attempts = app.ledger.attempts(&tenant, &operation_id).await?;
    let mut body = serde_json::to_value(&op).map_err(|e| ApiError::Internal(e.to_string()))?;
    body["response_body"] = json!(op.response_body.as_deref().map(String::from_utf8_lossy));
    body["transitions"] = json!(transitions);
    body["attempts_log"] = json!(attempts);
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

async fn list_operations(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    for k in q.keys() {
        if k != "state" && k != "limit" {
            return Err(ApiError::BadRequest { field: format!("query:{k}"), message: format!("unknown query parameter {k:?}") });
        }
    }
    let state = match q.get("state") {
        None => None,
        Some(s) => Some(s.parse::<OpState>().map_err(|e| ApiError::BadRequest { field: "query:state".into(), message: e.to_string() })?),
    };
    let max = app.settings.limits.max_list_limit;
    let limit = match q.get("limit") {
        None => 100.min(max),
        Some(l) => l.parse::<u32>().ok().filter(|n| (1..=max).contains(n)).ok_or_else(|| ApiError::BadRequest {
            field: "query:limit".into(),
            message: format!("limit must be an integer in 1..={max}"),
        })?,
    };
    let ops = app.ledger.list(Some(&tenant), state, limit).await?;
    Ok(axum::Json(json!({ "operations": ops })).into_response())
}
