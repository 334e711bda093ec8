//! Serving a listener's service ([`App`]) on one listener, in plain HTTP or over TLS: HTTP/1.1,
//! and HTTP/2 (negotiated by ALPN on TLS listeners, RFC 7301; by the
//! connection preface otherwise). Each request carries the peer address
//! and the scheme the caller used, as one extension ([`crate::forward::Inbound`]).
//! Shutdown is graceful: the listener stops accepting, idle connections
//! close, and in-flight requests get `drain_ms` to finish; a connection
//! still open at that deadline (a long pass-through stream, say) is cut.
//!
//! Hostile connections are bounded ([`ConnLimits`]):
//! - a connection must deliver its first request head (TLS handshake
//!   included) within `header_read_timeout_ms`, and on HTTP/1.1 every later
//!   head too (which also bounds an idle keep-alive connection); past it the
//!   connection is closed, nothing having been read;
//! - a connection with no request in flight for `idle_timeout_ms` is closed;
//! - at most `max_connections` are open. At the cap a new connection
//!   closes the oldest one that hasn't finished its first request head,
//!   else the one idle longest; only when every connection is busy is the
//!   new one refused. So a flood of slow headers never locks out a caller
//!   and the process never runs out of descriptors.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use crate::forward::Inbound;
use crate::tls::ListenerCert;

/// Connection limits of one listener (from `[limits]`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Time to deliver a request head (and the TLS handshake before the
    /// first one), ms.
    pub header_read_timeout_ms: u64,
    /// Time a connection may stay open with no request in flight, ms.
    pub idle_timeout_ms: u64,
    /// After shutdown starts, how long open connections may go on, ms
    /// (`shutdown.drain_ms`).
    pub drain_ms: u64,
}

/// The default `max_connections` of the proxy listener: half of the
/// descriptors left after 256 kept for the ledger, the admin listener and
/// the process (the other half is for upstream connections), at least 64
/// and at most 10000 (a bound on memory as well as descriptors).
/// `nofile` is the process's descriptor limit (`RLIMIT_NOFILE`).
pub fn default_max_connections(nofile: u64) -> usize {
    usize::try_from(nofile.saturating_sub(256) / 2)
        .unwrap_or(usize::MAX)
        .clamp(64, 10_000)
}

/// Raises the soft descriptor limit to the hard one (as servers do) and
/// returns it; 1024 when it can't be read.
pub fn raise_nofile_limit() -> u64 {
    let hard = rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(_, hard)| hard);
    rlimit::increase_nofile_limit(hard.min(1 << 20)).unwrap_or(1024)
}

/// One open connection, as the tracker sees it.
#[derive(Debug)]
struct Conn {
    id: u64,
    accepted: Instant,
    /// A request head arrived.
    served: AtomicBool,
    /// Requests whose answer hasn't been sent completely.
    in_flight: AtomicUsize,
    /// When the connection last went idle, ms after `accepted`.
    idle_since_ms: AtomicU64,
    close: Notify,
}

impl Conn {
    fn idle_for(&self) -> Option<Duration> {
        (self.in_flight.load(Ordering::Acquire) == 0).then(|| {
            let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
            self.accepted.elapsed().saturating_sub(since)
        })
    }
}

