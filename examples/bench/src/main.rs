//! Loopback load benchmark. Starts the mock provider and effectgate
//! in-process (SQLite ledger in a temp dir) and measures, in one run:
//!
//! - (a) direct: POST /v1/charges straight to the provider;
//! - (b) through effectgate on a pass-through route (no ledger);
//! - (c) through effectgate on an effectful route, a unique key per request;
//! - (n) nginx `proxy_pass` (keep-alive upstream) in front of the same
//!   provider, when nginx is installed, as the yardstick of (b), then both
//!   in alternating cycles (`paired.rs`), whose median ratio the targets
//!   table reports (so are (c) against (b) and, with `--postgres`,
//!   PostgreSQL against SQLite);
//! - (d) duplicates of one completed key (replays from the ledger);
//! - (f) a normal client's p99 and throughput with and without a
//!   slow-header flood larger than `limits.max_connections`;
//! - (g) pass-through to the same mock over HTTPS (certificates made at
//!   start), with HTTP/2 and with HTTP/1.1 by ALPN, as ratios to (b);
//! - (t) pass-through and effectful through three `effectgate serve`
//!   processes: trace export on (sampling 1.0, to a loopback receiver),
//!   export off, and untraced (`RUST_LOG=off`), as ratios on/off and
//!   off/untraced of throughput and of the gateway's CPU per call;
//! - (w) with `wrk` installed: the pass-through, effectful, duplicate and
//!   one-connection targets again, with `wrk` as the load generator, the
//!   gateway in a process of its own and nginx in front of the same
//!   provider (`wrk.rs`: the bench's own client costs as much per request
//!   as a proxy, which caps every arm near one throughput).
//!
//! Prints requests/s and p50/p99 latency per scenario, and the ratios b/a,
//! c/a, d/a of throughput. Bounded by `--requests` per scenario.
//!
//! With the policies built it also measures the per-call policy overhead,
//! proxy throughput with 0, 1 and 3 policies, and the same policy
//! (amount-threshold) in Rust, JavaScript and Python: first compile, load
//! from the disk cache, and p50/p99 per call.
//!
//! Run: `cargo run --release -p bench -- --requests 5000 --concurrency 32`

/// The allocator of the `effectgate` binary, so the in-process gateway of
/// (b)–(d) measures what `effectgate serve` runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod config;
mod flood;
mod load;
mod memory;
mod nginx;
mod paired;
mod policies;
mod postgres;
mod process;
mod targets;
mod tls;
mod tracing_cost;
mod wrk;

use clap::Parser;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use load::{HttpClient, Stats, run};
use policies::policy_scenarios;
use postgres::{SqliteBaseline, shared_ledger};
use tls::https_pass_through;

#[derive(Debug, Parser)]
#[command(name = "bench", about = "effectgate loopback benchmark")]
struct Args {
    /// Requests per scenario.
    #[arg(long, default_value_t = 5000)]
    requests: usize,
    /// Concurrent connections.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Folder of built policy components (see README); without it the
    /// policy scenarios are skipped.
    #[arg(long, default_value = "policies/target/wasm32-wasip2/release")]
    policy_dir: std::path::PathBuf,
    /// Policy calls measured per overhead scenario.
    #[arg(long, default_value_t = 5000)]
    policy_calls: usize,
    /// Folder with `amount_threshold_js.wasm` (built by
    /// `policies/js/amount-threshold/build.mjs`); without it the JavaScript
    /// line is skipped.
    #[arg(
        long,
        env = "POLICY_JS_WASM_DIR",
        default_value = "policies/js/amount-threshold"
    )]
    js_policy_dir: std::path::PathBuf,
    /// Folder with `amount_threshold_py.wasm` (built by
    /// `policies/python/amount-threshold/build.sh`); without it the Python
    /// line is skipped.
    #[arg(
        long,
        env = "POLICY_PY_WASM_DIR",
        default_value = "policies/python/amount-threshold"
    )]
    py_policy_dir: std::path::PathBuf,
    /// PostgreSQL URL for the shared-ledger scenarios (each run uses a
    /// fresh schema); default `$BENCH_POSTGRES_URL`. Without one they are
    /// skipped.
    #[arg(long)]
    postgres: Option<String>,
    /// Also measure the resident memory of a gateway process of its own
    /// after 1,000 and after 100,000 effectful calls (about a minute; needs
    /// the `effectgate` binary next to the bench's, or `$BENCH_EFFECTGATE_BIN`).
    #[arg(long)]
    memory: bool,
    /// Run only the trace-export scenario (t), e.g. under a profiler.
    #[arg(long)]
    only_tracing: bool,
    /// Run only pass-through against nginx in alternating cycles (b') and
    /// (n'), e.g. to compare two builds in a minute.
    #[arg(long)]
    only_nginx: bool,
    /// Run only (w): the targets measured with `wrk` as the load generator
    /// and the gateway in a process of its own (about a minute).
    #[arg(long)]
    only_wrk: bool,
    /// Run only PostgreSQL against SQLite, effectful ((c), (e), (f) and
    /// the alternating cycles (c') / (e')), e.g. to compare two builds in
    /// a minute; needs `--postgres` or `$BENCH_POSTGRES_URL`.
    #[arg(long)]
    only_postgres: bool,
}

