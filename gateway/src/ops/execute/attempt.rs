//! The wire side of one attempt: the stored request's headers as sent,
//! the attempt's span, the provider call under its response timeout with
//! the lease kept alive, and the response body read up to the stored
//! limit.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, header};
use http_body_util::BodyExt;

use crate::config::Route;
use crate::forward::{ResponseBody, add_route_headers, from_pairs};
use crate::ledger::{Claim, Operation, State as OpState};
use crate::state::AppState;

/// How one attempt ended.
pub(super) enum Attempt {
    /// A response head arrived (any status) and the body was read.
    Response {
        head: http::response::Parts,
        body: ReadBody,
    },
    /// Nothing was written: the connection could not be made.
    ConnectFailed(String),
    /// The request may have been sent; no usable answer came back.
    Lost { kind: &'static str, detail: String },
}

/// A response body read up to the stored-response limit.
pub(super) enum ReadBody {
    /// The whole body.
    Whole(Bytes),
    /// More than the limit: the prefix read so far and the rest, unread.
    Overflow(Bytes, Box<ResponseBody>),
    /// Reading failed after `Bytes` were read.
    Broken(Bytes, String),
}

/// Opens an MCP session of the gateway's own for a new attempt and sets
/// (or clears) `mcp-session-id` in `headers`; on failure the attempt goes
/// on without one (logged).
pub(super) async fn own_mcp_session(route: &Route, op: &Operation, headers: &mut HeaderMap) {
    match crate::ops::mcp::open_session(route, &op.path).await {
        Ok(Some(s)) => {
            if let Ok(v) = HeaderValue::from_str(&s) {
                headers.insert("mcp-session-id", v);
            }
        }
        Ok(None) => {
            headers.remove("mcp-session-id");
        }
        Err(e) => {
            tracing::warn!(operation_id = %op.operation_id, error = %e, "could not open an MCP session for a new attempt")
        }
    }
}

/// The stored request's headers as sent: the route's credentials and the
/// provider key added, `Content-Length` of the stored body.
pub(super) async fn request_headers(route: &Route, op: &Operation, claim: &Claim) -> HeaderMap {
    let mut headers = from_pairs(&op.request_headers);
    add_route_headers(route, &mut headers, Some(&op.provider_key));
    // Only the first attempt, made while its caller waits, can count on the
    // caller's MCP session still existing. Every other execution (a retry
    // after a read-back, an approved request, a requeue) runs in a session
    // of the gateway's own.
    // A compensation's tool call never had a caller's session.
    let callers_session = claim.attempt == 1
        && op.state == OpState::Reserved
        && crate::config::compensated_id(&op.operation_id).is_none();
    if route.mcp.is_some() && !callers_session {
        own_mcp_session(route, op, &mut headers).await;
    }
    headers.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(op.request_body.len()),
    );
    headers
}

/// The span of one provider attempt (kind client; OpenTelemetry HTTP client
/// conventions): method, server address and port, path (never the query,
/// which may carry credentials), resend count, and the attempt number,
/// provider key and fencing token as `effectgate.*` attributes; the status
/// and outcome class (`transient`, `COMPLETED`, `FAILED`, `UNKNOWN`) are
/// recorded when it ends.
pub(super) fn attempt_span(
    route: &Route,
    op: &Operation,
    claim: &Claim,
    method: &http::Method,
    uri: &http::Uri,
    attempt_no: i64,
) -> tracing::Span {
    tracing::debug_span!(
        "provider attempt",
        otel.name = method.as_str(),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = method.as_str(),
        http.request.resend_count = attempt_no - 1,
        http.response.status_code = tracing::field::Empty,
        server.address = uri.host().unwrap_or(""),
        server.port = uri.port_u16().unwrap_or(match uri.scheme_str() {
            Some("https") => 443,
            _ => 80,
        }),
        url.path = uri.path(),
        effectgate.tenant = op.tenant_id.as_str(),
        effectgate.route = route.name.as_str(),
        effectgate.operation_id = op.operation_id.as_str(),
        effectgate.attempt = attempt_no,
        effectgate.fence = claim.fence,
        effectgate.provider_key = op.provider_key.as_str(),
        effectgate.outcome = tracing::field::Empty,
    )
}

