//! The console's inbox: a tenant's events by state, and an operator's
//! release or drop of a quarantined one.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use minijinja::context;

use super::form::ConsoleForm;
use super::session::{form_session, login_redirect, session};
use super::{merge, page_ctx, render};
use crate::ops::OpError;
use crate::state::{AppState, Session};

/// `GET /console/inbox?state=S`: the tenant's inbox events, newest first.
pub(super) async fn inbox(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    inbox_page(&app, &s, q.get("state").cloned(), None).await
}

async fn inbox_page(
    app: &AppState,
    s: &Session,
    state: Option<String>,
    result: Option<String>,
) -> Response {
    if let Some(st) = &state
        && !crate::ledger::INBOX_STATES.contains(&st.as_str())
    {
        return OpError::BadRequest {
            field: "query:state".into(),
            message: format!("unknown inbox state {st:?}"),
        }
        .into_response();
    }
    let events = app
        .ledger
        .inbox_events(&s.principal.tenant, None, state.as_deref(), 200)
        .await;
    match events {
        Ok(events) => render(
            "inbox.html",
            merge(
                page_ctx(s),
                context! {
                    label => state.unwrap_or_else(|| "all".into()),
                    states => crate::ledger::INBOX_STATES,
                    events => minijinja::Value::from_serialize(&events),
                    can_decide => crate::ops::operator::SETTLERS.contains(&s.principal.role),
                    result => result,
                },
            ),
        ),
        Err(e) => OpError::from(e).into_response(),
    }
}

/// The Release / Drop form of a quarantined inbox event: the CSRF token
/// and `action` (`release` or `drop`).
#[derive(Debug, serde::Deserialize)]
pub(super) struct InboxForm {
    #[serde(default)]
    csrf: String,
    action: String,
}

/// `POST /console/inbox/{source}/{event_id}/decide`: release or drop a
/// quarantined event (operator, admin), as the admin API does.
pub(super) async fn decide_inbox(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path((source, event_id)): Path<(String, String)>,
    ConsoleForm(f): ConsoleForm<InboxForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    match crate::ops::operator::decide_inbox(&app, &s.principal, (&source, &event_id), &f.action)
        .await
    {
        Ok(changed) => {
            let msg = format!("{}: {}", f.action, changed.join(", "));
            inbox_page(&app, &s, None, Some(msg)).await
        }
        // The action is the form's field here, not the path's.
        Err(OpError::BadRequest { field, message }) if field == "path:action" => {
            OpError::BadRequest {
                field: "form:action".into(),
                message,
            }
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}
