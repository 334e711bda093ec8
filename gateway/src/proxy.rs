//! The proxy listener: authentication, route matching, pass-through
//! streaming, and the effectful request flow (DESIGN.md steps 1–9).

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

use crate::app::AppState;
use crate::config::{Role, Route};
use crate::error::ApiError;
use crate::execute::{ExecContext, execute};
use crate::forward::{build_request, outbound_headers, strip_hop_by_hop, upstream_uri};
use crate::idempotency::{IDEMPOTENT_REPLAYED, fingerprint, parse_key, provider_key};
use crate::ledger::{NewOperation, Operation, Reservation, State as OpState};

/// The proxy router: every path goes to [`handle`].
pub fn router(state: AppState) -> Router {
    Router::new().fallback(handle).with_state(state)
}

async fn handle(State(app): State<AppState>, ConnectInfo(peer): ConnectInfo<SocketAddr>, req: Request) -> Response {
    match handle_inner(&app, peer, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle_inner(app: &AppState, peer: SocketAddr, req: Request) -> Result<Response, ApiError> {
    // 1. Authenticate the principal.
    let principal = app.authenticate(req.headers())?.clone();
    if principal.role != Role::Client {
        return Err(ApiError::Forbidden { role: principal.role.as_str(), action: "send calls through the proxy" });
    }
    // 2. Match the route; the gateway is never an open proxy.
    let path = req.uri().path().to_owned();
    let route = app
        .settings
        .match_route(&path)
        .filter(|r| r.allows_tenant(&principal.tenant))
        .ok_or_else(|| ApiError::NotFound(format!("no route for {path}")))?
        .clone();
    let rest = &path[route.prefix.len() - 1..];
    let query = req.uri().query().map(str::to_owned);
    let uri = upstream_uri(&route, rest, query.as_deref())?;

    if !route.is_effectful(req.method()) {
        return pass_through(app, &route, peer, req, uri).await;
    }

    // 3. Identity: tenant + Idempotency-Key.
    let key = parse_key(req.headers(), app.settings.limits.max_idempotency_key_len)?.ok_or_else(|| {
        ApiError::IdempotencyKeyMissing { method: req.method().to_string(), route: route.name.clone() }
    })?;

    // 4. Read the body (bounded) and fingerprint the request.
    let (parts, body) = req.into_parts();
    if let Some(len) = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        && len > route.max_body_bytes
    {
        return Err(ApiError::PayloadTooLarge { limit: route.max_body_bytes });
    }
    let body = axum::body::to_bytes(body, route.max_body_bytes)
        .await
        .map_err(|_| ApiError::PayloadTooLarge { limit: route.max_body_bytes })?;
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let fp = fingerprint(parts.method.as_str(), &route.name, rest, query.as_deref(), content_type.as_deref(), &body);

    // 5. Policies come with the policy host; until then every request is allowed.

    // 6. Reserve in the ledger atomically.
    let new = NewOperation {
        tenant_id: principal.tenant.clone(),
        operation_id: key.clone(),
        route: route.name.clone(),
        method: parts.method.to_string(),
        path: rest.to_owned(),
        query,
        fingerprint: fp.clone(),
        provider_key: provider_key(&app.provider_key_secret, &principal.tenant, &key),
        effect_class: None,
        request_content_type: content_type,
        request_body: body.to_vec(),
        principal: principal.name.clone(),
        retention_ms: i64::try_from(route.key_retention_ms).unwrap_or(i64::MAX),
    };
    let op = match app.ledger.reserve(&new).await? {
        Reservation::Created(op) => op,
        Reservation::Existing(op) => {
            if op.fingerprint != fp {
                return Err(ApiError::FingerprintMismatch { key });
            }
            match op.state {
                OpState::Completed | OpState::Failed | OpState::Compensated => return Ok(replay(&op)),
                OpState::Reserved => op,
                OpState::Executing => {
                    let now = app.ledger.clock().now_ms();
                    let left_ms = op.lease_expires_at.unwrap_or(now) - now;
                    if left_ms > 0 {
                        return Err(ApiError::InFlight {
                            operation_id: key,
                            retry_after_s: (left_ms as u64).div_ceil(1000).max(1),
                        });
                    }
                    return Err(ApiError::OutcomeUnknown {
                        operation_id: key,
                        detail: "the lease of the last attempt expired before its outcome was recorded; \
                                 the operation awaits reconciliation"
                            .into(),
                        status: StatusCode::CONFLICT,
                    });
                }
                OpState::Unknown => {
                    return Err(ApiError::OutcomeUnknown {
                        operation_id: key,
                        detail: "the provider may have applied the effect; the operation awaits reconciliation \
                                 and is not executed again"
                            .into(),
                        status: StatusCode::CONFLICT,
                    });
                }
                OpState::AwaitingApproval => {
                    return Ok(awaiting_approval(&op));
                }
            }
        }
    };

    // 7–9. Claim the lease, forward, record the outcome, answer.
    let ctx = ExecContext { app, route: &route, uri, incoming: &parts.headers, peer: Some(peer), body };
    execute(ctx, &op).await
}

/// Streams a non-effectful request through without buffering either body.
async fn pass_through(
    app: &AppState,
    route: &Route,
    peer: SocketAddr,
    req: Request,
    uri: http::Uri,
) -> Result<Response, ApiError> {
    let client = app.clients.get(&route.name).ok_or_else(|| ApiError::Internal("route without client".into()))?;
    let (parts, body) = req.into_parts();
    let headers = outbound_headers(route, &parts.headers, Some(peer), None);
    let out = build_request(parts.method, uri, headers, body);
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    let resp = match tokio::time::timeout(timeout, client.request(out)).await {
        Err(_) => {
            return Err(ApiError::ProviderUnreachable(format!(
                "no response head within {} ms",
                route.response_timeout_ms
            )));
        }
        Ok(Err(e)) => return Err(ApiError::ProviderUnreachable(e.to_string())),
        Ok(Ok(r)) => r,
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// Replays a terminal operation's stored response with
/// `Idempotent-Replayed: true`, without calling the provider.
pub fn replay(op: &Operation) -> Response {
    let mut resp = match op.response_status.and_then(|s| StatusCode::from_u16(s as u16).ok()) {
        Some(status) => {
            let body = op.response_body.clone().map(Bytes::from).unwrap_or_default();
            let mut r = Response::new(Body::from(body));
            *r.status_mut() = status;
            for (name, value) in &op.response_headers {
                if let (Ok(n), Ok(v)) = (header::HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
                    r.headers_mut().append(n, v);
                }
            }
            if op.response_body_omitted {
                let v = format!("omitted; size={}", op.response_body_bytes.unwrap_or(-1));
                if let Ok(v) = HeaderValue::from_str(&v) {
                    r.headers_mut().insert("effectgate-stored-body", v);
                }
                r.headers_mut().remove(header::CONTENT_TYPE);
            }
            r
        }
        None => ApiError::ProviderUnreachable(
            op.error_detail.clone().unwrap_or_else(|| "the provider could not be reached".into()),
        )
        .into_response(),
    };
    resp.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// 202 for an operation waiting on a human decision.
fn awaiting_approval(op: &Operation) -> Response {
    let body = serde_json::json!({
        "operation_id": op.operation_id,
        "state": op.state,
        "detail": "the operation awaits approval; nothing has been sent to the provider",
    });
    (StatusCode::ACCEPTED, axum::Json(body)).into_response()
}
