//! The policy scenarios: per-call overhead of a policy chain, the same
//! policy in Rust, JavaScript and Python, and proxy throughput with 0, 1
//! and 3 policies on the effectful route.

use std::time::Instant;

use crate::config;
use crate::{Args, BODY, HttpClient, run};

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

/// The policy overhead, the policy languages, and proxy throughput with 0,
/// 1 and 3 policies on the effectful route.
pub(crate) async fn policy_scenarios(
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
            "{LISTEN}[storage]\npath = \"{db}\"\n{tenant}{policies}\n{route}",
            LISTEN = config::LISTEN,
            db = dir.path().join("bench.db").display(),
            tenant = config::tenant(hash),
            route = config::pay_route(&mock.url()),
        );
        let gw = config::start(dir.path(), "bench.toml", &toml).await?;
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
