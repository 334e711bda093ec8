//! The operator console: server-rendered pages on the admin listener.
//!
//! Log in with an admin, approver or operator key; the session lives in an
//! `HttpOnly; SameSite=Strict` cookie (`eg_session`, 8 h, kept in memory:
//! a restart logs everyone out). Every POST carries the session's CSRF
//! token and is refused (403) without it; the login POST carries the login
//! form's token, which must equal the `eg_login` cookie set with the form
//! (30 min). The console shows requests
//! exactly as they were stored and has no way to edit them: an approver
//! approves or rejects what is shown, with a comment.
//!
//! | page | what |
//! |---|---|
//! | `/console` | counts, each a link to its list: pending approvals, UNKNOWN, dead-letter depth and oldest age |
//! | `/console/approvals` | pending approvals with the exact request and the policy's reason |
//! | `/console/operations?state=S` | operations by state (`DEAD` = dead letters) |
//! | `/console/operations/{id}` | the transition timeline, attempts, policy decisions; for operators: replay, compensate (COMPLETED operations), resolve (UNKNOWN operations and dead letters past reconciliation's bounds), requeue (dead letters) |

use std::collections::HashMap;
use std::sync::OnceLock;

use axum::Form;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use minijinja::{Environment, context};
use serde::Deserialize;

use crate::config::Role;
use crate::http::auth::Authenticate;
use crate::ledger::{ApprovalDecision, State as OpState};
use crate::ops::OpError;
use crate::state::{AppState, Session};

const COOKIE: &str = "eg_session";
/// The login-form token's cookie and its lifetime (ms).
const LOGIN_COOKIE: &str = "eg_login";
const LOGIN_FORM_MS: i64 = 30 * 60 * 1000;

/// The `segment` filter: `value` as one URL path segment. Every byte but
/// the unreserved letters, digits, `-`, `_` and `~` is percent-encoded
/// (RFC 3986 §2.1), `/` and `.` included, so an operation id like
/// `zz/../k1` stays one segment and can't point a link or form at another
/// operation. (minijinja's `urlencode` leaves `/` and `.` as they are.)
pub fn path_segment(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn env() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Environment::new();
        env.add_filter("segment", path_segment);
        // `{{ ms|when }}`: ISO 8601 in UTC with a hint relative to the
        // viewer's clock, `2026-12-02T03:20:22.924Z (in 23 h)`.
        env.add_filter("when", |ms: Option<i64>| -> String {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            ms.map(|ms| crate::times::human(ms, now))
                .unwrap_or_default()
        });
        for (name, src) in [
            ("base.html", include_str!("templates/base.html")),
            ("login.html", include_str!("templates/login.html")),
            ("overview.html", include_str!("templates/overview.html")),
            ("approvals.html", include_str!("templates/approvals.html")),
            ("operations.html", include_str!("templates/operations.html")),
            ("operation.html", include_str!("templates/operation.html")),
            ("inbox.html", include_str!("templates/inbox.html")),
        ] {
            env.add_template(name, src)
                .expect("console templates parse");
        }
        env
    })
}

/// The console's Content-Security-Policy: no scripts, no loads, styles
/// inline only, forms to the console itself, never framed.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";

fn render(name: &str, ctx: minijinja::Value) -> Response {
    match env().get_template(name).and_then(|t| t.render(ctx)) {
        Ok(html) => {
            let mut r = Html(html).into_response();
            r.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            r.headers_mut()
                .insert("x-frame-options", HeaderValue::from_static("DENY"));
            // The pages run no script and load nothing: an injected script,
            // frame or off-site form target is refused by the browser too.
            r.headers_mut().insert(
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            );
            r
        }
        Err(e) => OpError::Internal(format!("template {name}: {e}")).into_response(),
    }
}

/// The console's routes (mounted on the admin router).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/console", get(overview))
        .route("/console/login", get(login_page).post(login))
        .route("/console/logout", post(logout))
        .route("/console/approvals", get(approvals))
        .route("/console/approvals/{id}/decide", post(decide))
        .route("/console/operations", get(operations))
        .route("/console/inbox", get(inbox))
        .route(
            "/console/inbox/{source}/{event_id}/decide",
            post(decide_inbox),
        )
        .route("/console/operations/{id}", get(operation))
        .route("/console/operations/{id}/replay", post(replay))
        .route("/console/operations/{id}/compensate", post(compensate))
        .route("/console/operations/{id}/resolve", post(resolve))
        .route("/console/operations/{id}/requeue", post(requeue))
        .layer(axum::middleware::from_fn(secure_cookies))
}

