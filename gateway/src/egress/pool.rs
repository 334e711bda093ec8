//! The pool of provider connections behind [`HttpClient`], one list per
//! destination (scheme and authority of the request's URL).
//!
//! - An HTTP/1.1 connection carries one exchange at a time. It is checked
//!   out for a request and comes back to its list when the response body
//!   has been read to its end ([`ResponseBody`]); a body dropped before its
//!   end takes the connection with it (hyper closes it).
//! - An HTTP/2 connection (ALPN `h2`) is shared by every request to its
//!   destination until it closes.
//! - Idle HTTP/1.1 connections are reused most recent first and closed
//!   after the idle timeout (a route's `idle_connection_timeout_ms`, 30 s
//!   by default): at checkout, and by a reaper task that runs once per
//!   timeout while the client lives.
//! - A request that a reused connection closed under before sending any of
//!   it goes out again on another connection, as hyper's own pool does; a
//!   request on a new connection is never sent twice.
//!
//! Requests go out in origin form (`/path?query`) with a `Host` header from
//! the URL when the caller set none (RFC 9112 §3.2), over HTTP/1.1; over
//! HTTP/2 the URL gives `:scheme` and `:authority` (RFC 9113 §8.3.1).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::Connection as _;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt as _;

use super::{BoxError, Egress, OutboundBody};

/// A pooled outbound client (see the module docs). Cheap to clone: clones
/// share the pool.
#[derive(Clone)]
pub struct HttpClient {
    inner: Arc<Inner>,
}

struct Inner {
    connector: HttpsConnector<Egress>,
    idle_timeout: Duration,
    destinations: Mutex<Vec<Destination>>,
    reaper_started: AtomicBool,
}

/// The connections to one scheme and authority.
struct Destination {
    key: Key,
    /// HTTP/1.1 connections waiting for a request, the most recently used
    /// last.
    idle: Vec<Idle>,
    /// The HTTP/2 connection every request shares, once one is open, and
    /// when a request last took it (it is dropped when idle as long as an
    /// HTTP/1.1 connection would be).
    shared: Option<(http2::SendRequest<OutboundBody>, Instant)>,
    /// The `Host` of HTTP/1.1 requests to it ([`host_value`]), made once.
    host: Option<HeaderValue>,
}

struct Idle {
    tx: http1::SendRequest<OutboundBody>,
    since: Instant,
}

#[derive(Clone)]
struct Key {
    scheme: Scheme,
    authority: Authority,
}

/// Byte for byte: `Authority`'s own comparison ignores case letter by
/// letter, and a route names its provider one way.
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.authority.as_str() == other.authority.as_str() && self.scheme == other.scheme
    }
}

enum Checked {
    H1(http1::SendRequest<OutboundBody>),
    H2(http2::SendRequest<OutboundBody>),
}

/// Why a request got no response head.
#[derive(Debug)]
pub enum Error {
    /// The URL has no scheme or no host (the message says which).
    Destination(String),
    /// No connection could be opened: TCP, the `CONNECT` tunnel or the TLS
    /// handshake failed (the source says which).
    Connect(BoxError),
    /// The connection was opened but its HTTP handshake failed.
    Handshake(hyper::Error),
    /// A new connection closed before it took the request: nothing of it
    /// was written (the connection's own error, when it had one).
    ClosedBeforeSend(hyper::Error),
    /// The request could not be sent or its response head not read.
    Exchange(hyper::Error),
}

impl Error {
    /// Whether nothing of the request left the gateway: the URL, the
    /// connection or its handshake failed, or a new connection closed,
    /// before the request was written.
    /// An [`Error::Exchange`] is never counted so: the provider may have
    /// read the request.
    pub fn is_connect(&self) -> bool {
        !matches!(self, Error::Exchange(_))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Destination(m) => write!(f, "bad destination URL: {m}"),
            Error::Connect(_) => f.write_str("cannot connect to the provider"),
            Error::Handshake(_) => f.write_str("the provider's HTTP handshake failed"),
            Error::ClosedBeforeSend(_) => {
                f.write_str("the provider closed the new connection before the request was sent")
            }
            Error::Exchange(_) => f.write_str("the exchange with the provider failed"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Destination(_) => None,
            Error::Connect(e) => Some(e.as_ref()),
            Error::Handshake(e) | Error::ClosedBeforeSend(e) | Error::Exchange(e) => Some(e),
        }
    }
}

