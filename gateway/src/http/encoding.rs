//! The proxy listener's replay decoding: a stored answer whose
//! `Content-Encoding` the duplicate doesn't accept is decoded before it
//! leaves the gateway (RFC 9110 §8.4, §12.5.3; see [`crate::encoding`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
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
    turns: Arc<Turns>,
}

impl DecodeReplaysLayer {
    /// The layer, reading `limits.max_decoded_replay_bytes` from `app`'s
    /// settings in force when a replay is decoded, and
    /// `limits.max_concurrent_replay_decodes` from those in force now.
    pub fn new(app: AppState) -> Self {
        let at_once = app.settings().limits.max_concurrent_replay_decodes;
        Self {
            app,
            turns: Arc::new(Turns::new(at_once)),
        }
    }
}

impl<S> tower::Layer<S> for DecodeReplaysLayer {
    type Service = DecodeReplays<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DecodeReplays {
            inner,
            app: self.app.clone(),
            turns: self.turns.clone(),
        }
    }
}

/// The service of [`DecodeReplaysLayer`].
#[derive(Clone)]
pub struct DecodeReplays<S> {
    inner: S,
    app: AppState,
    turns: Arc<Turns>,
}

/// Most stored bodies [`Turns`] remembers as undecodable; past it the
/// list starts over.
const REMEMBERED_UNDECODABLE: usize = 1024;

/// Largest stored body (bytes) whose key [`decode_replay`] hashes on the
/// request thread; a larger one is hashed on a blocking thread.
const HASHED_INLINE: usize = 64 * 1024;

/// What bounds the decoding of replays: at most so many at once (each may
/// hold about twice `limits.max_decoded_replay_bytes` while it decodes;
/// a turn is held to the decoding's end, even when its caller hung up),
/// and the stored bodies that did not decode within the limit (or were
/// corrupt), remembered by a keyed hash of their codings, bytes and the
/// limit, so that their later duplicates are replayed as stored without
/// another try. A body decoded within the limit is held by its answer
/// until sent, outside the turns.
pub struct Turns {
    at_once: Arc<tokio::sync::Semaphore>,
    undecodable: std::sync::Mutex<std::collections::HashSet<u64>>,
    hasher: std::hash::RandomState,
    /// Decodings started, for tests.
    started: std::sync::atomic::AtomicU64,
}

