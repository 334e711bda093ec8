//! The PostgreSQL scenarios (e) and (f): one and two gateway instances
//! sharing one ledger, against SQLite's effectful figure of the same run.

use crate::config;
use crate::{Args, HttpClient, PAIRED_CYCLES, Stats, paired, run};

/// What the PostgreSQL scenarios are compared with: the same run's
/// direct baseline (a), SQLite's effectful (c), and the effectful URL of
/// the SQLite gateway (still running) for the alternating cycles.
pub(crate) struct SqliteBaseline<'a> {
    pub(crate) direct: &'a Stats,
    pub(crate) sqlite: &'a Stats,
    pub(crate) sqlite_pay: &'a str,
}

/// Effectful throughput on PostgreSQL with one and with two gateway
/// instances sharing one fresh schema, next to SQLite's (c), each as a
/// ratio to the direct baseline (a) of the same run; then one PostgreSQL
/// instance and the SQLite gateway in alternating cycles, whose median
/// ratio is returned.
pub(crate) async fn shared_ledger(
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
        "{LISTEN}[storage]\nurl = \"{url}\"\nschema = \"{schema}\"\nmax_connections = 16\n{tenant}{route}",
        LISTEN = config::LISTEN,
        tenant = config::tenant(hash),
        route = config::pay_route(&mock.url()),
    );
    let cfg = dir.path().join("bench-pg.toml");
    let one = config::start(dir.path(), "bench-pg.toml", &toml).await?;
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
