//! The observability layers of both listeners, in one place:
//!
//! 1. `Authorization`, cookies and the other credential headers
//!    ([`crate::forward::CREDENTIAL_HEADERS`]) are marked sensitive, so no
//!    layer below logs their values ([`mark_sensitive`]);
//! 2. an `x-request-id` the caller sent is kept when it is 1–128 visible
//!    ASCII characters, and replaced otherwise; a UUID v4 is generated
//!    when there is none, and returned on every answer, problem bodies
//!    included ([`RequestIds`]);
//! 3. `tower_http`'s `TraceLayer`: one span per request (`HTTP request` in the logs, named
//!    `{method} {route}` in traces, kind server), the caller's W3C
//!    `traceparent` as its parent; the answer's status is recorded on it;
//! 4. the request's id and trace id are made available to the use cases
//!    (the attempts they record and the log lines they write carry them:
//!    [`crate::telemetry::RequestContext`]).

use std::time::Duration;

use axum::extract::Request;
use http::{HeaderName, HeaderValue};
use tower::ServiceBuilder;

use crate::http::listener::App;
use tower_http::request_id::RequestId;
use tower_http::trace::TraceLayer;

/// Longest `x-request-id` kept from a caller, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

static X_REQUEST_ID: HeaderName = HeaderName::from_static(crate::config::REQUEST_ID_HEADER);

/// Wraps `inner` (the service of the `listener` named `proxy` or
/// `admin`) in the layers of the module docs. The answer's body is the
/// trace layer's wrapper of `inner`'s.
pub fn observe<S>(inner: S, listener: &'static str) -> impl App
where
    S: App<Body = axum::body::Body>,
{
    ServiceBuilder::new()
        .map_request(mark_sensitive)
        .layer(tower::layer::layer_fn(|inner| RequestIds { inner }))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(move |req: &Request| request_span(req, listener))
                .on_request(())
                .on_response(record_response)
                .on_body_chunk(())
                .on_eos(())
                .on_failure(()),
        )
        .layer(tower::layer::layer_fn(|inner| ScopeRequest { inner }))
        .service(inner)
}

/// Marks the credential headers ([`crate::forward::CREDENTIAL_HEADERS`])
/// sensitive, so that no layer below logs their values: one pass over the
/// request's headers, comparing names (a lookup per credential name, as
/// `tower_http::sensitive_headers` does, hashes each of them on every
/// call).
fn mark_sensitive(mut req: Request) -> Request {
    for (name, value) in req.headers_mut().iter_mut() {
        if crate::forward::CREDENTIAL_HEADERS.contains(&name.as_str()) {
            value.set_sensitive(true);
        }
    }
    req
}

/// Whether `v` is an acceptable caller request id: 1–128 bytes of visible
/// ASCII (no spaces, no control characters).
pub fn valid_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_REQUEST_ID_BYTES && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// The request id of a request: the caller's `x-request-id` when it sent
/// exactly one that [`valid_request_id`] accepts, else a new UUID v4 (RFC
/// 9562 §5.4) that replaces whatever it sent. The request carries it in
/// its header and as a [`RequestId`] extension, and the answer in its
/// header (unless the answer set its own). One layer for what
/// `tower_http`'s `SetRequestId` and `PropagateRequestId` do, without
/// their second lookups and the answer's extension.
#[derive(Debug, Clone)]
struct RequestIds<S> {
    inner: S,
}

impl<S, B> tower::Service<Request> for RequestIds<S>
where
    S: tower::Service<Request, Response = http::Response<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = StampRequestId<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let id = request_id_of(req.headers_mut());
        req.extensions_mut().insert(RequestId::new(id.clone()));
        StampRequestId {
            inner: self.inner.call(req),
            id: Some(id),
        }
    }
}

/// The request id of `headers` (see [`RequestIds`]), set in them.
fn request_id_of(headers: &mut http::HeaderMap) -> HeaderValue {
    let kept = {
        let mut all = headers.get_all(&X_REQUEST_ID).iter();
        match (all.next(), all.next()) {
            (Some(v), None) if valid_request_id(v) => Some(v.clone()),
            _ => None,
        }
    };
    kept.unwrap_or_else(|| {
        let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let text = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut buf);
        let id = HeaderValue::from_str(text).expect("a UUID is a header value");
        headers.insert(X_REQUEST_ID.clone(), id.clone());
        id
    })
}

pin_project_lite::pin_project! {
    /// The future of [`RequestIds`]: the inner answer with the request id.
    struct StampRequestId<F> {
        #[pin]
        inner: F,
        id: Option<HeaderValue>,
    }
}

impl<F, B, E> std::future::Future for StampRequestId<F>
where
    F: std::future::Future<Output = Result<http::Response<B>, E>>,
{
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let mut resp = std::task::ready!(this.inner.poll(cx))?;
        if let Some(id) = this.id.take()
            && let http::header::Entry::Vacant(e) = resp.headers_mut().entry(&X_REQUEST_ID)
        {
            e.insert(id);
        }
        std::task::Poll::Ready(Ok(resp))
    }
}

