//! Failure injection with real processes: the gateway runs as a child
//! process and is killed with SIGKILL at each crash point, 10 runs per
//! point, then restarted on the same ledger file. After recovery every
//! operation must be terminal and the provider must count exactly one
//! effect per operation.
//!
//! Crash points:
//! - `after-claim`: the operation was reserved and claimed in one commit
//!   (EXECUTING under its first lease), nothing was sent; recovery: the
//!   lease expires, the operation becomes UNKNOWN and the reconciler reads
//!   back or attempts it with the same provider key;
//! - `after-send`: the provider applied the effect and is still answering
//!   (the test kills the gateway while the provider delays its reply);
//! - `before-record`: the provider answered, the ledger has not recorded it;
//! - `after-record`: recorded, the caller not answered yet;
//! - `batch-before-commit`: a group commit of two or more writes, one of
//!   them a reservation of the 8 calls sent at once, applied in its
//!   transaction, `COMMIT` not sent:
//!   every write of it is lost, and no caller of it was answered;
//! - `batch-after-commit`: the batch committed, none of its writes
//!   answered. After either, each caller retries with its key.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;

use std::time::{Duration, Instant};

use mock_provider::MockProvider;

mod common;
use common::{Gw, sha, spawn_gateway};

const RUNS: usize = 10;
const CLIENT_KEY: &str = "crash-client-key";
const ADMIN_KEY: &str = "crash-admin-key";

fn write_config(dir: &Path, provider: &str, proxy: u16, admin: u16) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
path = "{db}"
[limits]
lease_ms = 700
[reconcile]
interval_ms = 50
reserved_grace_ms = 300
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
# No provider idempotency header: the provider can't deduplicate, so one
# effect per operation is the gateway's doing alone.
effect_class = "payment"
response_timeout_ms = 500
tenant_scoped_field = "/metadata/tenant"
[routes.read_back]
path = "/v1/charges?client_ref={{body:/client_ref}}"
found_pointer = "/data/0"
reference_pointer = "/id"
"#,
        db = dir.join("ledger.db").display(),
        ck = sha(CLIENT_KEY),
        ak = sha(ADMIN_KEY),
    );
    let p = dir.join("effectgate.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

async fn start(dir: &Path, provider: &str, failpoint: Option<&str>) -> Gw {
    let fp = failpoint.map(|p| format!("{p}=return"));
    let env: Vec<(&str, &str)> = fp.iter().map(|v| ("FAILPOINTS", v.as_str())).collect();
    spawn_gateway(
        |proxy, admin| write_config(dir, provider, proxy, admin),
        &env,
        None,
    )
    .await
}

fn effects_for(mock: &MockProvider, client_ref: &str) -> usize {
    mock.provider
        .charges()
        .iter()
        .filter(|c| c.client_ref.as_deref() == Some(client_ref))
        .count()
}

async fn state_of(gw: &Gw, key: &str) -> Option<String> {
    let r = reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{}/admin/tenants/t/operations/{key}",
            gw.admin
        ))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .ok()?;
    let v: serde_json::Value = r.json().await.ok()?;
    v["state"].as_str().map(str::to_owned)
}