/// The open connections of one listener.
#[derive(Debug, Default)]
struct Tracker {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

impl Tracker {
    /// Connections open now.
    fn open(&self) -> usize {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Registers a new connection, making room at the cap (see the module
    /// docs); `None` when every open connection is busy.
    fn admit(self: &Arc<Self>, max: usize, listener: &'static str) -> Option<Arc<Conn>> {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        if conns.len() >= max {
            let victim = conns
                .values()
                .filter(|c| !c.served.load(Ordering::Acquire))
                .min_by_key(|c| c.accepted)
                .or_else(|| {
                    conns
                        .values()
                        .filter_map(|c| c.idle_for().map(|d| (d, c)))
                        .max_by_key(|(d, _)| *d)
                        .map(|(_, c)| c)
                })
                .cloned();
            let Some(victim) = victim else {
                crate::metrics::connection_refused(listener, "busy");
                return None;
            };
            let reason = if victim.served.load(Ordering::Acquire) {
                "idle"
            } else {
                "no-request-head"
            };
            crate::metrics::connection_refused(listener, reason);
            victim.close.notify_one();
            conns.remove(&victim.id);
        }
        let conn = Arc::new(Conn {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            accepted: Instant::now(),
            served: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            close: Notify::new(),
        });
        conns.insert(conn.id, conn.clone());
        Some(conn)
    }

    fn leave(&self, id: u64) {
        self.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }
}

/// Marks a request in flight on its connection until its answer's body
/// has been sent (or dropped).
struct InFlight(Arc<Conn>);

impl InFlight {
    fn new(conn: Arc<Conn>) -> Self {
        conn.served.store(true, Ordering::Release);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let ms = u64::try_from(self.0.accepted.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.idle_since_ms.store(ms, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer body that keeps its request counted as in flight.
struct Tracked<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A listener's service (the proxy's or the admin's, with their layers):
/// a request with the peer address, scheme and connection memo in its
/// extensions in, an answer out.
pub trait App:
    tower_service::Service<
        axum::extract::Request,
        Response = http::Response<Self::Body>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static
{
    /// The answer's body.
    type Body: http_body::Body<Data = bytes::Bytes, Error = axum::Error> + Send + Unpin + 'static;
}

impl<S, B> App for S
where
    S: tower_service::Service<
            axum::extract::Request,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + Sync
        + 'static,
    B: http_body::Body<Data = bytes::Bytes, Error = axum::Error> + Send + Unpin + 'static,
{
    type Body = B;
}

/// Serves `app` on `tcp` until `shutdown` turns true, then drains.
/// With `tls`, every connection is a TLS server connection using its
/// (reloadable) certificate. `name` labels the listener in metrics
/// (`proxy`, `admin`).
///
/// Errors: none once bound; a failed accept (e.g. out of descriptors) is
/// logged and retried after a short pause.
pub async fn serve<A: App>(
    tcp: TcpListener,
    tls: Option<Arc<ListenerCert>>,
    app: A,
    limits: ConnLimits,
    name: &'static str,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(c.server_config()));
    let scheme = if acceptor.is_some() { "https" } else { "http" };
    let head_timeout = Duration::from_millis(limits.header_read_timeout_ms);
    let idle_timeout = Duration::from_millis(limits.idle_timeout_ms);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(head_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(20)));
    let builder = Arc::new(builder);
    let tracker = Arc::new(Tracker::default());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let cut = tokio_util::sync::CancellationToken::new();
    let stop = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = tcp.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let Some(conn) = tracker.admit(limits.max_connections, name) else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let ctx = ConnCtx {
            app: app.clone(),
            builder: builder.clone(),
            acceptor: acceptor.clone(),
            watcher: graceful.watcher(),
            cut: cut.clone(),
            tracker: tracker.clone(),
            scheme,
            name,
            head_timeout,
            idle_timeout,
        };
        tokio::spawn(ctx.serve(stream, peer, conn));
    }
    drop(tcp);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_millis(limits.drain_ms)) => {
            let open = tracker.open();
            cut.cancel();
            tracing::warn!(listener = name, connections = open, drain_ms = limits.drain_ms,
                "drain deadline passed: connections still open were cut");
        }
    }
    Ok(())
}

/// What one connection's task needs from its listener.
struct ConnCtx<A> {
    app: A,
    builder: Arc<auto::Builder<TokioExecutor>>,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    watcher: hyper_util::server::graceful::Watcher,
    cut: tokio_util::sync::CancellationToken,
    tracker: Arc<Tracker>,
    scheme: &'static str,
    name: &'static str,
    head_timeout: Duration,
    idle_timeout: Duration,
}

impl<A: App> ConnCtx<A> {
    /// Serves one connection until it ends, is evicted, misses its first
    /// head's deadline or stays idle too long; then leaves the tracker.
    async fn serve(self, stream: tokio::net::TcpStream, peer: SocketAddr, conn: Arc<Conn>) {
        let ConnCtx {
            app,
            builder,
            acceptor,
            watcher,
            cut,
            tracker,
            scheme,
            name,
            head_timeout,
            idle_timeout,
        } = self;
        let c = conn.clone();
        // Only the proxy listener's handler reads the memo.
        let auth = (name == "proxy").then(|| Arc::new(crate::http::auth::ConnAuth::default()));
        let svc =
            hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                let in_flight = InFlight::new(c.clone());
                req.extensions_mut().insert(Inbound { peer, scheme });
                if let Some(auth) = &auth {
                    req.extensions_mut().insert(auth.clone());
                }
                // HTTP/2 carries the host in `:authority` (RFC 9113 §8.3.1):
                // give the request the `Host` an HTTP/1.1 request has, so
                // `X-Forwarded-Host` is the same on both.
                if !req.headers().contains_key(http::header::HOST)
                    && let Some(v) = req
                        .uri()
                        .authority()
                        .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
                {
                    req.headers_mut().insert(http::header::HOST, v);
                }
                let app = app.clone();
                async move {
                    use tower::ServiceExt;
                    let resp = app.oneshot(req.map(axum::body::Body::new)).await?;
                    Ok::<_, std::convert::Infallible>(resp.map(|inner| Tracked {
                        inner,
                        _in_flight: in_flight,
                    }))
                }
            });
        let accepted = tokio::time::Instant::now();
        let plain = acceptor.is_none();
        let serve = async {
            match acceptor {
                None => {
                    let mut stream = stream;
                    if !first_head_arrived(&stream, accepted + head_timeout).await {
                        crate::metrics::connection_refused(name, "header-timeout");
                        tracing::debug!(%peer, "no request head in time; answered 408 and closed");
                        answer_408(&mut stream, head_timeout).await;
                        return Ok(());
                    }
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    let stream = match acceptor.accept(stream).await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return Ok(());
                        }
                    };
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    watcher.watch(conn.into_owned()).await
                }
            }
        };
        // The first head (and handshake) must arrive in time. On plain
        // connections the wait for the first head answers 408 at the
        // deadline itself; this bound is the backstop.
        let backstop = if plain {
            head_timeout + Duration::from_millis(500)
        } else {
            head_timeout
        };
        // The reasons to stop a connection early are watched by a task of
        // their own, which aborts the connection's future: that future is
        // woken on every read and write, and polling the watches' timers
        // and notifications each time cost more than a request's routing.
        let (serve, abort) = futures_util::future::abortable(serve);
        // Aborted with this future, however it ends.
        let watch = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
            let conn = conn.clone();
            async move {
                let stop = watch_connection(conn, cut, backstop, idle_timeout).await;
                abort.abort();
                stop
            }
        }));
        let stopped = match serve.await {
            Ok(result) => {
                if let Err(e) = result {
                    if e.downcast_ref::<hyper::Error>()
                        .is_some_and(hyper::Error::is_timeout)
                    {
                        crate::metrics::connection_refused(name, "header-timeout");
                    }
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                None
            }
            Err(futures_util::future::Aborted) => watch.await.ok(),
        };
        match stopped {
            Some(Stop::Evicted) => {
                tracing::debug!(%peer, "connection closed to make room for a new one");
            }
            Some(Stop::NoHead) => {
                crate::metrics::connection_refused(name, "header-timeout");
                tracing::debug!(%peer, "no request head in time; connection closed");
            }
            Some(Stop::Idle) => tracing::debug!(%peer, "idle connection closed"),
            Some(Stop::Cut) => tracing::debug!(%peer, "connection cut at the drain deadline"),
            None => {}
        }
        tracker.leave(conn.id);
    }
}

