//! The proxy listener's replay decoding: a stored answer whose
//! `Content-Encoding` the duplicate doesn't accept is decoded before it
//! leaves the gateway (RFC 9110 §8.4, §12.5.3; see [`crate::encoding`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::{HeaderValue, header};

use crate::encoding::{accepts, decode};
use crate::state::AppState;

/// Marks an answer built from a stored response (a replay), as a response
/// extension: a provider's own `Idempotent-Replayed` header on a live,
/// streaming answer must not trigger buffering and decoding.
#[derive(Debug, Clone, Copy)]
pub struct StoredReplay;

/// Proxy-listener layer: a replayed answer (marked [`StoredReplay`])
/// whose `Content-Encoding` the duplicate doesn't accept is decoded, off
/// the request threads (see the module docs). Other answers pass untouched
/// and unbuffered, without a future or a service of their own on the heap.
#[derive(Clone)]
pub struct DecodeReplaysLayer {
    app: AppState,
}

impl DecodeReplaysLayer {
    /// The layer, reading `limits.max_decoded_replay_bytes` from `app`'s
    /// settings in force when a replay is decoded.
    pub fn new(app: AppState) -> Self {
        Self { app }
    }
}

impl<S> tower::Layer<S> for DecodeReplaysLayer {
    type Service = DecodeReplays<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DecodeReplays {
            inner,
            app: self.app.clone(),
        }
    }
}

/// The service of [`DecodeReplaysLayer`].
#[derive(Clone)]
pub struct DecodeReplays<S> {
    inner: S,
    app: AppState,
}

impl<S> tower::Service<Request> for DecodeReplays<S>
where
    S: tower::Service<Request, Response = Response>,
    S::Future: Unpin,
{
    type Response = Response;
    type Error = S::Error;
    type Future = DecodeFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let accept = accepted_codings(req.headers());
        DecodeFuture {
            inner: self.inner.call(req),
            caller: Some((self.app.clone(), accept)),
            decoding: None,
        }
    }
}

/// The future of [`DecodeReplays`]: the inner service's answer, or, for a
/// replay to decode, the decoding's.
pub struct DecodeFuture<F> {
    inner: F,
    /// The settings and the caller's `Accept-Encoding` (`None`: none sent),
    /// until the inner answer arrives.
    caller: Option<(AppState, Option<String>)>,
    decoding: Option<Pin<Box<dyn Future<Output = Response> + Send>>>,
}

impl<F, E> Future for DecodeFuture<F>
where
    F: Future<Output = Result<Response, E>> + Unpin,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            if let Some(d) = this.decoding.as_mut() {
                return d.as_mut().poll(cx).map(Ok);
            }
            let resp = std::task::ready!(Pin::new(&mut this.inner).poll(cx))?;
            let Some((app, accept)) = this.caller.take() else {
                return Poll::Ready(Ok(resp));
            };
            if resp.extensions().get::<StoredReplay>().is_none() {
                return Poll::Ready(Ok(resp));
            }
            this.decoding = Some(Box::pin(decode_replay(app, accept, resp)));
        }
    }
}

/// The caller's accepted codings, its `Accept-Encoding` fields joined
/// with `,` (`None`: it sent none).
fn accepted_codings(headers: &http::HeaderMap) -> Option<String> {
    if !headers.contains_key(header::ACCEPT_ENCODING) {
        return None;
    }
    Some(
        headers
            .get_all(header::ACCEPT_ENCODING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// A stored answer `resp`, decoded when the caller (`accept`) doesn't
/// accept its codings; as it is otherwise.
async fn decode_replay(app: AppState, accept: Option<String>, resp: Response) -> Response {
    let codings = resp
        .headers()
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    if codings.is_empty() {
        return resp;
    }
    if codings.split(',').all(|c| accepts(accept.as_deref(), c)) {
        return resp;
    }
    let limit = app.settings().limits.max_decoded_replay_bytes;
    let (mut parts, body) = resp.into_parts();
    // A replayed body is the stored one, already in memory: it is taken
    // whole, whatever its size (the limit is on the decoded size; a
    // stored body may be larger than it).
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "a replayed body could not be read");
            return Response::from_parts(parts, Body::empty());
        }
    };
    let (c, b) = (codings.clone(), bytes.clone());
    let decoded = tokio::task::spawn_blocking(move || decode(&c, &b, limit))
        .await
        .unwrap_or_else(|e| {
            Err(crate::encoding::DecodeError::Corrupt {
                coding: codings.clone(),
                detail: e.to_string(),
            })
        });
    match decoded {
        Ok(decoded) => {
            parts.headers.remove(header::CONTENT_ENCODING);
            parts.headers.remove(header::CONTENT_LENGTH);
            // Another representation: a strong validator of the encoded one
            // doesn't hold for it (RFC 9110 §8.8.3).
            if let Some(etag) = parts.headers.get(header::ETAG)
                && !etag.as_bytes().starts_with(b"W/")
                && let Ok(weak) = HeaderValue::from_bytes(&[b"W/", etag.as_bytes()].concat())
            {
                parts.headers.insert(header::ETAG, weak);
            }
            let varies = parts
                .headers
                .get_all(header::VARY)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .any(|v| {
                    let v = v.trim();
                    v == "*" || v.eq_ignore_ascii_case("accept-encoding")
                });
            if !varies {
                parts
                    .headers
                    .append(header::VARY, HeaderValue::from_static("accept-encoding"));
            }
            Response::from_parts(parts, Body::from(decoded))
        }
        Err(e) => {
            let e = match e {
                crate::encoding::DecodeError::OverLimit { limit } => format!(
                    "the decoded body is over limits.max_decoded_replay_bytes ({limit} bytes)"
                ),
                e => e.to_string(),
            };
            tracing::warn!(error = %e, codings = %codings, "a replayed body could not be decoded; sent as stored");
            Response::from_parts(parts, Body::from(bytes))
        }
    }
}
