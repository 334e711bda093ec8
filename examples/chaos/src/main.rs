//! `chaos`: a seeded fault soak of effectgate with an invariant checker.
//!
//! It starts, on loopback: N gateway processes (1 on SQLite, or 2–3
//! sharing one PostgreSQL schema, each through its own TCP relay), a
//! provider that cannot deduplicate and keeps the ground truth of every
//! effect by provider key, and clients for several tenants that duplicate,
//! retry with the same key and replay whole batches. From the seed it
//! schedules faults at the provider (see `provider.rs`), at the gateways
//! (SIGKILL and restart; SIGSTOP past the lease, then SIGCONT; on SQLite,
//! the ledger clock stepped forward or back, see [`clock_lane`]) and in
//! each database relay (cut, stall, restore). Then it stops the faults, waits
//! (a bounded time) for every operation to converge, and checks over the
//! whole history:
//!
//! - every operation a client started is COMPLETED, FAILED or
//!   COMPENSATED, or a dead letter with a reason; none is stuck;
//! - a COMPLETED operation has exactly one effect under its provider key;
//!   a FAILED one (permanent) none; a dead letter at most one; no effect
//!   exists under a key no operation has;
//! - every answer with `Idempotent-Replayed: true` equals the operation's
//!   recorded answer (and every other replay of it);
//! - no tenant got another tenant's data (every 2xx body names the
//!   caller's tenant and the operation's key);
//! - each operation's transitions are allowed by the state machine, leave
//!   the state the previous one entered, count versions up by one and
//!   never lower the fencing token (a stale owner's write would), and end
//!   at the row. They are taken in the ledger's order (`seq`), never by
//!   their timestamps, which a clock step back makes go backwards.
//!
//! It prints a table (seed, duration, operations, faults of each kind,
//! violations) and exits 1 on any violation, after printing the seed and
//! each violating operation's full history. `--plant-violation` records
//! one effect the provider never applied and checks that the checker
//! reports it (exit 0 only if it does).
//!
//! The clock steps need a gateway built with the `failpoints` feature
//! (`cargo build -p effectgate --features failpoints`): a run on SQLite
//! checks first that it answers `POST /admin/clock/step`.
//! `--expect-no-clock-step` checks the opposite of a plain build (exit 0
//! only if the endpoint is absent) and runs no soak.

mod clients;
mod gateways;
mod provider;
mod relay;
mod rng;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use effectgate::ledger::State;
use serde_json::Value;
use tokio::sync::Mutex;

