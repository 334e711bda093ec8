//! Building the outbound request: upstream URL, header hygiene, credential
//! injection, `X-Forwarded-*`.

use std::net::SocketAddr;

use axum::body::Body;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Uri};

use crate::config::Route;

pub use crate::egress::{HttpClient, OutboundBody, ResponseBody};

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

/// Fields a `Connection` option never removes: those that describe the
/// content for every recipient (RFC 9110 §7.6.1 forbids a sender to name
/// them: removed, the provider would read another request than the one
/// the ledger fingerprinted), and the `X-Request-Id` the gateway stamps on
/// every request it forwards.
const NOT_CONNECTION_OPTIONS: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-length",
    "x-request-id",
];

/// The field names `Connection` lists (lower case), but for
/// [`NOT_CONNECTION_OPTIONS`].
fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| !s.is_empty() && !NOT_CONNECTION_OPTIONS.contains(&s.as_str()))
        .collect()
}

/// Removes hop-by-hop headers from a response's headers in place.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed = connection_listed(headers);
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n, &listed))
        .cloned()
        .collect();
    for n in names {
        headers.remove(n);
    }
}

/// The upstream URI for `rest` (the path after the route prefix, starting
/// with `/`) and `query`.
///
/// Errors: [`BadUri`] (a 400 naming `path` to the caller) if the result is
/// not a valid URI.
pub fn upstream_uri(route: &Route, rest: &str, query: Option<&str>) -> Result<Uri, BadUri> {
    uri_from(route.upstream_base.as_ref(), &route.upstream, rest, query)
}

/// [`upstream_uri`] from the upstream's parts when there are some, else
/// from its whole URL.
fn uri_from(
    base: Option<&crate::config::UpstreamBase>,
    upstream: &url::Url,
    rest: &str,
    query: Option<&str>,
) -> Result<Uri, BadUri> {
    let Some(base) = base else {
        let base = upstream.as_str().trim_end_matches('/');
        return join(base, rest, query).parse().map_err(|_| BadUri);
    };
    let pq = http::uri::PathAndQuery::from_maybe_shared(bytes::Bytes::from(join(
        &base.path, rest, query,
    )))
    .map_err(|_| BadUri)?;
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(base.scheme.clone());
    parts.authority = Some(base.authority.clone());
    parts.path_and_query = Some(pq);
    Uri::from_parts(parts).map_err(|_| BadUri)
}

/// `base`, `rest` and `?query` in one string.
fn join(base: &str, rest: &str, query: Option<&str>) -> String {
    let mut s = String::with_capacity(base.len() + rest.len() + 1 + query.map_or(0, str::len));
    s.push_str(base);
    s.push_str(rest);
    if let Some(q) = query {
        s.push('?');
        s.push_str(q);
    }
    s
}

/// The route's upstream and the request's path and query don't make a
/// valid URI.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the request path is not a valid URI")]
pub struct BadUri;

/// The caller's headers as forwarded: drops hop-by-hop headers, `Host`,
/// the gateway's own `Authorization`, the caller's `Idempotency-Key`, the
/// route's credential headers and its provider idempotency header, and any
/// `X-Forwarded-*`, `Forwarded` or `X-Real-IP` the caller sent, and the
/// caller's W3C `traceparent`/`tracestate` (each send sets its own, see
/// [`trace_context`]); adds
/// `X-Forwarded-For` (the peer the gateway saw), `-Host` and `-Proto`
/// (`proto`: the scheme the caller used on the gateway's listener, see
/// [`Inbound`]). On MCP routes `Accept-Encoding`
/// is dropped too: the gateway reads those answers itself.
/// Effectful calls store this list in the ledger, so every attempt (also
/// one made by the reconciler) forwards the same headers.
pub fn caller_headers(
    route: &Route,
    incoming: &HeaderMap,
    peer: Option<SocketAddr>,
    proto: &'static str,
) -> HeaderMap {
    let mut out = incoming.clone();
    forward_headers(route, &mut out, peer, proto, false);
    out
}

