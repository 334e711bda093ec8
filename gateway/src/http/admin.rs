//! The admin listener: health, readiness, metrics and the ledger's operator API.
//!
//! | route | roles |
//! |---|---|
//! | `GET /healthz` | none (liveness) |
//! | `GET /readyz` | none (the ledger answers; 503 `shutting-down` once shutdown started) |
//! | `GET /metrics` | none (Prometheus text format) |
//! | `GET /admin/tenants/{t}/operations/{id}` | admin, operator, approver of `t` |
//! | `GET /admin/tenants/{t}/operations?state=S&limit=N` | admin, operator, approver of `t` |
//! | `GET /admin/tenants/{t}/dead-letters?limit=N` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/operations/{id}/requeue` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/operations/{id}/resolve` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/operations/{id}/compensate` | operator of `t` |
//! | `GET /admin/tenants/{t}/inbox?source=S&state=X&limit=N` | admin, operator, approver of `t` |
//! | `POST /admin/tenants/{t}/inbox/{source}/{event_id}/release` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/inbox/{source}/{event_id}/drop` | admin, operator of `t` |
//! | `POST /admin/reload` | any tenant's admin |
//! | `POST /admin/clock/step` (only with the `failpoints` feature) | any tenant's admin |
//!
//! A key of another tenant gets 404, never 403: it must not learn whether
//! the tenant or operation exists. Every operator action is recorded as a
//! ledger transition with the principal as actor.

use std::collections::HashMap;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use serde_json::json;

use crate::config::Role;
use crate::http::approvals::parse;
use crate::http::auth::Authenticate;
use crate::ledger::State as OpState;
use crate::ops::OpError;
pub use crate::ops::operator::{self, dead_letter_json, load, operation_json};
use crate::state::AppState;

const READERS: &[Role] = &[Role::Admin, Role::Operator, Role::Approver];
const OPERATORS: &[Role] = &[Role::Admin, Role::Operator];

/// The admin router.
pub fn router(state: AppState) -> Router {
    // Set at start: the layer holds the number.
    let max_body = state.settings().limits.max_admin_body_bytes;
    let router = Router::new()
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/admin/tenants/{tenant}/operations", get(list_operations))
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}",
            get(get_operation),
        )
        .route("/admin/tenants/{tenant}/dead-letters", get(dead_letters))
        .route(
            "/admin/tenants/{tenant}/events/dead-letters",
            get(dead_events),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/requeue",
            post(requeue),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/resolve",
            post(resolve),
        )
        .route("/admin/tenants/{tenant}/inbox", get(list_inbox))
        .route(
            "/admin/tenants/{tenant}/inbox/{source}/{event_id}/{action}",
            post(decide_inbox),
        )
        .route("/admin/reload", post(reload));
    #[cfg(feature = "failpoints")]
    let router = router.route("/admin/clock/step", post(step_clock));
    router
        .route(
            "/admin/tenants/{tenant}/approvals",
            get(crate::http::approvals::list),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}",
            get(crate::http::approvals::get),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}/approve",
            post(crate::http::approvals::approve),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}/reject",
            post(crate::http::approvals::reject),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/replay",
            post(crate::http::replay::replay),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/compensate",
            post(crate::http::replay::compensate),
        )
        .merge(crate::http::console::routes())
        .fallback(|| async { OpError::NotFound("no such admin endpoint".into()) })
        .method_not_allowed_fallback(|| async {
            OpError::MethodNotAllowed("method not allowed on this admin endpoint".into())
        })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            move |State(app): State<AppState>,
                  req: axum::extract::Request,
                  next: axum::middleware::Next| {
                read_body_first(app, req, next, max_body)
            },
        ))
        .layer(axum::middleware::from_fn(refuse_nul))
        .layer(axum::middleware::from_fn(refuse_repeated_parameters))
        .layer(axum::middleware::map_response(move |resp: Response| {
            as_problem(resp, Some(max_body))
        }))
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        // Outermost: a head past `limits.max_header_bytes` (431), or with
        // a transfer coding other than chunked (501), is refused before
        // anything else reads the request, as on the proxy listener.
        .layer(crate::http::guards::refuse({
            let app = state.clone();
            move |req: &axum::extract::Request| {
                crate::http::guards::limit_header_bytes(&app, req)
                    .or_else(|| crate::http::guards::transfer_coding_refusal(req.headers()))
            }
        }))
        .with_state(state)
}