impl fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpClient")
            .field("idle_timeout", &self.inner.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl HttpClient {
    /// A client connecting through `connector`, closing HTTP/1.1
    /// connections idle for `idle_timeout`.
    pub(super) fn new(connector: HttpsConnector<Egress>, idle_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                connector,
                idle_timeout,
                destinations: Mutex::new(Vec::new()),
                reaper_started: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (an absolute `http://` or `https://` URL) and returns the
    /// response once its head has arrived; its body streams.
    ///
    /// Errors: [`Error`]; the causes are in its source chain (a TLS
    /// handshake's reason among them, for `forward::error_detail`).
    pub async fn request(
        &self,
        mut req: Request<OutboundBody>,
    ) -> Result<Response<ResponseBody>, Error> {
        let key = Key::of(req.uri())?;
        let uri = req.uri().clone();
        loop {
            // A new connection comes with the receiver of its own error,
            // for a request it closed under before sending any of it.
            let (conn, fresh, host) = match self.inner.checkout(&key, Instant::now()) {
                Some((c, host)) => (c, None, host),
                None => {
                    let connect = self.boxed_connect(&key, &uri);
                    let (c, ended) = connect.await?;
                    (c, Some(ended), None)
                }
            };
            let (result, h2) = match conn {
                Checked::H2(mut tx) => {
                    *req.uri_mut() = uri.clone();
                    let r = tx.try_send_request(req).await;
                    (r.map(|r| r.map(ResponseBody::unpooled)), true)
                }
                Checked::H1(mut tx) => {
                    // A pooled connection is ready (checkout takes no
                    // other); a new one takes its first request at once.
                    to_origin_form(&mut req, host.or_else(|| host_value(&key)));
                    let r = tx.try_send_request(req).await;
                    (r.map(|r| self.pooled(key.clone(), tx, r)), false)
                }
            };
            let mut e = match result {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            if h2 {
                // The next request opens a new connection.
                self.inner.unshare(&key);
            }
            match (e.take_message(), fresh) {
                (Some(r), None) => {
                    req = r;
                    *req.uri_mut() = uri.clone();
                }
                (Some(_), Some(ended)) => {
                    return Err(closed_before_send(e.into_error(), ended).await);
                }
                (None, _) => return Err(Error::Exchange(e.into_error())),
            }
        }
    }

    /// The response of an HTTP/1.1 exchange on `tx`, whose connection goes
    /// back to the pool when its body ends.
    fn pooled(
        &self,
        key: Key,
        tx: http1::SendRequest<OutboundBody>,
        r: Response<Incoming>,
    ) -> Response<ResponseBody> {
        let back = Some(GiveBack {
            pool: Arc::downgrade(&self.inner),
            key,
            tx,
        });
        let (parts, body) = r.into_parts();
        let mut body = ResponseBody { body, back };
        if body.body.is_end_stream() {
            body.give_back();
        }
        Response::from_parts(parts, body)
    }

    /// [`Self::connect`]'s future (6 KB: the TCP, tunnel, TLS and HTTP
    /// handshakes), boxed in a plain function so that a request's future,
    /// which usually finds a pooled connection, keeps no room for it.
    fn boxed_connect<'a>(
        &'a self,
        key: &'a Key,
        uri: &'a Uri,
    ) -> futures_util::future::BoxFuture<'a, Result<(Checked, Ended), Error>> {
        Box::pin(self.connect(key, uri))
    }

    /// Opens a connection to `key` (HTTP/2 when the provider chose `h2` in
    /// ALPN) and drives it in a task of its own.
    async fn connect(&self, key: &Key, uri: &Uri) -> Result<(Checked, Ended), Error> {
        let io = self
            .inner
            .connector
            .clone()
            .oneshot(uri.clone())
            .await
            .map_err(Error::Connect)?;
        self.start_reaper();
        if io.connected().is_negotiated_h2() {
            let (tx, conn) = http2::Builder::new(TokioExecutor::new())
                .handshake(io)
                .await
                .map_err(Error::Handshake)?;
            let ended = drive(conn, "HTTP/2");
            self.inner.share(key, tx.clone());
            Ok((Checked::H2(tx), ended))
        } else {
            let (tx, conn) = http1::Builder::new()
                .handshake(io)
                .await
                .map_err(Error::Handshake)?;
            let ended = drive(conn, "HTTP/1.1");
            Ok((Checked::H1(tx), ended))
        }
    }

    /// Starts the task that closes expired idle connections, once per
    /// client; it ends when the last clone of the client is dropped.
    fn start_reaper(&self) {
        if self.inner.reaper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(&self.inner);
        // At most ten runs a second, however short the timeout.
        let every = self.inner.idle_timeout.max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(pool) = pool.upgrade() else { return };
                pool.reap(Instant::now());
            }
        });
    }

    /// How long an idle connection is kept.
    pub fn idle_timeout(&self) -> Duration {
        self.inner.idle_timeout
    }

    /// Idle HTTP/1.1 connections kept for `uri`'s destination (for tests).
    pub fn idle_connections(&self, uri: &Uri) -> usize {
        let Ok(key) = Key::of(uri) else { return 0 };
        let dests = self.inner.lock();
        dests
            .iter()
            .find(|d| d.key == key)
            .map_or(0, |d| d.idle.len())
    }
}