use clients::{History, Target};
use gateways::{Gateway, Store};
use relay::Relay;
use rng::mix;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A seeded fault soak of effectgate with an invariant checker.
#[derive(Debug, Parser)]
#[command(name = "chaos", about)]
struct Args {
    /// Ledger backend.
    #[arg(long, value_enum, default_value = "sqlite")]
    backend: Backend,
    /// Gateway processes (default 1 on SQLite, 3 on PostgreSQL).
    #[arg(long)]
    gateways: Option<usize>,
    /// Seeds, one run each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    seeds: Vec<u64>,
    /// How long faults run, per seed (`90s`, `30m`).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    duration: Duration,
    /// The bound on convergence after the faults stop.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    converge: Duration,
    /// Tenants.
    #[arg(long, default_value_t = 3)]
    tenants: usize,
    /// Client workers per tenant.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// PostgreSQL URL (a database the soak may create schemas in).
    #[arg(long, env = "TEST_POSTGRES_URL")]
    postgres_url: Option<String>,
    /// The `effectgate` binary (default: next to this one).
    #[arg(long)]
    effectgate: Option<PathBuf>,
    /// Plant one violation and check that the checker finds it.
    #[arg(long)]
    plant_violation: bool,
    /// Only check that the gateway binary has no clock step endpoint (a
    /// build without the `failpoints` feature); no soak.
    #[arg(long)]
    expect_no_clock_step: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (use 90s, 5m)"))?;
    match unit {
        "" | "s" => Ok(Duration::from_secs(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("unknown unit in {s:?} (use ms, s, m, h)")),
    }
}

/// One run's figures.
struct Run {
    seed: u64,
    backend: Backend,
    gateways: usize,
    secs: f64,
    operations: usize,
    requests: u64,
    states: BTreeMap<String, usize>,
    faults: BTreeMap<&'static str, u64>,
    violations: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = match &args.effectgate {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .map(|d| d.join("effectgate"))
            .ok_or_else(|| anyhow::anyhow!("no folder of the chaos binary"))?,
    };
    if !bin.exists() {
        anyhow::bail!(
            "{} does not exist: build it (cargo build -p effectgate) or pass --effectgate",
            bin.display()
        );
    }
    if args.expect_no_clock_step {
        return expect_no_clock_step(&bin).await;
    }
    let mut runs = Vec::new();
    for &seed in &args.seeds {
        let run = run(&args, &bin, seed).await?;
        eprintln!(
            "seed {seed}: {} operations, {} violations",
            run.operations,
            run.violations.len()
        );
        runs.push(run);
    }
    print_table(&runs);
    let violations: usize = runs.iter().map(|r| r.violations.len()).sum();
    if args.plant_violation {
        let found = runs
            .iter()
            .all(|r| r.violations.iter().any(|v| v.contains("planted")));
        if found {
            println!("self-check: the planted violation was reported in every run");
            return Ok(());
        }
        eprintln!("self-check FAILED: a planted violation was not reported");
        std::process::exit(1);
    }
    if violations > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// Starts one SQLite gateway from `bin` and checks that it has no clock
/// step: `POST /admin/clock/step` by an admin answers 404.
async fn expect_no_clock_step(bin: &std::path::Path) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = vec![(
        "t0".to_owned(),
        "probe-client".to_owned(),
        "probe-admin".to_owned(),
    )];
    let mut g = Gateway::start(
        0,
        bin,
        dir.path(),
        Store::Sqlite(dir.path().join("ledger.db")),
        "http://127.0.0.1:9",
        &keys,
    )
    .await?;
    let status = g.step_clock(60_000).await;
    g.kill();
    let status = status?;
    if status == 404 {
        println!(
            "{}: no clock step endpoint (404), as in a build without the failpoints feature",
            bin.display()
        );
        return Ok(());
    }
    eprintln!(
        "{}: POST /admin/clock/step answered {status}; a build without the failpoints feature must not have it",
        bin.display()
    );
    drop(dir);
    std::process::exit(1);
}

fn print_table(runs: &[Run]) {
    let mut kinds: Vec<&'static str> = runs.iter().flat_map(|r| r.faults.keys().copied()).collect();
    kinds.sort();
    kinds.dedup();
    let mut states: Vec<String> = runs.iter().flat_map(|r| r.states.keys().cloned()).collect();
    states.sort();
    states.dedup();
    println!();
    print!("| seed | backend | gateways | duration | operations | requests |");
    for s in &states {
        print!(" {s} |");
    }
    for k in &kinds {
        print!(" {k} |");
    }
    println!(" violations |");
    print!("|---|---|---|---|---|---|");
    for _ in 0..states.len() + kinds.len() + 1 {
        print!("---|");
    }
    println!();
    for r in runs {
        print!(
            "| {} | {} | {} | {:.0} s | {} | {} |",
            r.seed,
            match r.backend {
                Backend::Sqlite => "SQLite",
                Backend::Postgres => "PostgreSQL",
            },
            r.gateways,
            r.secs,
            r.operations,
            r.requests
        );
        for s in &states {
            print!(" {} |", r.states.get(s).copied().unwrap_or(0));
        }
        for k in &kinds {
            print!(" {} |", r.faults.get(k).copied().unwrap_or(0));
        }
        println!(" {} |", r.violations.len());
    }
}

/// The gateway and database faults injected, by kind.
type Counts = Arc<std::sync::Mutex<BTreeMap<&'static str, u64>>>;

fn count(c: &Counts, k: &'static str) {
    *c.lock().unwrap().entry(k).or_default() += 1;
}

async fn run(args: &Args, bin: &std::path::Path, seed: u64) -> anyhow::Result<Run> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let (provider, paddr) = provider::spawn(
        seed,
        gateways::RESPONSE_TIMEOUT_MS + 400,
        gateways::SETTLE_MS * 2 / 3,
    )
    .await?;
    let keys: Vec<(String, String, String)> = (0..args.tenants)
        .map(|t| {
            (
                format!("t{t}"),
                format!("chaos-client-{t}-{seed}"),
                format!("chaos-admin-{t}-{seed}"),
            )
        })
        .collect();
    let n = args.gateways.unwrap_or(match args.backend {
        Backend::Sqlite => 1,
        Backend::Postgres => 3,
    });
    let mut relays = Vec::new();
    let mut gws = Vec::new();
    let provider_url = format!("http://{paddr}");
    // Every PostgreSQL gateway shares one fresh schema.
    let schema = format!("chaos_{seed}_{:08x}", rand::random::<u32>());
    for i in 0..n {
        let store = match args.backend {
            Backend::Sqlite => Store::Sqlite(dir.path().join("ledger.db")),
            Backend::Postgres => {
                let url = args.postgres_url.clone().ok_or_else(|| {
                    anyhow::anyhow!("--backend postgres needs --postgres-url or TEST_POSTGRES_URL")
                })?;
                let mut parsed = url::Url::parse(&url)?;
                let target = format!(
                    "{}:{}",
                    parsed.host_str().unwrap_or("127.0.0.1"),
                    parsed.port().unwrap_or(5432)
                );
                let relay = Relay::start(target).await?;
                parsed
                    .set_host(Some("127.0.0.1"))
                    .map_err(|e| anyhow::anyhow!("bad URL: {e}"))?;
                parsed
                    .set_port(Some(relay.port))
                    .map_err(|_| anyhow::anyhow!("bad URL"))?;
                relays.push(relay);
                Store::Postgres {
                    url: parsed.to_string(),
                    schema: schema.clone(),
                }
            }
        };
        gws.push(Gateway::start(i, bin, dir.path(), store, &provider_url, &keys).await?);
    }
    if args.backend == Backend::Sqlite {
        // A step of 0: does this build have the clock step at all?
        let status = gws[0].step_clock(0).await?;
        if status != 200 {
            anyhow::bail!(
                "the gateway answered {status} to POST /admin/clock/step: the clock faults need \
                 a build with the failpoints feature (cargo build -p effectgate --features failpoints)"
            );
        }
    }
    let history = Arc::new(History::default());
    let target = Target {
        proxies: gws.iter().map(|g| g.proxy.clone()).collect(),
        tenants: keys
            .iter()
            .map(|(t, k, _)| (t.clone(), k.clone()))
            .collect(),
        started,
        history: history.clone(),
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(4)
            .build()?,
    };
    provider.set_faults(true);

