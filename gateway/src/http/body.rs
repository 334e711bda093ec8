//! Request bodies read whole, for the proxy's effectful calls and the
//! admin API: bounded by size and time (RFC 9112 §6.3), and decoded from
//! their `Content-Encoding` (RFC 9110 §8.4) before anything fingerprints,
//! checks or stores them.

use axum::body::Body;
use bytes::Bytes;
use http::header;
use http_body::Frame;

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

/// The largest declared pass-through body whose first frame
/// [`with_first_frame`] reads before the request goes out: 64 KiB.
pub(crate) const LEAD_MAX_BYTES: u64 = 64 * 1024;

/// A pass-through request body of a declared length (`Content-Length`)
/// from 1 byte to [`LEAD_MAX_BYTES`], with its first frame read here, in
/// the caller's connection task, before the provider's connection task
/// takes the request. Such a body usually arrived with its head, and is
/// then whole in that one frame: the provider's connection writes head and
/// body at once, with no hand-off back to the caller's task to fetch the
/// body. Anything else (a longer body, a chunked one, none) is returned as
/// it came; the rest of a longer first frame streams as before.
///
/// Errors: 408 `request-timeout` naming `body` when no byte of it arrives
/// within `timeout_ms` (the route's `response_timeout_ms`, which bounds a
/// pass-through body's wait in all); 400 `bad-request` naming `body` when
/// it can't be read (the connection closed before its declared length,
/// RFC 9112 §6.3). Nothing has been sent to the provider either way.
///
/// Returns the body, and whether it is whole in what was read (then it
/// can't break off or stall any more).
pub(crate) async fn with_first_frame(
    mut body: Body,
    timeout_ms: u64,
) -> Result<(Body, bool), OpError> {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    if !matches!(body.size_hint().exact(), Some(n) if n > 0 && n <= LEAD_MAX_BYTES) {
        return Ok((body, false));
    }
    let first = tokio::time::timeout(std::time::Duration::from_millis(timeout_ms), body.frame())
        .await
        .map_err(|_| OpError::RequestTimeout {
            limit_ms: timeout_ms,
        })?;
    match first {
        None => Ok((body, true)),
        Some(Err(e)) => Err(OpError::BadRequest {
            field: "body".into(),
            message: format!("the request body could not be read: {e}"),
        }),
        Some(Ok(frame)) => Ok(match frame.into_data() {
            Ok(data) if body.is_end_stream() => (Body::from(data), true),
            Ok(data) => (
                Body::new(Lead {
                    first: Some(Frame::data(data)),
                    rest: body,
                }),
                false,
            ),
            Err(frame) => (
                Body::new(Lead {
                    first: Some(frame),
                    rest: body,
                }),
                false,
            ),
        }),
    }
}

/// How a caller's streamed body ended, as [`watched`] saw it: shared
/// between the body (polled by the provider's connection) and the
/// request's handler, which reads it when the send failed.
#[derive(Debug, Clone, Default)]
pub(crate) struct BodyEnd(std::sync::Arc<std::sync::atomic::AtomicU8>);

impl BodyEnd {
    const WHOLE: u8 = 1;
    const BROKEN: u8 = 2;

    fn set(&self, to: u8) {
        self.0.store(to, std::sync::atomic::Ordering::Relaxed);
    }

    /// The body was read to its end.
    pub(crate) fn whole(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) == Self::WHOLE
    }

    /// The body broke off: the caller closed the connection before its
    /// declared length, or sent a malformed chunk (RFC 9112 §6.3, §7.1).
    pub(crate) fn broken(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) == Self::BROKEN
    }
}

/// `body` as it streams on, with what tells how it ended: so that a failed
/// send can tell the caller's fault (a body that broke off or stalled)
/// from the provider's.
pub(crate) fn watched(body: Body) -> (Body, BodyEnd) {
    let end = BodyEnd::default();
    let body = Body::new(Watched {
        inner: body,
        end: end.clone(),
    });
    (body, end)
}

