//! The outbound HTTP client: HTTP/1.1 or HTTP/2 (chosen by ALPN) over TLS
//! for `https://` providers, plain HTTP/1.1 for `http://`, pooled per route,
//! optionally through an HTTP `CONNECT` proxy (RFC 9110 §9.3.6).
//!
//! Proxy choice, per client:
//! - [`Proxy::Environment`] (the default): `HTTPS_PROXY` for `https://`
//!   destinations, `HTTP_PROXY` for `http://`, `ALL_PROXY` for both, hosts
//!   in `NO_PROXY` direct (lower-case names are read too, as curl does).
//!   Credentials in the proxy URL (`http://user:pass@host:port`) are sent
//!   as `Proxy-Authorization: Basic`.
//! - [`Proxy::Via`]: a route's own `proxy = "http://host:port"`, which wins
//!   over the environment (and `NO_PROXY`).
//! - [`Proxy::Direct`]: `proxy = "direct"`, never through a proxy.
//!
//! Every destination reached through a proxy is tunnelled with `CONNECT`,
//! also plain `http://` ones (the proxy can still read those: use
//! `https://` upstreams). Only `http://` proxies are supported: a
//! `https://` or `socks5://` proxy from the environment is an error, never
//! a plaintext `CONNECT` with its credentials.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderValue, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

mod pool;

pub use pool::{Error, HttpClient, ResponseBody};

/// The body type of requests to providers: a caller's streamed body on
/// pass-through routes, or bytes from the ledger.
pub type OutboundBody = Body;

/// How a client reaches its destinations (see the module docs).
#[derive(Clone, Debug, Default)]
pub enum Proxy {
    /// `HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY` / `NO_PROXY`, read when
    /// the client is built (at start and on every reload).
    #[default]
    Environment,
    /// Never through a proxy.
    Direct,
    /// Always through this proxy (`http://host:port`), with an optional
    /// `Proxy-Authorization` value.
    Via {
        /// The proxy.
        uri: Uri,
        /// `Basic …` credentials, if the proxy wants them.
        auth: Option<HeaderValue>,
    },
}

/// What one outbound client is built from.
#[derive(Debug)]
pub struct ClientOptions {
    /// TCP connect timeout, ms (to the provider, or to the proxy).
    pub connect_timeout_ms: u64,
    /// How long an idle connection is kept for the next request, ms
    /// (a route's `idle_connection_timeout_ms`; default
    /// [`DEFAULT_IDLE_TIMEOUT_MS`]).
    pub idle_timeout_ms: u64,
    /// TLS settings (roots, client certificate).
    pub tls: rustls::ClientConfig,
    /// Name to send in SNI and verify the certificate against, instead of
    /// the URL's host (for providers addressed by IP).
    pub server_name: Option<rustls_pki_types::ServerName<'static>>,
    /// Egress proxy.
    pub proxy: Proxy,
}

/// Builds a pooled client: HTTP/2 when the provider offers `h2` in ALPN,
/// HTTP/1.1 otherwise; idle connections are kept `idle_timeout_ms`.
pub fn build_client(opts: ClientOptions) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_millis(opts.connect_timeout_ms)));
    http.set_nodelay(true);
    // `https://` destinations pass through this connector too (TLS is
    // layered on top of it).
    http.enforce_http(false);
    let proxy = match opts.proxy {
        Proxy::Environment => {
            let m = Matcher::from_env();
            Route::Env(Arc::new(m))
        }
        Proxy::Direct => Route::Direct,
        Proxy::Via { uri, auth } => Route::Via(uri, auth),
    };
    let egress = Egress { http, route: proxy };
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(opts.tls)
        .https_or_http();
    let builder = match opts.server_name {
        Some(name) => {
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let connector = builder.enable_all_versions().wrap_connector(egress);
    HttpClient::new(connector, Duration::from_millis(opts.idle_timeout_ms))
}

/// How long an idle provider connection is kept open unless a route says
/// otherwise: 30,000 ms.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 30_000;

#[derive(Clone, Debug)]
enum Route {
    Direct,
    Env(Arc<Matcher>),
    Via(Uri, Option<HeaderValue>),
}

/// The TCP layer under TLS: a direct connection, or a `CONNECT` tunnel
/// through the chosen proxy.
#[derive(Clone, Debug)]
pub struct Egress {
    http: HttpConnector,
    route: Route,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for Egress {
    type Response = TokioIo<TcpStream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The HTTP connector is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let via = match &self.route {
            Route::Direct => None,
            Route::Env(m) => m
                .intercept(&dst)
                .map(|i| (i.uri().clone(), i.basic_auth().cloned())),
            Route::Via(uri, auth) => Some((uri.clone(), auth.clone())),
        };
        let mut http = self.http.clone();
        Box::pin(async move {
            if let Some((proxy, _)) = &via
                && proxy.scheme_str() != Some("http")
            {
                return Err(format!(
                    "egress proxy {proxy}: only http:// proxies are supported (HTTPS_PROXY/HTTP_PROXY/ALL_PROXY)"
                )
                .into());
            }
            let Some((proxy, auth)) = via else {
                return http.call(dst).await.map_err(Into::into);
            };
            // CONNECT names host:port explicitly (the default port of the
            // destination's scheme when its URL has none).
            let https = dst.scheme_str() == Some("https");
            let host = dst.host().ok_or("the destination URL has no host")?;
            let port = dst.port_u16().unwrap_or(if https { 443 } else { 80 });
            let target: Uri = format!("{}://{host}:{port}/", if https { "https" } else { "http" })
                .parse()
                .map_err(|e| format!("cannot tunnel to {host}:{port}: {e}"))?;
            let mut tunnel = Tunnel::new(proxy.clone(), http);
            if let Some(a) = auth {
                tunnel = tunnel.with_auth(a);
            }
            tunnel
                .call(target)
                .await
                .map_err(|e| format!("egress proxy {proxy}: {e}").into())
        })
    }
}
