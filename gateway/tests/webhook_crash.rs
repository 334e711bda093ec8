//! The outbox survives a crash between the commit and the delivery: the
//! gateway is killed (SIGKILL) right before it POSTs an approval event, and
//! after a restart the event arrives with the same event id.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{free_port, sha};

/// What the webhook receiver got: (event id, body), in arrival order.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A child process killed when dropped, so a failing assertion leaves none behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_committed_before_a_crash_is_delivered_after_restart_with_the_same_id() {
    // Receiver.
    let got: Received = Arc::default();
    let g = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |h: axum::http::HeaderMap, b: axum::body::Bytes| {
            let g = g.clone();
            async move {
                let id = h
                    .get("effectgate-event-id")
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
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();

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
[reconcile]
outbox_lease_ms = 300
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{c}" }}, {{ role = "operator", sha256 = "{o}" }}]
webhook = {{ url = "{hook}", secret_env = "HOOK_SECRET" }}
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{up}"
effect_class = "irreversible"
"#,
            db = dir.path().join("l.db").display(),
            c = sha("client"),
            o = sha("operator"),
            up = mock.url(),
        ),
    )
    .unwrap();
    let start = |failpoint: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_effectgate"));
        cmd.args(["serve", "--config"])
            .arg(&cfg)
            .env("HOOK_SECRET", "s")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd.env_remove("FAILPOINTS");
        if failpoint {
            cmd.env("FAILPOINTS", "before-deliver=return");
        }
        Killed(cmd.spawn().unwrap())
    };
    let http = reqwest::Client::new();
    let ready = |port: u16| {
        let http = http.clone();
        async move {
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
    };

    let mut child = start(true);
    ready(admin).await;
    let r = http
        .post(format!("http://127.0.0.1:{proxy}/pay/v1/charges"))
        .bearer_auth("client")
        .header("Idempotency-Key", "k")
        .body(r#"{"amount":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // An irreversible replay needs a human: the approval and its event commit together.
    let r = http
        .post(format!(
            "http://127.0.0.1:{admin}/admin/tenants/t/operations/k/replay"
        ))
        .bearer_auth("operator")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // The relay picks the event up and dies right before sending it.
    let status = tokio::task::spawn_blocking(move || child.0.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.signal(), Some(9));
    assert!(
        got.lock().unwrap().is_empty(),
        "nothing was delivered before the crash"
    );

    let child = start(false);
    ready(admin).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the event was never delivered after restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ledger = effectgate::ledger::Ledger::open(
        &dir.path().join("l.db"),
        1,
        5000,
        Arc::new(effectgate::ledger::SystemClock),
    )
    .await
    .unwrap();
    // The receiver has it; the relay records the delivery right after.
    let deadline = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let events = ledger.events("t").await.unwrap();
        if events.iter().all(|e| e.2.is_some()) || Instant::now() > deadline {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(child);
    assert_eq!(events.len(), 1);
    let got = got.lock().unwrap().clone();
    assert_eq!(
        got[0].0, events[0].0,
        "delivered with the id written before the crash"
    );
    assert_eq!(events[0].1, "approval.created");
    assert!(events[0].2.is_some(), "marked delivered");
    let body: serde_json::Value = serde_json::from_slice(&got[0].1).unwrap();
    assert_eq!(body["event_id"], events[0].0.as_str());
}
