//! The gateway as a process: SIGTERM drains within `shutdown.drain_ms`,
//! and `--log-format json` writes one JSON object a line carrying the
//! request id, trace id and operation id.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use mock_provider::MockProvider;

mod common;
use common::{Gw, sha, spawn_gateway};

const CLIENT_KEY: &str = "drain-client-key";
const ADMIN_KEY: &str = "drain-admin-key";

fn write_config(
    dir: &Path,
    provider: &str,
    proxy: u16,
    admin: u16,
    drain_ms: u64,
) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
path = "{db}"
[limits]
lease_ms = 1000
[shutdown]
drain_ms = {drain_ms}
[reconcile]
interval_ms = 50
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
effect_class = "payment"
response_timeout_ms = 10000
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

fn charge(gw: &Gw, key: &str, fault: Option<&str>) -> reqwest::RequestBuilder {
    let mut r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .header("X-Api-Key", "stored-not-shown")
        .body(format!(
            r#"{{"amount":100,"currency":"eur","client_ref":"{key}"}}"#
        ));
    if let Some(f) = fault {
        r = r.header("X-Mock-Fault", f);
    }
    r
}

fn effects(mock: &MockProvider, key: &str) -> usize {
    mock.provider
        .charges()
        .iter()
        .filter(|c| c.client_ref.as_deref() == Some(key))
        .count()
}

/// Waits (at most 10 s) until the provider has seen the charge.
async fn until_sent(mock: &MockProvider, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while effects(mock, key) == 0 {
        assert!(
            Instant::now() < deadline,
            "the call never reached the provider"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn sigterm(gw: &Gw) {
    let ok = Command::new("kill")
        .args(["-TERM", &gw.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

/// The exit status once the process ended (at most `within`).
async fn exited(gw: &mut Gw, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not exit in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ledger_state(config: &Path, key: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_effectgate"))
        .args(["ledger", "show", "t", key, "--config"])
        .arg(config)
        .output()
        .unwrap();
    common::succeeded(&out);
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn sigterm_lets_a_slow_call_finish_and_record_while_readyz_is_503() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gateway.log");
    let cfg = dir.path().join("effectgate.toml");
    let mut gw = spawn_gateway(
        |p, a| write_config(dir.path(), &mock.url(), p, a, 10_000),
        &[],
        Some(&log),
    )
    .await;
    let call = tokio::spawn(charge(&gw, "slow", Some("delay-reply:1500")).send());
    until_sent(&mock, "slow").await;
    sigterm(&gw);
    // Readiness turns at once, while the call is still in flight.
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = http
            .get(format!("http://127.0.0.1:{}/readyz", gw.admin))
            .send()
            .await
            .unwrap();
        if r.status() == 503 {
            assert_eq!(r.headers()["content-type"], "application/problem+json");
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["type"], "urn:effectgate:problem:shutting-down");
            break;
        }
        assert!(Instant::now() < deadline, "/readyz never said 503");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !call.is_finished(),
        "the slow call was still in flight when /readyz said 503"
    );
    // New calls are refused: the proxy listener no longer accepts (it may
    // take a moment to see the signal).
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut n = 0;
    while charge(&gw, &format!("late-{n}"), None).send().await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "calls after SIGTERM were still accepted"
        );
        n += 1;
    }
    // The slow call completes and is answered.
    let r = call.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    let status = exited(&mut gw, Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}");
    // Recorded before exit: the ledger file says COMPLETED, one effect.
    let row = ledger_state(&cfg, "slow");
    assert_eq!(row["state"], "COMPLETED");
    // `ledger show` redacts credential headers as the admin API does.
    assert!(!row.to_string().contains("stored-not-shown"), "{row}");
    assert!(
        row["request_headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "x-api-key" && h[1] == "[redacted]"),
        "{row}"
    );
    assert_eq!(effects(&mock, "slow"), 1);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("drained: every call and execution finished"),
        "{text}"
    );
}

#[tokio::test]
async fn at_the_drain_deadline_an_execution_keeps_its_lease_and_the_next_owner_reconciles_it() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gateway.log");
    let mut gw = spawn_gateway(
        |p, a| write_config(dir.path(), &mock.url(), p, a, 300),
        &[],
        Some(&log),
    )
    .await;
    let call = tokio::spawn(charge(&gw, "stuck", Some("delay-reply:4000")).send());
    until_sent(&mock, "stuck").await;
    let asked = Instant::now();
    sigterm(&gw);
    let status = exited(&mut gw, Duration::from_secs(5)).await;
    assert!(status.success(), "{status:?}");
    assert!(
        asked.elapsed() < Duration::from_millis(3000),
        "exit waited for the provider"
    );
    // The caller's connection was cut at the deadline.
    assert!(call.await.unwrap().is_err());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("executions still running keep their lease") && text.contains("executions=1"),
        "{text}"
    );
    // The next owner: reconciled by read-back, one effect.
    let gw = spawn_gateway(
        |p, a| write_config(dir.path(), &mock.url(), p, a, 300),
        &[],
        None,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = reqwest::Client::new()
            .get(format!(
                "http://127.0.0.1:{}/admin/tenants/t/operations/stuck",
                gw.admin
            ))
            .bearer_auth(ADMIN_KEY)
            .send()
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        if v["state"] == "COMPLETED" {
            break;
        }
        assert!(Instant::now() < deadline, "not reconciled: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(effects(&mock, "stuck"), 1);
}

#[tokio::test]
async fn json_logs_are_one_object_a_line_with_the_request_trace_and_operation_ids() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gateway.log");
    let gw = spawn_gateway(
        |p, a| write_config(dir.path(), &mock.url(), p, a, 1000),
        &[("EFFECTGATE_LOG_FORMAT", "json")],
        Some(&log),
    )
    .await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let r = charge(&gw, "logged", None)
        .header("x-request-id", "req-logged-1")
        .header("traceparent", format!("00-{trace}-b7ad6b7169203331-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(gw);
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() >= 2, "{text}");
    let recorded = lines
        .iter()
        .find(|l| l["fields"]["message"] == "operation recorded")
        .unwrap_or_else(|| panic!("no 'operation recorded' line in {text}"));
    assert_eq!(recorded["fields"]["operation_id"], "logged", "{recorded}");
    assert_eq!(recorded["span"]["request_id"], "req-logged-1", "{recorded}");
    assert_eq!(recorded["span"]["trace_id"], trace, "{recorded}");
    assert_eq!(
        recorded["span"]["effectgate.operation_id"], "logged",
        "{recorded}"
    );
    assert!(recorded["timestamp"].is_string() && recorded["level"] == "INFO");
}
