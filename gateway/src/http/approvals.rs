//! Approvals on the admin listener.
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

use crate::config::Role;
use crate::http::auth::Authenticate;
use crate::ledger::ApprovalDecision;
use crate::ops::OpError;
use crate::ops::approvals::{approval_view, decide_as};
use crate::state::AppState;

const VIEWERS: &[Role] = &[Role::Approver, Role::Operator, Role::Admin];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    #[serde(default)]
    comment: Option<String>,
}

/// A JSON body of type `T`; an empty body is `T::default()`.
///
/// Errors: 400 naming the member that is wrong (`body.comment` for
/// `{"comment": 5}`), or `body` when it isn't JSON or an object of that
/// shape.
pub(crate) fn parse<T: for<'de> Deserialize<'de> + Default>(body: &[u8]) -> Result<T, OpError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    // serde reads a struct from an array too, by position: an object only.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(OpError::BadRequest {
            field: "body".into(),
            message: "the body must be a JSON object".into(),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let at = e.path().to_string();
        OpError::BadRequest {
            // A member of the wrong type, or unknown: named. Not JSON, or
            // cut short: the body.
            field: if e.inner().is_data() && at != "." && !at.is_empty() {
                format!("body.{at}")
            } else {
                "body".into()
            },
            message: format!("invalid JSON body: {}", e.inner()),
        }
    })?;
    de.end().map_err(|e| OpError::BadRequest {
        field: "body".into(),
        message: format!("invalid JSON body: {e}"),
    })?;
    Ok(parsed)
}

/// Lists approvals of a tenant (`?status=pending|approved|rejected|expired|used`,
/// `?limit=N`: 1..=`limits.max_list_limit`, which is also the default).
///
/// Errors: 400 naming `query:status`, `query:limit` or an unknown
/// parameter.
pub async fn list(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<std::collections::HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, VIEWERS)?;
    let max = app.settings().limits.max_list_limit;
    let limit = crate::http::admin::list_limit(&app, &q, &["status", "limit"], max)?;
    let status = q.get("status").map(String::as_str);
    if let Some(s) = status
        && !["pending", "approved", "rejected", "expired", "used"].contains(&s)
    {
        return Err(OpError::BadRequest {
            field: "query:status".into(),
            message: format!("unknown approval status {s:?}"),
        });
    }
    let items = app.ledger.approvals(&tenant, status, limit).await?;
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
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, VIEWERS)?;
    Ok(axum::Json(approval_view(&app, &tenant, &id).await?).into_response())
}

/// Approves (`decision = Approve`) or rejects an approval.
async fn decide(
    app: &AppState,
    headers: &HeaderMap,
    tenant: &str,
    id: &str,
    decision: ApprovalDecision,
    comment: Option<String>,
) -> Result<serde_json::Value, OpError> {
    let p = app.authorize_admin(headers, tenant, &[Role::Approver])?;
    decide_as(app, &p, tenant, id, decision, comment).await
}

/// `POST …/approvals/{id}/approve`.
pub async fn approve(
    State(app): State<AppState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    // Who asks comes first: a caller without a key gets 401, not a
    // complaint about its body (the role is checked in `decide`).
    app.authenticate(&headers)?;
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
) -> Result<Response, OpError> {
    // Who asks comes first: a caller without a key gets 401, not a
    // complaint about its body (the role is checked in `decide`).
    app.authenticate(&headers)?;
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