    // Clients.
    let stop = Arc::new(AtomicBool::new(false));
    let faults_end = Instant::now() + args.duration;
    let until = faults_end + args.converge / 2;
    let mut workers = Vec::new();
    for t in 0..args.tenants {
        for w in 0..args.workers {
            workers.push(tokio::spawn(clients::worker(
                target.clone(),
                t,
                w,
                seed,
                stop.clone(),
                until,
            )));
        }
    }

    // Fault lanes: one for the gateways, one for the database relays.
    let counts: Counts = Arc::default();
    let gws = Arc::new(Mutex::new(gws));
    let relays = Arc::new(relays);
    let gw_lane = {
        let (gws, counts) = (gws.clone(), counts.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < faults_end {
                let r = mix(seed, &[b"gw", &i.to_be_bytes()]);
                i += 1;
                tokio::time::sleep(Duration::from_millis(800 + r % 2000)).await;
                if Instant::now() >= faults_end {
                    break;
                }
                let mut g = gws.lock().await;
                let g = &mut g[(r >> 8) as usize % n];
                if (r >> 16).is_multiple_of(2) {
                    count(&counts, "gateway kill -9 + restart");
                    g.kill();
                    tokio::time::sleep(Duration::from_millis(100 + (r >> 24) % 700)).await;
                    if let Err(e) = g.restart().await {
                        eprintln!("restart failed: {e}");
                    }
                } else {
                    count(&counts, "gateway SIGSTOP past the lease");
                    g.pause();
                    tokio::time::sleep(Duration::from_millis(
                        gateways::LEASE_MS + 300 + (r >> 24) % 1500,
                    ))
                    .await;
                    g.resume();
                }
            }
        })
    };
    let db_lane = {
        let (relays, counts) = (relays.clone(), counts.clone());
        tokio::spawn(async move {
            if relays.is_empty() {
                return;
            }
            let mut i = 0u64;
            while Instant::now() < faults_end {
                let r = mix(seed, &[b"db", &i.to_be_bytes()]);
                i += 1;
                tokio::time::sleep(Duration::from_millis(1000 + r % 2500)).await;
                if Instant::now() >= faults_end {
                    break;
                }
                let relay = &relays[(r >> 8) as usize % relays.len()];
                if (r >> 16).is_multiple_of(2) {
                    count(&counts, "database cut");
                    relay.cut();
                    tokio::time::sleep(Duration::from_millis(300 + (r >> 24) % 1200)).await;
                } else {
                    count(&counts, "database stall");
                    relay.stall();
                    tokio::time::sleep(Duration::from_millis(400 + (r >> 24) % 2000)).await;
                }
                relay.restore();
            }
        })
    };
    let clock = (args.backend == Backend::Sqlite)
        .then(|| tokio::spawn(clock_lane(seed, gws.clone(), counts.clone(), faults_end)));
    let _ = gw_lane.await;
    let _ = db_lane.await;
    if let Some(c) = clock {
        let _ = c.await;
    }
    stop.store(true, Ordering::SeqCst);

    // Faults off; everything back.
    provider.set_faults(false);
    for r in relays.iter() {
        r.restore();
    }
    {
        let mut g = gws.lock().await;
        for g in g.iter_mut() {
            if g.paused {
                g.resume();
            }
            if !g.running() {
                g.restart().await?;
            }
        }
    }
    for w in workers {
        let _ = w.await;
    }
    let admin: Vec<u16> = gws.lock().await.iter().map(|g| g.admin).collect();

    // Convergence: re-send what is not final (as a client would), until
    // every operation is terminal or a dead letter, within the bound.
    let http = reqwest::Client::new();
    let deadline = Instant::now() + args.converge;
    let mut rows: BTreeMap<(String, String), Value> = BTreeMap::new();
    let mut resends = Vec::new();
    loop {
        let ops: Vec<(String, String, String)> = history
            .ops
            .lock()
            .unwrap()
            .values()
            .map(|o| (o.tenant.clone(), o.key.clone(), o.body.clone()))
            .collect();
        let mut open = 0;
        for (i, (t, key, body)) in ops.iter().enumerate() {
            if rows.get(&(t.clone(), key.clone())).is_some_and(settled) {
                continue;
            }
            let ti = keys.iter().position(|k| &k.0 == t).unwrap();
            let row = fetch(&http, admin[i % admin.len()], t, &keys[ti].2, key).await;
            let done = row.as_ref().is_some_and(settled);
            if let Some(row) = row {
                rows.insert((t.clone(), key.clone()), row);
            }
            if !done {
                open += 1;
                let (tg, key, body) = (target.clone(), key.clone(), body.clone());
                resends.push(tokio::spawn(async move {
                    let pick = mix(seed, &[key.as_bytes(), b"converge"]);
                    tg.send(ti, &key, &body, pick, "converge").await;
                }));
            }
        }
        for t in std::mem::take(&mut resends) {
            let _ = t.await;
        }
        if open == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Fresh rows for the check (a replay may have come after the row was read).
    for ((t, key), row) in rows.iter_mut() {
        let ti = keys.iter().position(|k| &k.0 == t).unwrap();
        if let Some(r) = fetch(&http, admin[0], t, &keys[ti].2, key).await {
            *row = r;
        }
    }
    let secs = started.elapsed().as_secs_f64();

    if args.plant_violation
        && let Some(((_, _), row)) = rows.iter().find(|(_, r)| r["state"] == "COMPLETED")
        && let Some(pk) = row["provider_key"].as_str()
    {
        provider.plant_duplicate(pk);
    }
    let ops = history.ops.lock().unwrap().clone();
    let violations = check(&ops, &rows, &provider, seed);
    for v in &violations {
        println!("{v}");
    }
    let mut states: BTreeMap<String, usize> = BTreeMap::new();
    for r in rows.values() {
        let s = if r["dead_letter"] == true {
            "dead letter".to_owned()
        } else {
            r["state"].as_str().unwrap_or("?").to_owned()
        };
        *states.entry(s).or_default() += 1;
    }
    let mut faults = provider.counts();
    faults.extend(counts.lock().unwrap().iter().map(|(k, v)| (*k, *v)));
    drop(gws);
    Ok(Run {
        seed,
        backend: args.backend,
        gateways: n,
        secs,
        operations: ops.len(),
        requests: history.requests.load(Ordering::Relaxed),
        states,
        faults,
        violations,
    })
}

