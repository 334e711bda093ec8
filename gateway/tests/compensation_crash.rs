//! Compensation with real processes: the gateway is killed with SIGKILL at
//! each crash point of a compensation (10 runs per point), restarted on
//! the same ledger file, and must finish it: one refund at the provider,
//! the compensation COMPLETED, the original COMPENSATED, nothing stuck.
//! The provider gets no idempotency header, so it cannot deduplicate a
//! refund itself. Also `effectgate ledger compensate`.
//!
//! Crash points, on the compensating operation's own execution:
//! - `after-reserve`: `<id>#compensation` is RESERVED, nothing was sent;
//! - `after-send`: the provider applied the refund and holds its reply
//!   (the test kills the gateway);
//! - `before-record`: the provider answered, the ledger has not recorded it;
//! - `after-record`: recorded (and the original COMPENSATED), the operator
//!   not answered yet.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mock_provider::{Faults, MockProvider};
use serde_json::Value;

mod common;
use common::{Gw, sha, spawn_gateway};

const RUNS: usize = 10;
const CLIENT_KEY: &str = "comp-client-key";
const ADMIN_KEY: &str = "comp-admin-key";
const OPERATOR_KEY: &str = "comp-operator-key";

fn write_config(dir: &Path, provider: &str, proxy: u16, admin: u16) -> PathBuf {
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
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }},
        {{ role = "operator", name = "t:ops", sha256 = "{ok}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
# No provider idempotency header: one refund per compensation is the
# gateway's doing alone.
effect_class = "payment"
response_timeout_ms = 500
[routes.read_back]
path = "/v1/charges?client_ref={{body:/client_ref}}"
found_pointer = "/data/0"
match = {{ "/client_ref" = "{{body:/client_ref}}", "/metadata/tenant" = "{{tenant}}" }}
reference_pointer = "/id"
[routes.compensation]
method = "POST"
path = "/v1/refunds"
body = {{ charge = "{{reference}}", reason = "requested_by_customer" }}
read_back = {{ path = "/v1/refunds?charge={{reference}}", found_pointer = "/data/0", match = {{ "/charge" = "{{reference}}" }}, settle_delay_ms = 200 }}
"#,
        db = dir.join("ledger.db").display(),
        ck = sha(CLIENT_KEY),
        ak = sha(ADMIN_KEY),
        ok = sha(OPERATOR_KEY),
    )
    .replace(
        "response_timeout_ms = 500\n",
        "response_timeout_ms = 500\ntenant_scoped_field = \"/metadata/tenant\"\n",
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

fn refunds_of(mock: &MockProvider, charge: &str) -> usize {
    mock.provider
        .refunds()
        .iter()
        .filter(|r| r.charge == charge)
        .count()
}

async fn op(gw: &Gw, id: &str) -> Value {
    let r = reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{}/admin/tenants/t/operations/{}",
            gw.admin,
            id.replace('#', "%23")
        ))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await;
    match r {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

fn charge_request(gw: &Gw, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(format!(
            r#"{{"amount":100,"currency":"eur","client_ref":"{key}"}}"#
        ))
}

fn compensate_request(gw: &Gw, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/admin/tenants/t/operations/{key}/compensate",
            gw.admin
        ))
        .bearer_auth(OPERATOR_KEY)
        .body(r#"{"reason":"charged against policy"}"#)
}

/// A charge made and recorded by a gateway that is then stopped; returns
/// the charge's id at the provider.
async fn charged(dir: &Path, mock: &MockProvider, key: &str) -> String {
    let mut gw = start(dir, &mock.url(), None).await;
    let r = charge_request(&gw, key).send().await.unwrap();
    assert_eq!(r.status(), 200, "the charge");
    let v: Value = r.json().await.unwrap();
    gw.child.kill().unwrap();
    let _ = gw.child.wait();
    v["id"].as_str().unwrap().to_owned()
}

/// One run: charge, crash the compensation at `point`, restart, wait for
/// the original to be COMPENSATED. Returns (original's state, compensation's
/// state, refunds of the charge, ms from the restart to COMPENSATED).
async fn run_once(point: &str, mock: &MockProvider, run: usize) -> (String, String, usize, u128) {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("comp-{point}-{run}");
    let charge = charged(dir.path(), mock, &key).await;
    let failpoint = (point != "after-send").then_some(point);
    let mut gw = start(dir.path(), &mock.url(), failpoint).await;
    if point == "after-send" {
        mock.provider.set_faults(Faults {
            refund_delay_reply_ms: 10_000,
            ..Faults::default()
        });
    }
    let call = tokio::spawn(compensate_request(&gw, &key).send());
    if point == "after-send" {
        // The provider applied the refund and holds its reply: kill now.
        let deadline = Instant::now() + Duration::from_secs(10);
        while refunds_of(mock, &charge) == 0 {
            assert!(
                Instant::now() < deadline,
                "the provider never saw the refund"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        gw.child.kill().unwrap();
    }
    let (exit, gw) = tokio::task::spawn_blocking(move || {
        let s = gw.child.wait().unwrap();
        (s, gw)
    })
    .await
    .unwrap();
    drop(gw);
    mock.provider.set_faults(Faults::default());
    assert_eq!(
        exit.signal(),
        Some(9),
        "{point}: the gateway must die by SIGKILL, got {exit:?}"
    );
    assert!(
        call.await.unwrap().is_err(),
        "{point}: the operator can't have been answered"
    );

    let restarted = Instant::now();
    let gw = start(dir.path(), &mock.url(), None).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let child_id = format!("{key}#compensation");
    let (state, child_state) = loop {
        let s = op(&gw, &key).await["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let c = op(&gw, &child_id).await["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if s == "COMPENSATED" {
            break (s, c);
        }
        assert!(
            Instant::now() < deadline,
            "{point} run {run}: stuck with the original {s}, the compensation {c}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let recovered_ms = restarted.elapsed().as_millis();
    // Asking again is the same compensation, and no second refund.
    let again = compensate_request(&gw, &key).send().await.unwrap();
    assert_eq!(again.status(), 200, "{point}: asking again");
    let v: Value = again.json().await.unwrap();
    assert_eq!(v["compensation"]["operation_id"], child_id);
    // A duplicate of the charge is its stored answer, marked compensated.
    let dup = charge_request(&gw, &key).send().await.unwrap();
    assert_eq!(dup.status(), 200, "{point}: duplicate after recovery");
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.headers()["effectgate-compensated"], "true");
    assert_eq!(
        dup.headers()["effectgate-compensation-id"],
        child_id.as_str()
    );
    (state, child_state, refunds_of(mock, &charge), recovered_ms)
}

async fn crash_point(point: &str) {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut rows = Vec::new();
    for run in 0..RUNS {
        rows.push(run_once(point, &mock, run).await);
    }
    let compensated = rows.iter().filter(|r| r.0 == "COMPENSATED").count();
    let completed = rows.iter().filter(|r| r.1 == "COMPLETED").count();
    let exactly_one = rows.iter().filter(|r| r.2 == 1).count();
    let max_ms = rows.iter().map(|r| r.3).max().unwrap_or(0);
    println!(
        "compensation crash matrix | {point:<14} | runs {RUNS} | original COMPENSATED {compensated}/{RUNS} | compensation COMPLETED {completed}/{RUNS} | exactly one refund {exactly_one}/{RUNS} | stuck 0 | max recovery {max_ms} ms"
    );
    assert_eq!(
        exactly_one,
        RUNS,
        "{point}: refunds per charge {:?}",
        rows.iter().map(|r| r.2).collect::<Vec<_>>()
    );
    assert_eq!(compensated, RUNS);
    assert_eq!(completed, RUNS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensation_killed_after_reserve() {
    crash_point("after-reserve").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensation_killed_after_send_before_reply() {
    crash_point("after-send").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensation_killed_after_reply_before_commit() {
    crash_point("before-record").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensation_killed_after_commit_before_answer() {
    crash_point("after-record").await;
}

/// `effectgate ledger compensate` runs the compensation in its own process
/// (the gateway stopped): exit 0, one refund; again: the same compensation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_compensates_once() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let charge = charged(dir.path(), &mock, "cli-1").await;
    let cfg = dir.path().join("effectgate.toml");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_effectgate"))
            .args(args)
            .arg("--config")
            .arg(&cfg)
            .env_remove("FAILPOINTS")
            // Without a login name in the environment (a container, cron),
            // the actor is the user id.
            .env_remove("USER")
            .env_remove("LOGNAME")
            .output()
            .unwrap()
    };
    let out = tokio::task::block_in_place(|| {
        run(&[
            "ledger",
            "compensate",
            "t",
            "cli-1",
            "--reason",
            "duplicate order",
        ])
    });
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "COMPENSATED");
    assert_eq!(v["compensation"]["operation_id"], "cli-1#compensation");
    assert_eq!(v["compensation"]["state"], "COMPLETED");
    assert_eq!(refunds_of(&mock, &charge), 1);
    let again = tokio::task::block_in_place(|| {
        run(&["ledger", "compensate", "t", "cli-1", "--reason", "again"])
    });
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(
        refunds_of(&mock, &charge),
        1,
        "asking again refunds nothing"
    );
    // The original's timeline names the CLI's operator and the reason.
    let show = tokio::task::block_in_place(|| run(&["ledger", "show", "t", "cli-1"]));
    let v: Value = serde_json::from_slice(&show.stdout).unwrap();
    let last = v["transitions"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["from_state"], "COMPLETED");
    assert_eq!(last["to_state"], "COMPENSATED");
    let uid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").unwrap().uid()
    };
    assert_eq!(last["actor"], format!("cli:uid {uid}"), "{last}");
    let reason = last["reason"].as_str().unwrap();
    assert!(
        reason.contains("cli-1#compensation") && reason.contains("duplicate order"),
        "{reason}"
    );
    // Not a COMPLETED operation of a route with a compensation: refused.
    let missing = tokio::task::block_in_place(|| {
        run(&["ledger", "compensate", "t", "nope", "--reason", "x"])
    });
    assert_eq!(missing.status.code(), Some(1));
}
