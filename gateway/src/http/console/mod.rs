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

use std::sync::OnceLock;

use axum::Router;
use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, header};
use minijinja::{Environment, context};

use crate::ops::OpError;
use crate::state::{AppState, Session};

mod approvals;
mod form;
mod inbox;
mod operations;
mod session;

use session::{login_redirect, session};

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
        .route(
            "/console/login",
            get(session::login_page).post(session::login),
        )
        .route("/console/logout", post(session::logout))
        .route("/console/approvals", get(approvals::approvals))
        .route("/console/approvals/{id}/decide", post(approvals::decide))
        .route("/console/operations", get(operations::operations))
        .route("/console/inbox", get(inbox::inbox))
        .route(
            "/console/inbox/{source}/{event_id}/decide",
            post(inbox::decide_inbox),
        )
        .route("/console/operations/{id}", get(operations::operation))
        .route("/console/operations/{id}/replay", post(operations::replay))
        .route(
            "/console/operations/{id}/compensate",
            post(operations::compensate),
        )
        .route(
            "/console/operations/{id}/resolve",
            post(operations::resolve),
        )
        .route(
            "/console/operations/{id}/requeue",
            post(operations::requeue),
        )
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

fn page_ctx(s: &Session) -> minijinja::Value {
    context! {
        principal => context! { name => s.principal.name.clone(), role => s.principal.role.as_str(), tenant => s.principal.tenant.clone() },
        csrf => s.csrf.clone(),
    }
}

fn merge(a: minijinja::Value, b: minijinja::Value) -> minijinja::Value {
    context! { ..a, ..b }
}

/// `Some(text)` unless it is blank.
fn given(text: String) -> Option<String> {
    Some(text).filter(|t| !t.trim().is_empty())
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
