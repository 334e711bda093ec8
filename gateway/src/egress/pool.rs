//! The pool of provider connections behind [`HttpClient`], one list per
//! destination (scheme and authority of the request's URL).
//!
//! - An HTTP/1.1 connection carries one exchange at a time. It is checked
//!   out for a request and comes back to its list when the response body
//!   has been read to its end ([`ResponseBody`]); a body dropped before its
//!   end takes the connection with it (it is closed).
//! - An HTTP/1.1 connection has no task of its own: the request's task
//!   polls it (hyper's `Connection`, the [`Driver`]) while it waits for
//!   the response head, and the response body polls it while it is read.
//!   A call through the gateway then runs on one task from the caller's
//!   socket to the provider's and back, with no wake-up of another task
//!   (and thread) on each way, as a proxy's event loop does it. Idle
//!   connections are polled, without a waker, by the reaper (at least once
//!   a second): one the provider closed is found so and dropped. A call
//!   that takes one the provider closed since the reaper's last run reads
//!   the close before it writes anything, and goes out on another
//!   connection, once the runtime has seen the close on the socket (a
//!   close still on its way as the request is written fails that call,
//!   as it would with a connection in a task of its own). A connection
//!   whose request body is still being sent when its response has been
//!   read (the provider answered early) is finished by a task of its own
//!   and closed, not pooled. One whose request body is still being sent
//!   when its response head arrives is driven by a task of its own from
//!   then on, and closed after the exchange: the upload then goes on
//!   whether or not anyone reads the answer yet (a caller that reads
//!   nothing until it has sent everything, while the provider streams
//!   an answer larger than the sockets hold before it reads the rest of
//!   the upload, would otherwise wait forever).
//! - An HTTP/2 connection (ALPN `h2`) is shared by every request to its
//!   destination until it closes, and is driven by a task of its own.
//! - Idle HTTP/1.1 connections are reused most recent first and closed
//!   after the idle timeout (a route's `idle_connection_timeout_ms`, 30 s
//!   by default): at checkout, and by a reaper task that runs once per
//!   timeout, or once a second if that is shorter, while the client
//!   lives.
//! - A request that a reused connection closed under before sending any of
//!   it goes out again on another connection, as hyper's own pool does; a
//!   request on a new connection is never sent twice.
//!
//! An HTTP/1.1 answer that came with both `Transfer-Encoding` and
//! `Content-Length` is read by its transfer coding, and its
//! `Content-Length` is removed (RFC 9112 §6.3 ¶3).
//!
//! Requests go out in origin form (`/path?query`) with a `Host` header from
//! the URL when the caller set none (RFC 9112 §3.2), over HTTP/1.1; over
//! HTTP/2 the URL gives `:scheme` and `:authority` (RFC 9113 §8.3.1).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::Body;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::Connection as _;
use hyper_util::rt::TokioExecutor;
use sync_wrapper::SyncWrapper;
use tower::ServiceExt as _;

use super::{BoxError, Egress, OutboundBody};

mod body;

pub use body::ResponseBody;
use body::{GiveBack, Sending};

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
    driver: Driver,
    since: Instant,
}

/// An HTTP/1.1 connection's own future (hyper's `Connection`): each poll
/// writes what the request has ready and reads what the provider sent;
/// it ends when the connection closes. Boxed once per connection; `Sync`
/// (a response body must be) because it is only ever polled through
/// `&mut`.
struct Driver(SyncWrapper<ConnFuture>);

/// hyper's `Connection` future, boxed.
type ConnFuture = Pin<Box<dyn Future<Output = Result<(), hyper::Error>> + Send>>;

impl Driver {
    fn new<F>(conn: F) -> Self
    where
        F: Future<Output = Result<(), hyper::Error>> + Send + 'static,
    {
        Self(SyncWrapper::new(Box::pin(conn)))
    }