/// Refuses an admin request whose path or query holds `%00` (U+0000,
/// once decoded): no tenant, operation, source or event id holds it, and
/// PostgreSQL's text can't, so a lookup would fail rather than find
/// nothing.
///
/// Errors: 400 `bad-request` naming `path` or `query`.
async fn refuse_nul(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let has_nul = |s: &str| {
        s.as_bytes()
            .windows(3)
            .any(|w| w[0] == b'%' && w[1] == b'0' && w[2] == b'0')
    };
    let uri = req.uri();
    let field = if has_nul(uri.path()) {
        "path"
    } else if uri.query().is_some_and(has_nul) {
        "query"
    } else {
        return next.run(req).await;
    };
    OpError::BadRequest {
        field: field.into(),
        message: format!("the {field} holds %00 (U+0000), which no id holds"),
    }
    .into_response()
}

/// Refuses an admin request whose query names a parameter twice
/// (`?limit=1&limit=2`): the handlers read the query as a map, which
/// would keep one of them silently.
///
/// Errors: 400 `bad-request` naming `query:<name>`.
async fn refuse_repeated_parameters(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(q) = req.uri().query() {
        let mut seen = std::collections::HashSet::new();
        for (name, _) in form_urlencoded::parse(q.as_bytes()) {
            if !seen.insert(name.clone()) {
                return OpError::BadRequest {
                    field: format!("query:{name}"),
                    message: format!("the query names {name:?} more than once"),
                }
                .into_response();
            }
        }
    }
    next.run(req).await
}

/// Reads every admin request's body whole before a handler runs (also of
/// the endpoints that take none), within `limits.max_admin_body_bytes`
/// (`max_body`; a declared `Content-Length` over it is refused at once)
/// and `limits.body_read_timeout_ms`: a body that never comes can't hold
/// an admin connection longer than that, whoever sent it (a handler
/// authenticates after its extractors ran).
///
/// Errors: 413 `payload-too-large`, 408 `request-timeout`, 400 naming
/// `body` for one that can't be read whole (see
/// [`crate::http::body::read_body`]).
async fn read_body_first(
    app: AppState,
    req: axum::extract::Request,
    next: axum::middleware::Next,
    max_body: usize,
) -> Response {
    let timeout_ms = app.settings().limits.body_read_timeout_ms;
    let (parts, body) = req.into_parts();
    match crate::http::body::read_body(
        &parts.headers,
        body,
        max_body,
        "limits.max_admin_body_bytes",
        timeout_ms,
    )
    .await
    {
        Ok(bytes) => {
            next.run(axum::extract::Request::from_parts(
                parts,
                axum::body::Body::from(bytes),
            ))
            .await
        }
        Err(e) => e.into_response(),
    }
}

