//! Several gateway processes sharing one PostgreSQL ledger.
//!
//! Each test starts two or three `effectgate serve` processes on their own
//! ports, all on one fresh schema of the database named by
//! `TEST_POSTGRES_URL`, in front of one demo provider that can't
//! deduplicate (no provider idempotency header is sent), so one effect per
//! operation is the gateways' doing alone. Without `TEST_POSTGRES_URL` the
//! tests are skipped, with one line saying so.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use mock_provider::{Faults, MockProvider};
use rand::seq::SliceRandom;

mod common;
use common::{Gw, fresh_schema, pg_url, sha, spawn_gateway};

const CLIENT_KEY: &str = "multi-client-key";
const ADMIN_KEY: &str = "multi-admin-key";

/// Timing knobs of one test's gateways.
#[derive(Clone, Copy)]
struct Timing {
    /// `limits.lease_ms`.
    lease_ms: u64,
    /// The route's `response_timeout_ms`.
    response_timeout_ms: u64,
}

fn write_config(
    dir: &Path,
    url: &str,
    schema: &str,
    provider: &str,
    t: Timing,
    proxy: u16,
    admin: u16,
) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
url = "{url}"
schema = "{schema}"
max_connections = 8
[limits]
lease_ms = {lease}
[reconcile]
interval_ms = 50
reserved_grace_ms = 1000
duplicate_wait_ms = 3000
lease_ms = 3000
max_read_backs = 1000
backoff_base_ms = 20
backoff_max_ms = 40
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
effect_class = "payment"
response_timeout_ms = {timeout}
tenant_scoped_field = "/metadata/tenant"
[routes.read_back]
path = "/v1/charges?client_ref={{body:/client_ref}}"
found_pointer = "/data/0"
reference_pointer = "/id"
settle_delay_ms = 0
timeout_ms = 2000
"#,
        lease = t.lease_ms,
        timeout = t.response_timeout_ms,
        ck = sha(CLIENT_KEY),
        ak = sha(ADMIN_KEY),
    );
    let path = dir.join(format!("gw-{proxy}.toml"));
    std::fs::write(&path, cfg).unwrap();
    path
}

async fn start(
    dir: &Path,
    url: &str,
    schema: &str,
    provider: &str,
    t: Timing,
    failpoints: Option<&str>,
) -> Gw {
    let log = dir.join(format!("gw-{:016x}.log", rand::random::<u64>()));
    let mut env = vec![("RUST_LOG", "warn")];
    if let Some(fp) = failpoints {
        env.push(("FAILPOINTS", fp));
    }
    spawn_gateway(
        |proxy, admin| write_config(dir, url, schema, provider, t, proxy, admin),
        &env,
        Some(&log),
    )
    .await
}

/// A provider, a fresh schema and `n` gateways on it.
async fn cluster(n: usize, t: Timing) -> Option<(MockProvider, Vec<Gw>, tempfile::TempDir)> {
    cluster_with(n, t, &[]).await
}

/// [`cluster`], instance `i` with `FAILPOINTS = failpoints[i]`.
async fn cluster_with(
    n: usize,
    t: Timing,
    failpoints: &[Option<&str>],
) -> Option<(MockProvider, Vec<Gw>, tempfile::TempDir)> {
    let url = pg_url()?;
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let schema = fresh_schema();
    // All at once: they migrate the fresh schema together.
    let provider = mock.url();
    let gws = futures_util::future::join_all((0..n).map(|i| {
        start(
            dir.path(),
            &url,
            &schema,
            &provider,
            t,
            failpoints.get(i).copied().flatten(),
        )
    }))
    .await;
    Some((mock, gws, dir))
}

fn body(client_ref: &str) -> String {
    format!(r#"{{"amount":100,"currency":"eur","client_ref":"{client_ref}"}}"#)
}

fn charge(gw: &Gw, key: &str, fault: Option<&str>) -> reqwest::RequestBuilder {
    let mut req = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body(key));
    if let Some(f) = fault {
        req = req.header("X-Mock-Fault", f);
    }
    req
}

async fn operation(gw: &Gw, key: &str) -> serde_json::Value {
    reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{}/admin/tenants/t/operations/{key}",
            gw.admin
        ))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls `gw` until every key is COMPLETED or FAILED; panics after `limit`.
