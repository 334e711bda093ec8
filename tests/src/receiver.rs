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

fn axum_router(got: Arc<Mutex<Vec<Delivery>>>) -> axum::Router {
    axum::Router::new().route(
        "/hook",
        axum::routing::post(
            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let got = got.clone();
                async move {
                    let headers = headers
                        .iter()
                        .map(|(n, v)| {
                            (
                                n.as_str().to_owned(),
                                String::from_utf8_lossy(v.as_bytes()).into_owned(),
                            )
                        })
                        .collect();
                    got.lock().unwrap().push(Delivery {
                        headers,
                        body: body.to_vec(),
                    });
                    axum::http::StatusCode::NO_CONTENT
                }
            },
        ),
    )
}