/// [`caller_headers`] in place, on headers the caller no longer needs (a
/// pass-through call's own): the headers are not copied. With
/// `keep_trace_context` the caller's `traceparent` and `tracestate` stay
/// (a call forwarded while no span is exported passes them on unchanged).
pub fn forward_headers(
    route: &Route,
    headers: &mut HeaderMap,
    peer: Option<SocketAddr>,
    proto: &'static str,
    keep_trace_context: bool,
) {
    let listed = connection_listed(headers);
    let dropped = |name: &HeaderName| {
        is_hop_by_hop(name, &listed)
            || name == header::AUTHORIZATION
            || name.as_str() == crate::idempotency::IDEMPOTENCY_KEY
            || name.as_str().starts_with("x-forwarded-")
            || name == header::FORWARDED
            || name.as_str() == "x-real-ip"
            || route.inject_headers.iter().any(|(n, _)| n == name)
            || route.provider_idempotency_header.as_ref() == Some(name)
            || (route.mcp.is_some() && name == header::ACCEPT_ENCODING)
            || (!keep_trace_context
                && (name.as_str() == crate::telemetry::TRACEPARENT
                    || name.as_str() == crate::telemetry::TRACESTATE))
    };
    // The names to drop, on the stack for the usual few (`Authorization`
    // and little else); a name sent several times is dropped with all its
    // values.
    let names: smallvec::SmallVec<[HeaderName; 8]> =
        headers.keys().filter(|n| dropped(n)).cloned().collect();
    for name in names {
        headers.remove(name);
    }
    // `Host` names the gateway; the provider's is set by the outbound
    // client. The caller's X-Forwarded-*/Forwarded claims are not trusted:
    // the gateway states only the peer it saw.
    let host = headers.remove(header::HOST);
    if let Some(peer) = peer
        && let Some(v) = ip_value(peer.ip())
    {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST.clone(), host);
    }
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
}

/// A pass-through call's own headers made ready to forward, in place:
/// [`forward_headers`], the trace context of [`trace_context`] (the
/// span's when traces are exported, else the caller's, left where it is),
/// and the route's credentials ([`add_route_headers`]).
pub fn pass_through_headers(
    route: &Route,
    headers: &mut HeaderMap,
    peer: SocketAddr,
    proto: &'static str,
) {
    let traceparent = crate::telemetry::traceparent_header_of(&tracing::Span::current());
    forward_headers(route, headers, Some(peer), proto, traceparent.is_none());
    if let Some(v) = traceparent {
        headers.insert(TRACEPARENT.clone(), v);
    }
    add_route_headers(route, headers, None);
}

/// The names the gateway sets on every forwarded call, parsed once (a
/// name given as text is parsed and hashed on each use).
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static TRACEPARENT: HeaderName = HeaderName::from_static(crate::telemetry::TRACEPARENT);
static TRACESTATE: HeaderName = HeaderName::from_static(crate::telemetry::TRACESTATE);

/// `ip` as a header value (`192.0.2.1`, `2001:db8::1`), written without
/// an intermediate `String`; an IPv4 address digit by digit (the
/// formatting machinery cost a pass-through call 1,000 instructions).
fn ip_value(ip: std::net::IpAddr) -> Option<HeaderValue> {
    use std::io::Write;
    // The longest IPv6 text (an IPv4-mapped address in full) is 45 bytes.
    let mut buf = [0u8; 48];
    let len = match ip {
        std::net::IpAddr::V4(v4) => {
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + octet / 10 % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            n
        }
        std::net::IpAddr::V6(_) => {
            let mut w = &mut buf[..];
            write!(w, "{ip}").ok()?;
            48 - w.len()
        }
    };
    HeaderValue::from_bytes(&buf[..len]).ok()
}

