//! The headers of a forwarded call: hop-by-hop ones dropped (RFC 9110
//! §7.6.1), the caller's claims replaced by `X-Forwarded-*`, the trace
//! context and the route's credentials set.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::config::Route;

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

/// The caller's headers as forwarded: drops hop-by-hop headers, `Host`,
/// the gateway's own `Authorization`, the caller's `Idempotency-Key`, the
/// route's credential headers and its provider idempotency header, and any
/// `X-Forwarded-*`, `Forwarded` or `X-Real-IP` the caller sent, and the
/// caller's W3C `traceparent`/`tracestate` (each send sets its own, see
/// [`trace_context`]); adds
/// `X-Forwarded-For` (the peer the gateway saw), `-Host` and `-Proto`
/// (`proto`: the scheme the caller used on the gateway's listener, see
/// [`super::Inbound`]). On MCP routes `Accept-Encoding`
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::to_pairs;

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
}