impl Turns {
    /// `at_once` decodings at a time (at least 1).
    pub fn new(at_once: usize) -> Self {
        Self {
            at_once: Arc::new(tokio::sync::Semaphore::new(at_once.max(1))),
            undecodable: std::sync::Mutex::default(),
            hasher: std::hash::RandomState::new(),
            started: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The key of a body with `codings` decoded to at most `limit` bytes
    /// (a body over one limit may decode within a larger one).
    fn key(&self, codings: &str, body: &[u8], limit: usize) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one((codings, body, limit))
    }

    fn undecodable(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<u64>> {
        self.undecodable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_undecodable(&self, key: u64) -> bool {
        self.undecodable().contains(&key)
    }

    fn remember_undecodable(&self, key: u64) {
        let mut set = self.undecodable();
        if set.len() >= REMEMBERED_UNDECODABLE {
            set.clear();
        }
        set.insert(key);
    }

    /// Decodings started so far.
    pub fn started(&self) -> u64 {
        self.started.load(std::sync::atomic::Ordering::Relaxed)
    }
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
            caller: Some((self.app.clone(), self.turns.clone(), accept)),
            decoding: None,
        }
    }
}

/// The future of [`DecodeReplays`]: the inner service's answer, or, for a
/// replay to decode, the decoding's.
pub struct DecodeFuture<F> {
    inner: F,
    /// The settings, the decodings' bounds and the caller's
    /// `Accept-Encoding` (`None`: none sent), until the inner answer
    /// arrives.
    caller: Option<(AppState, Arc<Turns>, Option<String>)>,
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
            let Some((app, turns, accept)) = this.caller.take() else {
                return Poll::Ready(Ok(resp));
            };
            if resp.extensions().get::<StoredReplay>().is_none() {
                return Poll::Ready(Ok(resp));
            }
            let limit = app.settings().limits.max_decoded_replay_bytes;
            this.decoding = Some(Box::pin(decode_replay(turns, limit, accept, resp)));
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

/// A stored answer `resp`, decoded (to at most `limit` bytes, in one of
/// the `turns`) when the caller (`accept`) doesn't accept its codings; as
/// it is otherwise, or when it doesn't decode.
pub async fn decode_replay(
    turns: Arc<Turns>,
    limit: usize,
    accept: Option<String>,
    resp: Response,
) -> Response {
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
    let known = "a replayed body that did not decode before; sent as stored";
    // A body known not to decode is sent as stored at once, without
    // waiting for a turn behind other decodings. A large body is hashed
    // off the request threads.
    let key = if bytes.len() <= HASHED_INLINE {
        turns.key(&codings, &bytes, limit)
    } else {
        let (t, c, b) = (turns.clone(), codings.clone(), bytes.clone());
        match tokio::task::spawn_blocking(move || t.key(&c, &b, limit)).await {
            Ok(key) => key,
            Err(e) => {
                tracing::warn!(error = %e, "a replayed body could not be hashed; sent as stored");
                return Response::from_parts(parts, Body::from(bytes));
            }
        }
    };
    if turns.is_undecodable(key) {
        tracing::debug!(codings = %codings, "{known}");
        return Response::from_parts(parts, Body::from(bytes));
    }
    let Ok(turn) = turns.at_once.clone().acquire_owned().await else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    // The turn and the body's verdict go with the decoding, which runs on
    // to its end even when this caller hangs up meanwhile. The verdict is
    // looked up again: a decoding that ended while this one waited for
    // its turn may have found the body undecodable.
    let (t, c, b) = (turns.clone(), codings.clone(), bytes.clone());
    let decoded = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        if t.is_undecodable(key) {
            return None;
        }
        t.started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let decoded = decode(&c, &b, limit);
        if decoded.is_err() {
            t.remember_undecodable(key);
        }
        Some(decoded)
    })
    .await;
    let decoded = match decoded {
        Ok(Some(d)) => d,
        Ok(None) => {
            tracing::debug!(codings = %codings, "{known}");
            return Response::from_parts(parts, Body::from(bytes));
        }
        Err(e) => Err(crate::encoding::DecodeError::Corrupt {
            coding: codings.clone(),
            detail: e.to_string(),
        }),
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `data` gzipped.
    fn gzip(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn stored(body: Vec<u8>) -> Response {
        let mut r = Response::new(Body::from(body));
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r
    }

    /// Duplicates of a stored compression bomb, all at once with one turn:
    /// one decoding starts, and every duplicate gets the body as stored,
    /// with its `Content-Encoding`; a later one starts none. A body that
    /// decodes within the limit is decoded for each duplicate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_does_not_decode_is_tried_once_a_turn_at_a_time() {
        const LIMIT: usize = 1 << 20;
        let bomb = gzip(&vec![0u8; 8 * LIMIT]);
        let turns = Arc::new(Turns::new(1));
        let duplicates: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn(decode_replay(
                    turns.clone(),
                    LIMIT,
                    None,
                    stored(bomb.clone()),
                ))
            })
            .collect();
        for d in duplicates {
            let r = d.await.unwrap();
            assert_eq!(r.headers()[header::CONTENT_ENCODING], "gzip");
            let body = axum::body::to_bytes(r.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(body, bomb);
        }
        assert_eq!(turns.started(), 1);
        let r = decode_replay(turns.clone(), LIMIT, None, stored(bomb.clone())).await;
        assert_eq!(r.headers()[header::CONTENT_ENCODING], "gzip");
        assert_eq!(turns.started(), 1);

        let small = gzip(br#"{"id":"ch_1"}"#);
        for n in 2..=3 {
            let r = decode_replay(turns.clone(), LIMIT, None, stored(small.clone())).await;
            assert_eq!(r.headers().get(header::CONTENT_ENCODING), None);
            let body = axum::body::to_bytes(r.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(&body[..], br#"{"id":"ch_1"}"#);
            assert_eq!(turns.started(), n);
        }
    }
    /// A duplicate of a body known not to decode is sent as stored while
    /// every turn is taken, small (hashed inline) or large (hashed on a
    /// blocking thread); one not yet known waits for a turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_known_not_to_decode_waits_for_no_turn() {
        const LIMIT: usize = 1 << 20;
        let bomb = gzip(&vec![0u8; 8 * LIMIT]);
        assert!(bomb.len() <= HASHED_INLINE);
        let corrupt: Vec<u8> = (0..4 * HASHED_INLINE as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let turns = Arc::new(Turns::new(1));
        for body in [&bomb, &corrupt] {
            let r = decode_replay(turns.clone(), LIMIT, None, stored(body.clone())).await;
            assert_eq!(r.headers()[header::CONTENT_ENCODING], "gzip");
        }
        assert_eq!(turns.started(), 2);

        let held = turns.at_once.clone().acquire_owned().await.unwrap();
        let bound = std::time::Duration::from_secs(30);
        for body in [&bomb, &corrupt] {
            let r = tokio::time::timeout(
                bound,
                decode_replay(turns.clone(), LIMIT, None, stored(body.clone())),
            )
            .await
            .expect("a known undecodable body waited for a turn");
            assert_eq!(r.headers()[header::CONTENT_ENCODING], "gzip");
            let got = axum::body::to_bytes(r.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(&got[..], &body[..]);
        }
        assert_eq!(turns.started(), 2);

        let other = gzip(b"not seen before");
        let waiting = tokio::spawn(decode_replay(turns.clone(), LIMIT, None, stored(other)));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(held);
        let r = waiting.await.unwrap();
        assert_eq!(r.headers().get(header::CONTENT_ENCODING), None);
        assert_eq!(turns.started(), 3);
    }
}
