//! The proxy listener's replay decoding: a stored answer whose
//! `Content-Encoding` the duplicate doesn't accept is decoded before it
//! leaves the gateway (RFC 9110 §8.4, §12.5.3; see [`crate::encoding`]).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::{HeaderValue, header};

use crate::encoding::{accepts, decode};
use crate::state::AppState;

/// Marks an answer built from a stored response (a replay), as a response
/// extension: a provider's own `Idempotent-Replayed` header on a live,
/// streaming answer must not trigger buffering and decoding.
#[derive(Debug, Clone, Copy)]
pub struct StoredReplay;

/// Proxy-listener middleware: a replayed answer (marked [`StoredReplay`])
/// whose `Content-Encoding` the duplicate doesn't accept is decoded, off
/// the request threads (see the module docs). Other answers pass untouched
/// and unbuffered.
pub async fn decode_replays(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let accept = req
        .headers()
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let accept = (!accept.is_empty() || req.headers().contains_key(header::ACCEPT_ENCODING))
        .then_some(accept);
    let resp = next.run(req).await;
    if resp.extensions().get::<StoredReplay>().is_none() {
        return resp;
    }
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
    // A replayed body is the stored one, already in memory (and never
    // larger than the route's stored-response limit).
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(_) => return Response::from_parts(parts, Body::empty()),
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
