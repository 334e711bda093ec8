//! Serving a router on one listener, in plain HTTP or over TLS: HTTP/1.1,
//! and HTTP/2 (negotiated by ALPN on TLS listeners, RFC 7301; by the
//! connection preface otherwise). Each request carries the peer address
//! (`ConnectInfo`) and the scheme the caller used ([`ListenerScheme`]).
//! Shutdown is graceful: the listener stops accepting, idle connections
//! close, and in-flight requests finish.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::tls::ListenerCert;

/// How long a TLS handshake may take, in ms, before the connection is closed.
pub const TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;

/// The scheme a caller reached a listener with: `"http"` or `"https"`.
/// Set on every request as an extension; it feeds `X-Forwarded-Proto` and
/// the console cookie's `Secure` attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerScheme(pub &'static str);

impl ListenerScheme {
    /// The scheme of the listener a request came in on (`"http"` when the
    /// request didn't come through [`serve`], as in unit tests).
    pub fn of(ext: &http::Extensions) -> &'static str {
        ext.get::<ListenerScheme>().map_or("http", |s| s.0)
    }
}

/// Serves `app` on `tcp` until `shutdown` turns true, then drains.
/// With `tls`, every connection is a TLS server connection using its
/// (reloadable) certificate.
///
/// Errors: none once bound; a failed accept (e.g. out of descriptors) is
/// logged and retried after a short pause.
pub async fn serve(
    tcp: TcpListener,
    tls: Option<Arc<ListenerCert>>,
    app: Router,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(c.server_config()));
    let scheme = ListenerScheme(if acceptor.is_some() { "https" } else { "http" });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let stop = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = tcp.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let (app, builder, acceptor) = (app.clone(), builder.clone(), acceptor.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req.extensions_mut().insert(scheme);
                    let mut app = app.clone();
                    async move {
                        use tower_service::Service;
                        app.call(req.map(axum::body::Body::new)).await
                    }
                });
            let result = match acceptor {
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    let handshake = tokio::time::timeout(
                        Duration::from_millis(TLS_HANDSHAKE_TIMEOUT_MS),
                        acceptor.accept(stream),
                    )
                    .await;
                    let stream = match handshake {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    watcher.watch(conn.into_owned()).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(tcp);
    graceful.shutdown().await;
    Ok(())
}