    /// Polls the connection; an error it ends with is logged here, for
    /// every caller.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        let r = ready!(self.0.get_mut().as_mut().poll(cx));
        if let Err(e) = &r {
            tracing::debug!(error = %e, version = "HTTP/1.1", "provider connection ended");
        }
        Poll::Ready(r)
    }

    /// Polls an idle connection once with a waker that does nothing
    /// (whoever uses the connection next polls it with its own before it
    /// waits): whether it has ended (the provider closed it, or it
    /// failed).
    fn ended_while_idle(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.poll(&mut cx).is_ready()
    }
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
    H1(http1::SendRequest<OutboundBody>, Driver),
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
        // Whether the request's body has been sent whole, for a body not
        // at its end yet (none is needed for one without bytes).
        let mut sent: Option<Arc<AtomicBool>> = None;
        loop {
            // A new HTTP/2 connection comes with the receiver of its own
            // error, for a request it closed under before sending any of
            // it (an HTTP/1.1 connection's error comes from its driver).
            let (conn, fresh, h2_ended, host) = match self.inner.checkout(&key, Instant::now()) {
                Some((c, host)) => (c, false, None, host),
                None => {
                    let connect = self.boxed_connect(&key, &uri);
                    let (c, ended) = connect.await?;
                    (c, true, ended, None)
                }
            };
            let (result, h2, h1_ended) = match conn {
                Checked::H2(mut tx) => {
                    *req.uri_mut() = uri.clone();
                    let r = tx.try_send_request(req).await;
                    (r.map(|r| r.map(ResponseBody::unpooled)), true, None)
                }
                Checked::H1(mut tx, driver) => {
                    // A pooled connection is ready (checkout takes no
                    // other); a new one takes its first request at once.
                    to_origin_form(&mut req, host.or_else(|| host_value(&key)));
                    if sent.is_none() && !req.body().is_end_stream() {
                        let (body, flag) = Sending::wrap(std::mem::take(req.body_mut()));
                        *req.body_mut() = body;
                        sent = Some(flag);
                    }
                    let send = tx.try_send_request(req);
                    let (r, driver, ended) = exchange(send, driver).await;
                    let uploading = sent.as_ref().is_some_and(|s| !s.load(Ordering::Acquire));
                    (
                        r.map(|r| self.pooled(key.clone(), tx, driver, r, uploading)),
                        false,
                        ended,
                    )
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
                (Some(r), false) => {
                    req = r;
                    *req.uri_mut() = uri.clone();
                }
                (Some(_), true) => {
                    return Err(match (h1_ended, h2_ended) {
                        (Some(cause), _) => Error::ClosedBeforeSend(cause),
                        (None, Some(ended)) => closed_before_send(e.into_error(), ended).await,
                        (None, None) => Error::ClosedBeforeSend(e.into_error()),
                    });
                }
                (None, _) => return Err(Error::Exchange(e.into_error())),
            }
        }
    }

    /// The response of an HTTP/1.1 exchange on `tx`, whose connection
    /// (`driver`, `None` when it ended with the exchange) goes back to the
    /// pool when its body ends; or, when the request's body is still
    /// being sent (`uploading`), is driven by a task of its own until the
    /// exchange ends, and then closed. An answer with a `Transfer-Encoding`
    /// loses its `Content-Length`, if it had one.
    fn pooled(
        &self,
        key: Key,
        tx: http1::SendRequest<OutboundBody>,
        driver: Option<Driver>,
        mut r: Response<Incoming>,
        uploading: bool,
    ) -> Response<ResponseBody> {
        // A transfer coding overrides `Content-Length`, which a proxy
        // removes before it forwards the answer (RFC 9112 §6.3 ¶3): kept,
        // it would tell the caller another length than the body has.
        if r.headers().contains_key(header::TRANSFER_ENCODING) {
            r.headers_mut().remove(header::CONTENT_LENGTH);
        }
        if uploading {
            if let Some(driver) = driver {
                // Without its `SendRequest`, hyper closes the connection
                // once this exchange is over.
                drop(tx);
                drive(driver.0.into_inner(), "HTTP/1.1");
            }
            return r.map(ResponseBody::unpooled);
        }
        let back = driver.map(|driver| GiveBack {
            pool: Arc::downgrade(&self.inner),
            key,
            tx,
            driver,
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
    ) -> futures_util::future::BoxFuture<'a, Result<(Checked, Option<Ended>), Error>> {
        Box::pin(self.connect(key, uri))
    }

    /// Opens a connection to `key`: HTTP/2 when the provider chose `h2` in
    /// ALPN, driven by a task of its own (with the receiver of the error it
    /// ends with); else HTTP/1.1, with its [`Driver`].
    async fn connect(&self, key: &Key, uri: &Uri) -> Result<(Checked, Option<Ended>), Error> {
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
            Ok((Checked::H2(tx), Some(ended)))
        } else {
            let (tx, conn) = http1::Builder::new()
                .handshake(io)
                .await
                .map_err(Error::Handshake)?;
            Ok((Checked::H1(tx, Driver::new(conn)), None))
        }
    }

    /// Starts the task that closes expired idle connections and drops
    /// those the provider closed, once per client; it ends when the last
    /// clone of the client is dropped.
    fn start_reaper(&self) {
        if self.inner.reaper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(&self.inner);
        // Once a second at least, so that a connection the provider
        // closed is not kept half-closed for a whole timeout; at most ten
        // runs a second, however short the timeout.
        let every = self
            .inner
            .idle_timeout
            .clamp(Duration::from_millis(100), Duration::from_secs(1));
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

/// Awaits `send` (an HTTP/1.1 request's response head) while polling the
/// connection's `driver`, which writes the request and reads the head,
/// on the caller's task. Returns the outcome, the driver unless the
/// connection ended meanwhile, and the error it ended with, if any (when
/// it ended, hyper answers `send` with an error: the request back if none
/// of it was written).
async fn exchange<F: Future>(
    send: F,
    driver: Driver,
) -> (F::Output, Option<Driver>, Option<hyper::Error>) {
    let mut send = std::pin::pin!(send);
    let mut driver = Some(driver);
    let mut ended = None;
    let out = std::future::poll_fn(|cx| {
        if let Some(d) = driver.as_mut()
            && let Poll::Ready(r) = d.poll(cx)
        {
            // Dropped at once: hyper then fails whatever is pending.
            driver = None;
            ended = r.err();
        }
        send.as_mut().poll(cx)
    })
    .await;
    (out, driver, ended)
}

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
        // Most recent first. One the provider closed since the reaper last
        // looked is not polled here (a poll per call, in vain nearly
        // always): the request's first poll of it reads a close the
        // runtime has seen before it takes the request, which hyper then
        // gives back unsent, and the request goes out on another
        // connection.
        while let Some(idle) = d.idle.pop() {
            if now.duration_since(idle.since) < self.idle_timeout && idle.tx.is_ready() {
                return Some((Checked::H1(idle.tx, idle.driver), d.host.clone()));
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

    /// Pools a connection whose response was read to its end. Usually
    /// the poll that read the end also readied it for the next request;
    /// else it is polled once more. One still not ready (its request body
    /// is still being sent) is finished by a task of its own and then
    /// closed; one that ended is dropped.
    fn put_back(&self, key: &Key, tx: http1::SendRequest<OutboundBody>, mut driver: Driver) {
        if !tx.is_ready() {
            if driver.ended_while_idle() {
                return;
            }
            if !tx.is_ready() {
                drop(tx);
                // A body dropped outside any runtime (at exit) closes it.
                if tokio::runtime::Handle::try_current().is_ok() {
                    drive(driver.0.into_inner(), "HTTP/1.1");
                }
                return;
            }
        }
        let mut dests = self.lock();
        Self::destination(&mut dests, key).idle.push(Idle {
            tx,
            driver,
            since: Instant::now(),
        });
    }

    fn reap(&self, now: Instant) {
        let mut dests = self.lock();
        for d in dests.iter_mut() {
            d.idle.retain_mut(|i| {
                now.duration_since(i.since) < self.idle_timeout && !i.driver.ended_while_idle()
            });
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

#[cfg(test)]
mod tests;
