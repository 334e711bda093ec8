//! (m) The gateway's resident memory after 1,000 and after 100,000
//! effectful calls (unique keys), measured on an `effectgate serve`
//! process of its own in front of the bench's mock provider: the bench
//! process itself holds the mock provider, which keeps every request it
//! saw, so its own RSS would measure the mock. The binary is
//! `$EFFECTGATE_BIN`, else `effectgate` next to the bench's binary (`cargo
//! build --release -p bench -p effectgate`).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{HttpClient, run};

/// What (m) measured.
pub struct Memory {
    /// RSS after the first 1,000 calls, MiB.
    pub at_1k: f64,
    /// RSS after 100,000 more, MiB.
    pub at_100k: f64,
    /// Failed calls of both rounds.
    pub errors: usize,
    /// The gateway's `storage.replay_cache_bytes`, MiB.
    pub replay_cache_mib: f64,
}

/// The gateway process; killed when dropped.
struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("EFFECTGATE_BIN") {
        return Some(PathBuf::from(p));
    }
    let p = std::env::current_exe().ok()?.parent()?.join("effectgate");
    p.exists().then_some(p)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `VmRSS` of process `pid`, MiB.
fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// Whether `GET /readyz` on `port` answers 200.
fn ready(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// Runs (m), or says why it can't (no gateway binary: `None`).
pub async fn measure(
    client: &HttpClient,
    up: &str,
    hash: &str,
    c: usize,
) -> anyhow::Result<Option<Memory>> {
    let Some(bin) = binary() else {
        println!(
            "(m) skipped: no effectgate binary next to the bench (cargo build --release -p bench -p effectgate) and no $EFFECTGATE_BIN"
        );
        return Ok(None);
    };
    let dir = tempfile::tempdir()?;
    let (proxy, admin) = (free_port()?, free_port()?);
    let cfg = dir.path().join("memory.toml");
    let replay_cache_bytes: u64 = 64 << 20;
    std::fs::write(
        &cfg,
        format!(
            r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
path = "{db}"
replay_cache_bytes = {replay_cache_bytes}
[[tenants]]
id = "bench"
keys = [{{ role = "client", sha256 = "{hash}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{up}"
effectful_methods = ["POST"]
provider_idempotency_header = "Idempotency-Key"
"#,
            db = dir.path().join("memory.db").display(),
        ),
    )?;
    let child = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let mut gw = Gateway(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready(admin) {
        if gw.0.try_wait()?.is_some() || Instant::now() > deadline {
            anyhow::bail!("(m): {} did not become ready", bin.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = gw.0.id();
    let pay = format!("http://127.0.0.1:{proxy}/pay/v1/charges");
    let small = run(
        "(m) 1,000 effectful (own process)",
        client,
        pay.clone(),
        1_000,
        c,
        |i| Some(format!("m1-{i}")),
        true,
    )
    .await;
    let at_1k = rss_mib(pid);
    let big = run(
        "(m) 100,000 effectful (own process)",
        client,
        pay,
        100_000,
        c,
        |i| Some(format!("m2-{i}")),
        true,
    )
    .await;
    let at_100k = rss_mib(pid);
    drop(gw);
    Ok(match (at_1k, at_100k) {
        (Some(at_1k), Some(at_100k)) => Some(Memory {
            at_1k,
            at_100k,
            errors: small.errors + big.errors,
            replay_cache_mib: replay_cache_bytes as f64 / (1 << 20) as f64,
        }),
        _ => None,
    })
}