/// The clock lane (SQLite only: on PostgreSQL the database clock rules,
/// and the gateways have none of their own to step). Every 1–3.5 s it
/// steps one gateway's ledger clock by 0.3 s to [`gateways::CLOCK_BOUND_MS`]
/// (three leases) forward or back, keeping the gateway's offset from the
/// system clock within that bound (a step that would leave it goes the
/// other way). A kill -9 and restart brings the clock back to the system
/// clock. It waits its turn with the gateway lane, so it never steps a
/// stopped or dead process.
async fn clock_lane(seed: u64, gws: Arc<Mutex<Vec<Gateway>>>, counts: Counts, faults_end: Instant) {
    let bound = gateways::CLOCK_BOUND_MS;
    let mut i = 0u64;
    while Instant::now() < faults_end {
        let r = mix(seed, &[b"clock", &i.to_be_bytes()]);
        i += 1;
        tokio::time::sleep(Duration::from_millis(1000 + r % 2500)).await;
        if Instant::now() >= faults_end {
            break;
        }
        let mut g = gws.lock().await;
        let n = g.len();
        let g = &mut g[(r >> 8) as usize % n];
        let size = 300 + ((r >> 24) % (bound as u64 - 299)) as i64;
        let mut ms = if (r >> 16).is_multiple_of(2) {
            size
        } else {
            -size
        };
        if (g.clock_offset_ms + ms).abs() > bound {
            ms = -ms;
        }
        match g.step_clock(ms).await {
            Ok(200) => count(
                &counts,
                if ms > 0 {
                    "clock step forward"
                } else {
                    "clock step back"
                },
            ),
            Ok(status) => eprintln!("clock step answered {status}"),
            Err(e) => eprintln!("clock step failed: {e}"),
        }
    }
}