const CLIENT_KEY: &str = "bench-client-key";
/// Cycles of the alternating comparisons ([`paired`]): effectful against
/// pass-through, pass-through against nginx, PostgreSQL against SQLite.
const PAIRED_CYCLES: usize = 6;
const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

/// Pass-through (`pass`) against nginx (`nginx`) in [`PAIRED_CYCLES`]
/// alternating cycles of `n / 2` requests (at least 100), `c` at a time.
async fn nginx_cycles(
    client: &HttpClient,
    nginx: String,
    pass: String,
    n: usize,
    c: usize,
) -> paired::Paired {
    println!("pass-through against nginx, in alternating cycles:");
    paired::compare(
        client,
        &paired::Arm {
            name: "(n') nginx proxy_pass",
            url: nginx,
            auth: false,
            keys: None,
        },
        &paired::Arm {
            name: "(b') effectgate, pass-through",
            url: pass,
            auth: true,
            keys: None,
        },
        (n / 2).max(100),
        c,
        PAIRED_CYCLES,
    )
    .await
}

/// (c): `n` effectful calls to `pay`, `c` at a time, each with a key of
/// its own.
async fn effectful_unique_keys(client: &HttpClient, pay: &str, n: usize, c: usize) -> Stats {
    run(
        "(c) effectgate, effectful, unique keys",
        client,
        pay.to_owned(),
        n,
        c,
        |i| Some(format!("k-{i}")),
        true,
    )
    .await
}

/// The PostgreSQL URL: `--postgres`, else `$BENCH_POSTGRES_URL`.
fn postgres_url(args: &Args) -> Option<String> {
    args.postgres
        .clone()
        .or_else(|| std::env::var("BENCH_POSTGRES_URL").ok())
        .filter(|u| !u.is_empty())
}

