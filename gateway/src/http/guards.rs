//! Request guards of the proxy listener, one concern per layer, applied
//! before any handler runs (see [`crate::http::proxy::service`]):
//!
//! Each is a check of the request head alone, run as a [`Refuse`] layer: a
//! refused request is answered at once, any other goes to the inner
//! service unchanged (no future or boxed service of the guard's own).
//!
//! - [`refuse_methods`]: TRACE would echo injected credentials back and
//!   CONNECT would tunnel; both are 405 (RFC 9110 §9.3.6, §9.3.8). A
//!   standard method spelt in another case (`post`) is another method to
//!   the gateway (RFC 9110 §9.1: method names are case-sensitive) but may
//!   be the same one to a provider that compares them case-insensitively,
//!   so it would skip the ledger there: 400 naming `method`. So is a method
//!   override header (`X-HTTP-Method-Override` and its kin), which asks a
//!   provider to run another method than the one the gateway judged (also
//!   spelt with `_` for `-`, which CGI-style servers read as the same); and
//!   so is an HTTP/1.1 request without exactly one `Host` (RFC 9112 §3.2),
//!   which a provider behind a virtual host would read as another site's;
//! - [`limit_header_bytes`]: the request head is bounded by
//!   `limits.max_header_bytes` (431, RFC 6585 §5);
//! - [`refuse_dot_segments`]: dot segments and encoded separators would walk
//!   out of an upstream's base path (400 naming `path`; RFC 3986 §5.2.4).

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures_util::future::Either;
use http::{HeaderMap, Method};

use crate::ops::OpError;
use crate::state::AppState;

/// A guard layer's service: answers a request that `check` refuses with
/// the refusal (a problem+json answer, [`OpError`]), and passes every
/// other one to `inner`. Make one with [`refuse`].
#[derive(Debug, Clone)]
pub struct Refuse<S, F> {
    inner: S,
    check: F,
}

/// The layer of the guard `check` (a request's refusal, if any).
pub fn refuse<S, F>(check: F) -> impl tower::Layer<S, Service = Refuse<S, F>> + Clone
where
    F: Fn(&Request) -> Option<OpError> + Clone,
{
    tower::layer::layer_fn(move |inner| Refuse {
        inner,
        check: check.clone(),
    })
}

impl<S, F> tower::Service<Request> for Refuse<S, F>
where
    S: tower::Service<Request, Response = Response>,
    F: Fn(&Request) -> Option<OpError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        match (self.check)(&req) {
            Some(e) => Either::Left(std::future::ready(Ok(e.into_response()))),
            None => Either::Right(self.inner.call(req)),
        }
    }
}

/// 405 for TRACE and CONNECT, 400 for another spelling of a standard
/// method, a method override header, or an HTTP/1.1 request without one
/// `Host` ([`host_refusal`]), 501 for a transfer coding other than
/// `chunked` ([`transfer_coding_refusal`]); every other request passes.
pub fn refuse_methods(req: &Request) -> Option<OpError> {
    method_refusal(req.method())
        .or_else(|| override_refusal(req.headers()))
        .or_else(|| host_refusal(req.version(), req.headers()))
        .or_else(|| transfer_coding_refusal(req.headers()))
}

/// The refusal (501) of a request whose `Transfer-Encoding` names a coding
/// other than `chunked` (RFC 9112 §6.1). The HTTP/1 parser takes `gzip,
/// chunked` as chunked and hands on the gzip bytes as the body, which
/// would be fingerprinted and forwarded as if they were the content.
pub fn transfer_coding_refusal(headers: &HeaderMap) -> Option<OpError> {
    headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|c| String::from_utf8_lossy(c.trim_ascii()).to_ascii_lowercase())
        .find(|c| !c.is_empty() && c != "chunked")
        .map(|coding| OpError::TransferCodingNotImplemented { coding })
}

/// Methods whose other spellings are refused.
const STANDARD_METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// Headers that ask a provider to run another method than the request's.
const METHOD_OVERRIDES: &[&str] = &[
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// The refusal of `method`, if it is never forwarded.
pub fn method_refusal(method: &Method) -> Option<OpError> {
    if method == Method::TRACE || method == Method::CONNECT {
        return Some(OpError::MethodNotAllowed(format!(
            "{method} is never forwarded"
        )));
    }
    if !method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return None;
    }
    let upper = method.as_str().to_ascii_uppercase();
    (upper != method.as_str() && STANDARD_METHODS.contains(&upper.as_str())).then(|| {
        OpError::BadRequest {
            field: "method".into(),
            message: format!(
                "{method:?} is not {upper}: method names are case-sensitive (RFC 9110 §9.1); send {upper}"
            ),
        }
    })
}

