//! The console's session: the login form (with its double-submit
//! token), the `eg_session` cookie, each posted form's CSRF check, and
//! logging out.

use axum::extract::State;
use axum::response::{IntoResponse, Redirect, Response};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use minijinja::context;
use serde::Deserialize;

use super::form::ConsoleForm;
use super::render;
use crate::config::Role;
use crate::http::auth::Authenticate;
use crate::ops::OpError;
use crate::state::{AppState, Session};

/// The session cookie.
const COOKIE: &str = "eg_session";
/// The login-form token's cookie and its lifetime (ms).
const LOGIN_COOKIE: &str = "eg_login";
const LOGIN_FORM_MS: i64 = 30 * 60 * 1000;

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

pub(super) fn session(app: &AppState, headers: &HeaderMap) -> Option<Session> {
    let id = cookie(headers, COOKIE)?;
    let now = app.ledger.clock().now_ms();
    let settings = app.settings();
    let mut map = app.sessions.0.lock().unwrap();
    map.retain(|_, s| s.expires_at > now && settings.keys.get(&s.key_digest) == Some(&s.principal));
    map.get(&id).cloned()
}

pub(super) fn login_redirect() -> Response {
    Redirect::to("/console/login").into_response()
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

pub(super) async fn login_page() -> Response {
    login_form(StatusCode::OK, None)
}

/// The login form: the key, and the login-form token (`eg_login`).
#[derive(Debug, Deserialize)]
pub(super) struct LoginForm {
    key: String,
    #[serde(default)]
    csrf: String,
}

pub(super) async fn login(
    State(app): State<AppState>,
    headers: HeaderMap,
    ConsoleForm(f): ConsoleForm<LoginForm>,
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
    let (session_ms, per_key) = {
        let s = app.settings();
        (
            s.limits.console_session_ms,
            s.limits.console_sessions_per_key,
        )
    };
    let session_ms = i64::try_from(session_ms).unwrap_or(i64::MAX);
    let now = app.ledger.clock().now_ms();
    let expires_at = now.saturating_add(session_ms);
    let key_digest = crate::config::key_digest(f.key.trim());
    let mut sessions = app.sessions.0.lock().unwrap();
    sessions.retain(|_, s| s.expires_at > now);
    // A key keeps `limits.console_sessions_per_key` sessions at most: the
    // one nearest its end makes room.
    loop {
        let of_key = sessions
            .iter()
            .filter(|(_, s)| s.key_digest == key_digest)
            .map(|(id, s)| (s.expires_at, id));
        if of_key.clone().count() < per_key.max(1) {
            break;
        }
        let Some(oldest) = of_key.min().map(|(_, id)| id.clone()) else {
            break;
        };
        sessions.remove(&oldest);
    }
    sessions.insert(
        id.clone(),
        Session {
            principal,
            key_digest,
            csrf,
            expires_at,
        },
    );
    drop(sessions);
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

/// A form with the CSRF token alone (Log out).
#[derive(Debug, Deserialize)]
pub(super) struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// The session a form was posted in: the login page when there is none,
/// 403 when the form's CSRF token is not the session's.
pub(super) fn form_session(
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

pub(super) async fn logout(
    State(app): State<AppState>,
    headers: HeaderMap,
    ConsoleForm(f): ConsoleForm<CsrfForm>,
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