/// Turns the framework's plain-text rejections (a malformed path segment,
/// a body over `limits.max_admin_body_bytes`) into RFC 9457
/// problem+json, so every admin error, and every error of the proxy
/// listener's own routes, has the same shape: kind `payload-too-large`
/// for a 413 (with `field: "body"`, and `limit_bytes` when `max_body`
/// is given), `method-not-allowed` for a 405, else `bad-request`.
/// Console pages (HTML) pass unchanged.
pub(crate) async fn as_problem(resp: Response, max_body: Option<usize>) -> Response {
    let status = resp.status();
    let ct = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if status.as_u16() < 400
        || ct.starts_with(crate::http::error::PROBLEM_JSON)
        || ct.starts_with("text/html")
    {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let detail = match axum::body::to_bytes(body, 64 * 1024).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).into_owned(),
        _ => status.canonical_reason().unwrap_or("error").to_owned(),
    };
    // The kinds of the gateway's own errors with the same status.
    let kind = match status {
        StatusCode::METHOD_NOT_ALLOWED => "method-not-allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload-too-large",
        _ => "bad-request",
    };
    let mut problem = json!({
        "type": format!("urn:effectgate:problem:{kind}"),
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        problem["field"] = json!("body");
        if let Some(max) = max_body {
            problem["limit_bytes"] = json!(max);
        }
    } else if let Some(name) = path_parameter(&detail) {
        problem["field"] = json!(format!("path:{name}"));
    }
    let mut r = (parts.status, problem.to_string()).into_response();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(crate::http::error::PROBLEM_JSON),
    );
    r
}

/// The path parameter a rejection of the framework's names: its messages
/// for a segment that is no valid UTF-8 or doesn't parse read
/// ``Invalid URL: Invalid UTF-8 in `operation_id` `` or ``Invalid URL:
/// Cannot parse `limit` …``; the name is the first one in backticks.
fn path_parameter(detail: &str) -> Option<&str> {
    let rest = detail.strip_prefix("Invalid URL:")?;
    let (_, after) = rest.split_once('`')?;
    let (name, _) = after.split_once('`')?;
    (!name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .then_some(name)
}

async fn readyz(State(app): State<AppState>) -> Response {
    // From SIGTERM on, load balancers must stop sending new calls.
    if app.lifecycle.draining() {
        let problem = json!({
            "type": "urn:effectgate:problem:shutting-down",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "the gateway is shutting down: calls in flight are finishing, new ones belong elsewhere",
        });
        let mut r = (http::StatusCode::SERVICE_UNAVAILABLE, problem.to_string()).into_response();
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(crate::http::error::PROBLEM_JSON),
        );
        return r;
    }
    match app.ledger.ping().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(e) => OpError::LedgerUnavailable(e.to_string()).into_response(),
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    let settings = app.settings();
    let now = app.ledger.clock().now_ms();
    let age = |at: Option<i64>| at.map_or(0.0, |t| (now - t).max(0) as f64 / 1000.0);
    let counts = app.ledger.tenant_counts().await;
    if let Ok(counts) = &counts {
        let mut seen = std::collections::BTreeSet::new();
        for c in counts {
            let label = if settings.tenants.contains(&c.tenant) {
                c.tenant.clone()
            } else {
                "_other".to_owned()
            };
            crate::metrics::tenant_gauges(
                &label,
                (c.unknown, age(c.oldest_unknown_at)),
                c.dead_letters,
                age(c.oldest_dead_letter_at),
            );
            seen.insert(label);
        }
        for t in settings.tenants.iter().filter(|t| !seen.contains(*t)) {
            crate::metrics::tenant_gauges(t, (0, 0.0), 0, 0.0);
        }
    }
    let pending = app.ledger.pending_events().await.unwrap_or(0);
    let oldest_event = app.ledger.oldest_pending_event_at().await.ok().flatten();
    crate::metrics::scrape_gauges(counts.is_ok(), pending, age(oldest_event));
    if let Ok(rows) = app.ledger.inbox_gauges().await {
        for source in settings.inbox.keys() {
            let of = |state: &str| rows.iter().find(|(s, st, _, _)| s == source && st == state);
            let held = of("held").map_or(0, |r| r.2);
            let q = of("quarantined");
            crate::metrics::inbox_gauges(
                source,
                held,
                q.map_or(0, |r| r.2),
                age(q.and_then(|r| r.3)),
            );
        }
    }
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::handle().render(),
    )
        .into_response()
}

async fn get_operation(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let op = load(&app, &tenant, &operation_id).await?;
    Ok((StatusCode::OK, axum::Json(operation_json(&app, &op).await?)).into_response())
}

