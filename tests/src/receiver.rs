//! A webhook receiver for tests: records every POST (headers, body).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One delivery as received.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Lower-case header names and values.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Delivery {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// A running receiver.
pub struct Receiver {
    /// `http://127.0.0.1:PORT/hook`.
    pub url: String,
    /// What arrived.
    pub got: Arc<Mutex<Vec<Delivery>>>,
    _task: tokio::task::JoinHandle<()>,
}

/// Starts a receiver on port 0.
pub async fn spawn_receiver() -> Receiver {
    let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let g = got.clone();
    let app = axum_router(g);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Receiver {
        url: format!("http://{addr}/hook"),
        got,
        _task: task,
    }
}

/// Starts a receiver on port 0 that speaks HTTPS with `tls`; its URL is
/// `https://localhost:PORT/hook`.
pub async fn spawn_receiver_tls(tls: &mock_provider::TlsOptions) -> Receiver {
    let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let app = axum_router(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let config = tls.server_config().unwrap();
    let task = tokio::spawn(mock_provider::serve_tls(listener, app, config));
    Receiver {
        url: format!("https://localhost:{}/hook", addr.port()),
        got,
        _task: task,
    }
}

/// A receiver whose first delivery is recorded at once but answered only
/// after [`Held::release`]; later deliveries are answered at once.
pub struct Held {
    /// The receiver.
    pub receiver: Receiver,
    arrived: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
}

impl Held {
    /// Waits until the first delivery has arrived (and is being held).
    pub async fn first_arrived(&self) {
        self.arrived.notified().await;
    }
    /// Lets the held first delivery be answered `204`.
    pub fn release(&self) {
        self.release.notify_one();
    }
}

/// Starts a receiver on port 0 that holds its first delivery's answer.
pub async fn spawn_receiver_holding_first() -> Held {
    let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let arrived = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (g, a, r) = (got.clone(), arrived.clone(), release.clone());
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(
            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let (got, arrived, release, first) =
                    (g.clone(), a.clone(), r.clone(), first.clone());
                async move {
                    got.lock().unwrap().push(delivery(&headers, &body));
                    if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        arrived.notify_one();
                        release.notified().await;
                    }
                    axum::http::StatusCode::NO_CONTENT
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Held {
        receiver: Receiver {
            url: format!("http://{addr}/hook"),
            got,
            _task: task,
        },
        arrived,
        release,
    }
}

fn delivery(headers: &axum::http::HeaderMap, body: &[u8]) -> Delivery {
    Delivery {
        headers: headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: body.to_vec(),
    }
}

fn axum_router(got: Arc<Mutex<Vec<Delivery>>>) -> axum::Router {
    axum::Router::new().route(
        "/hook",
        axum::routing::post(
            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let got = got.clone();
                async move {
                    got.lock().unwrap().push(delivery(&headers, &body));
                    axum::http::StatusCode::NO_CONTENT
                }
            },
        ),
    )
}
