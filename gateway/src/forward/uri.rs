//! The provider's URL of a forwarded call: the route's upstream joined
//! with the path after the route's prefix and the query.

use http::Uri;

use crate::config::Route;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
