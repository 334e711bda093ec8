//! (t) The cost of trace export: pass-through and effectful throughput
//! with export paused and on (sampling 1.0, OTLP/HTTP to a receiver on
//! loopback that reads and discards each export) in alternating rounds on
//! one gateway, as ratios of the medians on/off from one run. Runs last:
//! the tracer is process-wide and stays installed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{HttpClient, Stats, run};

/// A gateway with a pass-through route `/pass/` and an effectful route
/// `/pay/` in front of `up`, for the bench client key (`hash`); also the
/// gateway of scenarios (b)–(d).
pub async fn gateway(
    up: &str,
    hash: &str,
) -> anyhow::Result<(effectgate::Gateway, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let toml = format!(
        r#"
[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"
[storage]
path = "{db}"
[[tenants]]
id = "bench"
keys = [{{ role = "client", sha256 = "{hash}" }}]
[[routes]]
name = "pass"
prefix = "/pass/"
upstream = "{up}"
mode = "pass"
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{up}"
effectful_methods = ["POST"]
provider_idempotency_header = "Idempotency-Key"
"#,
        db = dir.path().join("bench.db").display(),
    );
    let cfg = dir.path().join("bench.toml");
    std::fs::write(&cfg, toml)?;
    let gw = effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await?;
    Ok((gw, dir))
}

/// Rounds of (t): export off and on alternate, half each.
const ROUNDS: usize = 8;

async fn measure(
    client: &HttpClient,
    gw: &effectgate::Gateway,
    round: usize,
    n: usize,
    c: usize,
) -> (Stats, Stats) {
    let pass = format!("http://{}/pass/v1/charges", gw.proxy_addr);
    let pay = format!("http://{}/pay/v1/charges", gw.proxy_addr);
    let (pn, en): (&'static str, &'static str) = if round.is_multiple_of(2) {
        ("(t) pass-through, export off", "(t) effectful, export off")
    } else {
        ("(t) pass-through, export on", "(t) effectful, export on")
    };
    let p = run(pn, client, pass, 2 * n, c, |_| None, true).await;
    let e = run(
        en,
        client,
        pay,
        (n / 2).max(200),
        c,
        move |i| Some(format!("t-{round}-{i}")),
        true,
    )
    .await;
    (p, e)
}

/// The median of `xs` (not empty).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[m - 1] + xs[m]) / 2.0
    } else {
        xs[m]
    }
}

/// Runs the scenario and prints its table and ratios: one gateway, the
/// exporter installed once, and [`ROUNDS`] rounds of `2n` pass-through and
/// `n/2` effectful calls in which export is paused
/// ([`effectgate::telemetry::pause_export`]) and on in turn, so that drift
/// of the machine over the run falls on both sides alike.
pub async fn export_on_off(
    client: &HttpClient,
    up: &str,
    hash: &str,
    n: usize,
    c: usize,
) -> anyhow::Result<()> {
    // The receiver: answers 200 to every export, counting them.
    let exports = Arc::new(AtomicU64::new(0));
    let counted = exports.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::Relaxed);
                drop(body);
                axum::http::StatusCode::OK
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", l.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    // Logs: warnings only, as the other scenarios (which run with no
    // subscriber at all) write none either.
    let telemetry = effectgate::telemetry::init_with(
        effectgate::telemetry::LogFormat::Text,
        &effectgate::telemetry::TelemetrySettings {
            traces_endpoint: Some(effectgate::telemetry::traces_url(&endpoint)),
            sampling_ratio: 1.0,
            ..Default::default()
        },
        "warn",
    )?;
    let (gw, _dir) = gateway(up, hash).await?;
    let mut rows = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        effectgate::telemetry::pause_export(round.is_multiple_of(2));
        rows.push(measure(client, &gw, round, n, c).await);
    }
    effectgate::telemetry::pause_export(false);
    gw.shutdown().await;
    let telemetry = Arc::new(telemetry);
    let t2 = telemetry.clone();
    tokio::task::spawn_blocking(move || t2.flush()).await?;

    println!(
        "trace export (OTLP/HTTP to a loopback receiver, sampling 1.0), one gateway, {ROUNDS} rounds, export off and on in turn:"
    );
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for (p, e) in &rows {
        for s in [p, e] {
            println!(
                "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
                s.name, s.rps, s.p50_us, s.p99_us, s.errors
            );
        }
    }
    let side = |on: bool, pass: bool| {
        median(
            rows.iter()
                .enumerate()
                .filter(|(i, _)| i.is_multiple_of(2) != on)
                .map(|(_, (p, e))| if pass { p.rps } else { e.rps })
                .collect(),
        )
    };
    println!(
        "ratios of median throughput on/off, same run: pass-through = {:.3}, effectful = {:.3} (aim: at least 0.9); {} export requests received",
        side(true, true) / side(false, true),
        side(true, false) / side(false, false),
        exports.load(Ordering::Relaxed)
    );
    Ok(())
}