/// The refusal of a request without exactly one `Host`: an HTTP/1.1
/// request must have one and any request at most one (RFC 9112 §3.2; an
/// HTTP/2 request names its authority in `:authority` instead, and HTTP/1.0
/// needs none).
pub fn host_refusal(version: http::Version, headers: &HeaderMap) -> Option<OpError> {
    let mut hosts = headers.get_all(http::header::HOST).iter();
    let message = match (hosts.next(), hosts.next()) {
        (None, _) if version == http::Version::HTTP_11 => {
            "an HTTP/1.1 request must have a Host header (RFC 9112 §3.2)"
        }
        (Some(_), Some(_)) => "a request must have at most one Host header (RFC 9112 §3.2)",
        _ => return None,
    };
    Some(OpError::BadRequest {
        field: "header:Host".into(),
        message: message.into(),
    })
}

/// Whether header name `name` (lowercase, as `http` keeps them) is
/// `lower`, with `_` taken for `-`: CGI, WSGI and PHP servers map both
/// to the same variable (`HTTP_X_HTTP_METHOD_OVERRIDE`).
fn same_name(name: &str, lower: &str) -> bool {
    name.len() == lower.len()
        && name
            .bytes()
            .zip(lower.bytes())
            .all(|(n, l)| n == l || (n == b'_' && l == b'-'))
}

/// The refusal of a request that carries a method override header, in any
/// spelling with `_` for `-` (one pass over the request's header names: a
/// lookup per override name would hash each of them on every call).
pub fn override_refusal(headers: &HeaderMap) -> Option<OpError> {
    headers
        .keys()
        .find(|n| METHOD_OVERRIDES.iter().any(|o| same_name(n.as_str(), o)))
        .map(|h| OpError::BadRequest {
            field: format!("header:{h}"),
            message: "method override headers are not forwarded: send the method itself".into(),
        })
}

/// 431 when the request's headers (names, values and 4 bytes of framing
/// each) exceed `limits.max_header_bytes` (of the settings in force when
/// the request arrives).
pub fn limit_header_bytes(app: &AppState, req: &Request) -> Option<OpError> {
    header_refusal(req.headers(), app.settings().limits.max_header_bytes)
}

/// The refusal of `headers` past `limit` bytes, if any.
pub fn header_refusal(headers: &HeaderMap, limit: usize) -> Option<OpError> {
    let bytes: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    (bytes > limit).then_some(OpError::HeadersTooLarge { limit })
}

/// 400 naming `path` for a path with a `.` or `..` segment, or an encoded
/// dot, slash or backslash, or a backslash.
pub fn refuse_dot_segments(req: &Request) -> Option<OpError> {
    path_refusal(req.uri().path())
}

