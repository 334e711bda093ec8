//! (f) A normal client's latency on the pass-through route while a
//! slow-header flood (sockets that open, send half a request head and
//! stall) holds more connections than `limits.max_connections`; as ratios
//! to the same client without the flood, in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::{HttpClient, Stats, run};

/// Connection cap of the gateway under test.
const MAX_CONNECTIONS: usize = 64;
/// Slow sockets the flood keeps open (reconnecting as they are closed).
const FLOOD_SOCKETS: usize = 200;

/// Runs the flood scenario against a gateway of its own in front of
/// `upstream`; prints both lines and the ratios.
pub async fn slow_header_flood(
    client: &HttpClient,
    upstream: &str,
    key_hash: &str,
    requests: usize,
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let toml = format!(
        "{LISTEN}[storage]\npath = \"{db}\"\n[limits]\nmax_connections = {MAX_CONNECTIONS}\n\
         header_read_timeout_ms = 2000\n{tenant}{route}",
        LISTEN = crate::config::LISTEN,
        db = dir.path().join("flood.db").display(),
        tenant = crate::config::tenant(key_hash),
        route = crate::config::pass_route(upstream),
    );
    let gw = crate::config::start(dir.path(), "flood.toml", &toml).await?;
    let url = format!("http://{}/pass/v1/charges", gw.proxy_addr);
    let calm = run(
        "(f0) normal client, no flood",
        client,
        url.clone(),
        requests,
        4,
        |_| None,
        true,
    )
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let mut flood = Vec::new();
    for _ in 0..FLOOD_SOCKETS {
        let (stop, opened, addr) = (stop.clone(), opened.clone(), gw.proxy_addr);
        flood.push(tokio::spawn(async move {
            // Bounded: stops when told, and at most 10 000 reconnects each.
            for _ in 0..10_000 {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                opened.fetch_add(1, Ordering::Relaxed);
                let _ = s
                    .write_all(b"GET /pass/v1/charges HTTP/1.1\r\nHost: x\r\n")
                    .await;
                let mut buf = [0u8; 64];
                // Held until the gateway closes it, or the flood stops.
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match tokio::time::timeout(
                        Duration::from_millis(200),
                        tokio::io::AsyncReadExt::read(&mut s, &mut buf),
                    )
                    .await
                    {
                        Ok(Ok(0)) | Ok(Err(_)) => break,
                        _ => {}
                    }
                }
            }
        }));
    }
    // Let the flood fill the listener before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let flooded = run(
        "(f1) normal client, slow-header flood",
        client,
        url,
        requests,
        4,
        |_| None,
        true,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for f in flood {
        let _ = f.await;
    }
    gw.shutdown().await;
    println!(
        "slow-header flood: {FLOOD_SOCKETS} stalled sockets against max_connections = {MAX_CONNECTIONS} \
         ({} opened in all), a normal client with 4 connections:",
        opened.load(Ordering::Relaxed)
    );
    print_rows(&[&calm, &flooded]);
    println!(
        "ratios, flood to no flood, same run: p99 = {:.2}, throughput = {:.3}, errors {} vs {}",
        flooded.p99_us as f64 / calm.p99_us.max(1) as f64,
        flooded.rps / calm.rps,
        flooded.errors,
        calm.errors
    );
    Ok(())
}

fn print_rows(rows: &[&Stats]) {
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in rows {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
}