/// The error a connection ended with, if it ended with one.
type Ended = tokio::sync::oneshot::Receiver<hyper::Error>;

/// Drives a provider connection (`version`, for the log) in a task of its
/// own until it closes; its error, if any, goes to the receiver.
fn drive<F>(conn: F, version: &'static str) -> Ended
where
    F: Future<Output = Result<(), hyper::Error>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, version, "provider connection ended");
            let _ = tx.send(e);
        }
    });
    rx
}

/// [`Error::ClosedBeforeSend`] for a new connection that gave its request
/// back unsent: with the connection's own error (a TLS alert that came
/// after the handshake, say) when it ended with one within 1 s, else
/// `e`.
async fn closed_before_send(e: hyper::Error, ended: Ended) -> Error {
    match tokio::time::timeout(Duration::from_secs(1), ended).await {
        Ok(Ok(cause)) => Error::ClosedBeforeSend(cause),
        _ => Error::ClosedBeforeSend(e),
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Destination>> {
        // A panic while the list was held leaves it consistent (each
        // change is one push, pop or retain), so a poisoned lock is used.
        self.destinations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The shared HTTP/2 connection to `key`, or its most recently used
    /// idle HTTP/1.1 connection; closed and expired ones are dropped.
    fn checkout(&self, key: &Key, now: Instant) -> Option<(Checked, Option<HeaderValue>)> {
        let mut dests = self.lock();
        let d = dests.iter_mut().find(|d| d.key == *key)?;
        if let Some((tx, used)) = &mut d.shared {
            if !tx.is_closed() && now.duration_since(*used) < self.idle_timeout {
                *used = now;
                return Some((Checked::H2(tx.clone()), None));
            }
            d.shared = None;
        }
        // Most recent first. A connection still sending the body of its
        // last request (the provider answered before reading it all) is
        // not ready: it is left for later, not waited for.
        let mut i = d.idle.len();
        while i > 0 {
            i -= 1;
            let idle = &d.idle[i];
            if idle.tx.is_closed() || now.duration_since(idle.since) >= self.idle_timeout {
                d.idle.remove(i);
            } else if idle.tx.is_ready() {
                return Some((Checked::H1(d.idle.remove(i).tx), d.host.clone()));
            }
        }
        None
    }

    fn destination<'a>(dests: &'a mut Vec<Destination>, key: &Key) -> &'a mut Destination {
        match dests.iter().position(|d| d.key == *key) {
            Some(i) => &mut dests[i],
            None => {
                dests.push(Destination {
                    key: key.clone(),
                    idle: Vec::new(),
                    shared: None,
                    host: host_value(key),
                });
                let last = dests.len() - 1;
                &mut dests[last]
            }
        }
    }

    fn share(&self, key: &Key, tx: http2::SendRequest<OutboundBody>) {
        let mut dests = self.lock();
        Self::destination(&mut dests, key).shared = Some((tx, Instant::now()));
    }

    /// Drops the shared HTTP/2 connection to `key` after a failed exchange.
    fn unshare(&self, key: &Key) {
        if let Some(d) = self.lock().iter_mut().find(|d| d.key == *key) {
            d.shared = None;
        }
    }

    fn put_back(&self, key: &Key, tx: http1::SendRequest<OutboundBody>) {
        if tx.is_closed() {
            return;
        }
        let mut dests = self.lock();
        Self::destination(&mut dests, key).idle.push(Idle {
            tx,
            since: Instant::now(),
        });
    }

    fn reap(&self, now: Instant) {
        let mut dests = self.lock();
        for d in dests.iter_mut() {
            d.idle
                .retain(|i| !i.tx.is_closed() && now.duration_since(i.since) < self.idle_timeout);
            if d.shared.as_ref().is_some_and(|(tx, used)| {
                tx.is_closed() || now.duration_since(*used) >= self.idle_timeout
            }) {
                d.shared = None;
            }
        }
        dests.retain(|d| !d.idle.is_empty() || d.shared.is_some());
    }
}

