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
//!   off/untraced of throughput and of the gateway's CPU per call.
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

mod flood;
mod memory;
mod nginx;
mod paired;
mod process;
mod targets;
mod tracing_cost;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

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
}

const CLIENT_KEY: &str = "bench-client-key";
/// Cycles of the alternating comparisons ([`paired`]): effectful against
/// pass-through, pass-through against nginx, PostgreSQL against SQLite.
const PAIRED_CYCLES: usize = 6;
const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

struct Stats {
    name: &'static str,
    rps: f64,
    p50_us: u128,
    p99_us: u128,
    errors: usize,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One URL or several.
struct Urls(Vec<String>);

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
async fn run(
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

/// What the PostgreSQL scenarios are compared with: the same run's
/// direct baseline (a), SQLite's effectful (c), and the effectful URL of
/// the SQLite gateway (still running) for the alternating cycles.
struct SqliteBaseline<'a> {
    direct: &'a Stats,
    sqlite: &'a Stats,
    sqlite_pay: &'a str,
}

/// Effectful throughput on PostgreSQL with one and with two gateway
/// instances sharing one fresh schema, next to SQLite's (c), each as a
/// ratio to the direct baseline (a) of the same run; then one PostgreSQL
/// instance and the SQLite gateway in alternating cycles, whose median
/// ratio is returned.
async fn shared_ledger(
    client: &HttpClient,
    mock: &mock_provider::MockProvider,
    hash: &str,
    url: &str,
    args: &Args,
    base: SqliteBaseline<'_>,
) -> anyhow::Result<paired::Paired> {
    let SqliteBaseline {
        direct,
        sqlite,
        sqlite_pay,
    } = base;
    let dir = tempfile::tempdir()?;
    let schema = format!("bench_{:016x}", rand::random::<u64>());
    let toml = format!(
        r#"
[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"
[storage]
url = "{url}"
schema = "{schema}"
max_connections = 16
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
        up = mock.url()
    );
    let cfg = dir.path().join("bench-pg.toml");
    std::fs::write(&cfg, toml)?;
    let one = effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await?;
    let pay = |gw: &effectgate::Gateway| format!("http://{}/pay/v1/charges", gw.proxy_addr);
    let (n, c) = (args.requests, args.concurrency);
    run(
        "warmup",
        client,
        pay(&one),
        50,
        c,
        |i| Some(format!("pgw-{i}")),
        true,
    )
    .await;
    let e = run(
        "(e) PostgreSQL, 1 instance",
        client,
        pay(&one),
        n,
        c,
        |i| Some(format!("pg1-{i}")),
        true,
    )
    .await;
    println!("PostgreSQL against SQLite, effectful, in alternating cycles:");
    let cycles = paired::compare(
        client,
        &paired::Arm {
            name: "(c') SQLite",
            url: sqlite_pay.to_owned(),
            auth: true,
            keys: Some("sqc"),
        },
        &paired::Arm {
            name: "(e') PostgreSQL, 1 instance",
            url: pay(&one),
            auth: true,
            keys: Some("pgc"),
        },
        (n / 2).max(100),
        c,
        PAIRED_CYCLES,
    )
    .await;
    let two = effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await?;
    let f = run(
        "(f) PostgreSQL, 2 instances",
        client,
        vec![pay(&one), pay(&two)],
        n,
        c,
        |i| Some(format!("pg2-{i}")),
        true,
    )
    .await;
    one.shutdown().await;
    two.shutdown().await;
    println!("effectful, unique keys, by ledger (PostgreSQL: one local server, schema {schema}):");
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in [sqlite, &e, &f] {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
    println!(
        "ratios of throughput to (a), same run: sqlite c/a = {:.3}, postgres 1 instance e/a = {:.3}, 2 instances f/a = {:.3}",
        sqlite.rps / direct.rps,
        e.rps / direct.rps,
        f.rps / direct.rps
    );
    Ok(cycles)
}

/// Pass-through over HTTPS: the mock provider behind TLS (a CA and
/// certificate made here), reached with HTTP/2 and, in a second gateway,
/// with HTTP/1.1 only; printed next to the plain pass-through (b) of the
/// same run, as ratios.
async fn https_pass_through(
    client: &HttpClient,
    hash: &str,
    args: &Args,
    plain: &Stats,
) -> anyhow::Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let dir = tempfile::tempdir()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let leaf_key = KeyPair::generate()?;
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&leaf_key, &ca)?;
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem())?;
    let mut rows = Vec::new();
    for (http2, name) in [
        (true, "(g) pass-through over HTTPS, HTTP/2"),
        (false, "(g1) pass-through over HTTPS, HTTP/1.1"),
    ] {
        let mut tls = mock_provider::TlsOptions::new(leaf.pem(), leaf_key.serialize_pem());
        tls.http2 = http2;
        let mock = mock_provider::spawn_tls("127.0.0.1:0".parse()?, &tls).await?;
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
[routes.tls]
ca_file = "{ca}"
"#,
            db = dir.path().join(format!("tls-{http2}.db")).display(),
            up = mock.url(),
            ca = ca_file.display()
        );
        let cfg = dir.path().join("bench-tls.toml");
        std::fs::write(&cfg, toml)?;
        let gw = effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await?;
        let url = format!("http://{}/pass/v1/charges", gw.proxy_addr);
        run(
            "warmup",
            client,
            url.clone(),
            200,
            args.concurrency,
            |_| None,
            true,
        )
        .await;
        rows.push(
            run(
                name,
                client,
                url,
                args.requests,
                args.concurrency,
                |_| None,
                true,
            )
            .await,
        );
        gw.shutdown().await;
    }
    println!("pass-through to the same provider over HTTPS (keep-alive, TLS 1.3, ring):");
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in [plain, &rows[0], &rows[1]] {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
    println!(
        "ratios of throughput to (b), same run: HTTPS h2 g/b = {:.3}, HTTPS http/1.1 g1/b = {:.3}",
        rows[0].rps / plain.rps,
        rows[1].rps / plain.rps
    );
    Ok(())
}