/// One provider call, bounded by the route's response timeout. While it
/// runs, the lease is extended every third of its length, so a long but
/// healthy call keeps its claim.
pub(super) async fn attempt(
    app: &AppState,
    client: &crate::forward::HttpClient,
    req: http::Request<crate::forward::OutboundBody>,
    route: &Route,
    op: &Operation,
    fence: i64,
    lease_ms: i64,
) -> Attempt {
    let started = std::time::Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(route.response_timeout_ms);
    let call = async {
        let resp = match tokio::time::timeout_at(deadline, client.request(req)).await {
            Err(_) => {
                return Attempt::Lost {
                    kind: "timeout",
                    detail: format!("no response head within {} ms", route.response_timeout_ms),
                };
            }
            Ok(Err(e)) if e.is_connect() || crate::tls::refused_in_handshake(&e) => {
                return Attempt::ConnectFailed(crate::forward::error_detail(&e));
            }
            Ok(Err(e)) => {
                return Attempt::Lost {
                    kind: "connection-lost",
                    detail: crate::forward::error_detail(&e),
                };
            }
            Ok(Ok(r)) => r,
        };
        let (head, body) = resp.into_parts();
        // An MCP answer is read and stored whole (up to
        // `Route::mcp_answer_bytes`): the tool's outcome is inside it, and
        // a replay must be the whole result.
        let body = read_bounded(
            body,
            if route.mcp.is_some() {
                route.mcp_answer_bytes()
            } else {
                route.max_stored_response_bytes
            },
            // An MCP answer streamed as SSE ends with its result
            // message, whether or not the server closes the stream.
            (route.mcp.is_some()
                && head
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(crate::ops::mcp::is_event_stream))
            .then_some(&head.headers),
            deadline,
        )
        .await;
        Attempt::Response { head, body }
    };
    let period = Duration::from_millis((lease_ms / 3).max(1) as u64);
    let result = beside_heartbeat(call, period, || async {
        match app
            .ledger
            .extend_lease(&op.tenant_id, &op.operation_id, fence, lease_ms)
            .await
        {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(operation_id = %op.operation_id, "lease lost during the call; its outcome will be fenced off");
                false
            }
            Err(e) => {
                tracing::warn!(operation_id = %op.operation_id, error = %e, "lease extension failed");
                true
            }
        }
    })
    .await;
    crate::metrics::upstream_latency(&route.name, started.elapsed());
    result
}

/// Runs `call` to its end with `beat` (a lease extension) run every
/// `period` beside it, never instead of it: the call is polled while an
/// extension waits for the ledger, since the call's provider connection
/// is polled by the call itself. `beat` answers whether to go on (no once
/// the lease is lost).
async fn beside_heartbeat<T, B, BF>(
    call: impl Future<Output = T>,
    period: Duration,
    mut beat: B,
) -> T
where
    B: FnMut() -> BF,
    BF: Future<Output = bool>,
{
    let call = std::pin::pin!(call);
    let heartbeat = std::pin::pin!(async {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            ticks.tick().await;
            if !beat().await {
                break;
            }
        }
    });
    match futures_util::future::select(call, heartbeat).await {
        futures_util::future::Either::Left((r, _)) => r,
        futures_util::future::Either::Right(((), call)) => call.await,
    }
}

/// Reads a response body up to `limit` bytes, until `deadline` (the
/// route's `response_timeout_ms` from the request's start): a body not
/// whole by then is [`ReadBody::Broken`] with what arrived. With
/// `sse_result` (an MCP answer's headers, when it is an event stream),
/// reading stops at the first complete event that holds the JSON-RPC
/// result: that message decides the outcome, and the stream is closed
/// after it.
async fn read_bounded(
    mut body: ResponseBody,
    limit: usize,
    sse_result: Option<&HeaderMap>,
    deadline: tokio::time::Instant,
) -> ReadBody {
    let mut buf = BytesMut::new();
    // The end of the events already looked at: each frame's new complete
    // events are parsed once.
    let mut events_end = 0;
    loop {
        let Ok(frame) = tokio::time::timeout_at(deadline, body.frame()).await else {
            return ReadBody::Broken(
                buf.freeze(),
                "response body not complete within the response timeout".into(),
            );
        };
        match frame {
            None => return ReadBody::Whole(buf.freeze()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return ReadBody::Overflow(buf.freeze(), Box::new(body));
                    }
                    if let Some(h) = sse_result {
                        // A separator may straddle the previous frame's end.
                        let from = events_end.max(buf.len() - data.len()).saturating_sub(3);
                        let end = from + complete_events(&buf[from..]).len();
                        if end > events_end {
                            let found =
                                crate::ops::mcp::rpc_message(h, &buf[events_end..end]).is_some();
                            events_end = end;
                            if found {
                                return ReadBody::Whole(buf.freeze());
                            }
                        }
                    }
                }
            }
            Some(Err(e)) => {
                return ReadBody::Broken(buf.freeze(), crate::forward::error_detail(&e));
            }
        }
    }
}

