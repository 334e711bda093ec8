//! Request bodies read whole, for the proxy's effectful calls and the
//! admin API: bounded by size and time (RFC 9112 §6.3), and decoded from
//! their `Content-Encoding` (RFC 9110 §8.4) before anything fingerprints,
//! checks or stores them.

use axum::body::Body;
use bytes::Bytes;
use http::header;

use crate::ops::OpError;

/// What a 413 of a proxied body names as its limit.
pub(crate) const ROUTE_BODY_LIMIT: &str = "the route's max_body_bytes";

/// Step 4: the whole body, at most `max_bytes` (the value of `setting`,
/// which a 413 names), within `timeout_ms`.
///
/// Errors: 413 `payload-too-large` (by `Content-Length` at once, or while
/// reading); 408 `request-timeout` when the body stalls; 400 `bad-request`
/// naming `body` when it can't be read whole (shorter than its
/// `Content-Length`, a malformed or cut-off chunk: RFC 9112 §6.3, §7.1).
pub(crate) async fn read_body(
    headers: &http::HeaderMap,
    body: Body,
    max_bytes: usize,
    setting: &'static str,
    timeout_ms: u64,
) -> Result<Bytes, OpError> {
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        && len > max_bytes
    {
        return Err(OpError::PayloadTooLarge {
            limit: max_bytes,
            setting,
            decoded_from: None,
        });
    }
    tokio::time::timeout(
        std::time::Duration::from_millis(timeout_ms),
        axum::body::to_bytes(body, max_bytes),
    )
    .await
    .map_err(|_| OpError::RequestTimeout {
        limit_ms: timeout_ms,
    })?
    .map_err(|e| {
        if exceeds_limit(&e) {
            OpError::PayloadTooLarge {
                limit: max_bytes,
                setting,
                decoded_from: None,
            }
        } else {
            OpError::BadRequest {
                field: "body".into(),
                message: format!("the request body could not be read whole: {e}"),
            }
        }
    })
}

/// Headers that carry a digest of a body as sent (RFC 9530
/// `Content-Digest` and `Repr-Digest`, RFC 3230 `Digest`, RFC 1864
/// `Content-MD5`): dropped when the body is decoded.
const DIGEST_HEADERS: [&str; 4] = ["content-digest", "repr-digest", "digest", "content-md5"];

/// Decodes an effectful request's body sent with a `Content-Encoding`
/// (gzip, deflate, br; RFC 9110 §8.4) into at most `max_bytes` (the
/// route's `max_body_bytes`, which bounds the decoded body as well as the
/// encoded one), off the request threads, and drops the header (and the
/// digests of the encoded bytes, [`DIGEST_HEADERS`]): what is
/// fingerprinted, checked, stored and forwarded is the decoded body. A
/// body without a coding (or `identity`) is returned as it came.
///
/// Errors: 415 `unsupported-content-encoding` for another coding (with
/// `Accept-Encoding` listing the ones read, §12.5.3); 413
/// `payload-too-large` when the decoded body is over `max_bytes`; 400
/// `bad-request` naming `body` when the data isn't valid for its coding,
/// and `header:Content-Encoding` for more than
/// [`crate::encoding::MAX_CODINGS`] codings.
pub(crate) async fn decode_body(
    headers: &mut http::HeaderMap,
    body: Bytes,
    max_bytes: usize,
) -> Result<Bytes, OpError> {
    use crate::encoding::DecodeError;
    if !headers.contains_key(header::CONTENT_ENCODING) {
        return Ok(body);
    }
    let codings = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()))
        .collect::<Vec<_>>()
        .join(",");
    if codings
        .split(',')
        .all(|c| c.trim().is_empty() || c.trim().eq_ignore_ascii_case("identity"))
    {
        headers.remove(header::CONTENT_ENCODING);
        return Ok(body);
    }
    let c = codings.clone();
    let decoded =
        tokio::task::spawn_blocking(move || crate::encoding::decode(&c, &body, max_bytes))
            .await
            .map_err(|e| OpError::Internal(format!("decoding the request body: {e}")))?;
    match decoded {
        Ok(d) => {
            headers.remove(header::CONTENT_ENCODING);
            headers.remove(header::CONTENT_LENGTH);
            // Digests of the encoded bytes (RFC 9530 §2, §3; RFC 3230;
            // RFC 1864) don't hold for the decoded body.
            for name in DIGEST_HEADERS {
                headers.remove(name);
            }
            Ok(Bytes::from(d))
        }
        Err(DecodeError::UnknownCoding(coding)) => {
            Err(OpError::UnsupportedContentEncoding { coding })
        }
        Err(DecodeError::OverLimit { limit }) => Err(OpError::PayloadTooLarge {
            limit,
            setting: ROUTE_BODY_LIMIT,
            decoded_from: Some(codings),
        }),
        Err(e @ DecodeError::Corrupt { .. }) => Err(OpError::BadRequest {
            field: "body".into(),
            message: format!("the request body can't be decoded: {e}"),
        }),
        Err(e @ DecodeError::TooManyCodings) => Err(OpError::BadRequest {
            field: "header:Content-Encoding".into(),
            message: e.to_string(),
        }),
    }
}

/// Whether reading a body failed because it passed the limit
/// (`http_body_util::LengthLimitError` somewhere in its sources), rather
/// than because it was malformed or cut off.
fn exceeds_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over the limit is a 413; a body whose stream fails is a 400 naming
    /// `body`.
    #[tokio::test]
    async fn a_body_over_the_limit_is_413_and_a_broken_one_400() {
        let none = http::HeaderMap::new();
        let big = Body::from(vec![b'x'; 11]);
        let e = read_body(&none, big, 10, ROUTE_BODY_LIMIT, 5_000)
            .await
            .unwrap_err();
        assert!(
            matches!(e, OpError::PayloadTooLarge { limit: 10, .. }),
            "{e:?}"
        );
        let broken = Body::from_stream(futures_util::stream::iter([
            Ok::<_, std::io::Error>(Bytes::from_static(b"{\"a\"")),
            Err(std::io::Error::other(
                "connection closed before the body ended",
            )),
        ]));
        let e = read_body(&none, broken, 10, ROUTE_BODY_LIMIT, 5_000)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, OpError::BadRequest { field, .. } if field == "body"),
            "{e:?}"
        );
        let whole = Body::from("{}");
        assert_eq!(
            read_body(&none, whole, 10, ROUTE_BODY_LIMIT, 5_000)
                .await
                .unwrap(),
            "{}"
        );
    }
}
