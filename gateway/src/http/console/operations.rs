//! The console's operations: lists by state, one operation's page, and
//! an operator's actions on it (replay, compensate, resolve, requeue),
//! each through the same use case as the admin API.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use minijinja::context;
use serde::Deserialize;

use super::form::ConsoleForm;
use super::session::{form_session, login_redirect, session};
use super::{given, merge, page_ctx, render};
use crate::config::Role;
use crate::ledger::State as OpState;
use crate::ops::OpError;
use crate::state::{AppState, Session};

pub(super) async fn operations(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    let tenant = s.principal.tenant.clone();
    let label = q.get("state").cloned().unwrap_or_else(|| "all".into());
    let result = async {
        let ops = match label.as_str() {
            "DEAD" => app.ledger.dead_letters(Some(&tenant), 200).await?,
            "all" => app.ledger.list(Some(&tenant), None, 200).await?,
            other => {
                let st = other.parse::<OpState>().map_err(|e| OpError::BadRequest {
                    field: "query:state".into(),
                    message: format!("{e}, or DEAD (the dead letters), or all"),
                })?;
                app.ledger.list(Some(&tenant), Some(st), 200).await?
            }
        };
        Ok::<_, OpError>(ops)
    }
    .await;
    match result {
        Ok(ops) => render(
            "operations.html",
            merge(
                page_ctx(&s),
                context! { label => label, operations => minijinja::Value::from_serialize(&ops) },
            ),
        ),
        Err(e) => e.into_response(),
    }
}

/// The operation's page, with the result of an action on it when there is
/// one: answered with that action's status (200, or the status of the
/// problem that refused it).
async fn operation_page(app: &AppState, s: &Session, id: &str, result: Option<Shown>) -> Response {
    let status = result.as_ref().map_or(http::StatusCode::OK, |r| r.status);
    let result = result.map(|r| r.text);
    let tenant = s.principal.tenant.clone();
    let op = match app.ledger.get(&tenant, id).await {
        Ok(Some(op)) => op,
        Ok(None) => return OpError::NotFound(format!("no operation {id:?}")).into_response(),
        Err(e) => return OpError::from(e).into_response(),
    };
    match crate::ops::operator::operation_json(app, &op).await {
        Ok(v) => {
            let mut page = render(
                "operation.html",
                merge(
                    page_ctx(s),
                    context! { op => minijinja::Value::from_serialize(&v), can_replay => s.principal.role == Role::Operator, can_settle => crate::ops::operator::SETTLERS.contains(&s.principal.role), result => result },
                ),
            );
            if page.status() == http::StatusCode::OK {
                *page.status_mut() = status;
            }
            page
        }
        Err(e) => e.into_response(),
    }
}

pub(super) async fn operation(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    operation_page(&app, &s, &id, None).await
}

/// The Replay form: the CSRF token, a reason, and `force` (any value:
/// call the provider again for a COMPLETED operation whose replay policy
/// allows it, audited; see [`crate::ops::replay::run_replay`]).
#[derive(Debug, Deserialize)]
pub(super) struct ReplayForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    force: Option<String>,
}

pub(super) async fn replay(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ConsoleForm(f): ConsoleForm<ReplayForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let done = crate::ops::replay::replay_as(
        &app,
        &s.principal,
        &s.principal.tenant.clone(),
        &id,
        f.force.is_some(),
        given(f.reason),
    )
    .await;
    let result = report(done);
    operation_page(&app, &s, &id, Some(result)).await
}

/// The Resolve form: the CSRF token, `outcome` (`completed` or `absent`),
/// the provider's reference and a reason.
#[derive(Debug, Deserialize)]
pub(super) struct ResolveForm {
    #[serde(default)]
    csrf: String,
    /// `completed` or `absent`.
    #[serde(default)]
    outcome: String,
    #[serde(default)]
    provider_reference: String,
    #[serde(default)]
    reason: String,
}

/// An action's result as the page shows it, and the status the page is
/// answered with.
struct Shown {
    text: String,
    status: http::StatusCode,
}

/// What replay and compensate show on the page: the use case's report,
/// or the problem (RFC 9457) that refused it, as pretty JSON, with that
/// problem's status. A field of the admin API's body (`body.outcome`) is
/// named as the form's (`form:outcome`): the forms' fields have the same
/// names.
fn report<T>(done: Result<(T, serde_json::Value), OpError>) -> Shown {
    use crate::http::error::Problem as _;
    let (v, status) = match done {
        Ok((_, v)) => (v, http::StatusCode::OK),
        Err(e) => {
            let mut p = e.problem();
            if let Some(f) = p["field"].as_str().and_then(|f| f.strip_prefix("body.")) {
                p["field"] = serde_json::json!(format!("form:{f}"));
            }
            (p, e.status())
        }
    };
    Shown {
        text: serde_json::to_string_pretty(&v).unwrap_or_default(),
        status,
    }
}

/// What an operator's action shows on the page: the operation's id and
/// state after it, or the problem (RFC 9457) that refused it.
fn action_result(id: &str, done: Result<serde_json::Value, OpError>) -> Shown {
    report(done.map(|op| {
        (
            (),
            serde_json::json!({"operation_id": id, "state": op["state"]}),
        )
    }))
}

/// The console's Resolve form (operators and admins, UNKNOWN operations): the
/// operator's own read-back, as `POST …/resolve` on the admin API
/// ([`crate::ops::operator::resolve`]); the result shown on the page.
pub(super) async fn resolve(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ConsoleForm(f): ConsoleForm<ResolveForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let action = crate::ops::operator::Resolution {
        reason: given(f.reason),
        outcome: given(f.outcome),
        provider_reference: given(f.provider_reference),
    };
    let done = crate::ops::operator::resolve(&app, &s.principal, &id, &action).await;
    let result = action_result(&id, done);
    operation_page(&app, &s, &id, Some(result)).await
}

/// The console's Requeue button (operators and admins, dead letters): as `POST
/// …/requeue` on the admin API ([`crate::ops::operator::requeue`]); the
/// result shown on the page.
pub(super) async fn requeue(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ConsoleForm(f): ConsoleForm<CompensateForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let reason = given(f.reason);
    let done = crate::ops::operator::requeue(&app, &s.principal, &id, reason.as_deref()).await;
    let result = action_result(&id, done);
    operation_page(&app, &s, &id, Some(result)).await
}

/// A form with the CSRF token and a reason (Compensate, Requeue).
#[derive(Debug, Deserialize)]
pub(super) struct CompensateForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

/// The console's Compensate button (operators, COMPLETED operations):
/// [`crate::ops::compensate::compensate_as`], its report shown on the page.
pub(super) async fn compensate(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ConsoleForm(f): ConsoleForm<CompensateForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let wait = std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
    let done = crate::ops::compensate::compensate_as(
        &app,
        &s.principal,
        &s.principal.tenant.clone(),
        &id,
        given(f.reason),
        wait,
    )
    .await;
    let result = report(done);
    operation_page(&app, &s, &id, Some(result)).await
}