fn n_reqs(args: &Args) -> usize {
    args.requests.min(2000)
}

/// `[[tenants.policies]]` entries for `n` policies (0, 1 or 3), all allowing.
fn policy_bindings(dir: &std::path::Path, n: usize) -> String {
    let all = [
        ("amount_threshold", "{ threshold = 1000000 }"),
        ("allow_list", r#"{ rules = [{ path_prefix = "/" }] }"#),
        ("replay_matrix", "{}"),
    ];
    all.iter()
        .take(n)
        .map(|(m, c)| {
            format!(
                "[[tenants.policies]]\nroute = \"pay\"\nmodule = \"{}\"\nconfig = {c}\n",
                dir.join(format!("{m}.wasm")).display()
            )
        })
        .collect()
}

/// The route the policy measurements run on (`pay`, default settings).
fn bench_route() -> anyhow::Result<effectgate::config::Route> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("r.toml");
    std::fs::write(
        &cfg,
        "[[routes]]\nname = \"pay\"\nprefix = \"/pay/\"\nupstream = \"http://127.0.0.1:9\"\n",
    )?;
    let settings = effectgate::config::load(Some(&cfg))?;
    Ok(settings.routes[0].clone())
}

/// The request every policy measurement decides on: a 100 eur charge.
fn bench_request() -> effectgate::policy::Request {
    effectgate::policy::Request {
        tenant: "bench".into(),
        principal: "bench:client".into(),
        route: "pay".into(),
        effect_class: effectgate::policy::WitEffectClass::Payment,
        method: "POST".into(),
        path: "/v1/charges".into(),
        query: None,
        headers: vec![],
        body: BODY.as_bytes().to_vec(),
        operation_id: "k".into(),
        fingerprint: "0".repeat(64),
        existing_state: None,
    }
}

/// p50 and p99 of `calls` runs of `chain` (after 200 unmeasured ones), µs.
fn chain_latency(
    engine: &effectgate::policy::PolicyEngine,
    chain: &[effectgate::policy::BoundPolicy],
    route: &effectgate::config::Route,
    request: &effectgate::policy::Request,
    calls: usize,
) -> (u128, u128) {
    use effectgate::policy::evaluate_chain;
    for _ in 0..200 {
        evaluate_chain(engine, chain, route, "bench", request);
    }
    let mut lat: Vec<u128> = (0..calls.max(1))
        .map(|_| {
            let t = Instant::now();
            let _ = evaluate_chain(engine, chain, route, "bench", request);
            t.elapsed().as_micros()
        })
        .collect();
    lat.sort_unstable();
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    (p(0.5), p(0.99))
}