impl Key {
    fn of(uri: &Uri) -> Result<Self, Error> {
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| Error::Destination(format!("{uri} has no scheme")))?;
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| Error::Destination(format!("{uri} has no host")))?;
        Ok(Self { scheme, authority })
    }
}

/// The `Host` header of requests to `key` (RFC 9112 §3.2): the port only
/// when it is not the scheme's default.
fn host_value(key: &Key) -> Option<HeaderValue> {
    let a = &key.authority;
    let default_port = if key.scheme == Scheme::HTTPS { 443 } else { 80 };
    match a.port_u16() {
        Some(p) if p != default_port => HeaderValue::from_str(&format!("{}:{p}", a.host())).ok(),
        _ => HeaderValue::from_str(a.host()).ok(),
    }
}

/// Sets `host` as `Host` when the request has none, and puts the target in
/// origin form (RFC 9112 §3.2.1).
fn to_origin_form(req: &mut Request<OutboundBody>, host: Option<HeaderValue>) {
    if let Some(host) = host
        && let header::Entry::Vacant(e) = req.headers_mut().entry(header::HOST)
    {
        e.insert(host);
    }
    let origin = match req.uri().path_and_query() {
        Some(pq) if pq.as_str() != "/" => {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(pq.clone());
            Uri::from_parts(parts).unwrap_or_default()
        }
        _ => Uri::default(),
    };
    *req.uri_mut() = origin;
}

/// A provider's response body. An HTTP/1.1 connection goes back to its
/// pool when the body has been read to its end.
pub struct ResponseBody {
    body: Incoming,
    back: Option<GiveBack>,
}

struct GiveBack {
    pool: Weak<Inner>,
    key: Key,
    tx: http1::SendRequest<OutboundBody>,
}

impl ResponseBody {
    fn unpooled(body: Incoming) -> Self {
        Self { body, back: None }
    }

    fn give_back(&mut self) {
        if let Some(b) = self.back.take()
            && let Some(pool) = b.pool.upgrade()
        {
            pool.put_back(&b.key, b.tx);
        }
    }
}

