//! An HTTP `CONNECT` proxy on loopback (RFC 9110 §9.3.6), for the egress
//! tests: it tunnels to any destination, records each one, and can demand
//! `Proxy-Authorization` (407 otherwise). Anything but `CONNECT` gets 405.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running proxy.
pub struct ConnectProxy {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// `host:port` of every tunnel opened, in order.
    pub tunnels: Arc<Mutex<Vec<String>>>,
    /// Requests refused for their credentials.
    pub refused: Arc<Mutex<u32>>,
    _task: tokio::task::JoinHandle<()>,
}

/// Starts a proxy on port 0. With `credentials` (`user:password`), a
/// `CONNECT` without the matching `Proxy-Authorization: Basic` gets 407.
pub async fn spawn_connect_proxy(credentials: Option<&str>) -> ConnectProxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let expected = credentials.map(|c| {
        use base64::Engine as _;
        format!(
            "basic {}",
            base64::engine::general_purpose::STANDARD.encode(c.as_bytes())
        )
    });
    let tunnels: Arc<Mutex<Vec<String>>> = Arc::default();
    let refused: Arc<Mutex<u32>> = Arc::default();
    let (t, r) = (tunnels.clone(), refused.clone());
    let task = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let (t, r, expected) = (t.clone(), r.clone(), expected.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match inbound.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                    if head.len() > 16 * 1024 {
                        return;
                    }
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let mut lines = text.split("\r\n");
                let first: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
                if first.len() < 3 || first[0] != "CONNECT" {
                    let _ = inbound
                        .write_all(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                        .await;
                    return;
                }
                let auth = lines
                    .filter_map(|l| l.split_once(':'))
                    .find(|(n, _)| n.trim().eq_ignore_ascii_case("proxy-authorization"))
                    .map(|(_, v)| v.trim().to_ascii_lowercase());
                if let Some(want) = &expected
                    && auth.as_ref() != Some(&want.to_ascii_lowercase())
                {
                    *r.lock().unwrap() += 1;
                    let _ = inbound
                        .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"test\"\r\nContent-Length: 0\r\n\r\n")
                        .await;
                    return;
                }
                let target = first[1].to_owned();
                let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                    let _ = inbound
                        .write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                        .await;
                    return;
                };
                t.lock().unwrap().push(target);
                if inbound
                    .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    .await
                    .is_err()
                {
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    ConnectProxy {
        url,
        tunnels,
        refused,
        _task: task,
    }
}