/// Per-call policy overhead: one `evaluate` on a fresh instance (1 policy)
/// and a chain of 3, measured directly on the engine.
fn policy_overhead(args: &Args) -> anyhow::Result<()> {
    use effectgate::policy::{BoundPolicy, PolicyEngine};
    let engine = PolicyEngine::new(&Default::default())?;
    let mk = |m: &str, cfg: &str| -> anyhow::Result<BoundPolicy> {
        Ok(BoundPolicy {
            name: m.into(),
            compiled: engine.load(&args.policy_dir.join(format!("{m}.wasm")))?,
            config: cfg.into(),
        })
    };
    let three = [
        mk("amount_threshold", r#"{"threshold":1000000}"#)?,
        mk("allow_list", r#"{"rules":[{"path_prefix":"/"}]}"#)?,
        mk("replay_matrix", "{}")?,
    ];
    let route = bench_route()?;
    let request = bench_request();
    println!(
        "policy engine: pooling allocator {}",
        if engine.pooling {
            "on"
        } else {
            "off (unavailable)"
        }
    );
    println!(
        "{:<42} {:>10} {:>10}",
        "policy overhead per request", "p50 µs", "p99 µs"
    );
    for n in [1usize, 3] {
        let (p50, p99) = chain_latency(&engine, &three[..n], &route, &request, args.policy_calls);
        println!(
            "{:<42} {:>10} {:>10}",
            format!("{n} polic{}", if n == 1 { "y" } else { "ies" }),
            p50,
            p99
        );
    }
    Ok(())
}

/// The same policy (amount-threshold) written in Rust, JavaScript and
/// Python: module size, first compile (an empty disk cache), load from the
/// disk cache (a new engine on the warm cache, as after a restart), the
/// p50 of a fresh instance with the cheapest call (`config-schema`), and
/// the per-call overhead of one `evaluate` on a fresh instance. A variant
/// whose component isn't built is skipped with a line saying so.
fn policy_languages(args: &Args) -> anyhow::Result<()> {
    use effectgate::policy::{BoundPolicy, LoadOrigin, PolicyEngine};
    let cache = tempfile::tempdir()?;
    let limits = effectgate::config::PolicyLimitsSpec {
        memory_bytes: 32 << 20,
        cache_dir: Some(cache.path().to_path_buf()),
        ..Default::default()
    };
    let variants = [
        (
            "rust",
            args.policy_dir.join("amount_threshold.wasm"),
            "cargo build --manifest-path policies/Cargo.toml --target wasm32-wasip2 --release",
        ),
        (
            "javascript",
            args.js_policy_dir.join("amount_threshold_js.wasm"),
            "node policies/js/amount-threshold/build.mjs",
        ),
        (
            "python",
            args.py_policy_dir.join("amount_threshold_py.wasm"),
            "policies/python/amount-threshold/build.sh",
        ),
    ];
    let route = bench_route()?;
    let request = bench_request();
    let first = PolicyEngine::new(&limits)?;
    println!(
        "policy languages: amount-threshold, one evaluate per call on a fresh instance; memory_bytes = 32 MiB, pooling allocator {}",
        if first.pooling {
            "on"
        } else {
            "off (unavailable)"
        }
    );
    println!(
        "{:<12} {:>11} {:>18} {:>14} {:>14} {:>8} {:>8}",
        "variant",
        "module KiB",
        "first compile ms",
        "cache load ms",
        "instance µs",
        "p50 µs",
        "p99 µs"
    );
    let mut present = Vec::new();
    let mut compiled = Vec::new();
    for (name, path, build) in &variants {
        if !path.is_file() {
            println!(
                "{name:<12} skipped: {} not found (build it: {build})",
                path.display()
            );
            continue;
        }
        let c = first.load(path)?;
        anyhow::ensure!(
            c.origin == LoadOrigin::Compiled,
            "{name}: expected a fresh compile"
        );
        compiled.push(c.load_time);
        present.push((*name, path.clone()));
    }
    // A restart: a new engine on the warm cache loads every variant.
    let second = PolicyEngine::new(&limits)?;
    let restart = Instant::now();
    let mut loaded = Vec::new();
    for (name, path) in &present {
        let c = second.load(path)?;
        anyhow::ensure!(
            c.origin == LoadOrigin::DiskCache,
            "{name}: expected the disk cache"
        );
        loaded.push(c);
    }
    let restart = restart.elapsed();
    for (((name, _), compile), c) in present.iter().zip(&compiled).zip(&loaded) {
        let chain = [BoundPolicy {
            name: (*name).into(),
            compiled: c.clone(),
            config: r#"{"threshold":1000000}"#.into(),
        }];
        let (p50, p99) = chain_latency(&second, &chain, &route, &request, args.policy_calls);
        // A fresh instance and the cheapest export (config-schema returns
        // a constant): the instantiation share of a call.
        let mut inst: Vec<u128> = (0..args.policy_calls.clamp(1, 1000))
            .map(|_| {
                let t = Instant::now();
                let _ = second.call(c, "bench", |p, s| p.call_config_schema(s));
                t.elapsed().as_micros()
            })
            .collect();
        inst.sort_unstable();
        let inst_p50 = inst[inst.len() / 2];
        println!(
            "{:<12} {:>11} {:>18.0} {:>14.1} {:>14} {:>8} {:>8}",
            name,
            c.module_bytes / 1024,
            compile.as_secs_f64() * 1e3,
            c.load_time.as_secs_f64() * 1e3,
            inst_p50,
            p50,
            p99
        );
    }
    println!(
        "restart with a warm disk cache: {} policies loaded in {:.0} ms",
        loaded.len(),
        restart.as_secs_f64() * 1e3
    );
    Ok(())
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
            println!("pass-through against nginx, in alternating cycles:");
            let cycles = paired::compare(
                &client,
                &paired::Arm {
                    name: "(n') nginx proxy_pass",
                    url,
                    auth: false,
                    keys: None,
                },
                &paired::Arm {
                    name: "(b') effectgate, pass-through",
                    url: pass.clone(),
                    auth: true,
                    keys: None,
                },
                (n / 2).max(100),
                c,
                PAIRED_CYCLES,
            )
            .await;
            Some((single, cycles))
        }
        None => None,
    };
    let batches = targets::batch_totals();
    let cc = run(
        "(c) effectgate, effectful, unique keys",
        &client,
        pay.clone(),
        n,
        c,
        |i| Some(format!("k-{i}")),
        true,
    )
    .await;
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
                what: "pass-through / nginx proxy_pass (keep-alive upstream), p99".into(),
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
    flood::slow_header_flood(&client, &mock.url(), &hash, (n / 5).max(200)).await?;
    https_pass_through(&client, &hash, &args, &b).await?;

    let postgres = args
        .postgres
        .clone()
        .or_else(|| std::env::var("BENCH_POSTGRES_URL").ok())
        .filter(|u| !u.is_empty());
    rows.push(match postgres {
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

/// The policy overhead, the policy languages, and proxy throughput with 0,
/// 1 and 3 policies on the effectful route.
async fn policy_scenarios(
    args: &Args,
    client: &HttpClient,
    mock: &mock_provider::MockProvider,
    hash: &str,
) -> anyhow::Result<()> {
    let c = args.concurrency;
    policy_overhead(args)?;
    policy_languages(args)?;
    // Proxy throughput with 0, 1 and 3 policies on the effectful route.
    let mut rows = Vec::new();
    for n in [0usize, 1, 3] {
        let dir = tempfile::tempdir()?;
        let policies = policy_bindings(&args.policy_dir, n);
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
{policies}
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{up}"
effectful_methods = ["POST"]
provider_idempotency_header = "Idempotency-Key"
"#,
            db = dir.path().join("bench.db").display(),
            up = mock.url()
        );
        let cfg = dir.path().join("bench.toml");
        std::fs::write(&cfg, toml)?;
        let gw = effectgate::Gateway::start(effectgate::config::load(Some(&cfg))?).await?;
        let url = format!("http://{}/pay/v1/charges", gw.proxy_addr);
        let name: &'static str = match n {
            0 => "(c0) effectful, 0 policies",
            1 => "(c1) effectful, 1 policy",
            _ => "(c3) effectful, 3 policies",
        };
        rows.push(
            run(
                name,
                client,
                url,
                n_reqs(args),
                c,
                move |i| Some(format!("p{n}-{i}")),
                true,
            )
            .await,
        );
        gw.shutdown().await;
    }
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors"
    );
    for s in &rows {
        println!(
            "{:<42} {:>10.0} {:>10} {:>10} {:>7}",
            s.name, s.rps, s.p50_us, s.p99_us, s.errors
        );
    }
    println!(
        "ratios of throughput to 0 policies, same run: 1/0 = {:.3}, 3/0 = {:.3}",
        rows[1].rps / rows[0].rps,
        rows[2].rps / rows[0].rps
    );
    Ok(())
}
