//! The inbox and the operation events survive crashes: the gateway is
//! killed (SIGKILL) between an event's durable insert and its delivery,
//! and after a restart the consumer gets it exactly once by its
//! `webhook-id`; an event that resolves an UNKNOWN operation is killed
//! before and after its commit, and the operation ends COMPLETED from the
//! event either way, without a read-back; and a transition killed before
//! its commit never announces itself. Each runs on SQLite and, with
//! `TEST_POSTGRES_URL`, on PostgreSQL (a fresh schema per test).

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use effectgate::config::StorageSpec;
use effectgate::ledger::Ledger;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

mod common;
use common::{free_port, fresh_schema, pg_url, sha};

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

/// The ledger of one test's gateway.
#[derive(Clone)]
enum Backend {
    /// A SQLite file in the test's directory.
    Sqlite,
    /// A fresh schema of the `TEST_POSTGRES_URL` database.
    Postgres { url: String, schema: String },
}

impl Backend {
    /// PostgreSQL, or `None` (the test is skipped) without `TEST_POSTGRES_URL`.
    fn postgres() -> Option<Self> {
        Some(Self::Postgres {
            url: pg_url()?,
            schema: fresh_schema(),
        })
    }

    fn storage(&self, dir: &Path) -> StorageSpec {
        match self {
            Self::Sqlite => StorageSpec {
                path: dir.join("l.db"),
                ..StorageSpec::default()
            },
            Self::Postgres { url, schema } => StorageSpec {
                url: Some(url.clone()),
                schema: Some(schema.clone()),
                max_connections: 2,
                min_connections: 0,
                ..StorageSpec::default()
            },
        }
    }

    /// The `[storage]` table of the gateway's config.
    fn toml(&self, dir: &Path) -> String {
        match self {
            Self::Sqlite => format!("path = \"{}\"", dir.join("l.db").display()),
            Self::Postgres { url, schema } => {
                format!("url = \"{url}\"\nschema = \"{schema}\"\nmax_connections = 4")
            }
        }
    }

    /// The ledger, opened by the test itself (beside a running gateway).
    async fn open(&self, dir: &Path) -> Ledger {
        Ledger::open_storage(
            &self.storage(dir),
            Arc::new(effectgate::ledger::SystemClock),
        )
        .await
        .unwrap()
    }
}

/// Two tests running `$f` (an async fn of a [`Backend`]): on SQLite, and on PostgreSQL.
macro_rules! both {
    ($sqlite:ident, $pg:ident, $f:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sqlite() {
            $f(Backend::Sqlite).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $pg() {
            let Some(b) = Backend::postgres() else { return };
            $f(b).await;
        }
    };
}

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
    backend: Backend,
}

/// What a test's config varies.
struct Knobs<'a> {
    /// The webhook receiver.
    hook: &'a str,
    /// The route's upstream.
    upstream: &'a str,
    /// Whether the reconciler runs (off: only the inbox resolves).
    reconcile: bool,
    /// More lines of the `stripe` source.
    inbox_extra: &'a str,
}