/// Whether a ledger row is settled: terminal, or a dead letter.
fn settled(row: &Value) -> bool {
    row["dead_letter"] == true
        || matches!(
            row["state"].as_str(),
            Some("COMPLETED" | "FAILED" | "COMPENSATED")
        )
}

async fn fetch(
    http: &reqwest::Client,
    admin: u16,
    tenant: &str,
    key: &str,
    id: &str,
) -> Option<Value> {
    let r = http
        .get(format!(
            "http://127.0.0.1:{admin}/admin/tenants/{tenant}/operations/{id}"
        ))
        .bearer_auth(key)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    r.json().await.ok()
}

/// Checks every invariant; returns one text per violation, with the seed
/// and the operation's full history.
fn check(
    ops: &BTreeMap<(String, String), clients::Op>,
    rows: &BTreeMap<(String, String), Value>,
    provider: &provider::Provider,
    seed: u64,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut keys_of_ops = std::collections::HashSet::new();
    for (id, op) in ops {
        let mut bad: Vec<String> = Vec::new();
        let row = rows.get(id);
        let pk = row.and_then(|r| r["provider_key"].as_str()).unwrap_or("");
        keys_of_ops.insert(pk.to_owned());
        let effects = provider.effects(pk);
        match row {
            None => {
                bad.push("the ledger has no such operation: stuck before its reservation".into())
            }
            Some(r) => {
                let state = r["state"].as_str().unwrap_or("");
                let dead = r["dead_letter"] == true;
                if dead {
                    if r["dead_letter_reason"].as_str().is_none_or(str::is_empty) {
                        bad.push("a dead letter without a reason".into());
                    }
                    if effects.len() > 1 {
                        bad.push(format!("a dead letter with {} effects", effects.len()));
                    }
                } else {
                    match state {
                        "COMPLETED" | "COMPENSATED" if effects.len() != 1 => bad.push(format!(
                            "{state} with {} effects at the provider{}",
                            effects.len(),
                            if effects.iter().any(|e| e.id.ends_with("-planted")) {
                                " (planted)"
                            } else {
                                ""
                            }
                        )),
                        "FAILED" if !effects.is_empty() => {
                            bad.push(format!("FAILED with {} effects", effects.len()))
                        }
                        "COMPLETED" | "COMPENSATED" | "FAILED" => {}
                        s => bad.push(format!("stuck in {s}")),
                    }
                }
                bad.extend(check_transitions(r));
            }
        }
        // Replays equal the recorded answer, and each other.
        let recorded: Vec<&clients::Answer> = op
            .answers
            .iter()
            .filter(|a| a.replayed || matches!(a.status, 200 | 402))
            .collect();
        if let Some(first) = recorded.first()
            && let Some(other) = recorded
                .iter()
                .find(|a| (a.status, &a.body) != (first.status, &first.body))
        {
            bad.push(format!(
                "answers differ: {} {} vs {} {}{}",
                first.status,
                String::from_utf8_lossy(&first.body),
                other.status,
                String::from_utf8_lossy(&other.body),
                if other.replayed { " (replayed)" } else { "" }
            ));
        }
        // Tenant isolation: a 2xx body names this tenant and this key.
        for a in op.answers.iter().filter(|a| a.status == 200) {
            let v: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
            if v["metadata"]["tenant"] != op.tenant.as_str() || v["client_ref"] != op.key.as_str() {
                bad.push(format!(
                    "tenant {} got data of another operation or tenant: {}",
                    op.tenant,
                    String::from_utf8_lossy(&a.body)
                ));
            }
        }
        if !bad.is_empty() {
            out.push(history_text(seed, op, row, provider, pk, &bad));
        }
    }
    for e in provider.all_effects() {
        if !keys_of_ops.contains(&e.key) {
            out.push(format!(
                "seed {seed}: effect {} under provider key {} belongs to no operation: {}",
                e.id, e.key, e.object
            ));
        }
    }
    out
}

