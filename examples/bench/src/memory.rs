//! (m) The gateway's resident memory after 1,000 and after 100,000
//! effectful calls (unique keys), measured on an `effectgate serve`
//! process of its own in front of the bench's mock provider: the bench
//! process itself holds the mock provider, which keeps every request it
//! saw, so its own RSS would measure the mock. The binary is found as
//! [`process::binary`] says.

use crate::process;
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

/// Runs (m), or says why it can't (no gateway binary: `None`).
pub async fn measure(
    client: &HttpClient,
    up: &str,
    hash: &str,
    c: usize,
) -> anyhow::Result<Option<Memory>> {
    let Some(bin) = process::binary() else {
        println!(
            "(m) skipped: no effectgate binary next to the bench (cargo build --release -p bench -p effectgate) and no $BENCH_EFFECTGATE_BIN"
        );
        return Ok(None);
    };
    let replay_cache_bytes: u64 = 64 << 20;
    let gw = process::spawn(
        &bin,
        &format!(
            "[storage]\npath = \"{{db}}\"\nreplay_cache_bytes = {replay_cache_bytes}\n{}",
            crate::config::tenant_and_routes(up, hash)
        ),
        &[("RUST_LOG", "warn")],
    )
    .await
    .map_err(|e| anyhow::anyhow!("(m): {e}"))?;
    let pid = gw.pid();
    let proxy = gw.proxy;
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