/// The refusal of `path`, if it could leave the route's base path
/// ([`crate::config::leaves_base_path`]).
pub fn path_refusal(path: &str) -> Option<OpError> {
    crate::config::leaves_base_path(path).then(|| OpError::BadRequest {
        field: "path".into(),
        message: "dot segments and encoded separators are not allowed in paths".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn trace_and_connect_are_refused_others_pass() {
        for m in [Method::TRACE, Method::CONNECT] {
            let e = method_refusal(&m).expect("refused");
            assert_eq!(e.kind(), "method-not-allowed");
        }
        for m in [Method::GET, Method::POST, Method::DELETE, Method::PATCH] {
            assert!(method_refusal(&m).is_none(), "{m}");
        }
    }

    #[test]
    fn other_spellings_of_standard_methods_and_overrides_are_refused() {
        for m in ["post", "Post", "PoSt", "delete", "patch"] {
            let m = Method::from_bytes(m.as_bytes()).unwrap();
            let e = method_refusal(&m).unwrap_or_else(|| panic!("{m} passed"));
            assert!(matches!(e, OpError::BadRequest { ref field, .. } if field == "method"));
        }
        // An extension method is its own.
        assert!(method_refusal(&Method::from_bytes(b"purge").unwrap()).is_none());
        let mut h = HeaderMap::new();
        assert!(override_refusal(&h).is_none());
        h.insert("x-http-method-override", HeaderValue::from_static("POST"));
        let e = override_refusal(&h).expect("refused");
        assert!(
            matches!(e, OpError::BadRequest { ref field, .. } if field == "header:x-http-method-override")
        );
        for spelt in [
            "x_http_method_override",
            "x-http_method",
            "X_METHOD_OVERRIDE",
        ] {
            let mut h = HeaderMap::new();
            h.insert(
                http::HeaderName::from_bytes(spelt.as_bytes()).unwrap(),
                HeaderValue::from_static("POST"),
            );
            let e = override_refusal(&h).unwrap_or_else(|| panic!("{spelt} passed"));
            let want = format!("header:{}", spelt.to_ascii_lowercase());
            assert!(matches!(e, OpError::BadRequest { ref field, .. } if *field == want));
        }
        // A name that only resembles one passes.
        let mut h = HeaderMap::new();
        h.insert("x-http-method-overrides", HeaderValue::from_static("POST"));
        h.insert("x-http-methodxoverride", HeaderValue::from_static("POST"));
        assert!(override_refusal(&h).is_none());
    }

    #[test]
    fn transfer_codings_other_than_chunked_are_refused() {
        let refused = |v: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in v {
                h.append(http::header::TRANSFER_ENCODING, HeaderValue::from_static(v));
            }
            transfer_coding_refusal(&h).map(|e| match e {
                OpError::TransferCodingNotImplemented { coding } => coding,
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(refused(&[]), None);
        assert_eq!(refused(&["chunked"]), None);
        assert_eq!(refused(&["Chunked"]), None);
        assert_eq!(refused(&["gzip, chunked"]).as_deref(), Some("gzip"));
        assert_eq!(refused(&["GZIP", "chunked"]).as_deref(), Some("gzip"));
        assert_eq!(
            refused(&["chunked , x-custom"]).as_deref(),
            Some("x-custom")
        );
    }

    #[test]
    fn an_http_1_1_request_needs_exactly_one_host() {
        use http::Version;
        let mut h = HeaderMap::new();
        assert!(matches!(
            host_refusal(Version::HTTP_11, &h),
            Some(OpError::BadRequest { field, .. }) if field == "header:Host"
        ));
        assert!(host_refusal(Version::HTTP_10, &h).is_none());
        assert!(host_refusal(Version::HTTP_2, &h).is_none());
        h.insert(http::header::HOST, "gateway".parse().unwrap());
        assert!(host_refusal(Version::HTTP_11, &h).is_none());
        h.append(http::header::HOST, "other".parse().unwrap());
        for v in [Version::HTTP_10, Version::HTTP_11, Version::HTTP_2] {
            assert!(host_refusal(v, &h).is_some(), "{v:?}");
        }
    }

    #[test]
    fn header_bytes_count_names_values_and_framing() {
        let mut h = HeaderMap::new();
        h.insert("x-a", HeaderValue::from_static("12345")); // 3 + 5 + 4 = 12
        assert!(header_refusal(&h, 12).is_none());
        let e = header_refusal(&h, 11).expect("refused");
        assert!(matches!(e, OpError::HeadersTooLarge { limit: 11 }));
    }

    #[test]
    fn dot_segments_and_encoded_separators_are_refused() {
        for p in [
            "/pay/../admin",
            "/pay/./x",
            "/pay/v1/%2e%2e/x",
            "/pay/v1/%2E/x",
            "/pay/v1/a%2Fb",
            "/pay/v1/a%5cb",
            "/pay/v1/a\\b",
            "/pay/..;/x",
            "/pay/.;x/y",
            "/pay/v1/a%00b",
        ] {
            let e = path_refusal(p).unwrap_or_else(|| panic!("{p} passed"));
            assert!(matches!(e, OpError::BadRequest { ref field, .. } if field == "path"));
        }
        for p in ["/pay/v1/charges", "/pay/v1/a.b/c", "/pay/v1/..x", "/"] {
            assert!(path_refusal(p).is_none(), "{p}");
        }
    }

    /// The check as it was written first: each segment lowercased, then
    /// searched.
    fn path_refusal_by_segments(path: &str) -> bool {
        path.split('/').any(|seg| {
            let s = seg.to_ascii_lowercase();
            let bare = s.split(';').next().unwrap_or("");
            bare == "."
                || bare == ".."
                || s.contains("%00")
                || s.contains("%2e")
                || s.contains("%2f")
                || s.contains("%5c")
                || s.contains('\\')
        })
    }

    proptest::proptest! {
        #[test]
        fn path_refusal_reads_as_the_segment_by_segment_check(
            path in "[/.;%25eEfFcC0a\\\\]{0,12}"
        ) {
            proptest::prop_assert_eq!(
                path_refusal(&path).is_some(),
                path_refusal_by_segments(&path),
                "{:?}", path
            );
        }
    }
}