/// One run: crash at `point`, restart, wait for the operation to resolve.
/// Returns (final state, effects at the provider, ms to resolve after restart).
async fn run_once(point: &str, mock: &MockProvider, run: usize) -> (String, usize, u128) {
    let dir = tempfile::tempdir().unwrap();
    let provider = mock.url();
    let key = format!("{point}-{run}");
    let body = format!(r#"{{"amount":100,"currency":"eur","client_ref":"{key}"}}"#);
    let failpoint = (point != "after-send").then_some(point);
    let mut gw = start(dir.path(), &provider, failpoint).await;

    let mut req = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", &key)
        .header("Content-Type", "application/json")
        .body(body.clone());
    if point == "after-send" {
        req = req.header("X-Mock-Fault", "delay-reply:10000");
    }
    let call = tokio::spawn(req.send());
    if point == "after-send" {
        // The provider has applied the effect and holds its reply: kill now.
        let deadline = Instant::now() + Duration::from_secs(10);
        while effects_for(mock, &key) == 0 {
            assert!(Instant::now() < deadline, "the provider never saw the call");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        gw.child.kill().unwrap();
    }
    let status = tokio::task::spawn_blocking(move || {
        let s = gw.child.wait().unwrap();
        (s, gw)
    })
    .await
    .unwrap();
    let (exit, _dead) = status;
    assert_eq!(
        exit.signal(),
        Some(9),
        "{point}: the gateway must die by SIGKILL, got {exit:?}"
    );
    assert!(
        call.await.unwrap().is_err(),
        "{point}: the caller can't have been answered"
    );

    // Restart on the same ledger; the reconciler must finish the operation.
    let restarted = Instant::now();
    let mut gw = start(dir.path(), &provider, None).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let state = loop {
        let s = state_of(&gw, &key).await.unwrap_or_default();
        if s == "COMPLETED" || s == "FAILED" {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{point} run {run}: operation stuck in {s}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let resolved_ms = restarted.elapsed().as_millis();
    // A duplicate afterwards is a replay.
    let dup = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", &key)
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(dup.status(), 200, "{point}: duplicate after recovery");
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    gw.child.kill().unwrap();
    let _ = gw.child.wait();
    (state, effects_for(mock, &key), resolved_ms)
}

async fn crash_point(point: &str) {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut rows = Vec::new();
    for run in 0..RUNS {
        rows.push(run_once(point, &mock, run).await);
    }
    let completed = rows.iter().filter(|r| r.0 == "COMPLETED").count();
    let exactly_one = rows.iter().filter(|r| r.1 == 1).count();
    let max_ms = rows.iter().map(|r| r.2).max().unwrap_or(0);
    println!(
        "crash matrix | {point:<14} | runs {RUNS} | terminal {}/{RUNS} | completed {completed}/{RUNS} | exactly one effect {exactly_one}/{RUNS} | stuck 0 | max recovery {max_ms} ms",
        rows.len()
    );
    assert_eq!(
        exactly_one,
        RUNS,
        "{point}: effects per operation {:?}",
        rows.iter().map(|r| r.1).collect::<Vec<_>>()
    );
    assert_eq!(completed, RUNS, "{point}: every operation completes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_claim() {
    crash_point("after-claim").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_send_before_reply() {
    crash_point("after-send").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_reply_before_commit() {
    crash_point("before-record").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_commit_before_answer() {
    crash_point("after-record").await;
}

/// Calls sent at once in a group-commit crash run: enough to fill
/// batches of several writes.
const BATCH_CALLS: usize = 8;

/// Attempts of a group-commit crash run before it fails: an attempt in
/// which the calls' writes happened not to overlap (every batch held one
/// write) reaches no crash point and is tried again with new keys.
const BATCH_ATTEMPTS: usize = 20;

/// One run of a group-commit crash: `BATCH_CALLS` calls at once, the
/// gateway killed at `point` in a batch of at least two writes, then
/// restarted; each caller retries with its key until it gets its answer.
/// Returns (callers answered before the crash, effects per key, ms to
/// resolve every key after restart).
async fn batch_run_once(point: &str, mock: &MockProvider, run: usize) -> (usize, Vec<usize>, u128) {
    for attempt in 0..BATCH_ATTEMPTS {
        if let Some(row) = batch_attempt(point, mock, &format!("{run}a{attempt}")).await {
            return row;
        }
    }
    panic!("{point} run {run}: no batch of two or more writes formed in {BATCH_ATTEMPTS} attempts");
}

/// One attempt of [`batch_run_once`], its keys tagged `tag`; `None` when
/// every call was answered and the gateway lived (no batch of two or more
/// of its writes formed; the gateway is stopped).
async fn batch_attempt(
    point: &str,
    mock: &MockProvider,
    tag: &str,
) -> Option<(usize, Vec<usize>, u128)> {
    let dir = tempfile::tempdir().unwrap();
    let provider = mock.url();
    // Armed by the calls' own keys: the gateway's background writes at
    // start-up never trip it.
    let fp = format!("{point}=return({point}-{tag}-)");
    let gw = spawn_gateway(
        |proxy, admin| write_config(dir.path(), &provider, proxy, admin),
        &[("FAILPOINTS", fp.as_str())],
        None,
    )
    .await;
    let keys: Vec<String> = (0..BATCH_CALLS)
        .map(|i| format!("{point}-{tag}-{i}"))
        .collect();
    let call = |gw_port: u16, key: String| {
        let body = format!(r#"{{"amount":100,"currency":"eur","client_ref":"{key}"}}"#);
        reqwest::Client::new()
            .post(format!("http://127.0.0.1:{gw_port}/pay/v1/charges"))
            .bearer_auth(CLIENT_KEY)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
    };
    let calls: Vec<_> = keys
        .iter()
        .map(|k| tokio::spawn(call(gw.proxy, k.clone())))
        .collect();
    let mut outcomes = Vec::new();
    for c in calls {
        outcomes.push(c.await.unwrap().map(|r| r.status()));
    }
    let mut gw = gw;
    if outcomes.iter().all(Result::is_ok) && gw.child.try_wait().unwrap().is_none() {
        // Every call answered: none of their batches held two writes.
        gw.child.kill().unwrap();
        let _ = gw.child.wait();
        return None;
    }
    // A call lost its answer: the gateway is dying or dead.
    let (exit, _dead) = tokio::task::spawn_blocking(move || {
        let s = gw.child.wait().unwrap();
        (s, gw)
    })
    .await
    .unwrap();
    assert_eq!(
        exit.signal(),
        Some(9),
        "{point}: the gateway must die by SIGKILL in a batch of two or more writes, got {exit:?}"
    );
    let answered = outcomes.iter().filter(|o| o.is_ok()).count();

    let restarted = Instant::now();
    let gw = start(dir.path(), &provider, None).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    for key in &keys {
        // The caller retries with the same key until it gets an answer
        // other than "in progress" (409).
        loop {
            let r = call(gw.proxy, key.clone()).await.unwrap();
            if r.status() == 200 {
                break;
            }
            assert_eq!(
                r.status(),
                409,
                "{point} run {tag} {key}: retry answered {}",
                r.status()
            );
            assert!(
                Instant::now() < deadline,
                "{point} run {tag}: {key} stuck in {:?}",
                state_of(&gw, key).await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            state_of(&gw, key).await.as_deref(),
            Some("COMPLETED"),
            "{point} run {tag} {key}"
        );
    }
    let resolved_ms = restarted.elapsed().as_millis();
    let effects = keys.iter().map(|k| effects_for(mock, k)).collect();
    let mut gw = gw;
    gw.child.kill().unwrap();
    let _ = gw.child.wait();
    Some((answered, effects, resolved_ms))
}

/// The crash matrix row of a group-commit crash point.
async fn batch_crash_point(point: &str) {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut rows = Vec::new();
    for run in 0..RUNS {
        rows.push(batch_run_once(point, &mock, run).await);
    }
    let exactly_one = rows.iter().filter(|r| r.1.iter().all(|&e| e == 1)).count();
    let answered: usize = rows.iter().map(|r| r.0).sum();
    let max_ms = rows.iter().map(|r| r.2).max().unwrap_or(0);
    println!(
        "crash matrix | {point:<19} | runs {RUNS} × {BATCH_CALLS} calls | answered before the crash {answered}/{} | exactly one effect {exactly_one}/{RUNS} | stuck 0 | max recovery {max_ms} ms",
        RUNS * BATCH_CALLS
    );
    assert_eq!(
        exactly_one,
        RUNS,
        "{point}: effects per key {:?}",
        rows.iter().map(|r| &r.1).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_while_a_batch_commits() {
    batch_crash_point("batch-before-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_a_batch_committed_before_its_answers() {
    batch_crash_point("batch-after-commit").await;
}