fn setup(backend: Backend, k: Knobs<'_>) -> Setup {
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
{storage}
[limits]
lease_ms = 1000
[reconcile]
enabled = {reconcile}
interval_ms = 100
outbox_lease_ms = 300
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{c}" }}, {{ role = "operator", sha256 = "{o}" }}, {{ role = "admin", sha256 = "{a}" }}]
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
            storage = backend.toml(dir.path()),
            reconcile = k.reconcile,
            hook = k.hook,
            upstream = k.upstream,
            extra = k.inbox_extra,
            c = sha("client"),
            o = sha("operator"),
            a = sha("admin"),
        ),
    )
    .unwrap();
    Setup {
        dir,
        cfg,
        proxy,
        admin,
        backend,
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

/// `Stripe-Signature` of `body`, signed now.
fn stripe_signature(body: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(STRIPE_SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

async fn post_event(
    http: &reqwest::Client,
    s: &Setup,
    header: &str,
    body: &str,
) -> reqwest::Result<reqwest::Response> {
    http.post(format!("http://127.0.0.1:{}/inbox/stripe", s.proxy))
        .header("stripe-signature", header)
        .body(body.to_owned())
        .send()
        .await
}

async fn charge(
    http: &reqwest::Client,
    s: &Setup,
    key: &str,
) -> reqwest::Result<reqwest::Response> {
    http.post(format!("http://127.0.0.1:{}/pay/v1/charges", s.proxy))
        .bearer_auth("client")
        .header("Idempotency-Key", key)
        .body(r#"{"amount":1}"#)
        .send()
        .await
}

async fn operation(http: &reqwest::Client, s: &Setup, key: &str) -> Value {
    let r = http
        .get(format!(
            "http://127.0.0.1:{}/admin/tenants/t/operations/{key}",
            s.admin
        ))
        .bearer_auth("admin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// `(webhook-id, type)` of the distinct deliveries `got` holds (a
/// redelivery after a crash has the same id), sorted.
fn distinct(got: &Received) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = got
        .lock()
        .unwrap()
        .iter()
        .map(|(id, b)| {
            let ty = serde_json::from_slice::<Value>(b).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned();
            (id.clone(), ty)
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

async fn an_event_stored_before_a_crash_is_delivered_once_after_restart(backend: Backend) {
    let (hook, got) = receiver().await;
    let s = setup(
        backend,
        Knobs {
            hook: &hook,
            upstream: "http://127.0.0.1:9",
            reconcile: true,
            inbox_extra: "",
        },
    );
    let http = reqwest::Client::new();
    let child = start(&s, Some("before-deliver=return"));
    ready(&http, s.admin).await;
    let body = r#"{"id":"evt_crash","type":"charge.updated","data":{"object":{"id":"ch_1"}}}"#;
    let header = stripe_signature(body);
    // Answered once durable; the relay dies right before delivering it.
    // The relay runs beside the answer and only sees committed events, so
    // the crash may also cut the answer on its way out: the event was
    // stored either way (the provider would send it again).
    let id = effectgate::ledger::delivery_id("t", "stripe", "evt_crash");
    match post_event(&http, &s, &header, body).await {
        Ok(r) => {
            assert_eq!(r.status(), 200);
            if let Ok(v) = r.json::<Value>().await {
                assert_eq!(v["delivery_id"].as_str(), Some(id.as_str()));
            }
        }
        Err(e) => assert!(
            e.is_request() || e.is_connect(),
            "the answer was cut by the crash, not refused: {e}"
        ),
    }
    let status = wait_exit(child).await;
    assert_eq!(status.signal(), Some(9));
    assert!(
        got.lock().unwrap().is_empty(),
        "nothing delivered before the crash"
    );

    let _child = start(&s, None);
    ready(&http, s.admin).await;
    // The provider's redelivery after the restart is a duplicate.
    let r = post_event(&http, &s, &header, body).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "duplicate");
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "never delivered after restart");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Delivered and recorded: the outbox has nothing pending, and the
    // consumer saw the one id once.
    let ledger = s.backend.open(s.dir.path()).await;
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
    let body: Value = serde_json::from_slice(&got[0].1).unwrap();
    assert_eq!(body["data"]["provider_event_id"], "evt_crash");
}
both!(
    an_event_stored_before_a_crash_is_delivered_once_after_restart_sqlite,
    an_event_stored_before_a_crash_is_delivered_once_after_restart_postgres,
    an_event_stored_before_a_crash_is_delivered_once_after_restart
);

async fn a_transition_killed_before_its_commit_announces_nothing(backend: Backend) {
    let (hook, got) = receiver().await;
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let upstream = mock.url();
    let s = setup(
        backend,
        Knobs {
            hook: &hook,
            upstream: &upstream,
            reconcile: true,
            inbox_extra: "",
        },
    );
    let http = reqwest::Client::new();
    let child = start(&s, Some("before-outcome-commit=return"));
    ready(&http, s.admin).await;
    // The charge happens; the gateway dies before COMPLETED commits.
    let r = charge(&http, &s, "k").await;
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
        distinct(&got)
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>()
    };
    // Operation events carry no ordering key: the two may arrive in
    // either order, so both are waited for.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !["operation.reconciled", "operation.unknown"]
        .iter()
        .all(|t| types().contains(&(*t).to_owned()))
    {
        assert!(Instant::now() < deadline, "never reconciled: {:?}", types());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut t = types();
    t.sort();
    assert_eq!(t, vec!["operation.reconciled", "operation.unknown"]);
    assert_eq!(mock.provider.charges().len(), 1);
}
both!(
    a_transition_killed_before_its_commit_announces_nothing_sqlite,
    a_transition_killed_before_its_commit_announces_nothing_postgres,
    a_transition_killed_before_its_commit_announces_nothing
);

const RESOLVES: &str = "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nfailed = [\"charge.failed\"]\n\
     provider_key = \"/data/object/metadata/idempotency_key\"\nreference = \"/data/object/id\"\n";

/// A gateway killed at `point` while it stores a `charge.succeeded`
/// event naming an UNKNOWN operation (its reply was lost after the
/// charge). The reconciler is off: only the event can resolve it, and a
/// caller's retry of an UNKNOWN operation would read back. Returns the
/// gateway restarted without crash points.
async fn killed_while_resolving(backend: Backend, point: &str) -> Restarted {
    let (hook, got) = receiver().await;
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let upstream = mock.url();
    let s = setup(
        backend,
        Knobs {
            hook: &hook,
            upstream: &upstream,
            reconcile: false,
            inbox_extra: RESOLVES,
        },
    );
    let http = reqwest::Client::new();
    let child = start(&s, Some(format!("{point}=return").as_str()));
    ready(&http, s.admin).await;
    mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    let r = charge(&http, &s, "k").await.unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    assert_eq!(operation(&http, &s, "k").await["state"], "UNKNOWN");
    let c = mock.provider.charges()[0].clone();
    let body = json!({"id": "evt_paid", "type": "charge.succeeded", "data": {"object": {
        "id": c.id, "object": "charge", "amount": 1,
        "metadata": {"idempotency_key": c.idempotency_key}}}})
    .to_string();
    let header = stripe_signature(&body);
    let r = post_event(&http, &s, &header, &body).await;
    assert!(r.is_err(), "no answer: the process died at {point}");
    let status = wait_exit(child).await;
    assert_eq!(status.signal(), Some(9));
    let child = start(&s, None);
    ready(&http, s.admin).await;
    Restarted {
        s,
        _child: child,
        mock,
        header,
        body,
        charge_id: c.id,
        got,
    }
}

/// A gateway restarted after a crash while it stored an event.
struct Restarted {
    s: Setup,
    _child: Killed,
    mock: mock_provider::MockProvider,
    /// The event's `Stripe-Signature` and body.
    header: String,
    body: String,
    /// The charge the lost reply was about.
    charge_id: String,
    got: Received,
}

/// The end of both crash cases: COMPLETED from the event with its
/// reference, the caller's retry replayed, one charge, no read-back.
async fn completed_from_the_event(s: &Setup, mock: &mock_provider::MockProvider, charge_id: &str) {
    let http = reqwest::Client::new();
    let op = operation(&http, s, "k").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], charge_id);
    let reasons: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.contains(&"inbox: stripe event evt_paid (charge.succeeded) says the effect exists"),
        "{reasons:?}"
    );
    assert_eq!(op["inbox_events"][0]["event_id"], "evt_paid");
    assert_eq!(
        op["inbox_events"][0]["resolution"],
        "completed: charge.succeeded"
    );
    let retry = charge(&http, s, "k").await.unwrap();
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let v: Value = retry.json().await.unwrap();
    assert_eq!(v["id"], charge_id);
    assert_eq!(mock.provider.readbacks(), 0, "no read-back call");
    assert_eq!(mock.provider.charges().len(), 1);
}

async fn a_resolution_killed_before_its_commit_is_made_by_the_redelivery(backend: Backend) {
    let Restarted {
        s,
        _child,
        mock,
        header,
        body,
        charge_id,
        ..
    } = killed_while_resolving(backend, "before-inbox-commit").await;
    let http = reqwest::Client::new();
    // Nothing of the event committed: no row, the operation UNKNOWN.
    assert_eq!(operation(&http, &s, "k").await["state"], "UNKNOWN");
    let ledger = s.backend.open(s.dir.path()).await;
    assert!(
        ledger
            .inbox_events("t", None, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    // The provider redelivers (it got no 2xx): stored and resolved now.
    let r = post_event(&http, &s, &header, &body).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "accepted");
    completed_from_the_event(&s, &mock, &charge_id).await;
}
both!(
    a_resolution_killed_before_its_commit_is_made_by_the_redelivery_sqlite,
    a_resolution_killed_before_its_commit_is_made_by_the_redelivery_postgres,
    a_resolution_killed_before_its_commit_is_made_by_the_redelivery
);

async fn a_resolution_committed_before_a_crash_survives_it(backend: Backend) {
    let Restarted {
        s,
        _child,
        mock,
        header,
        body,
        charge_id,
        got,
    } = killed_while_resolving(backend, "after-inbox-commit").await;
    let http = reqwest::Client::new();
    // The event and its resolution committed together before the crash:
    // the operation is COMPLETED although the provider never got its 2xx,
    // and the provider's redelivery is a duplicate that changes nothing.
    let version = operation(&http, &s, "k").await["version"].clone();
    let r = post_event(&http, &s, &header, &body).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "duplicate");
    assert_eq!(operation(&http, &s, "k").await["version"], version);
    completed_from_the_event(&s, &mock, &charge_id).await;
    // The transition's event committed with it, and is delivered.
    let ops = || {
        distinct(&got)
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.starts_with("operation."))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while ops().len() < 2 {
        assert!(Instant::now() < deadline, "not delivered: {:?}", ops());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut t = ops();
    t.sort();
    assert_eq!(t, vec!["operation.reconciled", "operation.unknown"]);
}
both!(
    a_resolution_committed_before_a_crash_survives_it_sqlite,
    a_resolution_committed_before_a_crash_survives_it_postgres,
    a_resolution_committed_before_a_crash_survives_it
);
