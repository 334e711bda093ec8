//! Building and sending the outbound request: the provider's URL
//! ([`uri`]), header hygiene and credentials ([`headers`]), headers as
//! stored text ([`pairs`]) and their redaction ([`redact`]), the tenant
//! stamped into a body ([`stamp`]), and the send itself.

use std::net::SocketAddr;

use axum::body::Body;
use http::{HeaderMap, Method, Uri};

use crate::config::Route;

mod headers;
mod pairs;
mod redact;
mod stamp;
mod uri;

pub use crate::egress::{HttpClient, OutboundBody, ResponseBody};
pub use crate::tls::chain_text;
pub use headers::{
    add_route_headers, caller_headers, forward_headers, is_hop_by_hop, pass_through_headers,
    strip_hop_by_hop, trace_context,
};
pub use pairs::{from_pairs, text_value, to_pairs, value_text, visible_pairs};
pub use redact::{CREDENTIAL_HEADERS, CREDENTIAL_WORDS, is_credential, redacted};
pub use stamp::stamp_tenant;
pub use uri::{BadUri, upstream_uri};

/// How a request reached the gateway: the peer address the listener saw
/// and the scheme the caller used on it (`"http"` or `"https"`). Set by the
/// listener on every request, as one extension; the peer feeds
/// `X-Forwarded-For`, the scheme `X-Forwarded-Proto` and the console
/// cookie's `Secure` attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inbound {
    /// The peer's address.
    pub peer: SocketAddr,
    /// `"http"` or `"https"`.
    pub scheme: &'static str,
}

impl Inbound {
    /// How the request with extensions `ext` came in; `None` when it didn't
    /// come through the gateway's listener (as in unit tests).
    pub fn of(ext: &http::Extensions) -> Option<Inbound> {
        ext.get::<Inbound>().copied()
    }

    /// The scheme of the listener a request came in on (`"http"` when the
    /// request didn't come through the gateway's listener).
    pub fn scheme_of(ext: &http::Extensions) -> &'static str {
        ext.get::<Inbound>().map_or("http", |i| i.scheme)
    }
}

/// What went wrong on an outbound call, for a problem detail and the
/// ledger: the TLS handshake's reason when there is one (unknown issuer,
/// name mismatch, expired; see [`crate::tls::handshake_reason`]), else
/// the error with its causes, `: `-separated.
pub fn error_detail(e: &(dyn std::error::Error + 'static)) -> String {
    if let Some(reason) = crate::tls::handshake_reason(e) {
        return reason;
    }
    chain_text(e)
}

/// Why [`read_whole`] returned no body.
#[derive(Debug, thiserror::Error)]
pub enum ReadWholeError {
    /// More than the limit was read, bytes (a declared `Content-Length` is
    /// not trusted either way).
    #[error("the answer was larger than {0} bytes")]
    TooLarge(usize),
    /// The body did not end within the time given.
    #[error("the answer did not complete in time")]
    Timeout,
    /// The body broke off (the connection's error).
    #[error("the answer broke off: {0}")]
    Broken(String),
}

/// Reads a provider's body whole, at most `limit` bytes and within
/// `timeout`, for answers the gateway reads itself (MCP): a larger or
/// slower body is an error, never read on without bound.
///
/// Errors: [`ReadWholeError`].
pub async fn read_whole(
    body: ResponseBody,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<bytes::Bytes, ReadWholeError> {
    use http_body_util::BodyExt;
    match tokio::time::timeout(timeout, http_body_util::Limited::new(body, limit).collect()).await {
        Err(_) => Err(ReadWholeError::Timeout),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ReadWholeError::TooLarge(limit))
        }
        Ok(Err(e)) => Err(ReadWholeError::Broken(e.to_string())),
    }
}

/// Sends `req` on `route`'s client and waits at most the route's
/// `response_timeout_ms` for the response head; hop-by-hop headers are
/// stripped from it. The body is not read.
///
/// Errors: the provider unreachable or silent, as the text a problem's
/// `detail` and the ledger show ([`error_detail`]).
pub async fn send(
    route: &Route,
    req: http::Request<OutboundBody>,
) -> Result<http::Response<ResponseBody>, String> {
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    send_within(route, req, timeout).await.map_err(|e| e.detail)
}

/// Why [`send_within`] got no response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendError {
    /// What went wrong, for a problem's `detail` ([`error_detail`]).
    pub detail: String,
    /// The time given ran out (else the exchange failed).
    pub timed_out: bool,
    /// Nothing of the request left the gateway (the connection or its
    /// handshake failed before it was written).
    pub nothing_sent: bool,
}

/// [`send`], waiting at most `timeout` for the response head: what is left
/// of the route's `response_timeout_ms` when part of it went before the
/// send (a pass-through body's first bytes). The error names the route's
/// whole limit.
///
/// Errors: [`SendError`].
pub async fn send_within(
    route: &Route,
    req: http::Request<OutboundBody>,
    timeout: std::time::Duration,
) -> Result<http::Response<ResponseBody>, SendError> {
    match tokio::time::timeout(timeout, route.client.request(req)).await {
        Err(_) => Err(SendError {
            detail: format!("no response head within {} ms", route.response_timeout_ms),
            timed_out: true,
            nothing_sent: false,
        }),
        Ok(Err(e)) => Err(SendError {
            detail: error_detail(&e),
            timed_out: false,
            // A TLS 1.3 provider refuses a client certificate after the
            // handshake, before it reads the request.
            nothing_sent: e.is_connect() || crate::tls::refused_in_handshake(&e),
        }),
        Ok(Ok(r)) => {
            let (mut parts, body) = r.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Ok(http::Response::from_parts(parts, body))
        }
    }
}

/// A request ready to send.
pub fn build_request(
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> http::Request<Body> {
    let mut req = http::Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}
