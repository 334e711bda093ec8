//! A TCP relay between one gateway and PostgreSQL that can cut (close
//! every relayed connection and refuse new ones), stall (hold every
//! byte: a black hole) and restore.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const UP: u8 = 0;
const CUT: u8 = 1;
const STALL: u8 = 2;

/// A running relay.
pub struct Relay {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    mode: Arc<AtomicU8>,
    cut: tokio::sync::watch::Sender<u64>,
}

impl Relay {
    /// Starts a relay to `target` (`host:port`).
    pub async fn start(target: String) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let mode = Arc::new(AtomicU8::new(UP));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (m, c) = (mode.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if m.load(Ordering::SeqCst) == CUT {
                    continue; // dropped: the connection is closed at once
                }
                let mut cut = c.subscribe();
                let (m, target) = (m.clone(), target.clone());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::select! {
                        _ = pump(ri, wo, m.clone()) => {}
                        _ = pump(ro, wi, m) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Ok(Relay { port, mode, cut })
    }

    /// Closes every relayed connection and refuses new ones.
    pub fn cut(&self) {
        self.mode.store(CUT, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Holds every byte (connections stay open, nothing moves).
    pub fn stall(&self) {
        self.mode.store(STALL, Ordering::SeqCst);
    }

    /// Relays again.
    pub fn restore(&self) {
        self.mode.store(UP, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<AtomicU8>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        loop {
            match mode.load(Ordering::SeqCst) {
                UP => break,
                CUT => return,
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
