//! A payments-like demo provider with fault injection.
//!
//! Endpoints:
//! - `POST /v1/charges`: creates a charge from a JSON body
//!   (`{"amount": 100, "currency": "eur", "client_ref": "…"}`) or a form
//!   body in Stripe's bracket syntax (`amount=100&currency=eur&metadata[order]=42`,
//!   `application/x-www-form-urlencoded`). When an
//!   `Idempotency-Key` header is sent, a repeat with the same key returns the
//!   first charge and applies no new effect.
//! - `GET /v1/charges?client_ref=…` / `?idempotency_key=…`: read-back,
//!   `{"data": [charge, …]}`. Charges become visible here only after
//!   `readback_lag_ms` (see faults).
//! - `GET /v1/charges/{id}`: one charge, or 404.
//!   Every read-back is logged with its query and when it started and
//!   ended ([`Provider::readback_log`]); `readback_delay_ms` holds each
//!   one open that long.
//! - `POST /v1/refunds`: refunds a charge, from JSON or a Stripe-style form
//!   body (`charge=ch_1&reason=requested_by_customer`); `charge` must name
//!   an existing charge (400 otherwise). Honours `Idempotency-Key` like
//!   charges. Answers `{"id": "re_N", "object": "refund", "charge", "status":
//!   "succeeded", …}`.
//! - `GET /v1/refunds?charge=…`: read-back of refunds, `{"data": [refund, …]}`.
//! - `GET /stats`: `{"effects": n, "requests": n, "readbacks": n, "refunds": n}`.
//! - `GET /requests`: every request seen (method, path, headers).
//! - `POST /admin/faults`: set fault knobs (JSON [`Faults`]); `POST /admin/reset`.
//!
//! Answers are gzipped when the request's `Accept-Encoding` asks for it.
//! Over TLS ([`spawn_tls`]) it speaks HTTP/2 or HTTP/1.1 by ALPN and can
//! require client certificates; every request's HTTP version is recorded.
//!
//! Per-request fault headers:
//! - `X-Mock-Delay-Ms: N`: wait N ms before handling;
//! - `X-Mock-Fault: drop-after-effect`: apply the effect, then close the
//!   connection without answering;
//! - `X-Mock-Fault: fail-503:N`: the first N requests with this request's
//!   `Idempotency-Key` (or `client_ref`) get 503 without an effect;
//! - `X-Mock-Fault: status:CODE`: answer CODE without an effect;
//! - `X-Mock-Fault: delay-reply:MS`: apply the effect, then wait MS before answering;
//! - `X-Mock-Fault: cut-body-after-effect`: apply the effect, then answer
//!   200 with the whole body's `Content-Length` and send only its first 10
//!   bytes before closing the connection;
//! - `X-Mock-Fault: stall-body-after-effect`: the same, but the body then
//!   stalls (the connection stays open, nothing more is sent).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Notify;

mod api;
pub use api::{form_to_json, router};

/// Fault knobs, consumed request by request (the `_times` counters count down).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// The next N charge requests get 503 and apply nothing.
    pub fail_503_times: u32,
    /// `Retry-After` seconds sent with those 503s.
    pub retry_after_s: Option<u32>,
    /// The next N charge requests apply the effect, then the connection drops.
    pub drop_after_effect_times: u32,
    /// The next N charge requests get `fail_status` and apply nothing.
    pub fail_status_times: u32,
    /// Status for `fail_status_times` (e.g. 400 or 500).
    pub fail_status: u16,
    /// Delay in ms added to the next `delay_times` charge requests.
    pub delay_ms: u64,
    /// How many charge requests get `delay_ms`.
    pub delay_times: u32,
    /// A charge appears in read-back only this many ms after creation.
    pub readback_lag_ms: u64,
    /// The next N read-back requests get 500.
    pub readback_fail_times: u32,
    /// While true, read-back shows no charges at all (a lagging search index).
    pub readback_hidden: bool,
    /// Every read-back takes this long (ms) before it answers.
    pub readback_delay_ms: u64,
    /// The next N refund requests apply the refund, then the connection drops.
    pub refund_drop_after_effect_times: u32,
    /// While set, every refund is applied and then answered this many ms later.
    pub refund_delay_reply_ms: u64,
}