/// The targets row of PostgreSQL (one instance) against SQLite, from the
/// alternating cycles.
fn postgres_row(pg: &paired::Paired) -> targets::Row {
    targets::Row {
        what: "PostgreSQL, 1 instance / SQLite, effectful".into(),
        measured: format!(
            "{:.3}× ({:.2}–{:.2}; medians of {PAIRED_CYCLES} alternating cycles)",
            pg.ratio, pg.lowest, pg.highest
        ),
        aim: "≥ 0.5×",
        met: Some(pg.ratio >= 0.5),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    for dir in [
        &mut args.policy_dir,
        &mut args.js_policy_dir,
        &mut args.py_policy_dir,
    ] {
        if let Ok(abs) = dir.canonicalize() {
            *dir = abs;
        }
    }
    let mock = mock_provider::spawn("127.0.0.1:0".parse()?).await?;
    let hash: String = effectgate::config::key_digest(CLIENT_KEY)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if args.only_tracing {
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(args.concurrency)
            .build({
                let mut c = HttpConnector::new();
                c.set_nodelay(true);
                c
            });
        return tracing_cost::export_on_off(
            &client,
            &mock.url(),
            &hash,
            args.requests,
            args.concurrency,
        )
        .await;
    }
    if args.only_wrk {
        let dir = tempfile::tempdir()?;
        let fsync = targets::fsync_ms(dir.path())?;
        let rows = wrk::targets(&mock.url(), mock.addr, &hash, args.concurrency, fsync).await?;
        targets::print(&rows);
        return Ok(());
    }
    let (gw, dir) = tracing_cost::gateway(&mock.url(), &hash).await?;

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(args.concurrency)
        .build(connector);
    let (n, c) = (args.requests, args.concurrency);
    let direct = format!("{}/v1/charges", mock.url());
    let pass = format!("http://{}/pass/v1/charges", gw.proxy_addr);
    let pay = format!("http://{}/pay/v1/charges", gw.proxy_addr);

    // Warm-up (connections, allocator), not measured.
    run("warmup", &client, direct.clone(), 200, c, |_| None, false).await;
    run(
        "warmup",
        &client,
        pay.clone(),
        1,
        1,
        |_| Some("dup-key".into()),
        true,
    )
    .await;

    if args.only_nginx {
        let Some(bin) = nginx::binary() else {
            anyhow::bail!(
                "--only-nginx: nginx is not installed (apt-get install nginx, or set NGINX)"
            );
        };
        let server = nginx::start(&bin, mock.addr)?;
        let url = format!("http://{}/v1/charges", server.addr);
        run("warmup", &client, url.clone(), 200, c, |_| None, false).await;
        run("warmup", &client, pass.clone(), 200, c, |_| None, true).await;
        nginx_cycles(&client, url, pass, n, c).await;
        return Ok(());
    }
    if args.only_postgres {
        let Some(url) = postgres_url(&args) else {
            anyhow::bail!("--only-postgres: pass --postgres URL or set BENCH_POSTGRES_URL");
        };
        let a = run("(a) direct", &client, direct, n, c, |_| None, false).await;
        let cc = effectful_unique_keys(&client, &pay, n, c).await;
        let base = SqliteBaseline {
            direct: &a,
            sqlite: &cc,
            sqlite_pay: &pay,
        };
        let pg = shared_ledger(&client, &mock, &hash, &url, &args, base).await?;
        targets::print(&[postgres_row(&pg)]);
        return Ok(());
    }
    let a = run("(a) direct", &client, direct, n, c, |_| None, false).await;
    let b = run(
        "(b) effectgate, pass-through route",
        &client,
        pass.clone(),
        n,
        c,
        |_| None,
        true,
    )
    .await;
    // (n) nginx proxy_pass in front of the same provider, right after (b).
    let nginx_bin = nginx::binary();
    let nx = match &nginx_bin {
        Some(bin) => {
            let server = nginx::start(bin, mock.addr)?;
            let url = format!("http://{}/v1/charges", server.addr);
            run("warmup", &client, url.clone(), 200, c, |_| None, false).await;
            let single = run(
                "(n) nginx proxy_pass, keep-alive upstream",
                &client,
                url.clone(),
                n,
                c,
                |_| None,
                false,
            )
            .await;
            let cycles = nginx_cycles(&client, url, pass.clone(), n, c).await;
            Some((single, cycles))
        }
        None => None,
    };
    let batches = targets::batch_totals();
    let cc = effectful_unique_keys(&client, &pay, n, c).await;
    let batch = targets::average_batch(batches, targets::batch_totals());
    let d = run(
        "(d) effectgate, duplicates of one key",
        &client,
        pay.clone(),
        n,
        c,
        |_| Some("dup-key".into()),
        true,
    )
    .await;
    let one = run(
        "(c1) effectgate, effectful, 1 connection",
        &client,
        pay.clone(),
        (n / 10).max(200),
        1,
        |i| Some(format!("one-{i}")),
        true,
    )
    .await;
    println!("effectful against pass-through, in alternating cycles:");
    let effectful = paired::compare(
        &client,
        &paired::Arm {
            name: "(b') effectgate, pass-through",
            url: pass.clone(),
            auth: true,
            keys: None,
        },
        &paired::Arm {
            name: "(c') effectgate, effectful",
            url: pay.clone(),
            auth: true,
            keys: Some("cb"),
        },
        (n / 2).max(100),
        c,
        PAIRED_CYCLES,
    )
    .await;
    let fsync = targets::fsync_ms(dir.path())?;
    let memory = if args.memory {
        memory::measure(&client, &mock.url(), &hash, c).await?
    } else {
        None
    };

    println!(
        "requests per scenario: {n}, concurrency: {c}, ledger: SQLite (WAL, synchronous={:?})",
        gw.state.settings().storage.synchronous
    );
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in [
        Some(&a),
        Some(&b),
        nx.as_ref().map(|(single, _)| single),
        Some(&cc),
        Some(&d),
        Some(&one),
    ]
    .into_iter()
    .flatten()
    {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
    println!(
        "ratios of throughput to (a), same run: b/a = {:.3}, c/a = {:.3}, d/a = {:.3}",
        b.rps / a.rps,
        cc.rps / a.rps,
        d.rps / a.rps
    );
    let mut rows = vec![
        targets::Row {
            what: format!("effectful, unique keys, {c} connections / pass-through"),
            measured: format!(
                "{:.3}× ({:.2}–{:.2}; medians of {PAIRED_CYCLES} alternating cycles; average commit batch of (c) {batch:.1} writes)",
                effectful.ratio, effectful.lowest, effectful.highest
            ),
            aim: "≥ 0.15×",
            met: Some(effectful.ratio >= 0.15),
        },
        targets::Row {
            what: "effectful, 1 connection, p50 / (2 fsyncs + 0.5 ms)".into(),
            measured: format!(
                "{:.2} ms / {:.2} ms (one fsync here: {fsync:.2} ms)",
                one.p50_us as f64 / 1000.0,
                2.0 * fsync + 0.5
            ),
            aim: "≤ 1",
            met: Some(one.p50_us as f64 / 1000.0 <= 2.0 * fsync + 0.5),
        },
        targets::Row {
            what: "duplicates of one key / pass-through".into(),
            measured: format!("{:.3}×", d.rps / b.rps),
            aim: "≥ 1.0×",
            met: Some(d.rps / b.rps >= 1.0),
        },
        match &nx {
            Some((_, p)) => targets::Row {
                what: "pass-through / nginx proxy_pass (keep-alive upstream), p99 (bench client)"
                    .into(),
                measured: format!(
                    "{:.3}× ({:.2}–{:.2}), p99 {} µs vs nginx {} µs (medians of {PAIRED_CYCLES} alternating cycles)",
                    p.ratio, p.lowest, p.highest, p.b_p99_us, p.a_p99_us
                ),
                aim: "≥ 0.9×, p99 ≤ nginx",
                met: Some(p.ratio >= 0.9 && p.b_p99_us <= p.a_p99_us),
            },
            None => targets::Row {
                what: "pass-through / nginx proxy_pass (keep-alive upstream)".into(),
                measured: "skipped: nginx is not installed (apt-get install nginx, or set NGINX)"
                    .into(),
                aim: "≥ 0.9×, p99 ≤ nginx",
                met: None,
            },
        },
    ];
    rows.push(match memory {
        Some(m) => targets::Row {
            what: "gateway RSS after 100,000 / after 1,000 effectful calls (own process)".into(),
            measured: format!(
                "{:.0} MiB / {:.0} MiB: +{:.0} MiB ({} errors; replay cache budget {:.0} MiB)",
                m.at_100k,
                m.at_1k,
                m.at_100k - m.at_1k,
                m.errors,
                m.replay_cache_mib
            ),
            aim: "≤ +64 MiB + replay cache",
            met: Some(m.at_100k - m.at_1k <= 64.0 + m.replay_cache_mib),
        },
        None => targets::Row {
            what: "gateway RSS after 100,000 / after 1,000 effectful calls (own process)".into(),
            measured: "pass --memory (and build effectgate)".into(),
            aim: "≤ +64 MiB + replay cache",
            met: None,
        },
    });
    rows.extend(wrk::targets(&mock.url(), mock.addr, &hash, c, fsync).await?);
    flood::slow_header_flood(&client, &mock.url(), &hash, (n / 5).max(200)).await?;
    https_pass_through(&client, &hash, &args, &b).await?;

    rows.push(match postgres_url(&args) {
        Some(url) => {
            let pg = shared_ledger(
                &client,
                &mock,
                &hash,
                &url,
                &args,
                SqliteBaseline {
                    direct: &a,
                    sqlite: &cc,
                    sqlite_pay: &pay,
                },
            )
            .await?;
            postgres_row(&pg)
        }
        None => {
            println!("PostgreSQL scenarios skipped: pass --postgres URL or set BENCH_POSTGRES_URL");
            targets::Row {
                what: "PostgreSQL, 1 instance / SQLite, effectful".into(),
                measured: "pass --postgres URL".into(),
                aim: "≥ 0.5×",
                met: None,
            }
        }
    });
    // Up to here: the PostgreSQL comparison runs SQLite's arm on it.
    gw.shutdown().await;
    targets::print(&rows);

    let threshold = args.policy_dir.join("amount_threshold.wasm");
    if threshold.exists() {
        policy_scenarios(&args, &client, &mock, &hash).await?;
    } else {
        println!(
            "policy scenarios skipped: {} not found (build the policies first)",
            threshold.display()
        );
    }
    tracing_cost::export_on_off(&client, &mock.url(), &hash, n, c).await
}
