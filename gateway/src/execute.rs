//! Executing an effectful operation: claim the lease, call the provider
//! (retrying transient failures with the same provider key), classify the
//! result, record it under the fencing token, answer the caller.
//!
//! Classification of one attempt:
//!
//! | provider result | outcome |
//! |---|---|
//! | 2xx | COMPLETED |
//! | connect refused / connect timeout (nothing written) | transient |
//! | 429, 503 | transient (retried; `Retry-After` honoured) |
//! | 500, 502, 504 and other 5xx but 501/505 | UNKNOWN |
//! | timeout or connection lost after the request was sent | UNKNOWN |
//! | any other status (1xx, 3xx, 4xx, 501, 505) | FAILED (permanent) |
//!
//! Transient failures past the route's `retry.max_attempts` end FAILED with
//! `error_kind = "retries-exhausted"`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::app::AppState;
use crate::config::Route;
use crate::error::ApiError;
use crate::forward::{build_request, outbound_headers, strip_hop_by_hop};
use crate::ledger::{Operation, Outcome, State as OpState};

/// What [`execute`] needs besides the operation.
pub struct ExecContext<'a> {
    /// Shared state.
    pub app: &'a AppState,
    /// The operation's route.
    pub route: &'a Route,
    /// Upstream URI.
    pub uri: Uri,
    /// The caller's headers (filtered before forwarding).
    pub incoming: &'a HeaderMap,
    /// The caller's address, for `X-Forwarded-For`.
    pub peer: Option<SocketAddr>,
    /// The request body, exactly as stored in the ledger.
    pub body: Bytes,
}

/// How one attempt ended.
enum Attempt {
    /// A response head arrived (any status) and the body was read.
    Response { head: http::response::Parts, body: ReadBody },
    /// Nothing was written: the connection could not be made.
    ConnectFailed(String),
    /// The request may have been sent; no usable answer came back.
    Lost { kind: &'static str, detail: String },
}

/// A response body read up to the stored-response limit.
enum ReadBody {
    /// The whole body.
    Whole(Bytes),
    /// More than the limit: the prefix read so far and the rest, unread.
    Overflow(Bytes, Incoming),
    /// Reading failed after `Bytes` were read.
    Broken(Bytes, String),
}

/// Runs operation `op` (in a state that may start an attempt) and answers.
///
/// Errors: 409 when another request claimed the operation first; 503
/// when the ledger is unavailable (nothing is forwarded unrecorded).
pub async fn execute(ctx: ExecContext<'_>, op: &Operation) -> Result<Response, ApiError> {
    let app = ctx.app;
    let route = ctx.route;
    let ledger = &app.ledger;
    let owner: &str = &app.instance_id;
    let lease_ms = (route.response_timeout_ms + app.settings.limits.lease_margin_ms) as i64;
    let Some(claim) = ledger
        .claim(&op.tenant_id, &op.operation_id, op.state, op.version, owner, lease_ms, "lease claimed for attempt")
        .await?
    else {
        return Err(ApiError::InFlight { operation_id: op.operation_id.clone(), retry_after_s: 1 });
    };
    let client = app.clients.get(&route.name).ok_or_else(|| ApiError::Internal("route without client".into()))?;
    let headers = outbound_headers(route, ctx.incoming, ctx.peer, Some(&op.provider_key));
    let method: http::Method = op.method.parse().map_err(|_| ApiError::Internal("stored method".into()))?;

    let mut attempt_no = claim.attempt;
    let mut attempts_in_call: u32 = 1;
    loop {
        let mut h = headers.clone();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(ctx.body.len()));
        let req = build_request(method.clone(), ctx.uri.clone(), h, Body::from(ctx.body.clone()));
        let result = attempt(client, req, route).await;

        // Transient: retry within budget, same provider key.
        let transient = match &result {
            Attempt::ConnectFailed(d) => Some((None, "connect-failed".to_owned(), d.clone(), None)),
            Attempt::Response { head, .. } if matches!(head.status.as_u16(), 429 | 503) => Some((
                Some(head.status.as_u16()),
                format!("status-{}", head.status.as_u16()),
                format!("provider answered {}", head.status),
                retry_after_ms(&head.headers),
            )),
            _ => None,
        };
        if let Some((status, kind, detail, retry_after)) = &transient {
            let delay = backoff_ms(route, attempts_in_call, *retry_after);
            if let Some(delay) = delay.filter(|_| attempts_in_call < route.retry.max_attempts) {
                let ok = ledger
                    .note_retry(&op.tenant_id, &op.operation_id, claim.fence, *status, kind, detail, lease_ms + delay as i64)
                    .await?;
                if !ok {
                    return Err(ApiError::InFlight { operation_id: op.operation_id.clone(), retry_after_s: 1 });
                }
                tracing::info!(operation_id = %op.operation_id, attempt = attempt_no, delay_ms = delay, %detail, "transient failure; retrying");
                tokio::time::sleep(Duration::from_millis(delay)).await;
                attempts_in_call += 1;
                attempt_no += 1;
                continue;
            }
        }

        let (outcome, reply) = classify(result, transient.is_some(), route, &op.operation_id);
        let recorded = ledger.record_outcome(&op.tenant_id, &op.operation_id, claim.fence, owner, &outcome).await?;
        if !recorded {
            return Err(ApiError::OutcomeUnknown {
                operation_id: op.operation_id.clone(),
                detail: "a newer claim took over this operation; its outcome will be recorded by that owner".into(),
                status: StatusCode::CONFLICT,
            });
        }
        tracing::info!(
            tenant = %op.tenant_id, operation_id = %op.operation_id, route = %route.name,
            state = %outcome.state, attempts = attempt_no, outcome = %outcome.attempt_outcome, "operation recorded"
        );
        return Ok(reply);
    }
}