/// A list's `?limit=` (default 100) after checking that every query
/// parameter is one of `allowed`; see [`list_limit`].
fn limit_param(
    app: &AppState,
    q: &HashMap<String, String>,
    allowed: &[&str],
) -> Result<u32, OpError> {
    list_limit(app, q, allowed, 100)
}

/// [`limit_param`] with `default` (at most `limits.max_list_limit`) when
/// `?limit=` is not given.
///
/// Errors: 400 naming `query:<name>` for a parameter not in `allowed`,
/// `query:limit` for a limit out of 1..=`limits.max_list_limit`.
pub(crate) fn list_limit(
    app: &AppState,
    q: &HashMap<String, String>,
    allowed: &[&str],
    default: u32,
) -> Result<u32, OpError> {
    for k in q.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(OpError::BadRequest {
                field: format!("query:{k}"),
                message: format!("unknown query parameter {k:?}"),
            });
        }
    }
    let max = app.settings().limits.max_list_limit;
    match q.get("limit") {
        None => Ok(default.min(max)),
        Some(l) => l
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| OpError::BadRequest {
                field: "query:limit".into(),
                message: format!("limit must be an integer in 1..={max}"),
            }),
    }
}

async fn list_operations(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let limit = limit_param(&app, &q, &["state", "limit"])?;
    let state = match q.get("state") {
        None => None,
        Some(s) => Some(s.parse::<OpState>().map_err(|e| OpError::BadRequest {
            field: "query:state".into(),
            message: e.to_string(),
        })?),
    };
    let ops = app.ledger.list(Some(&tenant), state, limit).await?;
    let ops = ops
        .iter()
        .map(operator::operation_row)
        .collect::<Result<Vec<_>, _>>()?;
    let mut body = json!({ "operations": ops });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

async fn dead_letters(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let limit = limit_param(&app, &q, &["limit"])?;
    let ops = app.ledger.dead_letters(Some(&tenant), limit).await?;
    let items: Vec<_> = ops.iter().map(dead_letter_json).collect();
    let mut body = json!({ "dead_letters": items });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

/// `GET /admin/tenants/{t}/events/dead-letters`: the tenant's webhook
/// events whose delivery gave up (retry budget spent), newest first:
/// `{"dead_events": [{event_id, event_type, attempts, last_error,
/// created_at, dead_lettered_at, …_rfc3339}]}`. Roles: operator, admin.
async fn dead_events(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let limit = limit_param(&app, &q, &["limit"])?;
    let events = app.ledger.dead_events(&tenant, limit).await?;
    let mut body = json!({ "dead_events": events });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

/// `GET /admin/tenants/{t}/inbox?source=S&state=X&limit=N`: the tenant's
/// inbox events, newest first: `{"events": [{source, event_id,
/// event_type, state, sequence_key, sequence, gap, received_at,
/// held_until, outbox_event_id, operation_id, resolution, …_rfc3339}]}`.
/// `state` is one of `accepted`, `stale`, `held`, `quarantined`,
/// `dropped`. Roles: admin, operator, approver.
async fn list_inbox(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let limit = limit_param(&app, &q, &["source", "state", "limit"])?;
    if let Some(s) = q.get("state")
        && !crate::ledger::INBOX_STATES.contains(&s.as_str())
    {
        return Err(OpError::BadRequest {
            field: "query:state".into(),
            message: format!(
                "unknown inbox state {s:?}; expected one of {}",
                crate::ledger::INBOX_STATES.join(", ")
            ),
        });
    }
    let events = app
        .ledger
        .inbox_events(
            &tenant,
            q.get("source").map(String::as_str),
            q.get("state").map(String::as_str),
            limit,
        )
        .await?;
    let mut body = json!({ "events": events });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

/// `POST /admin/tenants/{t}/inbox/{source}/{event_id}/release|drop`
/// (operator): a quarantined event is delivered (flagged as after a gap)
/// or dropped; its sequence key goes on past it. The row keeps the
/// principal and the time. 409 unless the event is quarantined.
async fn decide_inbox(
    State(app): State<AppState>,
    Path((tenant, source, event_id, action)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Result<Response, OpError> {
    let principal = app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let events =
        crate::ops::operator::decide_inbox(&app, &principal, (&source, &event_id), &action).await?;
    Ok(
        axum::Json(json!({ "event_id": event_id, "action": action, "changed": events }))
            .into_response(),
    )
}

/// Reloads the configuration and policies (admin role of any tenant):
/// compiled in the background, swapped atomically; on error the old set
/// stays and the answer says why (422).
async fn reload(State(app): State<AppState>, headers: HeaderMap) -> Result<Response, OpError> {
    let p = app.authenticate(&headers)?;
    if p.role != Role::Admin {
        return Err(OpError::Forbidden {
            role: p.role.as_str(),
            action: "reload the configuration".into(),
        });
    }
    match app.reload(None).await {
        Ok(summary) => Ok(axum::Json(json!({"status": "reloaded", "summary": summary})).into_response()),
        Err(e) => Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            [(http::header::CONTENT_TYPE, crate::http::error::PROBLEM_JSON)],
            json!({"type": "urn:effectgate:problem:reload-refused", "title": "Unprocessable Entity", "status": 422,
                   "detail": format!("the reload was refused and the old configuration stays: {e}")})
            .to_string(),
        )
            .into_response()),
    }
}

/// `POST /admin/clock/step` with `{"ms": <integer>}` (admin role of any
/// tenant; only in builds with the `failpoints` feature): steps the
/// ledger's clock by `ms`, negative back. See [`operator::step_clock`].
///
/// Errors: 400 naming `body.ms` when it is missing or not an integer (or
/// `body.<name>` for another member); 409 on
/// PostgreSQL.
#[cfg(feature = "failpoints")]
async fn step_clock(
    State(app): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    let p = app.authenticate(&headers)?;
    if p.role != Role::Admin {
        return Err(OpError::Forbidden {
            role: p.role.as_str(),
            action: "step the ledger's clock".into(),
        });
    }
    let v: serde_json::Value = parse(&body)?;
    let ms = v
        .get("ms")
        .and_then(serde_json::Value::as_i64)
        .ok_or_else(|| OpError::BadRequest {
            field: "body.ms".into(),
            message: "ms must be an integer: the step in milliseconds, negative to step back"
                .into(),
        })?;
    if let Some(k) = v
        .as_object()
        .and_then(|o| o.keys().find(|k| k.as_str() != "ms"))
    {
        return Err(OpError::BadRequest {
            field: format!("body.{k}"),
            message: format!("unknown field {k:?}; the body is {{\"ms\": <integer>}}"),
        });
    }
    Ok(axum::Json(operator::step_clock(&app, ms).await?).into_response())
}

/// `POST …/operations/{id}/requeue` (operator, admin): see [`operator::requeue`].
async fn requeue(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    let principal = app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let action: operator::Requeue = parse(&body)?;
    let op = operator::requeue(&app, &principal, &operation_id, action.reason.as_deref()).await?;
    Ok((StatusCode::ACCEPTED, axum::Json(op)).into_response())
}

/// `POST …/operations/{id}/resolve` (operator, admin): see [`operator::resolve`].
async fn resolve(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, OpError> {
    let principal = app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let action: operator::Resolution = parse(&body)?;
    let op = operator::resolve(&app, &principal, &operation_id, &action).await?;
    Ok(axum::Json(op).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_path_rejection_names_its_parameter() {
        let resp = (
            StatusCode::BAD_REQUEST,
            "Invalid URL: Invalid UTF-8 in `operation_id`",
        )
            .into_response();
        let resp = as_problem(resp, Some(1024)).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let p: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(p["field"], "path:operation_id");
        assert_eq!(p["type"], "urn:effectgate:problem:bad-request");
        assert_eq!(path_parameter("Invalid URL: no name"), None);
        assert_eq!(path_parameter("Failed to parse the request body"), None);
    }
}