/// One refund.
#[derive(Debug, Clone, Serialize)]
pub struct Refund {
    /// `re_<n>`.
    pub id: String,
    /// Always `"refund"`.
    pub object: &'static str,
    /// The refunded charge's id.
    pub charge: String,
    /// Amount (the charge's, unless the body names one).
    pub amount: Value,
    /// Reason, as sent.
    pub reason: Value,
    /// Always `"succeeded"`.
    pub status: &'static str,
    /// Idempotency key the refund was created with, if any.
    pub idempotency_key: Option<String>,
    /// Free-form key-value pairs.
    pub metadata: Value,
}

/// One charge.
#[derive(Debug, Clone, Serialize)]
pub struct Charge {
    /// `ch_<n>`.
    pub id: String,
    /// Always `"charge"` (as Stripe's objects say what they are).
    pub object: &'static str,
    /// Amount in minor units.
    pub amount: Value,
    /// Currency.
    pub currency: Value,
    /// Caller's reference, if any.
    pub client_ref: Option<String>,
    /// Idempotency key the charge was created with, if any.
    pub idempotency_key: Option<String>,
    /// Free-form key-value pairs (`metadata[k]=v` in a form body).
    pub metadata: Value,
    #[serde(skip)]
    created: Option<Instant>,
}

/// A request as the provider saw it.
#[derive(Debug, Clone, Serialize)]
pub struct SeenRequest {
    /// Method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// `HTTP/1.1` or `HTTP/2.0`.
    pub version: String,
    /// Headers (lower-case names).
    pub headers: Vec<(String, String)>,
}

/// An append-only list in chunks of [`Log::CHUNK`] items: a push never
/// moves the items before it. The request log and the charges grow by
/// millions in a benchmark, and a `Vec` that doubles then copies (and
/// faults in) hundreds of MiB while it holds the provider's lock, which
/// stalled every request for up to a second.
#[derive(Debug)]
struct Log<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Log<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T: Clone> Log<T> {
    /// Items per chunk.
    const CHUNK: usize = 4096;

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, item: T) {
        match self.chunks.last_mut() {
            Some(c) if c.len() < Self::CHUNK => c.push(item),
            _ => {
                let mut c = Vec::with_capacity(Self::CHUNK);
                c.push(item);
                self.chunks.push(c);
            }
        }
        self.len += 1;
    }

    fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / Self::CHUNK)?.get(i % Self::CHUNK)
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    fn to_vec(&self) -> Vec<T> {
        self.iter().cloned().collect()
    }
}

#[derive(Debug, Default)]
struct Inner {
    refunds: Vec<Refund>,
    refunds_by_key: HashMap<String, usize>,
    charges: Log<Charge>,
    by_key: HashMap<String, usize>,
    requests: Log<SeenRequest>,
    readbacks: u64,
    readback_log: Vec<ReadBack>,
    faults: Faults,
    per_key_failures: HashMap<String, u32>,
}

/// One read-back request, as logged.
#[derive(Debug, Clone)]
pub struct ReadBack {
    /// The query string (`client_ref=…` or `idempotency_key=…`).
    pub query: String,
    /// When it arrived.
    pub started: Instant,
    /// When it was answered.
    pub ended: Instant,
}

/// Shared provider state; tests read counts from it directly.
#[derive(Debug, Clone, Default)]
pub struct Provider {
    inner: Arc<Mutex<Inner>>,
}

impl Provider {
    /// Number of effects applied (charges created).
    pub fn effects(&self) -> usize {
        self.inner.lock().unwrap().charges.len()
    }
    /// Every request seen so far.
    pub fn requests(&self) -> Vec<SeenRequest> {
        self.inner.lock().unwrap().requests.to_vec()
    }
    /// Number of read-back (GET /v1/charges) requests.
    pub fn readbacks(&self) -> u64 {
        self.inner.lock().unwrap().readbacks
    }
    /// Every answered read-back, in the order they ended.
    pub fn readback_log(&self) -> Vec<ReadBack> {
        self.inner.lock().unwrap().readback_log.clone()
    }
    /// Pairs of read-backs with the same query that were open at the same
    /// time (each pair once).
    pub fn overlapping_readbacks(&self) -> Vec<(ReadBack, ReadBack)> {
        let log = self.readback_log();
        let mut out = Vec::new();
        for (i, a) in log.iter().enumerate() {
            for b in &log[i + 1..] {
                if a.query == b.query && a.started < b.ended && b.started < a.ended {
                    out.push((a.clone(), b.clone()));
                }
            }
        }
        out
    }
    /// The refunds made.
    pub fn refunds(&self) -> Vec<Refund> {
        self.inner.lock().unwrap().refunds.clone()
    }
    /// The charges created.
    pub fn charges(&self) -> Vec<Charge> {
        self.inner.lock().unwrap().charges.to_vec()
    }
    /// Replaces the fault knobs.
    pub fn set_faults(&self, f: Faults) {
        self.inner.lock().unwrap().faults = f;
    }
}