async fn attempt(client: &crate::forward::HttpClient, req: http::Request<Body>, route: &Route) -> Attempt {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(route.response_timeout_ms);
    let resp = match tokio::time::timeout_at(deadline, client.request(req)).await {
        Err(_) => {
            return Attempt::Lost {
                kind: "timeout",
                detail: format!("no response head within {} ms", route.response_timeout_ms),
            };
        }
        Ok(Err(e)) if e.is_connect() => return Attempt::ConnectFailed(error_chain(&e)),
        Ok(Err(e)) => return Attempt::Lost { kind: "connection-lost", detail: error_chain(&e) },
        Ok(Ok(r)) => r,
    };
    let (head, body) = resp.into_parts();
    let body = match tokio::time::timeout_at(deadline, read_bounded(body, route.max_stored_response_bytes)).await {
        Ok(b) => b,
        Err(_) => ReadBody::Broken(Bytes::new(), "response body not complete within the response timeout".into()),
    };
    Attempt::Response { head, body }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

async fn read_bounded(mut body: Incoming, limit: usize) -> ReadBody {
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return ReadBody::Whole(buf.freeze()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return ReadBody::Overflow(buf.freeze(), body);
                    }
                }
            }
            Some(Err(e)) => return ReadBody::Broken(buf.freeze(), error_chain(&e)),
        }
    }
}

/// `Retry-After` in ms: delay-seconds or an HTTP-date is not parsed (only
/// delay-seconds, RFC 9110 §10.2.3, which is what providers send).
fn retry_after_ms(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim().parse::<u64>().ok().map(|s| s.saturating_mul(1000))
}

/// Full-jitter exponential backoff for retry number `n` (1 = first retry),
/// or `None` when the provider's `Retry-After` exceeds what the route honours.
fn backoff_ms(route: &Route, n: u32, retry_after: Option<u64>) -> Option<u64> {
    let r = &route.retry;
    let exp = r.base_delay_ms.saturating_mul(1u64 << (n - 1).min(30)).min(r.max_delay_ms);
    let jitter = if exp == 0 { 0 } else { rand::random_range(0..=exp) };
    match retry_after {
        Some(ra) if ra > r.max_retry_after_ms => None,
        Some(ra) => Some(jitter.max(ra)),
        None => Some(jitter),
    }
}