/// Why [`watch_connection`] stopped a connection.
enum Stop {
    /// Closed to make room for a new connection.
    Evicted,
    /// No request head within the head timeout (plus its backstop).
    NoHead,
    /// Idle for the idle timeout.
    Idle,
    /// Cut at the drain deadline of a shutdown.
    Cut,
}

/// Waits for a reason to stop `conn` early: eviction, no first head within
/// `backstop`, `idle_timeout` without a request in flight, or `cut`.
/// Returns once one happens; the caller aborts the connection then.
async fn watch_connection(
    conn: Arc<Conn>,
    cut: tokio_util::sync::CancellationToken,
    backstop: Duration,
    idle_timeout: Duration,
) -> Stop {
    let head_deadline = async {
        tokio::time::sleep(backstop).await;
        if conn.served.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
    };
    let idle = async {
        loop {
            if !conn.served.load(Ordering::Acquire) {
                // Until the first head, the head deadline rules.
                tokio::time::sleep(idle_timeout).await;
                continue;
            }
            match conn.idle_for() {
                Some(d) if d >= idle_timeout => break,
                Some(d) => tokio::time::sleep(idle_timeout - d).await,
                None => tokio::time::sleep(idle_timeout).await,
            }
        }
    };
    tokio::select! {
        _ = conn.close.notified() => Stop::Evicted,
        _ = head_deadline => Stop::NoHead,
        _ = idle => Stop::Idle,
        _ = cut.cancelled() => Stop::Cut,
    }
}

