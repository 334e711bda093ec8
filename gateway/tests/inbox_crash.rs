//! The inbox and the operation events survive crashes: the gateway is
//! killed (SIGKILL) between an event's durable insert and its delivery,
//! and after a restart the consumer gets it exactly once by its
//! `webhook-id`; and a transition killed before its commit never
//! announces itself.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

mod common;
use common::{free_port, sha};

/// What the webhook receiver got: (webhook-id, body), in arrival order.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A child process killed when dropped, so a failing assertion leaves none behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const STRIPE_SECRET: &str = "whsec_crash_test";

async fn receiver() -> (String, Received) {
    let got: Received = Arc::default();
    let g = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |h: axum::http::HeaderMap, b: axum::body::Bytes| {
            let g = g.clone();
            async move {
                let id = h
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                g.lock().unwrap().push((id, b.to_vec()));
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (hook, got)
}

struct Setup {
    dir: tempfile::TempDir,
    cfg: std::path::PathBuf,
    proxy: u16,
    admin: u16,
}

fn setup(hook: &str, upstream: &str, extra: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, admin) = (free_port(), free_port());
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
path = "{db}"
[limits]
lease_ms = 1000
[reconcile]
interval_ms = 100
outbox_lease_ms = 300
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{c}" }}, {{ role = "operator", sha256 = "{o}" }}]
webhook = {{ url = "{hook}", secret_env = "HOOK_SECRET", events = ["operation.unknown", "operation.reconciled", "operation.completed", "operation.failed"] }}
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{upstream}"
effectful_methods = ["POST"]
provider_idempotency_header = "Idempotency-Key"
[routes.read_back]
path = "/v1/charges?idempotency_key={{provider_key}}"
found_pointer = "/data/0"
match = {{ "/idempotency_key" = "{{provider_key}}" }}
settle_delay_ms = 0
[[inbox]]
name = "stripe"
tenant = "t"
scheme = "stripe"
secrets = [{{ env = "STRIPE_WHSEC" }}]
{extra}
"#,
            db = dir.path().join("l.db").display(),
            c = sha("client"),
            o = sha("operator"),
        ),
    )
    .unwrap();
    Setup {
        dir,
        cfg,
        proxy,
        admin,
    }
}

fn start(s: &Setup, failpoint: Option<&str>) -> Killed {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_effectgate"));
    cmd.args(["serve", "--config"])
        .arg(&s.cfg)
        .env("HOOK_SECRET", "s")
        .env("STRIPE_WHSEC", STRIPE_SECRET)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd.env_remove("FAILPOINTS");
    if let Some(f) = failpoint {
        cmd.env("FAILPOINTS", f);
    }
    Killed(cmd.spawn().unwrap())
}

async fn ready(http: &reqwest::Client, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while http
        .get(format!("http://127.0.0.1:{port}/readyz"))
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "not ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_exit(child: Killed) -> std::process::ExitStatus {
    let mut child = child;
    tokio::task::spawn_blocking(move || {
        let s = child.0.wait().unwrap();
        std::mem::forget(child);
        s
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stored_before_a_crash_is_delivered_once_after_restart() {
    let (hook, got) = receiver().await;
    let s = setup(&hook, "http://127.0.0.1:9", "");
    let http = reqwest::Client::new();
    let child = start(&s, Some("before-deliver=return"));
    ready(&http, s.admin).await;
    let body = r#"{"id":"evt_crash","type":"charge.updated","data":{"object":{"id":"ch_1"}}}"#;
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(STRIPE_SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    let header = format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()));
    let r = http
        .post(format!("http://127.0.0.1:{}/inbox/stripe", s.proxy))
        .header("stripe-signature", &header)
        .body(body)
        .send()
        .await
        .unwrap();
    // Answered once durable: the relay dies right before delivering it.
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    let id = v["delivery_id"].as_str().unwrap().to_owned();
    assert_eq!(
        id,
        effectgate::ledger::delivery_id("t", "stripe", "evt_crash")
    );
    let status = wait_exit(child).await;
    assert_eq!(status.signal(), Some(9));
    assert!(
        got.lock().unwrap().is_empty(),
        "nothing delivered before the crash"
    );

    let _child = start(&s, None);
    ready(&http, s.admin).await;
    // The provider's redelivery after the restart is a duplicate.
    let r = http
        .post(format!("http://127.0.0.1:{}/inbox/stripe", s.proxy))
        .header("stripe-signature", &header)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["state"],
        "duplicate"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "never delivered after restart");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Delivered and recorded: the outbox has nothing pending, and the
    // consumer saw the one id once.
    let ledger = effectgate::ledger::Ledger::open(
        &s.dir.path().join("l.db"),
        1,
        5000,
        Arc::new(effectgate::ledger::SystemClock),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let events = ledger.events("t").await.unwrap();
        if events.iter().all(|e| e.2.is_some()) {
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].0, id);
            break;
        }
        assert!(Instant::now() < deadline, "never marked delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = got.lock().unwrap().clone();
    let ids: Vec<&str> = got.iter().map(|(i, _)| i.as_str()).collect();
    assert_eq!(ids, vec![id.as_str()], "exactly once by webhook-id");
    let body: serde_json::Value = serde_json::from_slice(&got[0].1).unwrap();
    assert_eq!(body["data"]["provider_event_id"], "evt_crash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transition_killed_before_its_commit_announces_nothing() {
    let (hook, got) = receiver().await;
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let s = setup(&hook, &mock.url(), "");
    let http = reqwest::Client::new();
    let child = start(&s, Some("before-outcome-commit=return"));
    ready(&http, s.admin).await;
    // The charge happens; the gateway dies before COMPLETED commits.
    let r = http
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", s.proxy))
        .bearer_auth("client")
        .header("Idempotency-Key", "k")
        .body(r#"{"amount":1}"#)
        .send()
        .await;
    assert!(r.is_err(), "no answer: the process died");
    let status = wait_exit(child).await;
    assert_eq!(status.signal(), Some(9));
    assert_eq!(mock.provider.charges().len(), 1);

    // After the restart the lease runs out: UNKNOWN, then the read-back
    // finds the charge: reconciled. The COMPLETED that never committed
    // is never announced.
    let _child = start(&s, None);
    ready(&http, s.admin).await;
    let types = || {
        got.lock()
            .unwrap()
            .iter()
            .map(|(_, b)| {
                serde_json::from_slice::<serde_json::Value>(b).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !types().contains(&"operation.reconciled".to_owned()) {
        assert!(Instant::now() < deadline, "never reconciled: {:?}", types());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut t = types();
    t.sort();
    assert_eq!(t, vec!["operation.reconciled", "operation.unknown"]);
    assert_eq!(mock.provider.charges().len(), 1);
}