impl fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("body", &self.body)
            .field("pooled", &self.back.is_some())
            .finish()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.give_back(),
            Some(Err(_)) => this.back = None,
            Some(Ok(_)) if this.body.is_end_stream() => this.give_back(),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // Read to its end without a last poll (its length was known).
        if self.back.is_some() && self.body.is_end_stream() {
            self.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    /// How the test provider answers each request.
    #[derive(Clone, Copy)]
    enum Answer {
        /// `200`, body `hello`, the connection kept.
        Whole,
        /// `200` announcing 10 bytes, of which 5 are sent; then the
        /// connection stays open, silent.
        Half,
        /// `200`, body `hello`, then the connection is closed (no
        /// `Connection: close`: a provider that drops idle connections).
        ThenClose,
    }

    /// A provider on 127.0.0.1 speaking HTTP/1.1 by hand: it counts the
    /// connections it accepts and reports each one that ends.
    async fn provider(answer: Answer) -> (Uri, Arc<AtomicUsize>, mpsc::UnboundedReceiver<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let n = count.fetch_add(1, Ordering::SeqCst);
                let ended = ended_tx.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    loop {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            // The second connection of a `Half` provider
                            // answers whole.
                            let half = matches!(answer, Answer::Half) && n == 0;
                            let reply: &[u8] = if half {
                                b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello"
                            } else {
                                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
                            };
                            s.write_all(reply).await.unwrap();
                            if matches!(answer, Answer::ThenClose) {
                                // Closed before it is reported: the
                                // client's socket has its end to read.
                                drop(s);
                                let _ = ended.send(());
                                return;
                            }
                        }
                    }
                    let _ = ended.send(());
                });
            }
        });
        let uri: Uri = format!("http://{addr}/v1/things?x=1").parse().unwrap();
        (uri, accepted, ended)
    }

    const IDLE: Duration = Duration::from_secs(30);

    fn client() -> HttpClient {
        // Plain-HTTP providers only: no roots are needed.
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        super::super::build_client(super::super::ClientOptions {
            connect_timeout_ms: 5_000,
            tls,
            server_name: None,
            proxy: super::super::Proxy::Direct,
            idle_timeout_ms: IDLE.as_millis() as u64,
        })
    }

    fn get(uri: &Uri) -> Request<OutboundBody> {
        Request::get(uri.clone())
            .body(OutboundBody::empty())
            .unwrap()
    }

    async fn body_of(r: Response<ResponseBody>) -> Bytes {
        r.into_body().collect().await.unwrap().to_bytes()
    }

    /// Two calls one after the other share one connection: it is back in
    /// the pool once the first body was read to its end.
    #[tokio::test]
    async fn a_connection_is_reused_once_its_body_is_read() {
        let (uri, accepted, _ended) = provider(Answer::Whole).await;
        let c = client();
        for _ in 0..2 {
            let r = c.request(get(&uri)).await.unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(body_of(r).await, "hello");
            assert_eq!(c.idle_connections(&uri), 1);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// A body dropped before its end takes its connection with it: the
    /// next call opens another and gets its whole answer.
    #[tokio::test]
    async fn a_body_dropped_before_its_end_takes_its_connection() {
        let (uri, accepted, mut ended) = provider(Answer::Half).await;
        let c = client();
        let r = c.request(get(&uri)).await.unwrap();
        let mut body = r.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "hello");
        drop(body);
        assert_eq!(c.idle_connections(&uri), 0);
        next_call_opens_a_connection(&c, &uri, &mut ended, &accepted, 2).await;
    }

    /// Once the provider has seen a connection end, the next call gets its
    /// whole answer on the `n`th connection.
    async fn next_call_opens_a_connection(
        c: &HttpClient,
        uri: &Uri,
        ended: &mut mpsc::UnboundedReceiver<()>,
        accepted: &AtomicUsize,
        n: usize,
    ) {
        ended.recv().await.unwrap();
        let r = c.request(get(uri)).await.unwrap();
        assert_eq!(body_of(r).await, "hello");
        assert_eq!(accepted.load(Ordering::SeqCst), n);
    }

    /// A pooled connection the provider closed is not used again: the next
    /// call goes out on a new one and succeeds.
    #[tokio::test]
    async fn a_connection_the_provider_closed_is_not_used_again() {
        let (uri, accepted, mut ended) = provider(Answer::ThenClose).await;
        let c = client();
        for i in 1..=3 {
            let r = c.request(get(&uri)).await.unwrap();
            assert_eq!(body_of(r).await, "hello");
            ended.recv().await.unwrap();
            assert_eq!(accepted.load(Ordering::SeqCst), i);
        }
    }

    /// A connection still sending its request's body after the provider
    /// answered (and the answer was read) is not ready: the next call
    /// doesn't wait for it but opens another.
    #[tokio::test]
    async fn a_connection_still_sending_is_not_waited_for() {
        let (uri, accepted, _ended) = provider(Answer::Whole).await;
        let c = client();
        let endless = OutboundBody::from_stream(futures_util::stream::pending::<
            Result<Bytes, std::io::Error>,
        >());
        let upload = Request::post(uri.clone())
            .header(header::TRANSFER_ENCODING, "chunked")
            .body(endless)
            .unwrap();
        let r = c.request(upload).await.unwrap();
        assert_eq!(body_of(r).await, "hello");
        let r = tokio::time::timeout(Duration::from_secs(10), c.request(get(&uri)))
            .await
            .expect("the next call did not wait for the busy connection")
            .unwrap();
        assert_eq!(body_of(r).await, "hello");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Idle connections older than the idle timeout are closed by the
    /// reaper (run here at a time past it), and a later call opens a new
    /// one.
    #[tokio::test]
    async fn expired_idle_connections_are_closed() {
        let (uri, accepted, mut ended) = provider(Answer::Whole).await;
        let c = client();
        let r = c.request(get(&uri)).await.unwrap();
        body_of(r).await;
        assert_eq!(c.idle_connections(&uri), 1);
        // Not yet expired.
        c.inner.reap(Instant::now() + IDLE / 2);
        assert_eq!(c.idle_connections(&uri), 1);
        c.inner.reap(Instant::now() + IDLE);
        assert_eq!(c.idle_connections(&uri), 0);
        next_call_opens_a_connection(&c, &uri, &mut ended, &accepted, 2).await;
    }

    /// A URL without a scheme or host is refused before any connection,
    /// and counts as nothing sent.
    #[tokio::test]
    async fn a_url_without_a_host_is_refused() {
        let c = client();
        let e = c
            .request(get(&Uri::from_static("/v1/things")))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Destination(_)), "{e:?}");
        assert!(e.is_connect());
    }

    /// `Host` names the port only when it is not the scheme's default, and
    /// the target is in origin form; a caller's own `Host` is kept.
    #[test]
    fn requests_go_out_in_origin_form_with_a_host() {
        for (url, host, target) in [
            ("http://p.example/v1/a?b=1", "p.example", "/v1/a?b=1"),
            ("http://p.example:8080/", "p.example:8080", "/"),
            ("https://p.example:443/x", "p.example", "/x"),
            ("https://p.example:80/x", "p.example:80", "/x"),
            ("http://u:pw@p.example:8080/x", "p.example:8080", "/x"),
        ] {
            let uri: Uri = url.parse().unwrap();
            let mut req = get(&uri);
            to_origin_form(&mut req, host_value(&Key::of(&uri).unwrap()));
            assert_eq!(req.headers()[header::HOST], host, "{url}");
            assert_eq!(req.uri().to_string(), target, "{url}");
        }
        let uri: Uri = "http://10.0.0.1/x".parse().unwrap();
        let mut req = get(&uri);
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("p.example"));
        to_origin_form(&mut req, host_value(&Key::of(&uri).unwrap()));
        assert_eq!(req.headers()[header::HOST], "p.example");
    }
}