/// Bytes of a first request head looked at before hyper reads it; a head
/// that fills them is handed over as it is (hyper's own header timeout and
/// size limit then apply).
const FIRST_HEAD_PEEK_BYTES: usize = 4096;

/// Waits, without consuming anything, until the connection's first request
/// head has arrived whole (its blank line is buffered), the peer closed, or
/// [`FIRST_HEAD_PEEK_BYTES`] are waiting; `false` if `deadline` passes
/// first. A head that arrives in one packet costs one `peek`; a stalled
/// one is looked at again after 10 ms, doubling up to 250 ms.
async fn first_head_arrived(
    stream: &tokio::net::TcpStream,
    deadline: tokio::time::Instant,
) -> bool {
    let mut buf = [0u8; FIRST_HEAD_PEEK_BYTES];
    let mut pause = Duration::from_millis(10);
    loop {
        match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Err(_) => return false,
            Ok(Err(_)) | Ok(Ok(0)) => return true,
            Ok(Ok(n)) if n == buf.len() || head_ends(&buf[..n]) => return true,
            Ok(Ok(_)) => {}
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep_until((now + pause).min(deadline)).await;
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Whether `bytes` hold the blank line that ends a request head: CRLF
/// CRLF, or a bare LF for either line end, which RFC 9112 §2.2 lets a
/// server accept (hyper does; a head of bare LFs waited for the header
/// timeout here, then got 408).
fn head_ends(bytes: &[u8]) -> bool {
    bytes
        .windows(2)
        .enumerate()
        .any(|(i, w)| w == b"\n\n" || (w == b"\n\r" && bytes.get(i + 2) == Some(&b'\n')))
}

/// Answers a connection whose first head didn't arrive within
/// `limits.header_read_timeout_ms` with 408 `request-timeout` (RFC 9110
/// §15.5.9) and `Connection: close`; nothing was read, so nothing was
/// recorded. The write is bounded (a peer that doesn't read gets nothing).
async fn answer_408(stream: &mut tokio::net::TcpStream, limit: Duration) {
    use tokio::io::AsyncWriteExt;
    let body = format!(
        "{{\"type\":\"urn:effectgate:problem:request-timeout\",\"title\":\"Request Timeout\",\"status\":408,\
         \"detail\":\"the request head did not arrive within {} ms\",\"field\":\"headers\",\"limit_ms\":{}}}",
        limit.as_millis(),
        limit.as_millis()
    );
    let answer = format!(
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        crate::http::error::PROBLEM_JSON,
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::head_ends;

    #[test]
    fn a_head_ends_at_a_blank_line_of_crlf_or_bare_lf() {
        for ended in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"GET / HTTP/1.1\nHost: x\n\n",
            b"GET / HTTP/1.1\r\nHost: x\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n\nbody",
        ] {
            assert!(head_ends(ended), "{}", String::from_utf8_lossy(ended));
        }
        for open in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n"[..],
            b"GET / HTTP/1.1\nHost: x\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r",
            b"",
        ] {
            assert!(!head_ends(open), "{}", String::from_utf8_lossy(open));
        }
    }
}