fn stored_headers(route: &Route, headers: &HeaderMap) -> Vec<(String, String)> {
    route
        .stored_response_headers
        .iter()
        .flat_map(|n| headers.get_all(n).iter().filter_map(move |v| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned()))))
        .collect()
}

/// Turns the final attempt into the ledger outcome and the caller's answer.
fn classify(result: Attempt, exhausted: bool, route: &Route, operation_id: &str) -> (Outcome, Response) {
    let base = |state: OpState, kind: Option<&str>, detail: Option<String>, attempt_outcome: String, reason: &str| Outcome {
        state,
        response_status: None,
        response_headers: Vec::new(),
        response_body: None,
        response_body_bytes: None,
        response_body_omitted: false,
        error_kind: kind.map(str::to_owned),
        error_detail: detail,
        attempt_outcome,
        reason: reason.to_owned(),
    };
    match result {
        Attempt::ConnectFailed(detail) => {
            let o = base(OpState::Failed, Some("retries-exhausted"), Some(detail.clone()), "connect-failed".into(), "retries exhausted: provider unreachable");
            (o, ApiError::ProviderUnreachable(detail).into_response())
        }
        Attempt::Lost { kind, detail } => {
            let o = base(OpState::Unknown, Some(kind), Some(detail.clone()), kind.into(), "outcome unknown after the request was sent");
            let status = if kind == "timeout" { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
            (o, ApiError::OutcomeUnknown { operation_id: operation_id.to_owned(), detail, status }.into_response())
        }
        Attempt::Response { head, body } => {
            let code = head.status.as_u16();
            let attempt_outcome = format!("status-{code}");
            let (state, kind, reason) = match code {
                200..=299 => (OpState::Completed, None, "provider applied the effect".to_owned()),
                _ if exhausted => (OpState::Failed, Some("retries-exhausted"), format!("retries exhausted: provider answered {code}")),
                500..=599 if code != 501 && code != 505 => {
                    (OpState::Unknown, Some("provider-5xx"), format!("provider answered {code}; the effect may have been applied"))
                }
                _ => (OpState::Failed, Some("permanent"), format!("provider refused with {code}")),
            };
            let headers = stored_headers(route, &head.headers);
            let mut o = base(state, kind, None, attempt_outcome, &reason);
            o.response_status = Some(code);
            o.response_headers = headers;
            let reply_body;
            match body {
                ReadBody::Whole(b) => {
                    o.response_body_bytes = Some(b.len() as i64);
                    o.response_body = Some(b.to_vec());
                    reply_body = Body::from(b);
                }
                ReadBody::Overflow(prefix, rest) => {
                    o.response_body_omitted = true;
                    let rest = http_body_util::BodyStream::new(rest)
                        .filter_map(|f| async move { f.map(|f| f.into_data().ok()).transpose() });
                    reply_body = Body::from_stream(futures_util::stream::once(async move { Ok::<_, hyper::Error>(prefix) }).chain(rest));
                }
                ReadBody::Broken(prefix, err) => {
                    o.response_body_omitted = true;
                    o.error_detail = Some(format!("response body unreadable: {err}"));
                    if o.state == OpState::Completed {
                        o.error_kind = Some("response-body-lost".into());
                    }
                    reply_body = Body::from(prefix);
                }
            }
            if o.state == OpState::Unknown {
                let detail = o.reason.clone();
                let reply = ApiError::OutcomeUnknown { operation_id: operation_id.to_owned(), detail, status: StatusCode::BAD_GATEWAY };
                return (o, reply.into_response());
            }
            let mut parts = head;
            strip_hop_by_hop(&mut parts.headers);
            if o.response_body_omitted {
                parts.headers.remove(header::CONTENT_LENGTH);
            }
            (o, Response::from_parts(parts, reply_body))
        }
    }
}