fn request_span(req: &Request, listener: &'static str) -> tracing::Span {
    let request_id = req
        .extensions()
        .get::<RequestId>()
        .and_then(|r| r.header_value().to_str().ok())
        .unwrap_or("");
    let method = req.method().as_str();
    let span = tracing::info_span!(
        "HTTP request",
        otel.name = method,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = method,
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        url.path = req.uri().path(),
        url.scheme = crate::forward::Inbound::scheme_of(req.extensions()),
        network.protocol.version = protocol_version(req.version()),
        effectgate.listener = listener,
        request_id,
        effectgate.tenant = tracing::field::Empty,
        effectgate.route = tracing::field::Empty,
        effectgate.operation_id = tracing::field::Empty,
        effectgate.state = tracing::field::Empty,
        effectgate.fence = tracing::field::Empty,
    );
    crate::telemetry::set_parent_from(&span, req.headers());
    span
}

/// `network.protocol.version` as the OpenTelemetry HTTP semantic
/// conventions spell it (`1.1`, `2`), a static string (no allocation).
fn protocol_version(v: http::Version) -> &'static str {
    match v {
        http::Version::HTTP_09 => "0.9",
        http::Version::HTTP_10 => "1.0",
        http::Version::HTTP_2 => "2",
        http::Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

fn record_response<B>(res: &http::Response<B>, _latency: Duration, span: &tracing::Span) {
    let status = res.status().as_u16();
    span.record("http.response.status_code", status);
    // A server span is an error for 5xx only (OpenTelemetry HTTP semantic
    // conventions, "Status").
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// Serves each request in its [`crate::telemetry::RequestContext`]: its
/// request id and trace id (of the request span, a child of the caller's
/// `traceparent`, when spans are exported; else the caller's; worked out
/// when a log line first asks). The request id is also an attribute of the
/// span; the trace id is the span's own. (A service of its own rather than
/// `axum::middleware::from_fn`, which boxes the inner service and the
/// future of every request.)
#[derive(Debug, Clone)]
struct ScopeRequest<S> {
    inner: S,
}

impl<S> tower::Service<Request> for ScopeRequest<S>
where
    S: tower::Service<Request>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = crate::telemetry::WithRequest<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let id = req
            .extensions()
            .get::<RequestId>()
            .and_then(|r| r.header_value().to_str().ok())
            .map(std::sync::Arc::<str>::from);
        // Called inside the request span (the trace layer enters it).
        let context = std::sync::Arc::new(crate::telemetry::RequestContext::of_request(
            id,
            &tracing::Span::current(),
            req.headers(),
        ));
        // The inner service's `call` runs in the context too, not only its
        // future.
        let future = crate::telemetry::in_request(Some(context.clone()), || self.inner.call(req));
        crate::telemetry::with_request(Some(context), future)
    }
}

/// Records the matched route on the current request span: `http.route` (the
/// route's prefix), `effectgate.route`, and the span name `{method} {prefix}`
/// (`otel.name`).
///
/// Call it before anything reads the span's OpenTelemetry context (the
/// trace id of a log line, the `traceparent` of a forwarded call): that
/// starts the exported span, which keeps the name it started with. Until
/// then the fields go into the span's builder, the cheapest place.
pub fn record_route(method: &http::Method, name: &str, prefix: &str) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    span.record("http.route", prefix);
    span.record("effectgate.route", name);
    span.record(
        "otel.name",
        tracing::field::display(format_args!("{method} {prefix}")),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller's one valid id is kept as it is; a missing, invalid or
    /// repeated one is replaced by one new UUID v4, set in the headers.
    #[test]
    fn a_request_keeps_its_callers_id_or_gets_a_new_one() {
        let mut h = http::HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("caller-1"));
        assert_eq!(request_id_of(&mut h), "caller-1");
        assert_eq!(h.get_all(&X_REQUEST_ID).iter().count(), 1);
        for sent in [&[][..], &["has space"][..], &["a", "b"][..]] {
            let mut h = http::HeaderMap::new();
            for v in sent {
                h.append(&X_REQUEST_ID, HeaderValue::from_str(v).unwrap());
            }
            let id = request_id_of(&mut h);
            let all: Vec<_> = h.get_all(&X_REQUEST_ID).iter().collect();
            assert_eq!(all, [&id], "{sent:?}");
            let uuid = uuid::Uuid::parse_str(id.to_str().unwrap()).unwrap();
            assert_eq!(uuid.get_version_num(), 4);
            assert_eq!(id.len(), 36);
        }
    }

    #[test]
    fn request_ids_from_callers() {
        for ok in [
            "a",
            "req-123",
            &"x".repeat(128),
            "0f2b6c1e-7d1a-4b7e-9f3a-1c2d3e4f5a6b",
        ] {
            assert!(
                valid_request_id(&HeaderValue::from_str(ok).unwrap()),
                "{ok}"
            );
        }
        for bad in ["", "has space", &"x".repeat(129)] {
            assert!(
                !valid_request_id(&HeaderValue::from_str(bad).unwrap()),
                "{bad:?}"
            );
        }
        assert!(!valid_request_id(
            &HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()
        ));
    }
}
