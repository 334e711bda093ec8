//! The console's approvals: the pending list with each exact request, and
//! an approver's decision.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use http::HeaderMap;
use minijinja::context;
use serde::Deserialize;

use super::form::ConsoleForm;
use super::session::{form_session, login_redirect, session};
use super::{merge, page_ctx, render};
use crate::config::Role;
use crate::ledger::ApprovalDecision;
use crate::ops::OpError;
use crate::state::AppState;

pub(super) async fn approvals(State(app): State<AppState>, headers: HeaderMap) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    let tenant = s.principal.tenant.clone();
    let result = async {
        let mut items = Vec::new();
        for a in app.ledger.approvals(&tenant, Some("pending"), 200).await? {
            let mut v = crate::ops::approvals::approval_view(&app, &tenant, &a.id).await?;
            let body = v["request"]["body"].as_str().unwrap_or("").to_owned();
            let pretty = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|j| serde_json::to_string_pretty(&j).ok())
                .unwrap_or(body);
            v["body_pretty"] = serde_json::json!(pretty);
            v["approval_id"] = serde_json::json!(a.id);
            items.push(v);
        }
        Ok::<_, OpError>(items)
    }
    .await;
    match result {
        Ok(items) => render(
            "approvals.html",
            merge(
                page_ctx(&s),
                context! { approvals => minijinja::Value::from_serialize(&items), can_decide => s.principal.role == Role::Approver },
            ),
        ),
        Err(e) => e.into_response(),
    }
}

/// The Approve / Reject form: the CSRF token, `decision` (`approve` or
/// `reject`) and an optional comment.
#[derive(Debug, Deserialize)]
pub(super) struct DecideForm {
    #[serde(default)]
    csrf: String,
    decision: String,
    #[serde(default)]
    comment: String,
}

pub(super) async fn decide(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ConsoleForm(f): ConsoleForm<DecideForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let decision = match f.decision.as_str() {
        "approve" => ApprovalDecision::Approve,
        "reject" => ApprovalDecision::Reject,
        other => {
            return OpError::BadRequest {
                field: "form:decision".into(),
                message: format!("unknown decision {other:?}"),
            }
            .into_response();
        }
    };
    let comment = Some(f.comment).filter(|c| !c.trim().is_empty());
    match crate::ops::approvals::decide_as(
        &app,
        &s.principal,
        &s.principal.tenant.clone(),
        &id,
        decision,
        comment,
    )
    .await
    {
        Ok(v) => {
            let op = v["operation_id"].as_str().unwrap_or_default().to_owned();
            Redirect::to(&format!(
                "/console/operations/{}",
                crate::template::url_encode(&op)
            ))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}