/// On a TLS admin listener every cookie the console sets is `Secure`
/// (RFC 6265 §4.1.2.5), so a browser never sends the session over plain HTTP.
async fn secure_cookies(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let https = crate::forward::Inbound::scheme_of(req.extensions()) == "https";
    let mut r = next.run(req).await;
    if https {
        let cookies: Vec<HeaderValue> = r
            .headers()
            .get_all(header::SET_COOKIE)
            .iter()
            .cloned()
            .collect();
        r.headers_mut().remove(header::SET_COOKIE);
        for c in cookies {
            let secured = [c.as_bytes(), b"; Secure"].concat();
            if let Ok(v) = HeaderValue::from_bytes(&secured) {
                r.headers_mut().append(header::SET_COOKIE, v);
            }
        }
    }
    r
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

fn session(app: &AppState, headers: &HeaderMap) -> Option<Session> {
    let id = cookie(headers, COOKIE)?;
    let now = app.ledger.clock().now_ms();
    let settings = app.settings();
    let mut map = app.sessions.0.lock().unwrap();
    map.retain(|_, s| s.expires_at > now && settings.keys.get(&s.key_digest) == Some(&s.principal));
    map.get(&id).cloned()
}

fn login_redirect() -> Response {
    Redirect::to("/console/login").into_response()
}

fn page_ctx(s: &Session) -> minijinja::Value {
    context! {
        principal => context! { name => s.principal.name.clone(), role => s.principal.role.as_str(), tenant => s.principal.tenant.clone() },
        csrf => s.csrf.clone(),
    }
}

fn merge(a: minijinja::Value, b: minijinja::Value) -> minijinja::Value {
    context! { ..a, ..b }
}

/// The login page with a fresh login-form token, also set as the
/// `eg_login` cookie (double-submit): a login POST must carry both, equal,
/// so another site can't log a browser into a session of its choosing.
fn login_form(status: StatusCode, error: Option<&str>) -> Response {
    let token = hex::encode(rand::random::<[u8; 24]>());
    let mut r = render(
        "login.html",
        context! { principal => (), error => error, login_csrf => token.clone() },
    );
    *r.status_mut() = status;
    let cookie = format!(
        "{LOGIN_COOKIE}={token}; Path=/console/login; HttpOnly; SameSite=Strict; Max-Age={}",
        LOGIN_FORM_MS / 1000
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

async fn login_page() -> Response {
    login_form(StatusCode::OK, None)
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    key: String,
    #[serde(default)]
    csrf: String,
}

async fn login(
    State(app): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    let form_ok = cookie(&headers, LOGIN_COOKIE).is_some_and(|c| {
        !f.csrf.is_empty() && crate::http::same_bytes(c.as_bytes(), f.csrf.as_bytes())
    });
    if !form_ok {
        return login_form(
            StatusCode::FORBIDDEN,
            Some("this login form has expired or was not served by this gateway; log in again"),
        );
    }
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", f.key.trim())) {
        h.insert(header::AUTHORIZATION, v);
    }
    let principal = match app.authenticate(&h) {
        Ok(p) if p.role != Role::Client => p,
        Ok(_) => {
            return login_form(
                StatusCode::FORBIDDEN,
                Some("a client key can't use the console"),
            );
        }
        Err(_) => return login_form(StatusCode::UNAUTHORIZED, Some("unknown key")),
    };
    let id = hex::encode(rand::random::<[u8; 32]>());
    let csrf = hex::encode(rand::random::<[u8; 24]>());
    let session_ms = i64::try_from(app.settings().limits.console_session_ms).unwrap_or(i64::MAX);
    let expires_at = app.ledger.clock().now_ms().saturating_add(session_ms);
    let key_digest = crate::config::key_digest(f.key.trim());
    app.sessions.0.lock().unwrap().insert(
        id.clone(),
        Session {
            principal,
            key_digest,
            csrf,
            expires_at,
        },
    );
    let mut r = Redirect::to("/console").into_response();
    let cookie = format!(
        "{COOKIE}={id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}",
        (session_ms / 1000).max(1)
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    // The login-form token is spent.
    let spent =
        format!("{LOGIN_COOKIE}=; Path=/console/login; HttpOnly; SameSite=Strict; Max-Age=0");
    if let Ok(v) = HeaderValue::from_str(&spent) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// The session a form was posted in: the login page when there is none,
/// 403 when the form's CSRF token is not the session's.
fn form_session(
    app: &AppState,
    headers: &HeaderMap,
    token: &str,
) -> Result<Session, Box<Response>> {
    use crate::http::same_bytes as eq;
    let s = session(app, headers).ok_or_else(|| Box::new(login_redirect()))?;
    if !eq(s.csrf.as_bytes(), token.as_bytes()) {
        return Err(Box::new(
            OpError::Forbidden {
                role: "console session",
                action: "post a form without its CSRF token".into(),
            }
            .into_response(),
        ));
    }
    Ok(s)
}

async fn logout(
    State(app): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<CsrfForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    app.sessions
        .0
        .lock()
        .unwrap()
        .retain(|_, v| v.csrf != s.csrf);
    let mut r = Redirect::to("/console/login").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(
            "eg_session=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0",
        ),
    );
    r
}

async fn overview(State(app): State<AppState>, headers: HeaderMap) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    let tenant = &s.principal.tenant;
    let result = async {
        let pending = app
            .ledger
            .approvals(tenant, Some("pending"), 10_000)
            .await?
            .len();
        let counts = app.ledger.tenant_counts().await?;
        let (unknown, dead, oldest) = counts
            .into_iter()
            .find(|c| &c.tenant == tenant)
            .map(|c| (c.unknown, c.dead_letters, c.oldest_dead_letter_at))
            .unwrap_or((0, 0, None));
        let now = app.ledger.clock().now_ms();
        let dead_events = app.ledger.dead_events(tenant, 50).await?;
        Ok::<_, OpError>(context! {
            pending => pending, unknown => unknown, dead => dead,
            oldest_age_s => oldest.map(|t| (now - t).max(0) / 1000),
            dead_events => dead_events,
        })
    }
    .await;
    match result {
        Ok(ctx) => render("overview.html", merge(page_ctx(&s), ctx)),
        Err(e) => e.into_response(),
    }
}

async fn approvals(State(app): State<AppState>, headers: HeaderMap) -> Response {
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

#[derive(Debug, Deserialize)]
struct DecideForm {
    #[serde(default)]
    csrf: String,
    decision: String,
    #[serde(default)]
    comment: String,
}

async fn decide(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<DecideForm>,
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

async fn operations(
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

/// `GET /console/inbox?state=S`: the tenant's inbox events, newest first.
async fn inbox(
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
                    can_decide => matches!(s.principal.role, crate::config::Role::Admin | crate::config::Role::Operator),
                    result => result,
                },
            ),
        ),
        Err(e) => OpError::from(e).into_response(),
    }
}

#[derive(Debug, serde::Deserialize)]
struct InboxForm {
    csrf: String,
    action: String,
}

/// `POST /console/inbox/{source}/{event_id}/decide`: release or drop a
/// quarantined event (operator, admin), as the admin API does.
async fn decide_inbox(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path((source, event_id)): Path<(String, String)>,
    Form(f): Form<InboxForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    if !matches!(
        s.principal.role,
        crate::config::Role::Admin | crate::config::Role::Operator
    ) {
        return OpError::Forbidden {
            role: s.principal.role.as_str(),
            action: "release or drop inbox events".into(),
        }
        .into_response();
    }
    match crate::ops::operator::decide_inbox(&app, &s.principal, (&source, &event_id), &f.action)
        .await
    {
        Ok(changed) => {
            let msg = format!("{}: {}", f.action, changed.join(", "));
            inbox_page(&app, &s, None, Some(msg)).await
        }
        Err(e) => e.into_response(),
    }
}

async fn operation_page(app: &AppState, s: &Session, id: &str, result: Option<String>) -> Response {
    let tenant = s.principal.tenant.clone();
    let op = match app.ledger.get(&tenant, id).await {
        Ok(Some(op)) => op,
        Ok(None) => return OpError::NotFound(format!("no operation {id:?}")).into_response(),
        Err(e) => return OpError::from(e).into_response(),
    };
    match crate::ops::operator::operation_json(app, &op).await {
        Ok(v) => render(
            "operation.html",
            merge(
                page_ctx(s),
                context! { op => minijinja::Value::from_serialize(&v), can_replay => s.principal.role == Role::Operator, result => result },
            ),
        ),
        Err(e) => e.into_response(),
    }
}

async fn operation(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let Some(s) = session(&app, &headers) else {
        return login_redirect();
    };
    operation_page(&app, &s, &id, None).await
}

#[derive(Debug, Deserialize)]
struct ReplayForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    force: Option<String>,
}