/// The transition history replays to the row: allowed steps, from the
/// state the previous step entered, versions up by one, fences never down.
fn check_transitions(row: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    let empty = Vec::new();
    let ts = row["transitions"].as_array().unwrap_or(&empty);
    let mut state: Option<State> = None;
    let mut version = 0;
    let mut fence = 0;
    for t in ts {
        let from: Option<State> = t["from_state"].as_str().and_then(|s| s.parse().ok());
        let Some(to) = t["to_state"].as_str().and_then(|s| s.parse::<State>().ok()) else {
            bad.push(format!("a transition without a state: {t}"));
            continue;
        };
        if from != state {
            bad.push(format!(
                "transition {t} leaves {from:?}, the state was {state:?}"
            ));
        }
        let allowed = match from {
            None => to == State::Reserved,
            Some(f) => f.can_transition_to(to),
        };
        if !allowed {
            bad.push(format!(
                "transition {from:?} → {to} is not in the state machine"
            ));
        }
        let v = t["version"].as_i64().unwrap_or(-1);
        let f = t["fence"].as_i64().unwrap_or(-1);
        if v != version + 1 {
            bad.push(format!("version {v} after {version}"));
        }
        if f < fence {
            bad.push(format!("fence {f} after {fence}: a stale owner's write"));
        }
        state = Some(to);
        version = v;
        fence = f;
    }
    let row_state = row["state"].as_str().and_then(|s| s.parse::<State>().ok());
    if state != row_state || Some(version) != row["version"].as_i64() {
        bad.push(format!(
            "the history ends at {state:?} v{version}, the row is {row_state:?} v{}",
            row["version"]
        ));
    }
    bad
}

fn history_text(
    seed: u64,
    op: &clients::Op,
    row: Option<&Value>,
    provider: &provider::Provider,
    pk: &str,
    bad: &[String],
) -> String {
    let mut s = format!(
        "VIOLATION seed {seed} tenant {} operation {}: {}\n  request: {}\n  answers:\n",
        op.tenant,
        op.key,
        bad.join("; "),
        op.body
    );
    for a in &op.answers {
        s.push_str(&format!(
            "    +{} ms gateway {} ({}): {}{} {}\n",
            a.at_ms,
            a.gateway,
            a.why,
            a.status,
            if a.replayed { " replayed" } else { "" },
            String::from_utf8_lossy(&a.body)
        ));
    }
    if let Some(r) = row {
        s.push_str(&format!(
            "  ledger: state {} dead letter {} ({}) provider key {pk} fence {} version {}\n  transitions:\n",
            r["state"], r["dead_letter"], r["dead_letter_reason"], r["fence"], r["version"]
        ));
        for t in r["transitions"].as_array().into_iter().flatten() {
            s.push_str(&format!(
                "    {} → {} v{} fence {} by {}: {}\n",
                t["from_state"], t["to_state"], t["version"], t["fence"], t["actor"], t["reason"]
            ));
        }
    }
    let log = provider.log(pk);
    s.push_str(&format!(
        "  provider: attempts {:?}, read-backs {:?}, effects {:?}\n",
        log.attempts.iter().map(|f| f.name()).collect::<Vec<_>>(),
        log.read_backs,
        provider
            .effects(pk)
            .iter()
            .map(|e| e.id.clone())
            .collect::<Vec<_>>()
    ));
    s
}