/// The part of an event stream up to its last complete event (one ended
/// by a blank line: LF LF, CRLF CRLF or CR CR).
fn complete_events(buf: &[u8]) -> &[u8] {
    let end = [&b"\n\n"[..], b"\r\n\r\n", b"\r\r"]
        .iter()
        .filter_map(|sep| {
            buf.windows(sep.len())
                .rposition(|w| w == *sep)
                .map(|i| i + sep.len())
        })
        .max()
        .unwrap_or(0);
    &buf[..end]
}

/// `Retry-After` in ms (RFC 9110 §10.2.3): delay-seconds (digits past
/// `u64` wait as long as it holds), or an HTTP-date, counted from the
/// answer's own `Date` (RFC 9110 §6.6.1: the provider's clock, so the
/// two clocks' skew doesn't count) or else from `now_ms` (ms since the
/// epoch); a date already past is no wait. Anything else is ignored, and
/// the backoff applies.
pub(super) fn retry_after_ms(headers: &HeaderMap, now_ms: i64) -> Option<u64> {
    let v = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return Some(v.parse::<u64>().unwrap_or(u64::MAX).saturating_mul(1000));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    let from = headers
        .get(header::DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d.trim()).ok())
        .unwrap_or_else(|| {
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(now_ms.max(0).unsigned_abs())
        });
    let wait = at.duration_since(from).unwrap_or_default();
    Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Retry-After` as delay-seconds (digits past `u64` as long as it
    /// holds) or as an HTTP-date, counted from the answer's `Date` when it
    /// has one, else from now; a past date is no wait; anything else none.
    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        let h = |pairs: &[(&str, &str)]| {
            let mut m = HeaderMap::new();
            for (n, v) in pairs {
                m.insert(
                    http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    http::HeaderValue::from_str(v).unwrap(),
                );
            }
            m
        };
        // Sun, 06 Nov 1994 08:49:37 GMT (RFC 9110 §5.6.7's example).
        let date_ms = 784_111_777_000;
        // Headers, now (ms since the epoch), the wait.
        type Case<'a> = (&'a [(&'a str, &'a str)], i64, Option<u64>);
        let cases: [Case; 8] = [
            (&[("retry-after", "120")], 0, Some(120_000)),
            (
                &[("retry-after", "18446744073709551616")],
                0,
                Some(u64::MAX),
            ),
            (
                &[
                    ("retry-after", "Sun, 06 Nov 1994 08:49:40 GMT"),
                    ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
                ],
                // The answer's Date counts, not the gateway's clock.
                date_ms + 3_600_000,
                Some(3_000),
            ),
            (
                &[("retry-after", "Sun, 06 Nov 1994 08:49:47 GMT")],
                date_ms,
                Some(10_000),
            ),
            (
                &[("retry-after", "Sun, 06 Nov 1994 08:49:30 GMT")],
                date_ms,
                Some(0),
            ),
            (
                &[("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT")],
                date_ms,
                Some(253_402_300_799_000 - 784_111_777_000),
            ),
            (&[("retry-after", "soon")], 0, None),
            (&[], 0, None),
        ];
        for (headers, now, want) in cases {
            assert_eq!(retry_after_ms(&h(headers), now), want, "{headers:?}");
        }
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A call that spans several heartbeat periods ends while the first
    /// lease extension is still waiting (here: for ever): the extension
    /// runs beside the call, not instead of it. A heartbeat that awaited
    /// each extension in place of the call would never let it end.
    #[tokio::test(start_paused = true)]
    async fn the_call_goes_on_while_a_lease_extension_waits() {
        let period = Duration::from_millis(100);
        let started = AtomicUsize::new(0);
        let call = async {
            for _ in 0..5 {
                tokio::time::sleep(period).await;
            }
            "answered"
        };
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            beside_heartbeat(call, period, || {
                started.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<bool>()
            }),
        )
        .await
        .expect("the call ended while the extension waited");
        assert_eq!(r, "answered");
        assert_eq!(started.load(Ordering::SeqCst), 1, "one extension began");
    }

    /// Extensions run every period while the call lasts, and stop once
    /// one answers that the lease is lost.
    #[tokio::test(start_paused = true)]
    async fn extensions_stop_once_the_lease_is_lost() {
        let period = Duration::from_millis(100);
        let beats = AtomicUsize::new(0);
        let call = tokio::time::sleep(period * 10);
        beside_heartbeat(call, period, || {
            let n = beats.fetch_add(1, Ordering::SeqCst) + 1;
            async move { n < 3 }
        })
        .await;
        assert_eq!(beats.load(Ordering::SeqCst), 3);
    }
}