/// Closes the current connection without a response when notified.
#[derive(Clone)]
struct ConnKill(Arc<Notify>);

/// A running provider.
pub struct MockProvider {
    /// Bound address.
    pub addr: SocketAddr,
    /// Its state.
    pub provider: Provider,
    tls: bool,
    task: tokio::task::JoinHandle<()>,
}

impl MockProvider {
    /// Base URL: `http://127.0.0.1:PORT`, or over TLS
    /// `https://localhost:PORT` (the name a test certificate is issued for).
    pub fn url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `addr` (port 0 picks one) and serves in the background.
pub async fn spawn(addr: SocketAddr) -> std::io::Result<MockProvider> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let provider = Provider::default();
    let app = router(provider.clone());
    let task = tokio::spawn(serve(listener, app));
    Ok(MockProvider {
        addr,
        provider,
        tls: false,
        task,
    })
}

/// TLS settings of a provider started with [`spawn_tls`] (PEM texts).
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// Server certificate chain, leaf first.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
    /// When set, clients must present a certificate issued by this CA.
    pub client_ca_pem: Option<String>,
    /// Offer `h2` in ALPN (default `true` through [`TlsOptions::new`]);
    /// `false` leaves HTTP/1.1 only.
    pub http2: bool,
}

impl TlsOptions {
    /// A server certificate and key, HTTP/2 offered, no client certificates.
    pub fn new(cert_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        Self {
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            client_ca_pem: None,
            http2: true,
        }
    }

    /// The rustls server config (ring provider).
    ///
    /// Errors: PEM that doesn't parse, or a key that doesn't fit.
    pub fn server_config(&self) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                    roots.add(c?)?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut cfg = builder.with_single_cert(certs, key)?;
        cfg.alpn_protocols = if self.http2 {
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        Ok(Arc::new(cfg))
    }
}

/// [`spawn`] over TLS.
///
/// Errors: the address can't be bound, or the TLS material is unusable.
pub async fn spawn_tls(addr: SocketAddr, tls: &TlsOptions) -> anyhow::Result<MockProvider> {
    let config = tls.server_config()?;
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let provider = Provider::default();
    let app = router(provider.clone());
    let task = tokio::spawn(serve_tls(listener, app, config));
    Ok(MockProvider {
        addr,
        provider,
        tls: true,
        task,
    })
}

/// Accept loop over TLS: HTTP/2 or HTTP/1.1 as ALPN decided; a handshake
/// that fails (a client without the required certificate) closes the
/// connection.
pub async fn serve_tls(listener: TcpListener, app: Router, config: Arc<rustls::ServerConfig>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (app, acceptor) = (app.clone(), acceptor.clone());
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(stream).await else {
                return;
            };
            serve_connection(hyper_util::rt::TokioIo::new(tls), app).await;
        });
    }
}

/// Accept loop: hyper per connection, so a handler can drop its connection.
pub async fn serve(listener: TcpListener, app: Router) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let app = app.clone();
        tokio::spawn(serve_connection(hyper_util::rt::TokioIo::new(stream), app));
    }
}

async fn serve_connection<I>(io: I, app: Router)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let kill = Arc::new(Notify::new());
    let k2 = kill.clone();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(ConnKill(k2.clone()));
        let app = app.clone();
        async move {
            use tower_service::Service;
            let mut app = app;
            app.call(req.map(axum::body::Body::new)).await
        }
    });
    let builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    let conn = builder.serve_connection(io, svc);
    tokio::select! {
        _ = conn => {}
        _ = kill.notified() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_order_and_index_across_chunks() {
        let mut log = Log::default();
        let n = Log::<usize>::CHUNK * 2 + 3;
        for i in 0..n {
            log.push(i);
        }
        assert_eq!(log.len(), n);
        assert_eq!(log.chunks.len(), 3);
        assert_eq!(log.get(Log::<usize>::CHUNK), Some(&Log::<usize>::CHUNK));
        assert_eq!(log.get(n - 1), Some(&(n - 1)));
        assert_eq!(log.get(n), None);
        assert_eq!(log.to_vec(), (0..n).collect::<Vec<_>>());
        // A full chunk is never reallocated: its first item stays put.
        let first = log.get(0).unwrap() as *const usize;
        log.push(n);
        assert_eq!(first, log.get(0).unwrap() as *const usize);
    }
}
