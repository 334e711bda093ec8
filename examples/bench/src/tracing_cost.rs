//! (t) The cost of tracing: pass-through and effectful throughput of three
//! `effectgate serve` processes (see [`crate::process`]) in front of the
//! same mock provider, in interleaved rounds of one run:
//!
//! - **on**: the default log filter and trace export on
//!   (`OTEL_EXPORTER_OTLP_ENDPOINT`, sampling 1.0, OTLP/HTTP to a receiver
//!   in the bench that reads and discards each export);
//! - **off**: the default log filter, no endpoint: what a gateway without
//!   one runs;
//! - **untraced**: `RUST_LOG=off` and no endpoint, so no span is built and
//!   no line written.
//!
//! on / off is the cost of export (aim ≥ 0.9×); off / untraced is the cost
//! of a gateway's spans and logs without export (aim ≥ 0.98×); it holds
//! the info-level log line of each effectful call too, which predates
//! tracing, so it is an upper bound of what spans cost.
//!
//! Rounds go in cycles, `untraced, off, on` and then the reverse order, so
//! that a linear drift of the machine's speed falls on every arm alike;
//! the ratios are taken within each cycle and their median is printed:
//! the machine's speed changes from second to second here (by a third
//! between runs), and a ratio of two rounds seconds apart carries that,
//! while a median of per-cycle ratios carries much less. Each round also
//! reads the CPU time the gateway process spent (`/proc/<pid>/stat`), per
//! call: the steadier figure on a machine whose speed varies, since it
//! doesn't depend on how much of the cores the client and the mock took.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{LISTEN, start, tenant_and_routes};
use crate::{HttpClient, Stats, run};

/// A gateway of [`tenant_and_routes`] in this process: the gateway of
/// scenarios (b)–(d).
pub async fn gateway(
    up: &str,
    hash: &str,
) -> anyhow::Result<(effectgate::Gateway, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let toml = format!(
        "{LISTEN}[storage]\npath = \"{db}\"\n{rest}",
        db = dir.path().join("bench.db").display(),
        rest = tenant_and_routes(up, hash),
    );
    let gw = start(dir.path(), "bench.toml", &toml).await?;
    Ok((gw, dir))
}

/// Cycles of (t); each runs the three arms once.
const CYCLES: usize = 8;

/// One arm of (t).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    Untraced,
    Off,
    On,
}

impl Arm {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Arm::Untraced => ("(t) pass-through, untraced", "(t) effectful, untraced"),
            Arm::Off => ("(t) pass-through, export off", "(t) effectful, export off"),
            Arm::On => ("(t) pass-through, export on", "(t) effectful, export on"),
        }
    }
}

/// The arms of cycle `k` in order: forward in even cycles, reversed in odd
/// ones.
fn order(k: usize) -> [Arm; 3] {
    if k.is_multiple_of(2) {
        [Arm::Untraced, Arm::Off, Arm::On]
    } else {
        [Arm::On, Arm::Off, Arm::Untraced]
    }
}

/// One round of an arm.
struct Round {
    arm: Arm,
    pass: Stats,
    effectful: Stats,
    /// The gateway's CPU time per pass-through call, µs.
    pass_cpu_us: f64,
    /// The gateway's CPU time per effectful call, µs.
    effectful_cpu_us: f64,
}

/// One round: `n` pass-through and `n / 5` (at least 200) effectful calls
/// to `gw`, with the CPU time the gateway process spent on each.
async fn measure(
    client: &HttpClient,
    gw: &crate::process::GatewayProcess,
    arm: Arm,
    round: usize,
    n: usize,
    c: usize,
) -> Round {
    let port = gw.proxy;
    let pass = format!("http://127.0.0.1:{port}/pass/v1/charges");
    let pay = format!("http://127.0.0.1:{port}/pay/v1/charges");
    let (pn, en) = arm.names();
    let per_call = |before: Option<f64>, after: Option<f64>, calls: usize| match (before, after) {
        (Some(b), Some(a)) => (a - b) * 1000.0 / calls as f64,
        _ => f64::NAN,
    };
    let cpu0 = gw.cpu_ms();
    let p = run(pn, client, pass, n, c, |_| None, true).await;
    let cpu1 = gw.cpu_ms();
    let effectful_calls = (n / 5).max(200);
    let e = run(
        en,
        client,
        pay,
        effectful_calls,
        c,
        move |i| Some(format!("t-{round}-{i}")),
        true,
    )
    .await;
    let cpu2 = gw.cpu_ms();
    Round {
        arm,
        pass: p,
        effectful: e,
        pass_cpu_us: per_call(cpu0, cpu1, n),
        effectful_cpu_us: per_call(cpu1, cpu2, effectful_calls),
    }
}

/// The median of `xs` (not empty).
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[m - 1] + xs[m]) / 2.0
    } else {
        xs[m]
    }
}

/// The rounds of one cycle, one per arm.
type Cycle = Vec<Round>;

/// What is compared across arms.
#[derive(Clone, Copy)]
enum Figure {
    PassRps,
    EffectfulRps,
    PassCpu,
    EffectfulCpu,
}

impl Round {
    fn figure(&self, f: Figure) -> f64 {
        match f {
            Figure::PassRps => self.pass.rps,
            Figure::EffectfulRps => self.effectful.rps,
            Figure::PassCpu => self.pass_cpu_us,
            Figure::EffectfulCpu => self.effectful_cpu_us,
        }
    }
}