async fn wait_terminal(gw: &Gw, keys: &[String], limit: Duration) -> Duration {
    let start = Instant::now();
    for key in keys {
        loop {
            let op = operation(gw, key).await;
            let state = op["state"].as_str().unwrap_or_default().to_owned();
            if state == "COMPLETED" || state == "FAILED" {
                break;
            }
            assert!(start.elapsed() < limit, "{key} stuck in {state}: {op}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    start.elapsed()
}

fn effects_per_ref(mock: &MockProvider) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for c in mock.provider.charges() {
        *m.entry(c.client_ref.unwrap_or_default()).or_default() += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_spread_across_three_instances_make_one_effect_each() {
    let timing = Timing {
        lease_ms: 5_000,
        response_timeout_ms: 10_000,
    };
    let Some((mock, gws, _dir)) = cluster(3, timing).await else {
        return;
    };
    let keys: Vec<String> = (0..200).map(|i| format!("op-{i:03}")).collect();
    let mut sends: Vec<(String, usize)> = keys
        .iter()
        .flat_map(|k| (0..5).map(move |_| k.clone()))
        .map(|k| (k, rand::random_range(0..3)))
        .collect();
    sends.shuffle(&mut rand::rng());
    let gws_ref = &gws;
    let answers: Vec<(String, u16, bool, String)> = futures_util::stream::iter(sends)
        .map(|(key, i)| async move {
            let r = charge(&gws_ref[i], &key, None).send().await.unwrap();
            let status = r.status().as_u16();
            let replayed = r
                .headers()
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true");
            (key, status, replayed, r.text().await.unwrap())
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert_eq!(answers.len(), 1000);
    assert_eq!(
        mock.provider.effects(),
        200,
        "exactly one effect per operation"
    );
    assert!(effects_per_ref(&mock).values().all(|&n| n == 1));
    let mut originals: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut bodies: HashMap<&str, Vec<&str>> = HashMap::new();
    let (mut replays, mut conflicts) = (0, 0);
    for (key, status, replayed, body) in &answers {
        match (status, replayed) {
            (200, false) => originals.entry(key).or_default().push(body),
            (200, true) => replays += 1,
            (409, _) => {
                conflicts += 1;
                continue;
            }
            other => panic!("{key}: neither the original, a replay nor a 409: {other:?} {body}"),
        }
        bodies.entry(key).or_default().push(body);
    }
    for key in &keys {
        assert_eq!(
            originals.get(key.as_str()).map(Vec::len),
            Some(1),
            "{key}: exactly one original answer"
        );
        let b = &bodies[key.as_str()];
        assert!(
            b.iter().all(|x| x == &b[0]),
            "{key}: every replay is the original"
        );
    }
    eprintln!("200 originals, {replays} replays, {conflicts} conflicts (409)");
    assert_eq!(200 + replays + conflicts, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_instances_operations_are_resolved_by_the_survivor() {
    let timing = Timing {
        lease_ms: 900,
        response_timeout_ms: 30_000,
    };
    let Some((mock, mut gws, _dir)) = cluster(2, timing).await else {
        return;
    };
    let keys: Vec<String> = (0..20).map(|i| format!("inflight-{i}")).collect();
    // Every call reaches the provider, which applies the effect and holds
    // its reply: the operations are in flight on instance A.
    let calls: Vec<_> = keys
        .iter()
        .map(|k| tokio::spawn(charge(&gws[0], k, Some("delay-reply:30000")).send()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while mock.provider.effects() < keys.len() {
        assert!(
            Instant::now() < deadline,
            "the provider never saw every call"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for k in &keys {
        assert_eq!(operation(&gws[1], k).await["state"], "EXECUTING");
    }
    let mut a = gws.remove(0);
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    for c in calls {
        assert!(c.await.unwrap().is_err(), "A's callers were never answered");
    }
    let survivor = &gws[0];
    let took = wait_terminal(survivor, &keys, Duration::from_secs(30)).await;
    eprintln!(
        "the survivor resolved {} operations {} ms after the kill",
        keys.len(),
        took.as_millis()
    );
    for k in &keys {
        let op = operation(survivor, k).await;
        assert_eq!(op["state"], "COMPLETED", "{op}");
    }
    assert_eq!(mock.provider.effects(), keys.len());
    assert!(effects_per_ref(&mock).values().all(|&n| n == 1));
    // A duplicate now is a replay of the reconciled result.
    let dup = charge(survivor, &keys[0], None).send().await.unwrap();
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(mock.provider.effects(), keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_instances_late_write_is_fenced_off() {
    let timing = Timing {
        lease_ms: 600,
        response_timeout_ms: 30_000,
    };
    let Some((mock, gws, _dir)) = cluster(2, timing).await else {
        return;
    };
    let (a, b) = (&gws[0], &gws[1]);
    // A sends; the provider applies the effect and answers 1.5 s later.
    let call = tokio::spawn(charge(a, "stalled", Some("delay-reply:1500")).send());
    let deadline = Instant::now() + Duration::from_secs(20);
    while mock.provider.effects() == 0 {
        assert!(Instant::now() < deadline, "the provider never saw the call");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A stalls (a GC pause, a frozen VM): it can't extend its lease.
    let pid = a.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    // B takes over after the lease expires and reconciles by read-back.
    wait_terminal(b, &["stalled".to_owned()], Duration::from_secs(20)).await;
    let op = operation(b, "stalled").await;
    assert_eq!(op["state"], "COMPLETED");
    let fence_b = op["fence"].as_i64().unwrap();
    assert!(fence_b >= 2, "B holds a newer fencing token: {op}");
    // A resumes, gets the provider's late reply, and tries to record it.
    assert!(
        Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let answer = call.await.unwrap().unwrap();
    let status = answer.status().as_u16();
    let stale = loop {
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", a.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let n: u64 = text
            .lines()
            .find(|l| l.starts_with("effectgate_stale_fence_rejections_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or(0);
        if n > 0 {
            break n;
        }
        assert!(Instant::now() < deadline, "A never tried its stale write");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let after = operation(b, "stalled").await;
    assert_eq!(after["state"], "COMPLETED");
    assert_eq!(after["fence"], fence_b, "A's late write did not land");
    assert_eq!(
        after["version"], op["version"],
        "nothing changed after B's outcome"
    );
    assert_eq!(mock.provider.effects(), 1);
    eprintln!("A answered its caller {status}; {stale} stale-fence rejection(s) on A");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reconcilers_on_every_instance_never_read_back_one_operation_at_once() {
    let timing = Timing {
        lease_ms: 5_000,
        response_timeout_ms: 10_000,
    };
    let Some((mock, gws, _dir)) = cluster(3, timing).await else {
        return;
    };
    // Every read-back takes a while and the first ones fail, so each
    // operation is read back several times while three reconcilers scan.
    mock.provider.set_faults(Faults {
        readback_delay_ms: 60,
        readback_fail_times: 60,
        ..Default::default()
    });
    let keys: Vec<String> = (0..30).map(|i| format!("lost-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        let r = charge(&gws[i % 3], k, Some("drop-after-effect"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 502, "the reply was lost");
    }
    wait_terminal(&gws[2], &keys, Duration::from_secs(60)).await;
    for k in &keys {
        assert_eq!(operation(&gws[0], k).await["state"], "COMPLETED");
    }
    let log = mock.provider.readback_log();
    assert!(
        log.len() >= keys.len() + 60,
        "every operation was read back, some several times: {}",
        log.len()
    );
    let overlaps = mock.provider.overlapping_readbacks();
    assert!(
        overlaps.is_empty(),
        "{} pairs of read-backs of one operation ran at the same time: {:?}",
        overlaps.len(),
        overlaps.first()
    );
    assert_eq!(mock.provider.effects(), keys.len());
    eprintln!(
        "{} read-backs, none of one operation at the same time",
        log.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_paused_between_claim_and_send_does_not_send_after_losing_its_lease() {
    let timing = Timing {
        lease_ms: 700,
        response_timeout_ms: 10_000,
    };
    // A stalls 1.5 s after claiming, before sending: its lease runs out.
    let Some((mock, gws, _dir)) =
        cluster_with(2, timing, &[Some("before-send=1*sleep(1500)"), None]).await
    else {
        return;
    };
    let r = charge(&gws[0], "paused", None).send().await.unwrap();
    let status = r.status().as_u16();
    // B took over after the lease: read-back absent, a new attempt, one effect.
    wait_terminal(&gws[1], &["paused".to_owned()], Duration::from_secs(20)).await;
    let op = operation(&gws[1], "paused").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    assert_eq!(
        mock.provider.effects(),
        1,
        "A renewed its lease under its fencing token before sending, failed, and sent nothing (A answered {status})"
    );
    eprintln!("A answered {status}; the provider saw 1 effect");
}