/// A body that records its end in a [`BodyEnd`].
struct Watched {
    inner: Body,
    end: BodyEnd,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => self.end.set(BodyEnd::WHOLE),
            std::task::Poll::Ready(Some(Err(_))) => self.end.set(BodyEnd::BROKEN),
            std::task::Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => {
                self.end.set(BodyEnd::WHOLE);
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A body whose first frame was read ahead ([`with_first_frame`]),
/// followed by the rest as it streams.
struct Lead {
    first: Option<Frame<Bytes>>,
    rest: Body,
}

impl http_body::Body for Lead {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(frame) = self.first.take() {
            return std::task::Poll::Ready(Some(Ok(frame)));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(data) = self.first.as_ref().and_then(Frame::data_ref) {
            let n = data.len() as u64;
            // The upper bound first: a lower one above it would panic.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper + n);
            }
            hint.set_lower(hint.lower() + n);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A body of `frames` with an exact size hint (what is left of the
    /// data), as a declared `Content-Length` gives; counts its polls, and
    /// stays pending for ever once its frames are gone unless it `ends`.
    struct Frames {
        frames: VecDeque<Frame<Bytes>>,
        left: u64,
        ends: bool,
        polls: Arc<AtomicUsize>,
    }

    impl Frames {
        fn new(frames: Vec<Frame<Bytes>>, ends: bool) -> (Self, Arc<AtomicUsize>) {
            let left = frames
                .iter()
                .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
                .sum();
            let polls = Arc::new(AtomicUsize::new(0));
            let body = Frames {
                frames: frames.into(),
                left,
                ends,
                polls: polls.clone(),
            };
            (body, polls)
        }
    }

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            match self.frames.pop_front() {
                Some(f) => {
                    if let Some(d) = f.data_ref() {
                        self.left -= d.len() as u64;
                    }
                    std::task::Poll::Ready(Some(Ok(f)))
                }
                None if self.ends => std::task::Poll::Ready(None),
                None => std::task::Poll::Pending,
            }
        }

        fn is_end_stream(&self) -> bool {
            self.ends && self.frames.is_empty()
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.left)
        }
    }

    fn data(s: &str) -> Frame<Bytes> {
        Frame::data(Bytes::copy_from_slice(s.as_bytes()))
    }

    /// A small body read ahead keeps its exact length, every byte in
    /// order, and its trailers; a whole one becomes one buffer; a longer
    /// body is not touched.
    #[tokio::test]
    async fn a_small_body_is_read_ahead_whole_and_in_order() {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-sum", http::HeaderValue::from_static("10"));
        let (parts, polls) = Frames::new(
            vec![data("abcd"), data("efghij"), Frame::trailers(trailers)],
            true,
        );
        let (body, whole) = with_first_frame(Body::new(parts), 1000).await.unwrap();
        assert!(!whole);
        assert_eq!(polls.load(Ordering::Relaxed), 1, "only the first frame");
        assert_eq!(body.size_hint().exact(), Some(10));
        let all = body.collect().await.unwrap();
        assert_eq!(all.trailers().and_then(|t| t.get("x-sum")).unwrap(), "10");
        assert_eq!(all.to_bytes(), "abcdefghij");

        // Whole in its first frame: one buffer, and the caller's body is
        // not polled again.
        let (whole, polls) = Frames::new(vec![data("0123456789")], true);
        let (body, whole) = with_first_frame(Body::new(whole), 1000).await.unwrap();
        assert!(whole);
        assert_eq!(body.size_hint().exact(), Some(10));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "0123456789");
        assert_eq!(polls.load(Ordering::Relaxed), 1);

        let big = "x".repeat(64 * 1024 + 1);
        let (long, polls) = Frames::new(vec![data(&big)], true);
        let (body, whole) = with_first_frame(Body::new(long), 1000).await.unwrap();
        assert!(!whole);
        assert_eq!(polls.load(Ordering::Relaxed), 0, "not read ahead");
        assert_eq!(body.collect().await.unwrap().to_bytes().len(), big.len());
    }

    /// A small body whose first bytes don't come within the limit is a 408
    /// naming the limit.
    #[tokio::test(start_paused = true)]
    async fn a_small_body_that_never_starts_is_a_408() {
        let (stalled, _) = Frames::new(vec![], false);
        let mut stalled = stalled;
        stalled.left = 10;
        match with_first_frame(Body::new(stalled), 50).await {
            Err(OpError::RequestTimeout { limit_ms: 50 }) => {}
            other => panic!("expected a 408, got {other:?}"),
        }
    }

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