async fn replay(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<ReplayForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let reason = Some(f.reason).filter(|r| !r.trim().is_empty());
    let result = match crate::ops::replay::replay_as(
        &app,
        &s.principal,
        &s.principal.tenant.clone(),
        &id,
        f.force.is_some(),
        reason,
    )
    .await
    {
        Ok((_, v)) => serde_json::to_string_pretty(&v).unwrap_or_default(),
        Err(e) => serde_json::to_string_pretty(&crate::http::error::Problem::problem(&e))
            .unwrap_or_default(),
    };
    operation_page(&app, &s, &id, Some(result)).await
}

#[derive(Debug, Deserialize)]
struct ResolveForm {
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

/// `Some(text)` unless it is blank.
fn given(text: String) -> Option<String> {
    Some(text).filter(|t| !t.trim().is_empty())
}

/// Refuses every role but operator (403 `forbidden` in the page's
/// result), as the console's replay and compensate do; the admin API's
/// `…/resolve` and `…/requeue` refuse approvers and clients the same way.
fn operator_only(s: &Session, action: &'static str) -> Result<(), OpError> {
    if s.principal.role == Role::Operator {
        return Ok(());
    }
    Err(OpError::Forbidden {
        role: s.principal.role.as_str(),
        action: action.into(),
    })
}

/// What an operator's action shows on the page: the operation's id and
/// state after it, or the problem (RFC 9457) that refused it.
fn action_result(id: &str, done: Result<serde_json::Value, OpError>) -> String {
    let v = match done {
        Ok(op) => serde_json::json!({"operation_id": id, "state": op["state"]}),
        Err(e) => serde_json::json!(crate::http::error::Problem::problem(&e)),
    };
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// The console's Resolve form (operators, UNKNOWN operations): the
/// operator's own read-back, as `POST …/resolve` on the admin API
/// ([`crate::ops::operator::resolve`]); the result shown on the page.
async fn resolve(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<ResolveForm>,
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
    let done = match operator_only(&s, "resolve operations") {
        Ok(()) => crate::ops::operator::resolve(&app, &s.principal, &id, &action).await,
        Err(e) => Err(e),
    };
    let result = action_result(&id, done);
    operation_page(&app, &s, &id, Some(result)).await
}

/// The console's Requeue button (operators, dead letters): as `POST
/// …/requeue` on the admin API ([`crate::ops::operator::requeue`]); the
/// result shown on the page.
async fn requeue(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CompensateForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let reason = given(f.reason);
    let done = match operator_only(&s, "requeue operations") {
        Ok(()) => crate::ops::operator::requeue(&app, &s.principal, &id, reason.as_deref()).await,
        Err(e) => Err(e),
    };
    let result = action_result(&id, done);
    operation_page(&app, &s, &id, Some(result)).await
}

/// A form with the CSRF token and a reason (Compensate, Requeue).
#[derive(Debug, Deserialize)]
struct CompensateForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

/// The console's Compensate button (operators, COMPLETED operations):
/// [`crate::ops::compensate::compensate_as`], its report shown on the page.
async fn compensate(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CompensateForm>,
) -> Response {
    let s = match form_session(&app, &headers, &f.csrf) {
        Ok(s) => s,
        Err(refused) => return *refused,
    };
    let reason = Some(f.reason).filter(|r| !r.trim().is_empty());
    let wait = std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
    let result = match crate::ops::compensate::compensate_as(
        &app,
        &s.principal,
        &s.principal.tenant.clone(),
        &id,
        reason,
        wait,
    )
    .await
    {
        Ok((_, v)) => serde_json::to_string_pretty(&v).unwrap_or_default(),
        Err(e) => serde_json::to_string_pretty(&crate::http::error::Problem::problem(&e))
            .unwrap_or_default(),
    };
    operation_page(&app, &s, &id, Some(result)).await
}
