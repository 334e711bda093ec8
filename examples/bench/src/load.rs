//! The load generator: `requests` POSTs, `concurrency` at a time, and
//! their throughput and latency percentiles.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::{BODY, CLIENT_KEY};

/// One scenario's figures: requests/s, p50 and p99 latency (µs), and the
/// requests that failed or were answered with a non-2xx status.
pub(crate) struct Stats {
    pub(crate) name: &'static str,
    pub(crate) rps: f64,
    pub(crate) p50_us: u128,
    pub(crate) p99_us: u128,
    pub(crate) errors: usize,
}

/// The benchmark's HTTP/1 client.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One URL or several.
pub(crate) struct Urls(Vec<String>);

impl From<String> for Urls {
    fn from(u: String) -> Self {
        Urls(vec![u])
    }
}

impl From<Vec<String>> for Urls {
    fn from(u: Vec<String>) -> Self {
        Urls(u)
    }
}

/// Sends `requests` POSTs, `concurrency` at a time; request `i` goes to
/// `urls[i % urls.len()]` (several gateway instances share the load).
pub(crate) async fn run(
    name: &'static str,
    client: &HttpClient,
    urls: impl Into<Urls>,
    requests: usize,
    concurrency: usize,
    key: impl Fn(usize) -> Option<String> + Send + Sync + 'static,
    auth: bool,
) -> Stats {
    let next = Arc::new(AtomicUsize::new(0));
    let key = Arc::new(key);
    let url: Arc<Vec<String>> = Arc::new(urls.into().0);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, next, key) = (client.clone(), url.clone(), next.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                let mut b = hyper::Request::post(&url[i % url.len()])
                    .header("content-type", "application/json");
                if auth {
                    b = b.header("authorization", format!("Bearer {CLIENT_KEY}"));
                }
                if let Some(k) = key(i) {
                    b = b.header("idempotency-key", k);
                }
                let req = b
                    .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                    .unwrap();
                let t = Instant::now();
                match client.request(req).await {
                    Ok(resp) => {
                        let ok = resp.status().is_success();
                        let _ = resp.into_body().collect().await;
                        if !ok {
                            errors += 1;
                        }
                    }
                    Err(_) => errors += 1,
                }
                lat.push(t.elapsed().as_micros());
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::with_capacity(requests);
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    let elapsed = start.elapsed();
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Stats {
        name,
        rps: requests as f64 / elapsed.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        errors,
    }
}