/// Sets the W3C Trace Context of a call forwarded while its caller waits
/// (pass-through, MCP traffic outside the ledger): the current span's
/// context when traces are exported, else the caller's own `traceparent`
/// and `tracestate` unchanged (`incoming`).
pub fn trace_context(incoming: &HeaderMap, out: &mut HeaderMap) {
    match crate::telemetry::traceparent_header_of(&tracing::Span::current()) {
        Some(v) => {
            out.insert(TRACEPARENT.clone(), v);
        }
        None => {
            for name in [&TRACEPARENT, &TRACESTATE] {
                if let Some(v) = incoming.get(name) {
                    out.insert(name.clone(), v.clone());
                }
            }
        }
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

pub use crate::tls::chain_text;

/// Adds the route's injected credentials and, when given, the provider key
/// in the route's idempotency header.
pub fn add_route_headers(route: &Route, out: &mut HeaderMap, provider_key: Option<&str>) {
    for (name, value) in &route.inject_headers {
        out.insert(name.clone(), value.clone());
    }
    if let (Some(h), Some(k)) = (&route.provider_idempotency_header, provider_key)
        && let Ok(v) = HeaderValue::from_str(k)
    {
        out.insert(h.clone(), v);
    }
}

/// Writes `tenant` at `pointer` (a route's `tenant_scoped_field`, e.g.
/// `/metadata/tenant`) into an effectful request body, replacing whatever
/// the caller put there: a JSON object gets the field (intermediate objects
/// created), a form body (`application/x-www-form-urlencoded`) gets the
/// pair in bracket syntax (`metadata[tenant]=…`, other pairs kept in order).
///
/// Errors: a body that is neither a JSON object nor a form, or a JSON path
/// that runs into a non-object; the message names the pointer.
pub fn stamp_tenant(
    content_type: Option<&str>,
    body: &[u8],
    pointer: &str,
    tenant: &str,
) -> Result<Vec<u8>, String> {
    let segments: Vec<String> = pointer
        .split('/')
        .skip(1)
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect();
    let form = content_type.is_some_and(|c| {
        c.split(';').next().is_some_and(|m| {
            m.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
    });
    if form {
        let key = segments
            .iter()
            .enumerate()
            .map(|(i, s)| if i == 0 { s.clone() } else { format!("[{s}]") })
            .collect::<String>();
        let mut out = form_urlencoded::Serializer::new(String::new());
        for (k, v) in form_urlencoded::parse(body) {
            if k != key {
                out.append_pair(&k, &v);
            }
        }
        out.append_pair(&key, tenant);
        return Ok(out.finish().into_bytes());
    }
    let mut v: serde_json::Value = serde_json::from_slice(body).map_err(|_| {
        format!(
            "the route stamps the tenant at {pointer}: the body must be a JSON object or a form"
        )
    })?;
    let mut node = &mut v;
    for (i, seg) in segments.iter().enumerate() {
        let obj = node.as_object_mut().ok_or_else(|| {
            format!("the route stamps the tenant at {pointer}: the value on the way there is not an object")
        })?;
        if i == segments.len() - 1 {
            obj.insert(seg.clone(), serde_json::Value::String(tenant.to_owned()));
            break;
        }
        node = obj
            .entry(seg.clone())
            .or_insert_with(|| serde_json::json!({}));
    }
    serde_json::to_vec(&v).map_err(|e| e.to_string())
}

/// A header value as storable text, one `char` per byte (ISO-8859-1), so
/// that obs-text bytes (0x80–0xFF, RFC 9110 §5.5) survive the effect ledger.
/// Visible-ASCII values are stored unchanged.
pub fn value_text(v: &HeaderValue) -> String {
    v.as_bytes().iter().map(|&b| char::from(b)).collect()
}

/// The reverse of [`value_text`]. `None` when `s` holds a `char` above
/// U+00FF or a byte a header value can't hold (control characters).
pub fn text_value(s: &str) -> Option<HeaderValue> {
    let bytes: Vec<u8> = s
        .chars()
        .map(|c| u8::try_from(c).ok())
        .collect::<Option<_>>()?;
    HeaderValue::from_bytes(&bytes).ok()
}

/// Headers as a storable list of (name, value) pairs, in order, repeated
/// names kept. Values are encoded by [`value_text`], so no header is lost.
pub fn to_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(n, v)| (n.as_str().to_owned(), value_text(v)))
        .collect()
}

/// Headers whose values are visible ASCII, as (name, value) pairs: the view
/// a policy gets. Others are left out rather than guessed at.
pub fn visible_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect()
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

/// Header names whose values are credentials: shown as `[redacted]` in the
/// admin API and the console (stored as sent: a new attempt needs them).
pub const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "api-key",
    "x-auth-token",
    "x-amz-security-token",
    "x-csrf-token",
];

/// Words that make a header name a credential's wherever they stand in it
/// (`X-Client-Secret`, `X-Hub-Signature-256`, `X-Session-Id`): a header the
/// gateway can't tell apart is shown as `[redacted]` rather than shown.
pub const CREDENTIAL_WORDS: &[&str] = &[
    "secret",
    "token",
    "password",
    "api-key",
    "apikey",
    "private-key",
    "privatekey",
    "credential",
    "signature",
    "session",
    "auth",
];

/// Whether header `name` (lower case) carries a credential: one of
/// [`CREDENTIAL_HEADERS`], or a name with one of [`CREDENTIAL_WORDS`] in
/// it, `_` read as `-` (`api_key`, `X_Auth_Token`, `private_key`: names
/// with underscores are valid fields, RFC 9110 §5.1, and servers often
/// read them as the hyphenated ones).
pub fn is_credential(name: &str) -> bool {
    let hyphenated;
    let name = if name.contains('_') {
        hyphenated = name.replace('_', "-");
        hyphenated.as_str()
    } else {
        name
    };
    CREDENTIAL_HEADERS.contains(&name) || CREDENTIAL_WORDS.iter().any(|w| name.contains(w))
}

/// `pairs` with the values of credential headers ([`is_credential`])
/// replaced by `[redacted]`.
pub fn redacted(mut pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    for (n, v) in &mut pairs {
        if is_credential(&n.to_ascii_lowercase()) {
            *v = "[redacted]".into();
        }
    }
    pairs
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
    match tokio::time::timeout(timeout, route.client.request(req)).await {
        Err(_) => Err(format!(
            "no response head within {} ms",
            route.response_timeout_ms
        )),
        Ok(Err(e)) => Err(error_detail(&e)),
        Ok(Ok(r)) => {
            let (mut parts, body) = r.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Ok(http::Response::from_parts(parts, body))
        }
    }
}

/// The reverse of [`to_pairs`]. A pair that can't be a header (a name that
/// is not a token) is skipped.
pub fn from_pairs(pairs: &[(String, String)]) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(pairs.len());
    for (n, v) in pairs {
        if let (Ok(n), Some(v)) = (HeaderName::from_bytes(n.as_bytes()), text_value(v)) {
            h.append(n, v);
        }
    }
    h
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The first route of a config with `routes` (TOML) after a listener
    /// section.
    fn route_of(routes: &str) -> Route {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, format!("[listen]\nproxy = \"127.0.0.1:0\"\n{routes}")).unwrap();
        crate::config::load(Some(&p)).unwrap().routes.remove(0)
    }

    /// Filtered in place, a caller's headers lose every hop-by-hop name
    /// (also those its `Connection` lists, but for the content's own fields
    /// and `X-Request-Id`), `Host`, `Authorization`, its
    /// idempotency key, the route's credential and key headers, its
    /// forwarding claims and (unless kept) its trace context, with all
    /// their values, however many names go; the rest stay as sent, and the
    /// gateway's `X-Forwarded-*` are added. The same as the copy.
    #[test]
    fn forwarded_headers_are_filtered_in_place_as_in_a_copy() {
        // The injected value is read from the environment at load; any set
        // variable will do (its value is not looked at here).
        let route = route_of(
            "[[routes]]\nname = \"r\"\nprefix = \"/r/\"\nupstream = \"http://127.0.0.1:9\"\n\
             provider_idempotency_header = \"Idempotency-Key\"\n\
             [[routes.inject_headers]]\nname = \"x-api-key\"\nvalue_env = \"PATH\"\n",
        );
        let mut sent = HeaderMap::new();
        for (n, v) in [
            ("host", "gw.example"),
            ("authorization", "Bearer client"),
            (
                "connection",
                "keep-alive, x-drop-me, Content-Type, x-request-id",
            ),
            ("x-drop-me", "1"),
            ("content-type", "application/json"),
            ("x-request-id", "req-1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic a"),
            ("proxy-authorization", "Basic b"),
            ("idempotency-key", "k-1"),
            ("x-api-key", "caller's own"),
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-proto", "https"),
            ("forwarded", "for=203.0.113.9"),
            ("x-real-ip", "203.0.113.9"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "a=1"),
            ("accept", "application/json"),
            ("x-caller", "one"),
            ("x-caller", "two"),
        ] {
            sent.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let peer: SocketAddr = "192.0.2.7:4000".parse().unwrap();
        let copy = caller_headers(&route, &sent, Some(peer), "http");
        for keep_trace in [false, true] {
            let mut h = sent.clone();
            forward_headers(&route, &mut h, Some(peer), "http", keep_trace);
            let mut got = to_pairs(&h);
            got.sort();
            let mut want = vec![
                ("accept".to_owned(), "application/json".to_owned()),
                // Named in `Connection`, yet kept: the content's type and
                // the gateway's request id are never connection options.
                ("content-type".into(), "application/json".into()),
                ("x-request-id".into(), "req-1".into()),
                ("x-caller".into(), "one".into()),
                ("x-caller".into(), "two".into()),
                ("x-forwarded-for".into(), "192.0.2.7".into()),
                ("x-forwarded-host".into(), "gw.example".into()),
                ("x-forwarded-proto".into(), "http".into()),
            ];
            if keep_trace {
                want.push((
                    "traceparent".into(),
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                ));
                want.push(("tracestate".into(), "a=1".into()));
            } else {
                assert_eq!(h, copy);
            }
            want.sort();
            assert_eq!(got, want, "keep_trace_context {keep_trace}");
        }
    }

    /// A call's URI put together from the upstream's parts is the one
    /// parsed from the whole text, for ports, base paths, user info, IPv6
    /// hosts and queries.
    #[test]
    fn upstream_parts_give_the_uri_the_whole_url_gives() {
        for upstream in [
            "http://127.0.0.1:9090",
            "http://provider.example/",
            "https://provider.example/api/v2/",
            "http://user:pw@h.example:1/x",
            "http://[::1]:8080/base",
        ] {
            let url = url::Url::parse(upstream).unwrap();
            let base = crate::config::UpstreamBase::of(&url).expect(upstream);
            for (rest, query) in [
                ("/v1/charges", None),
                ("/", Some("a=1&b=%20")),
                ("/v1/x%2Fy", Some("")),
            ] {
                let whole = uri_from(None, &url, rest, query).unwrap();
                let parts = uri_from(Some(&base), &url, rest, query).unwrap();
                assert_eq!(parts, whole, "{upstream} {rest} {query:?}");
                assert_eq!(parts.to_string(), whole.to_string());
            }
        }
        let bad = url::Url::parse("http://h.example/").unwrap();
        let base = crate::config::UpstreamBase::of(&bad).unwrap();
        assert!(uri_from(Some(&base), &bad, "/a b", None).is_err());
        assert!(uri_from(None, &bad, "/a b", None).is_err());
    }

    /// `X-Forwarded-For` is the peer's address as text, for both families
    /// and the longest IPv6 form.
    #[test]
    fn the_peer_address_becomes_its_header_value() {
        for (ip, text) in [
            ("192.0.2.1", "192.0.2.1"),
            ("2001:db8::1", "2001:db8::1"),
            (
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            ),
            ("::ffff:255.255.255.255", "::ffff:255.255.255.255"),
        ] {
            let v = ip_value(ip.parse().unwrap()).unwrap();
            assert_eq!(v.to_str().unwrap(), text);
        }
        // IPv4 is written digit by digit: it reads as `Display` does for
        // every octet value in every position.
        for o in 0..=255u8 {
            for ip in [
                std::net::Ipv4Addr::new(o, 0, 9, 255),
                std::net::Ipv4Addr::new(10, o, 100, 1),
                std::net::Ipv4Addr::new(99, 250, o, 0),
                std::net::Ipv4Addr::new(0, 1, 200, o),
            ] {
                let v = ip_value(ip.into()).unwrap();
                assert_eq!(v.to_str().unwrap(), ip.to_string());
            }
        }
    }

    #[test]
    fn the_tenant_is_stamped_into_json_and_form_bodies() {
        let j = stamp_tenant(
            Some("application/json"),
            br#"{"amount":1,"metadata":{"tenant":"forged","order":"7"}}"#,
            "/metadata/tenant",
            "a",
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(
            v["metadata"],
            serde_json::json!({"order": "7", "tenant": "a"})
        );
        let j = stamp_tenant(None, br#"{"amount":1}"#, "/metadata/tenant", "a").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(v["metadata"]["tenant"], "a");
        let f = stamp_tenant(
            Some("application/x-www-form-urlencoded; charset=utf-8"),
            b"amount=1&metadata%5Btenant%5D=forged&metadata[order]=7",
            "/metadata/tenant",
            "a b",
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(f).unwrap(),
            "amount=1&metadata%5Border%5D=7&metadata%5Btenant%5D=a+b"
        );
        assert!(stamp_tenant(None, b"[1]", "/metadata/tenant", "a").is_err());
        assert!(stamp_tenant(None, br#"{"metadata":3}"#, "/metadata/tenant", "a").is_err());
        assert!(stamp_tenant(None, b"not json", "/t", "a").is_err());
    }

    /// Credential names are recognised with `_` for `-` too; other names
    /// are shown.
    #[test]
    fn credential_headers_are_redacted_whatever_their_separator() {
        let pairs = |names: &[&str]| {
            names
                .iter()
                .map(|n| ((*n).to_owned(), "s3cret".to_owned()))
                .collect::<Vec<_>>()
        };
        for name in [
            "api_key",
            "Api_Key",
            "x_api_key",
            "X-Api-Key",
            "apikey",
            "x_auth_token",
            "client_secret",
            "Proxy_Authorization",
            "private_key",
            "X-Signature",
            "Stripe-Signature",
            "X-Hub-Signature-256",
            "X-Client-Credential",
            "X-Session-Id",
            "X-Auth-User",
        ] {
            assert_eq!(redacted(pairs(&[name]))[0].1, "[redacted]", "{name}");
        }
        for name in [
            "content_type",
            "x-request-id",
            "idempotency_key",
            "traceparent",
            "x-forwarded-for",
            "user-agent",
        ] {
            assert_eq!(redacted(pairs(&[name]))[0].1, "s3cret", "{name}");
        }
    }

    #[test]
    fn stored_header_values_keep_every_byte() {
        let mut h = HeaderMap::new();
        h.append(
            "x-note",
            HeaderValue::from_bytes("café".as_bytes()).unwrap(),
        );
        h.append("x-note", HeaderValue::from_static("second"));
        h.append(
            "x-raw",
            HeaderValue::from_bytes(&[b'a', 0xff, b'b']).unwrap(),
        );
        let pairs = to_pairs(&h);
        assert_eq!(pairs.len(), 3);
        assert_eq!(pairs[1], ("x-note".to_owned(), "second".to_owned()));
        let back = from_pairs(&pairs);
        assert_eq!(back, h);
        let notes: Vec<&[u8]> = back
            .get_all("x-note")
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        assert_eq!(notes, vec!["café".as_bytes(), b"second".as_slice()]);
        // A policy only sees the visible-ASCII values.
        assert_eq!(
            visible_pairs(&h),
            vec![("x-note".to_owned(), "second".to_owned())]
        );
        // Text that no header value can hold is refused, not mangled.
        assert!(text_value("snow ☃").is_none());
        assert!(text_value("a\u{0}b").is_none());
    }
}