/// Per-cycle ratios `a / b` of `f`, as (median, lowest, highest).
fn cycle_ratios(cycles: &[Cycle], a: Arm, b: Arm, f: Figure) -> (f64, f64, f64) {
    let of = |cycle: &Cycle, arm: Arm| {
        cycle
            .iter()
            .find(|r| r.arm == arm)
            .map_or(f64::NAN, |r| r.figure(f))
    };
    let rs: Vec<f64> = cycles.iter().map(|cy| of(cy, a) / of(cy, b)).collect();
    let lo = rs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = rs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(rs), lo, hi)
}

/// The median of `f` over the rounds of `arm`.
fn arm_median(cycles: &[Cycle], arm: Arm, f: Figure) -> f64 {
    median(
        cycles
            .iter()
            .flatten()
            .filter(|r| r.arm == arm)
            .map(|r| r.figure(f))
            .collect(),
    )
}

/// Runs the scenario and prints its table and ratios: three gateway
/// processes (see the module docs) and [`CYCLES`] cycles of the three arms,
/// each arm a round of `n` pass-through and `n / 5` effectful calls. Without
/// a gateway binary it says that it skipped.
///
/// Errors: a gateway process can't start.
pub async fn export_on_off(
    client: &HttpClient,
    up: &str,
    hash: &str,
    n: usize,
    c: usize,
) -> anyhow::Result<()> {
    let Some(bin) = crate::process::binary() else {
        println!(
            "(t) skipped: no effectgate binary next to the bench (cargo build --release -p bench -p effectgate) and no $BENCH_EFFECTGATE_BIN"
        );
        return Ok(());
    };
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
    let config = format!(
        "[storage]\npath = \"{{db}}\"\n[telemetry]\nsampling_ratio = 1.0\n{}",
        tenant_and_routes(up, hash)
    );
    let untraced = crate::process::spawn(&bin, &config, &[("RUST_LOG", "off")]).await?;
    let off = crate::process::spawn(&bin, &config, &[]).await?;
    let on = crate::process::spawn(
        &bin,
        &config,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
    )
    .await?;
    let mut cycles: Vec<Cycle> = Vec::with_capacity(CYCLES);
    let mut round = 0;
    for k in 0..CYCLES {
        let mut cycle = Vec::with_capacity(3);
        for arm in order(k) {
            let gw = match arm {
                Arm::Untraced => &untraced,
                Arm::Off => &off,
                Arm::On => &on,
            };
            cycle.push(measure(client, gw, arm, round, n, c).await);
            round += 1;
        }
        cycles.push(cycle);
    }
    drop((untraced, off, on));

    println!(
        "tracing cost, three gateway processes: export on (OTLP/HTTP to a loopback receiver, sampling 1.0), export off (default logs), untraced (RUST_LOG=off); {CYCLES} cycles of the three arms:"
    );
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>7} {:>12}",
        "scenario", "req/s", "p50 µs", "p99 µs", "errors", "CPU µs/call"
    );
    for r in cycles.iter().flatten() {
        for (s, cpu) in [(&r.pass, r.pass_cpu_us), (&r.effectful, r.effectful_cpu_us)] {
            println!(
                "{:<42} {:>10.0} {:>10} {:>10} {:>7} {:>12.1}",
                s.name, s.rps, s.p50_us, s.p99_us, s.errors, cpu
            );
        }
    }
    let show = |what: &str, a: Arm, b: Arm, aim: &str| {
        let (pm, plo, phi) = cycle_ratios(&cycles, a, b, Figure::PassRps);
        let (em, elo, ehi) = cycle_ratios(&cycles, a, b, Figure::EffectfulRps);
        println!(
            "{what}, median of per-cycle throughput ratios (lowest–highest): pass-through = {pm:.3} ({plo:.2}–{phi:.2}), effectful = {em:.3} ({elo:.2}–{ehi:.2}) (aim: at least {aim})"
        );
        let (pc, _, _) = cycle_ratios(&cycles, b, a, Figure::PassCpu);
        let (ec, _, _) = cycle_ratios(&cycles, b, a, Figure::EffectfulCpu);
        println!(
            "{what}, median of per-cycle ratios of the gateway's CPU per call, inverted (CPU {b:?} / CPU {a:?}): pass-through = {pc:.3}, effectful = {ec:.3}"
        );
    };
    show("export on / off", Arm::On, Arm::Off, "0.9");
    show("export off / untraced", Arm::Off, Arm::Untraced, "0.98");
    println!(
        "gateway CPU per call, median µs (untraced, off, on): pass-through {:.1}, {:.1}, {:.1}; effectful {:.1}, {:.1}, {:.1}",
        arm_median(&cycles, Arm::Untraced, Figure::PassCpu),
        arm_median(&cycles, Arm::Off, Figure::PassCpu),
        arm_median(&cycles, Arm::On, Figure::PassCpu),
        arm_median(&cycles, Arm::Untraced, Figure::EffectfulCpu),
        arm_median(&cycles, Arm::Off, Figure::EffectfulCpu),
        arm_median(&cycles, Arm::On, Figure::EffectfulCpu),
    );
    println!(
        "{} export requests received",
        exports.load(Ordering::Relaxed)
    );
    Ok(())
}
