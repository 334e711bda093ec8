//! Building the outbound request: upstream URL, header hygiene, credential
//! injection, `X-Forwarded-*`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::Route;
use crate::error::ApiError;

/// The outbound HTTP client of one route (its connect timeout is per route).
pub type HttpClient = Client<HttpConnector, Body>;

/// Builds the client for a route: HTTP/1.1, pooled, `connect_timeout_ms`.
pub fn client_for(route: &Route) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_millis(route.connect_timeout_ms)));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus proxy credentials; never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` is hop-by-hop (including names listed in `Connection`).
pub fn is_hop_by_hop(name: &HeaderName, connection_listed: &[String]) -> bool {
    HOP_BY_HOP.contains(&name.as_str()) || connection_listed.iter().any(|c| c == name.as_str())
}

fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| !s.is_empty())
        .collect()
}

/// Removes hop-by-hop headers from a response's headers in place.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed = connection_listed(headers);
    let names: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n, &listed)).cloned().collect();
    for n in names {
        headers.remove(n);
    }
}

/// The upstream URI for `rest` (the path after the route prefix, starting
/// with `/`) and `query`.
///
/// Errors: 400 if the result is not a valid URI.
pub fn upstream_uri(route: &Route, rest: &str, query: Option<&str>) -> Result<Uri, ApiError> {
    let base = route.upstream.as_str().trim_end_matches('/');
    let mut s = String::with_capacity(base.len() + rest.len() + 1 + query.map_or(0, str::len));
    s.push_str(base);
    s.push_str(rest);
    if let Some(q) = query {
        s.push('?');
        s.push_str(q);
    }
    s.parse().map_err(|_| ApiError::BadRequest { field: "path".into(), message: "the request path is not a valid URI".into() })
}

/// Builds outbound headers from the caller's: drops hop-by-hop headers,
/// `Host`, the gateway's own `Authorization`, the caller's
/// `Idempotency-Key` and the route's credential headers; adds
/// `X-Forwarded-For/Host/Proto`, the injected credentials and, when given,
/// the provider key in the route's idempotency header.
pub fn outbound_headers(
    route: &Route,
    incoming: &HeaderMap,
    peer: Option<SocketAddr>,
    provider_key: Option<&str>,
) -> HeaderMap {
    let listed = connection_listed(incoming);
    let mut out = HeaderMap::with_capacity(incoming.len() + 4);
    for (name, value) in incoming {
        if is_hop_by_hop(name, &listed)
            || name == header::HOST
            || name == header::AUTHORIZATION
            || name.as_str() == crate::idempotency::IDEMPOTENCY_KEY
            || name.as_str().starts_with("x-forwarded-")
            || route.inject_headers.iter().any(|(n, _)| n == name)
            || route.provider_idempotency_header.as_ref() == Some(name)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if let Some(peer) = peer {
        let prior = incoming.get("x-forwarded-for").and_then(|v| v.to_str().ok());
        let xff = match prior {
            Some(p) => format!("{p}, {}", peer.ip()),
            None => peer.ip().to_string(),
        };
        if let Ok(v) = HeaderValue::from_str(&xff) {
            out.insert("x-forwarded-for", v);
        }
    }
    if let Some(host) = incoming.get(header::HOST) {
        out.insert("x-forwarded-host", host.clone());
    }
    out.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    for (name, value) in &route.inject_headers {
        out.insert(name.clone(), value.clone());
    }
    if let (Some(h), Some(k)) = (&route.provider_idempotency_header, provider_key)
        && let Ok(v) = HeaderValue::from_str(k)
    {
        out.insert(h.clone(), v);
    }
    out
}

/// A request ready to send.
pub fn build_request(method: Method, uri: Uri, headers: HeaderMap, body: Body) -> http::Request<Body> {
    let mut req = http::Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}
