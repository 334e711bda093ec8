//! The inbox: provider webhooks at `POST /inbox/<name>`, verified by
//! signature (agreeing with Stripe's SDK and the `standardwebhooks`
//! package), stored once, ordered per sequence key, delivered to the
//! tenant through the outbox (Standard Webhooks signed), and used to
//! resolve UNKNOWN operations. Each scenario runs on SQLite and, with
//! `TEST_POSTGRES_URL`, on PostgreSQL.

use std::time::Duration;

use base64::Engine;
use effectgate::config::StorageSpec;
use effectgate_tests::receiver::{Delivery, Receiver, spawn_receiver};
use effectgate_tests::*;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

const STRIPE_SECRET: &str = "whsec_test_stripe_inbox_secret";
const STRIPE_SECRET_NEXT: &str = "whsec_test_stripe_inbox_secret_rotated";
/// The tenant's delivery secret (Standard Webhooks form: base64 after `whsec_`).
const HOOK_SECRET: &str = "whsec_Y29uc3VtZXItc2VjcmV0LTAxMjM0NTY3ODk=";
/// A Standard Webhooks source's secret.
const SW_SECRET: &str = "whsec_c291cmNlLXNlY3JldC1hYmNkZWZnaGlqaw==";
const GH_SECRET: &str = "gh-secret";

fn env() {
    // SAFETY: set before any gateway reads its config; the same values in every test.
    unsafe {
        std::env::set_var("TEST_INBOX_STRIPE", STRIPE_SECRET);
        std::env::set_var("TEST_INBOX_STRIPE_NEXT", STRIPE_SECRET_NEXT);
        std::env::set_var("TEST_INBOX_HOOK", HOOK_SECRET);
        std::env::set_var("TEST_INBOX_SW", SW_SECRET);
        std::env::set_var("TEST_INBOX_GH", GH_SECRET);
    }
}

fn hmac_of(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().to_vec()
}

/// `Stripe-Signature` for `body` at unix second `t`, as Stripe computes it.
fn stripe_header(secret: &str, t: i64, body: &str) -> String {
    let sig = hmac_of(
        secret.as_bytes(),
        &[t.to_string().as_bytes(), b".", body.as_bytes()],
    );
    format!("t={t},v1={}", hex::encode(sig))
}

/// The GitHub-style `X-Hub-Signature-256` of `body` under the `gh`
/// source's secret: `sha256=<hex>`.
fn gh_signature(body: &str) -> String {
    format!(
        "sha256={}",
        hex::encode(hmac_of(GH_SECRET.as_bytes(), &[body.as_bytes()]))
    )
}

/// Standard Webhooks `webhook-signature` of `(id, ts, body)` under a `whsec_` secret.
fn sw_signature(secret: &str, id: &str, ts: i64, body: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = b64.decode(secret.trim_start_matches("whsec_")).unwrap();
    let sig = hmac_of(
        &key,
        &[
            id.as_bytes(),
            b".",
            ts.to_string().as_bytes(),
            b".",
            body.as_bytes(),
        ],
    );
    format!("v1,{}", b64.encode(sig))
}

/// The config of the inbox tests: a Stripe source `stripe` of tenant `a`
/// (resolving by provider key, with `extra` lines), a Standard Webhooks
/// source `sw`, a GitHub-style source `gh`, and tenant `a`'s webhook.
#[derive(Default)]
struct Setup {
    stripe_extra: String,
    storage: Option<StorageSpec>,
    /// `events = […]` of tenant a's webhook (TOML), if set.
    hook_events: Option<String>,
    /// More lines of the `/pay/` route (before its read-back).
    route_extra: String,
    /// More lines of tenant a (after its webhook: e.g. its policies).
    tenant_a_extra: String,
    /// Lines of the `[limits]` table, if any.
    limits: String,
}

/// A gateway of the inbox tests, with the name of its Stripe source:
/// unique per gateway, so its metric series (the recorder is
/// process-wide) are its own.
struct App {
    app: TestApp,
    src: String,
}

impl std::ops::Deref for App {
    type Target = TestApp;
    fn deref(&self) -> &TestApp {
        &self.app
    }
}

/// The metrics text, with this gateway's Stripe source named `stripe`.
async fn metrics_of(app: &App) -> String {
    app.metrics()
        .await
        .replace(&format!("source=\"{}\"", app.src), "source=\"stripe\"")
}

async fn app_with(rx: &Receiver, s: Setup) -> App {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let src = format!(
        "stripe-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    env();
    let app = spawn_with(Opts {
        route_extra: format!(
            "{}[routes.read_back]\npath = \"/v1/charges?idempotency_key={{provider_key}}\"\n\
             found_pointer = \"/data/0\"\nmatch = {{ \"/idempotency_key\" = \"{{provider_key}}\" }}\n\
             reference_pointer = \"/id\"\nsettle_delay_ms = 0\n",
            s.route_extra
        ),
        tenant_a: format!(
            "webhook = {{ url = \"{}\", secret_env = \"TEST_INBOX_HOOK\"{} }}\n{}",
            rx.url,
            s.hook_events
                .map(|e| format!(", events = {e}"))
                .unwrap_or_default(),
            s.tenant_a_extra
        ),
        more: format!(
            "[limits]\n{}\n[reconcile]\nenabled = false\n\n\
             [[inbox]]\nname = \"{src}\"\ntenant = \"a\"\nscheme = \"stripe\"\n\
             secrets = [{{ env = \"TEST_INBOX_STRIPE\" }}, {{ env = \"TEST_INBOX_STRIPE_NEXT\" }}]\n\
             max_body_bytes = 4096\n{}\n\
             [[inbox]]\nname = \"sw\"\ntenant = \"a\"\nscheme = \"standard-webhooks\"\n\
             secrets = [{{ env = \"TEST_INBOX_SW\" }}]\n\n\
             [[inbox]]\nname = \"gh\"\ntenant = \"b\"\nscheme = \"hmac-sha256\"\nheader = \"X-Hub-Signature-256\"\n\
             event_id = \"header:X-GitHub-Delivery\"\nevent_type = \"/action\"\n\
             secrets = [{{ env = \"TEST_INBOX_GH\" }}]\n",
            s.limits,
            s.stripe_extra
        ),
        storage: s.storage,
        ..Default::default()
    })
    .await;
    App { app, src }
}

/// Now, in unix seconds, by the gateway's clock.
fn now_s(app: &TestApp) -> i64 {
    app.gw.state.ledger.clock().now_ms().div_euclid(1000)
}

async fn post_stripe(app: &App, body: &str, header: Option<&str>) -> reqwest::Response {
    let mut b = app
        .http
        .post(app.proxy(&format!("/inbox/{}", app.src)))
        .header("content-type", "application/json");
    if let Some(h) = header {
        b = b.header("stripe-signature", h);
    }
    b.body(body.to_owned()).send().await.unwrap()
}

/// POSTs `body` to the Stripe source, signed now.
async fn stripe_event(app: &App, body: &str) -> reqwest::Response {
    let h = stripe_header(STRIPE_SECRET, now_s(app), body);
    post_stripe(app, body, Some(&h)).await
}

fn charge_event(id: &str, ty: &str, object: Value) -> String {
    json!({"id": id, "object": "event", "type": ty, "data": {"object": object}}).to_string()
}

/// Runs relay passes until `rx` holds `n` deliveries (bounded), then one
/// more pass, and returns them all.
async fn deliveries(app: &TestApp, rx: &Receiver, n: usize) -> Vec<Delivery> {
    for _ in 0..200 {
        effectgate::workers::outbox::relay_once(&app.gw.state)
            .await
            .unwrap();
        if rx.got.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    effectgate::workers::outbox::relay_once(&app.gw.state)
        .await
        .unwrap();
    rx.got.lock().unwrap().clone()
}

async fn inbox_list(app: &TestApp, query: &str) -> Vec<Value> {
    let r = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/inbox{query}")))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["events"].as_array().unwrap().clone()
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric line {line_start}"))
}

/// Two tests running `$f` (an async fn of `Option<StorageSpec>`): on SQLite, and on PostgreSQL.
macro_rules! both {
    ($sqlite:ident, $pg:ident, $f:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sqlite() {
            $f(None).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $pg() {
            let Some(url) = pg::url() else { return };
            $f(Some(pg::storage(&url))).await;
        }
    };
}

// ---------------------------------------------------------------------------
// Signatures agree with the providers' own code.
// ---------------------------------------------------------------------------

const STRIPE_PY: &str = r#"
import sys, stripe
mode, secret, payload = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "sign":
    print(stripe.WebhookSignature.generate_signature_header(payload, secret))
else:
    try:
        event = stripe.Webhook.construct_event(payload, sys.argv[4], secret)
        print("ok " + event.id)
    except stripe.SignatureVerificationError as e:
        print("refused")
"#;

async fn python(py: &std::path::Path, script: &str, args: &[&str]) -> String {
    let out = tokio::process::Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

async fn the_stripe_scheme_agrees_with_the_stripe_sdk_both_ways(storage: Option<StorageSpec>) {
    let Some(py) = test_python(&["stripe"]) else {
        return;
    };
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;

    // Signed by the SDK: effectgate accepts it.
    let body = charge_event("evt_sdk_1", "charge.succeeded", json!({"id": "ch_9"}));
    let header = python(&py, STRIPE_PY, &["sign", STRIPE_SECRET, &body]).await;
    let r = post_stripe(&app, &body, Some(&header)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "accepted");
    assert_eq!(v["event_id"], "evt_sdk_1");

    // Signed by the SDK under another secret: both refuse it.
    let body2 = charge_event("evt_sdk_2", "charge.succeeded", json!({"id": "ch_9"}));
    let wrong = python(&py, STRIPE_PY, &["sign", "whsec_other", &body2]).await;
    assert_eq!(
        python(&py, STRIPE_PY, &["verify", STRIPE_SECRET, &body2, &wrong]).await,
        "refused"
    );
    let r = post_stripe(&app, &body2, Some(&wrong)).await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["check"], "signature-mismatch");

    // Signed the way effectgate verifies (this test's HMAC over "t.body"):
    // the SDK's construct_event accepts it, and so does effectgate.
    let body3 = charge_event("evt_sdk_3", "charge.succeeded", json!({"id": "ch_9"}));
    let mine = stripe_header(STRIPE_SECRET, now_s(&app), &body3);
    assert_eq!(
        python(&py, STRIPE_PY, &["verify", STRIPE_SECRET, &body3, &mine]).await,
        "ok evt_sdk_3"
    );
    assert_eq!(post_stripe(&app, &body3, Some(&mine)).await.status(), 200);

    // An old timestamp, correctly signed: both refuse it (5 min tolerance).
    let body4 = charge_event("evt_sdk_4", "charge.succeeded", json!({"id": "ch_9"}));
    let old = stripe_header(STRIPE_SECRET, now_s(&app) - 600, &body4);
    assert_eq!(
        python(&py, STRIPE_PY, &["verify", STRIPE_SECRET, &body4, &old]).await,
        "refused"
    );
    let r = post_stripe(&app, &body4, Some(&old)).await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["check"], "timestamp-outside-tolerance");

    // Only the two verified events are in the inbox.
    let mut ids: Vec<String> = inbox_list(&app, &format!("?source={}", app.src))
        .await
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, vec!["evt_sdk_1", "evt_sdk_3"]);
}
both!(
    the_stripe_scheme_agrees_with_the_stripe_sdk_both_ways_sqlite,
    the_stripe_scheme_agrees_with_the_stripe_sdk_both_ways_postgres,
    the_stripe_scheme_agrees_with_the_stripe_sdk_both_ways
);

const SW_PY: &str = r#"
import sys, json
from standardwebhooks.webhooks import Webhook
mode, secret = sys.argv[1], sys.argv[2]
wh = Webhook(secret)
if mode == "sign":
    from datetime import datetime, timezone
    msg_id, ts, body = sys.argv[3], int(sys.argv[4]), sys.argv[5]
    print(wh.sign(msg_id, datetime.fromtimestamp(ts, tz=timezone.utc), body))
else:
    # verify: a JSON list of deliveries [{headers, body}]
    out = []
    for d in json.loads(sys.stdin.read()):
        try:
            wh.verify(d["body"], d["headers"])
            out.append("ok")
        except Exception as e:
            out.append("refused: %s" % e)
    print(json.dumps(out))
"#;

async fn sw_verify(py: &std::path::Path, secret: &str, got: &[Delivery]) -> Vec<String> {
    use tokio::io::AsyncWriteExt;
    let input: Vec<Value> = got
        .iter()
        .map(|d| {
            let headers: serde_json::Map<String, Value> = d
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), json!(v)))
                .collect();
            json!({"headers": headers, "body": String::from_utf8_lossy(&d.body)})
        })
        .collect();
    let mut child = tokio::process::Command::new(py)
        .args(["-c", SW_PY, "verify", secret])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(Value::Array(input).to_string().as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn standard_webhooks_agree_with_the_standardwebhooks_package_in_and_out(
    storage: Option<StorageSpec>,
) {
    let Some(py) = test_python(&["standardwebhooks"]) else {
        return;
    };
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    let body = json!({"type": "email.delivered", "data": {"id": "m_1"}}).to_string();
    let ts = now_s(&app);

    // In: signed by the package, verified by effectgate (event id = webhook-id).
    let sig = python(
        &py,
        SW_PY,
        &["sign", SW_SECRET, "msg_1", &ts.to_string(), &body],
    )
    .await;
    assert_eq!(
        sig,
        sw_signature(SW_SECRET, "msg_1", ts, &body),
        "the same bytes"
    );
    let post = |id: &str, sig: &str, ts: i64| {
        app.http
            .post(app.proxy("/inbox/sw"))
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", sig)
            .body(body.clone())
            .send()
    };
    let r = post("msg_1", &sig, ts).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "accepted");
    // The same signature on another id: refused.
    let r = post("msg_2", &sig, ts).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["check"],
        "signature-mismatch"
    );
    // Ten minutes old: refused after the signature checked out.
    let old = ts - 600;
    let r = post("msg_3", &sw_signature(SW_SECRET, "msg_3", old, &body), old)
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["check"],
        "timestamp-outside-tolerance"
    );

    // Out: the delivery to the tenant verifies with the package under the
    // tenant's secret, and its webhook-id is the stable delivery id.
    let got = deliveries(&app, &rx, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(sw_verify(&py, HOOK_SECRET, &got).await, vec!["ok"]);
    assert_ne!(
        sw_verify(&py, SW_SECRET, &got).await,
        vec!["ok"],
        "another secret does not verify it"
    );
    let d = &got[0];
    assert_eq!(
        d.header("webhook-id"),
        Some(effectgate::ledger::delivery_id("a", "sw", "msg_1").as_str())
    );
    let v = d.json();
    assert_eq!(v["type"], "inbox.event");
    assert_eq!(v["data"]["source"], "sw");
    assert_eq!(v["data"]["provider_event_id"], "msg_1");
    assert_eq!(v["data"]["event"]["data"]["id"], "m_1");
    assert_eq!(d.header("effectgate-gap"), None);
}
both!(
    standard_webhooks_agree_with_the_standardwebhooks_package_in_and_out_sqlite,
    standard_webhooks_agree_with_the_standardwebhooks_package_in_and_out_postgres,
    standard_webhooks_agree_with_the_standardwebhooks_package_in_and_out
);

// ---------------------------------------------------------------------------
// Bad input: 400/413 naming the check, counted, never stored.
// ---------------------------------------------------------------------------

/// (what, body, `Stripe-Signature`, status, check, field).
type BadCase = (
    &'static str,
    String,
    Option<String>,
    u16,
    &'static str,
    &'static str,
);

async fn bad_input_is_refused_counted_and_not_stored(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    let t = now_s(&app);
    let good = charge_event("evt_ok", "charge.succeeded", json!({"id": "ch_1"}));
    let no_id = json!({"type": "charge.succeeded"}).to_string();
    let big = charge_event("evt_big", "x", json!({"pad": "x".repeat(5000)}));
    // Ids a float would write out alike: refused, not merged.
    let float_id = r#"{"id":98765432109876543210001,"type":"charge.succeeded"}"#.to_owned();
    let one_point_oh = r#"{"id":1.0,"type":"charge.succeeded"}"#.to_owned();
    // U+0000, which PostgreSQL's text can't hold.
    let nul_id = json!({"id": "evt_a\u{0}b", "type": "charge.succeeded"}).to_string();
    let nul_type = json!({"id": "evt_nul_type", "type": "charge.\u{0}"}).to_string();
    let bool_id = r#"{"id":true,"type":"charge.succeeded"}"#.to_owned();
    let number_type = r#"{"id":"evt_number_type","type":1.5}"#.to_owned();
    let cases: Vec<BadCase> = vec![
        (
            "no header",
            good.clone(),
            None,
            400,
            "signature-missing",
            "header:Stripe-Signature",
        ),
        (
            "malformed",
            good.clone(),
            Some("v1=zz".into()),
            400,
            "signature-malformed",
            "header:Stripe-Signature",
        ),
        (
            "mismatch",
            good.clone(),
            Some(stripe_header("whsec_wrong", t, &good)),
            400,
            "signature-mismatch",
            "header:Stripe-Signature",
        ),
        (
            "tampered body",
            good.replace("ch_1", "ch_2"),
            Some(stripe_header(STRIPE_SECRET, t, &good)),
            400,
            "signature-mismatch",
            "header:Stripe-Signature",
        ),
        (
            "future timestamp",
            good.clone(),
            Some(stripe_header(STRIPE_SECRET, t + 900, &good)),
            400,
            "timestamp-outside-tolerance",
            "header:Stripe-Signature",
        ),
        (
            "not JSON",
            "not json".into(),
            Some(stripe_header(STRIPE_SECRET, t, "not json")),
            400,
            "body-not-json",
            "body",
        ),
        (
            "no event id",
            no_id.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &no_id)),
            400,
            "event-id-missing",
            "body:/id",
        ),
        (
            "an id past 64-bit integers",
            float_id.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &float_id)),
            400,
            "event-id-missing",
            "body:/id",
        ),
        (
            "a fractional id",
            one_point_oh.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &one_point_oh)),
            400,
            "event-id-missing",
            "body:/id",
        ),
        (
            "NUL in the id",
            nul_id.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &nul_id)),
            400,
            "text-invalid",
            "body:/id",
        ),
        (
            "NUL in the type",
            nul_type.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &nul_type)),
            400,
            "text-invalid",
            "body:/type",
        ),
        (
            "a boolean id",
            bool_id.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &bool_id)),
            400,
            "event-id-missing",
            "body:/id",
        ),
        (
            "a type that is a fraction",
            number_type.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &number_type)),
            400,
            "text-invalid",
            "body:/type",
        ),
        (
            "too large",
            big.clone(),
            Some(stripe_header(STRIPE_SECRET, t, &big)),
            413,
            "body-too-large",
            "body",
        ),
    ];
    for (what, body, header, status, check, field) in &cases {
        let r = post_stripe(&app, body, header.as_deref()).await;
        assert_eq!(r.status().as_u16(), *status, "{what}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["check"], *check, "{what}: {p}");
        assert_eq!(p["field"], *field, "{what}: {p}");
        assert_eq!(
            p["type"],
            format!("urn:effectgate:problem:{check}"),
            "{what}"
        );
        assert_eq!(p["status"], *status, "{what}");
        if *check == "body-too-large" {
            assert_eq!(p["limit_bytes"], 4096, "{what}: {p}");
        }
    }
    // A rotated secret verifies too.
    let rotated = charge_event("evt_rotated", "charge.succeeded", json!({"id": "ch_1"}));
    let h = stripe_header(STRIPE_SECRET_NEXT, t, &rotated);
    assert_eq!(post_stripe(&app, &rotated, Some(&h)).await.status(), 200);
    // An integer id is its digits.
    let int_id = r#"{"id":12345678901234567,"type":"charge.succeeded"}"#;
    let r = post_stripe(&app, int_id, Some(&stripe_header(STRIPE_SECRET, t, int_id))).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["event_id"].as_str(), v["state"].as_str()),
        (Some("12345678901234567"), Some("accepted"))
    );
    // An unknown source is 404; GET is 405.
    let r = app
        .http
        .post(app.proxy("/inbox/nope"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = app
        .http
        .get(app.proxy(&format!("/inbox/{}", app.src)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // Nothing refused was stored; each refusal was counted.
    let events = inbox_list(&app, "").await;
    let ids: Vec<_> = events.iter().map(|e| e["event_id"].clone()).collect();
    assert_eq!(ids, [json!("12345678901234567"), json!("evt_rotated")]);
    let m = metrics_of(&app).await;
    for (check, n) in [
        ("signature-missing", 1.0),
        ("signature-malformed", 1.0),
        ("signature-mismatch", 2.0),
        ("timestamp-outside-tolerance", 1.0),
        ("body-not-json", 1.0),
        ("event-id-missing", 4.0),
        ("text-invalid", 3.0),
        ("body-too-large", 1.0),
        ("sequence-missing", 0.0),
    ] {
        let line =
            format!("effectgate_inbox_rejected_total{{source=\"stripe\",check=\"{check}\"}}");
        assert_eq!(metric(&m, &line), n, "{check}");
    }
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_received_total{source=\"stripe\",outcome=\"accepted\"}"
        ),
        2.0
    );
}
both!(
    bad_input_is_refused_counted_and_not_stored_sqlite,
    bad_input_is_refused_counted_and_not_stored_postgres,
    bad_input_is_refused_counted_and_not_stored
);

/// The webhook's answer to `head` sent raw (and, with `half_close`, the
/// write side shut after it), read to the connection's end within 5 s,
/// with the time it took.
async fn raw_inbox(app: &App, head: String, half_close: bool) -> (String, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    if half_close {
        s.shutdown().await.unwrap();
    }
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer))
        .await
        .expect("answered and closed in time")
        .unwrap();
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

/// A webhook's body is held to `limits.body_read_timeout_ms` like any
/// other (the signature is checked only on a whole body, so without the
/// bound, senders without a secret held connections for ever, enough of
/// them locking callers out): 408 `body-timeout`. A body shorter than its
/// `Content-Length` is 400 `body-unreadable`, not 413. Neither is stored.
#[tokio::test]
async fn a_webhook_body_is_bounded_in_time_and_a_cut_off_one_is_400() {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            limits: "body_read_timeout_ms = 800\n".into(),
            ..Setup::default()
        },
    )
    .await;
    let head = |len: usize, body: &str| {
        format!(
            "POST /inbox/{} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n\
             Stripe-Signature: t=1,v1=00\r\nContent-Length: {len}\r\n\r\n{body}",
            app.src
        )
    };
    let (text, took) = raw_inbox(&app, head(100, "{\"id\":"), false).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"check\":\"body-timeout\""), "{text}");
    assert!(text.contains("limits.body_read_timeout_ms"), "{text}");
    assert!(text.contains("\"limit_ms\":800"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
    let (text, _) = raw_inbox(&app, head(100, "{\"id\":"), true).await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("\"check\":\"body-unreadable\""), "{text}");
    assert!(text.contains("\"field\":\"body\""), "{text}");
    assert!(inbox_list(&app, "").await.is_empty());
    let m = metrics_of(&app).await;
    for (check, n) in [
        ("body-timeout", 1.0),
        ("body-unreadable", 1.0),
        ("body-too-large", 0.0),
    ] {
        let line =
            format!("effectgate_inbox_rejected_total{{source=\"stripe\",check=\"{check}\"}}");
        assert_eq!(metric(&m, &line), n, "{check}");
    }
}

// ---------------------------------------------------------------------------
// Dedupe.
// ---------------------------------------------------------------------------

async fn a_duplicate_sent_ten_times_at_once_is_stored_and_delivered_once(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    let body = charge_event("evt_dup", "charge.updated", json!({"id": "ch_1"}));
    let header = stripe_header(STRIPE_SECRET, now_s(&app), &body);
    let sends = (0..10).map(|_| post_stripe(&app, &body, Some(&header)));
    let answers = futures_util::future::join_all(sends).await;
    let mut states = Vec::new();
    for r in answers {
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["delivery_id"],
            effectgate::ledger::delivery_id("a", &app.src, "evt_dup")
        );
        states.push(v["state"].as_str().unwrap().to_owned());
    }
    states.sort();
    let mut want = vec!["duplicate".to_owned(); 9];
    want.insert(0, "accepted".into());
    assert_eq!(states, want);
    let got = deliveries(&app, &rx, 1).await;
    assert_eq!(got.len(), 1, "delivered once");
    assert_eq!(got[0].json()["data"]["provider_event_id"], "evt_dup");
    // And later: a redelivery from the provider still changes nothing.
    assert_eq!(
        post_stripe(&app, &body, Some(&header))
            .await
            .json::<Value>()
            .await
            .unwrap()["state"],
        "duplicate"
    );
    assert_eq!(deliveries(&app, &rx, 2).await.len(), 1);
    assert_eq!(inbox_list(&app, "").await.len(), 1);
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_received_total{source=\"stripe\",outcome=\"duplicate\"}"
        ),
        10.0
    );
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_delivery_lag_seconds_count{source=\"stripe\"}"
        ),
        1.0
    );
}

/// A duplicate's answer names the stored event's delivery, as the first
/// answer did: none for a source that doesn't deliver.
async fn a_duplicate_answers_with_the_stored_events_delivery(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: "deliver = false\n".into(),
            ..Setup::default()
        },
    )
    .await;
    let body = charge_event("evt_quiet", "charge.updated", json!({"id": "ch_1"}));
    for want in ["accepted", "duplicate"] {
        let r = stripe_event(&app, &body).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["state"], want, "{v}");
        assert_eq!(v["delivery_id"], Value::Null, "{want}: {v}");
    }
    let rows = inbox_list(&app, "").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["outbox_event_id"], Value::Null, "{rows:?}");
}

both!(
    a_duplicate_answers_with_the_stored_events_delivery_sqlite,
    a_duplicate_answers_with_the_stored_events_delivery_postgres,
    a_duplicate_answers_with_the_stored_events_delivery
);

async fn events_past_the_dedupe_window_are_swept(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: "dedupe_window_ms = 300000\n".into(),
            ..Setup::default()
        },
    )
    .await;
    let body = charge_event("evt_old", "charge.updated", json!({"id": "ch_1"}));
    assert_eq!(state_of(&app, &body).await, "accepted");
    assert_eq!(state_of(&app, &body).await, "duplicate");
    // Within the window it stays.
    app.gw.state.ledger.shift_clock(299_000).await.unwrap();
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    assert_eq!(inbox_list(&app, "").await.len(), 1);
    app.gw.state.ledger.shift_clock(2_000).await.unwrap();
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    assert!(inbox_list(&app, "").await.is_empty());
}
both!(
    events_past_the_dedupe_window_are_swept_sqlite,
    events_past_the_dedupe_window_are_swept_postgres,
    events_past_the_dedupe_window_are_swept
);
both!(
    a_duplicate_sent_ten_times_at_once_is_stored_and_delivered_once_sqlite,
    a_duplicate_sent_ten_times_at_once_is_stored_and_delivered_once_postgres,
    a_duplicate_sent_ten_times_at_once_is_stored_and_delivered_once
);

async fn a_github_style_hmac_source_takes_its_event_id_from_a_header(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    let body = json!({"action": "opened", "number": 7}).to_string();
    let sig = gh_signature(&body);
    let post = |sig: String, id: &'static str| {
        app.http
            .post(app.proxy("/inbox/gh"))
            .header("x-hub-signature-256", sig)
            .header("x-github-delivery", id)
            .body(body.clone())
            .send()
    };
    // Tenant b has no webhook: the event is kept, no delivery is queued.
    let r = post(sig.clone(), "d-1").await.unwrap();
    assert_eq!(r.status(), 200);
    let v = r.json::<Value>().await.unwrap();
    assert_eq!(v["state"], "accepted");
    assert_eq!(v["delivery_id"], Value::Null, "{v}");
    let r = post(sig.clone(), "d-1").await.unwrap();
    let v = r.json::<Value>().await.unwrap();
    assert_eq!(v["state"], "duplicate");
    assert_eq!(v["delivery_id"], Value::Null, "{v}");
    assert_eq!(app.gw.state.ledger.pending_events().await.unwrap(), 0);
    let r = post(format!("sha256={}", "0".repeat(64)), "d-2")
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["check"],
        "signature-mismatch"
    );
    // Tenant b's events are tenant b's: a's admin doesn't see them.
    assert!(inbox_list(&app, "?source=gh").await.is_empty());
    let r = app
        .http
        .get(app.admin("/admin/tenants/b/inbox?source=gh"))
        .bearer_auth(ADMIN_B)
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["events"].as_array().unwrap().len(), 1);
    assert_eq!(v["events"][0]["event_type"], "opened");
    assert_eq!(v["events"][0]["outbox_event_id"], Value::Null, "{v}");
}
both!(
    a_github_style_hmac_source_takes_its_event_id_from_a_header_sqlite,
    a_github_style_hmac_source_takes_its_event_id_from_a_header_postgres,
    a_github_style_hmac_source_takes_its_event_id_from_a_header
);

/// A reload that gives a source's tenant a webhook ends the config's
/// warning and delivers the source's events from then on; an event kept
/// before it stays undelivered.
///
/// SQLite only: the harness sets PostgreSQL's `[storage]` beside the
/// config file, and a reload from the file would change the storage
/// (refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_adds_the_tenants_webhook_delivers_from_then_on() {
    let rx = spawn_receiver().await;
    let app = app_with(&rx, Setup::default()).await;
    let warnings = app.gw.state.settings().warnings.clone();
    // The GitHub-like source also reads its event id from a header its
    // signature doesn't cover.
    let unsigned_id = "inbox[2].event_id: the header x-github-delivery is not an event id the hmac-sha256 signature of \"gh\" covers";
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("tenant \"b\" has no webhook") && warnings[0].contains("\"gh\""),
        "{warnings:?}"
    );
    assert!(warnings[1].starts_with(unsigned_id), "{warnings:?}");
    let post = |id: &'static str| {
        let body = json!({"action": "opened", "id": id}).to_string();
        app.http
            .post(app.proxy("/inbox/gh"))
            .header("x-hub-signature-256", gh_signature(&body))
            .header("x-github-delivery", id)
            .body(body)
            .send()
    };
    let v: Value = post("d-1").await.unwrap().json().await.unwrap();
    assert_eq!(
        (&v["state"], &v["delivery_id"]),
        (&json!("accepted"), &Value::Null),
        "{v}"
    );
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let with_hook = text.replacen(
        "id = \"b\"\n",
        &format!(
            "id = \"b\"\nwebhook = {{ url = \"{}\", secret_env = \"TEST_INBOX_HOOK\" }}\n",
            rx.url
        ),
        1,
    );
    assert_ne!(with_hook, text);
    std::fs::write(&path, with_hook).unwrap();
    app.gw.state.reload(None).await.unwrap();
    let warnings = app.gw.state.settings().warnings.clone();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with(unsigned_id), "{warnings:?}");
    let v: Value = post("d-2").await.unwrap().json().await.unwrap();
    assert_eq!(v["state"], "accepted");
    assert_eq!(
        v["delivery_id"],
        effectgate::ledger::delivery_id("b", "gh", "d-2"),
        "{v}"
    );
    let got = deliveries(&app, &rx, 1).await;
    assert_eq!(got.len(), 1, "only the event accepted after the reload");
    assert_eq!(got[0].json()["data"]["provider_event_id"], "d-2");
}

// ---------------------------------------------------------------------------
// Webhook-driven reconciliation.
// ---------------------------------------------------------------------------

const CHARGE: &str = r#"{"amount":100,"currency":"eur","client_ref":"r-1"}"#;

const RESOLVES: &str = "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nfailed = [\"charge.failed\"]\n\
     provider_key = \"/data/object/metadata/idempotency_key\"\nreference = \"/data/object/id\"\n";

/// The `charge.<ty>` event of the provider's charge `n`, naming its
/// provider key in the metadata (as a Stripe integration sets it).
fn event_for(app: &TestApp, n: usize, id: &str, ty: &str) -> String {
    let c = &app.mock.provider.charges()[n];
    charge_event(
        id,
        ty,
        json!({"id": c.id, "object": "charge", "amount": c.amount,
               "metadata": {"idempotency_key": c.idempotency_key}}),
    )
}

async fn a_lost_reply_whose_webhook_comes_first_completes_without_a_read_back(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: RESOLVES.into(),
            ..Setup::default()
        },
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    let first = app.charge("k1", CHARGE).await;
    assert!(first.status().is_server_error(), "{}", first.status());
    assert_eq!(app.op_json("k1").await["state"], "UNKNOWN");
    assert_eq!(app.mock.provider.charges().len(), 1);

    let body = event_for(&app, 0, "evt_paid", "charge.succeeded");
    let r = stripe_event(&app, &body).await;
    assert_eq!(r.status(), 200);
    let op = app.op_json("k1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], "ch_1");
    let reasons: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| *r
            == format!(
                "inbox: {} event evt_paid (charge.succeeded) says the effect exists",
                app.src
            )),
        "{reasons:?}"
    );
    // The timeline shows the event and what it did.
    assert_eq!(op["inbox_events"][0]["event_id"], "evt_paid");
    assert_eq!(
        op["inbox_events"][0]["resolution"],
        "completed: charge.succeeded"
    );

    // The caller's retry is the replay; the provider saw no read-back and
    // one charge.
    let retry = app.charge("k1", CHARGE).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let v: Value = retry.json().await.unwrap();
    assert_eq!(v["id"], "ch_1");
    assert_eq!(app.mock.provider.readbacks(), 0, "no read-back call");
    assert_eq!(app.provider_calls(), (1, 0));
    // A redelivery of the event is a duplicate and changes nothing.
    let again = stripe_event(&app, &body).await;
    assert_eq!(again.json::<Value>().await.unwrap()["state"], "duplicate");
    assert_eq!(app.op_json("k1").await["version"], op["version"]);
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_resolutions_total{source=\"stripe\",outcome=\"completed\"}"
        ),
        1.0
    );
}
both!(
    a_lost_reply_whose_webhook_comes_first_completes_without_a_read_back_sqlite,
    a_lost_reply_whose_webhook_comes_first_completes_without_a_read_back_postgres,
    a_lost_reply_whose_webhook_comes_first_completes_without_a_read_back
);

async fn an_event_naming_another_tenants_provider_key_is_ignored(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: RESOLVES.into(),
            ..Setup::default()
        },
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    // Tenant b's operation is UNKNOWN; tenant a's source names its key.
    let r = app.charge_as(KEY_B, "kb", CHARGE).await;
    assert!(r.status().is_server_error());
    let body = event_for(&app, 0, "evt_cross", "charge.succeeded");
    assert_eq!(stripe_event(&app, &body).await.status(), 200);
    let op: Value = app
        .operation(ADMIN_B, "b", "kb")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        op["state"], "UNKNOWN",
        "another tenant's event resolves nothing"
    );
    assert_eq!(op["inbox_events"], json!([]));
    let ev = &inbox_list(&app, "").await[0];
    assert_eq!(ev["event_id"], "evt_cross");
    assert_eq!(ev["operation_id"], Value::Null);
    assert_eq!(ev["resolution"], Value::Null);
}
both!(
    an_event_naming_another_tenants_provider_key_is_ignored_sqlite,
    an_event_naming_another_tenants_provider_key_is_ignored_postgres,
    an_event_naming_another_tenants_provider_key_is_ignored
);

async fn a_failure_event_only_starts_a_read_back(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: RESOLVES.into(),
            ..Setup::default()
        },
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    assert!(app.charge("k1", CHARGE).await.status().is_server_error());
    // The event says failed, but the charge exists: the read-back it
    // starts finds it.
    let body = event_for(&app, 0, "evt_failed", "charge.failed");
    assert_eq!(stripe_event(&app, &body).await.status(), 200);
    let mut state = Value::Null;
    for _ in 0..200 {
        state = app.op_json("k1").await["state"].clone();
        if state == "COMPLETED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state, "COMPLETED");
    assert_eq!(
        app.mock.provider.readbacks(),
        1,
        "one read-back, started by the event"
    );
    let op = app.op_json("k1").await;
    assert_eq!(
        op["inbox_events"][0]["resolution"],
        "read-back: charge.failed says it failed; read back now"
    );
    assert_eq!(app.mock.provider.charges().len(), 1);
}
both!(
    a_failure_event_only_starts_a_read_back_sqlite,
    a_failure_event_only_starts_a_read_back_postgres,
    a_failure_event_only_starts_a_read_back
);

// ---------------------------------------------------------------------------
// Ordering by sequence key.
// ---------------------------------------------------------------------------

fn ordered(on_gap: &str) -> String {
    format!(
        "sequence_key = \"/data/object/id\"\nsequence = \"/data/object/version\"\n\
         reorder_window_ms = 60000\non_gap = \"{on_gap}\"\n"
    )
}

fn versioned(id: &str, key: &str, version: i64) -> String {
    charge_event(
        id,
        "customer.updated",
        json!({"id": key, "version": version}),
    )
}

async fn state_of(app: &App, body: &str) -> String {
    let r = stripe_event(app, body).await;
    assert_eq!(r.status(), 200);
    r.json::<Value>().await.unwrap()["state"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn delivered_ids(got: &[Delivery]) -> Vec<String> {
    got.iter()
        .map(|d| {
            d.json()["data"]["provider_event_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

async fn out_of_order_events_are_delivered_in_order(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: ordered("deliver"),
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(state_of(&app, &versioned("e3", "cus_1", 3)).await, "held");
    assert!(deliveries(&app, &rx, 0).await.is_empty(), "v3 waits");
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(
        state_of(&app, &versioned("e2", "cus_1", 2)).await,
        "accepted"
    );
    let got = deliveries(&app, &rx, 3).await;
    assert_eq!(delivered_ids(&got), vec!["e1", "e2", "e3"]);
    assert!(got.iter().all(|d| d.header("effectgate-gap").is_none()));
    // v1 again under a new event id: older than v3, stale, not delivered.
    assert_eq!(state_of(&app, &versioned("e1b", "cus_1", 1)).await, "stale");
    assert_eq!(deliveries(&app, &rx, 4).await.len(), 3);
    let stale = inbox_list(&app, "?state=stale").await;
    assert_eq!(stale.len(), 1);
    assert_eq!(stale[0]["event_id"], "e1b");
    // Another key is ordered on its own.
    assert_eq!(
        state_of(&app, &versioned("f1", "cus_2", 1)).await,
        "accepted"
    );
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_received_total{source=\"stripe\",outcome=\"held\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_received_total{source=\"stripe\",outcome=\"stale\"}"
        ),
        1.0
    );
}
both!(
    out_of_order_events_are_delivered_in_order_sqlite,
    out_of_order_events_are_delivered_in_order_postgres,
    out_of_order_events_are_delivered_in_order
);

async fn a_permanent_gap_is_delivered_flagged(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: ordered("deliver"),
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("e3", "cus_1", 3)).await, "held");
    // Within the window nothing changes.
    assert!(
        effectgate::workers::inbox::tick(&app.gw.state)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(delivered_ids(&deliveries(&app, &rx, 1).await), vec!["e1"]);
    app.gw.state.ledger.shift_clock(60_001).await.unwrap();
    // (The gateway's own relay loop may get there first.)
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    let e3 = inbox_list(&app, "?state=accepted").await;
    let e3 = e3
        .iter()
        .find(|e| e["event_id"] == "e3")
        .expect("e3 accepted");
    assert_eq!(e3["gap"], true);
    assert!(e3["received_at_rfc3339"].as_str().unwrap().ends_with('Z'));
    let got = deliveries(&app, &rx, 2).await;
    assert_eq!(delivered_ids(&got), vec!["e1", "e3"]);
    assert_eq!(got[1].header("effectgate-gap"), Some("true"));
    assert_eq!(got[1].json()["data"]["gap"], true);
    // v2 arriving after the gap closed is stale: v3 is never reverted.
    assert_eq!(state_of(&app, &versioned("e2", "cus_1", 2)).await, "stale");
    assert_eq!(deliveries(&app, &rx, 3).await.len(), 2);
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_gaps_total{source=\"stripe\",outcome=\"delivered\"}"
        ),
        1.0
    );
}
both!(
    a_permanent_gap_is_delivered_flagged_sqlite,
    a_permanent_gap_is_delivered_flagged_postgres,
    a_permanent_gap_is_delivered_flagged
);

/// An event the relay is still delivering when the ledger's clock passes
/// its claim's lease is not claimed and delivered a second time by this
/// instance's next relay pass: that pass waits for the first.
async fn a_delivery_outliving_its_claim_is_not_repeated_by_the_same_instance(
    storage: Option<StorageSpec>,
) {
    let held = effectgate_tests::receiver::spawn_receiver_holding_first().await;
    let rx = &held.receiver;
    let app = app_with(
        rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(
        state_of(
            &app,
            &charge_event("e1", "charge.succeeded", json!({"id": "ch_1"}))
        )
        .await,
        "accepted"
    );
    let first = {
        let state = app.gw.state.clone();
        tokio::spawn(async move { effectgate::workers::outbox::relay_once(&state).await })
    };
    // The first delivery (this pass's or the background relay's) is at
    // the receiver, unanswered; its claim (5 s) lapses in ledger time.
    held.first_arrived().await;
    app.gw.state.ledger.shift_clock(60_001).await.unwrap();
    let second = {
        let state = app.gw.state.clone();
        tokio::spawn(async move { effectgate::workers::outbox::relay_once(&state).await })
    };
    // A second delivery would arrive within this window; none may.
    for _ in 0..50 {
        assert_eq!(rx.got.lock().unwrap().len(), 1, "delivered twice");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    effectgate::workers::outbox::relay_once(&app.gw.state)
        .await
        .unwrap();
    assert_eq!(delivered_ids(&rx.got.lock().unwrap()), vec!["e1"]);
}
both!(
    a_delivery_outliving_its_claim_is_not_repeated_by_the_same_instance_sqlite,
    a_delivery_outliving_its_claim_is_not_repeated_by_the_same_instance_postgres,
    a_delivery_outliving_its_claim_is_not_repeated_by_the_same_instance
);

async fn a_permanent_gap_is_quarantined_then_released_or_dropped(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: ordered("quarantine"),
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("e3", "cus_1", 3)).await, "held");
    assert_eq!(state_of(&app, &versioned("g2", "cus_2", 2)).await, "held");
    app.gw.state.ledger.shift_clock(60_001).await.unwrap();
    // (The gateway's own relay loop may get there first.)
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    assert_eq!(delivered_ids(&deliveries(&app, &rx, 1).await), vec!["e1"]);
    let q = inbox_list(&app, &format!("?state=quarantined&source={}", app.src)).await;
    let mut ids: Vec<&str> = q.iter().map(|e| e["event_id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, vec!["e3", "g2"]);
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(&m, "effectgate_inbox_quarantined_events{source=\"stripe\"}"),
        2.0
    );
    assert!(
        metric(
            &m,
            "effectgate_inbox_quarantine_oldest_age_seconds{source=\"stripe\"}"
        ) >= 60.0
    );

    let decide = |who: &'static str, id: &str, action: &str| {
        app.http
            .post(app.admin(&format!("/admin/tenants/a/inbox/{}/{id}/{action}", app.src)))
            .bearer_auth(who)
            .send()
    };
    // An approver may not; another tenant's operator gets 404.
    assert_eq!(
        decide(APPROVER_A, "e3", "release").await.unwrap().status(),
        403
    );
    assert_eq!(
        decide(ADMIN_B, "e3", "release").await.unwrap().status(),
        404
    );
    let r = decide(OPERATOR_A, "e3", "release").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], json!(["e3"]));
    // Decided already: 409 naming its state; no such event: 404.
    let r = decide(OPERATOR_A, "e3", "release").await.unwrap();
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .ends_with("is accepted, not quarantined"),
        "{p}"
    );
    let r = decide(OPERATOR_A, "no-such-event", "drop").await.unwrap();
    assert_eq!(r.status(), 404);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:not-found", "{p}");
    let r = decide(OPERATOR_A, "g2", "drop").await.unwrap();
    assert_eq!(r.status(), 200);
    let got = deliveries(&app, &rx, 2).await;
    assert_eq!(delivered_ids(&got), vec!["e1", "e3"]);
    assert_eq!(got[1].header("effectgate-gap"), Some("true"));
    let dropped = inbox_list(&app, "?state=dropped").await;
    assert_eq!(dropped.len(), 1);
    assert_eq!(dropped[0]["event_id"], "g2");
    // Both decisions are kept with the operator and the time.
    assert_eq!(dropped[0]["decided_by"], "a:operator");
    assert!(
        dropped[0]["decided_at_rfc3339"].is_string(),
        "{}",
        dropped[0]
    );
    let released = inbox_list(&app, "?state=accepted").await;
    let e3 = released.iter().find(|e| e["event_id"] == "e3").unwrap();
    assert_eq!(e3["decided_by"], "a:operator");
    assert_eq!(e3["gap"], true);
    // Past the dropped event its key goes on: v3 of cus_2 is applied.
    assert_eq!(
        state_of(&app, &versioned("g3", "cus_2", 3)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("g1", "cus_2", 1)).await, "stale");
    let m = metrics_of(&app).await;
    assert_eq!(
        metric(&m, "effectgate_inbox_quarantined_events{source=\"stripe\"}"),
        0.0
    );
    assert_eq!(
        metric(
            &m,
            "effectgate_inbox_gaps_total{source=\"stripe\",outcome=\"quarantined\"}"
        ),
        2.0
    );
}
both!(
    a_permanent_gap_is_quarantined_then_released_or_dropped_sqlite,
    a_permanent_gap_is_quarantined_then_released_or_dropped_postgres,
    a_permanent_gap_is_quarantined_then_released_or_dropped
);

// ---------------------------------------------------------------------------
// Operation events out.
// ---------------------------------------------------------------------------

/// `(type, operation_id)` of the operation events delivered, in order.
fn operation_events(got: &[Delivery]) -> Vec<(String, String)> {
    got.iter()
        .map(Delivery::json)
        .filter(|v| v["type"].as_str().unwrap().starts_with("operation."))
        .map(|v| {
            (
                v["type"].as_str().unwrap().to_owned(),
                v["data"]["operation_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn every_transition_reports_its_event_and_a_fenced_off_one_none(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: RESOLVES.into(),
            hook_events: Some(
                "[\"operation.unknown\", \"operation.dead_lettered\", \"operation.reconciled\", \
                 \"operation.completed\", \"operation.failed\"]"
                    .into(),
            ),
            ..Setup::default()
        },
    )
    .await;
    let faults = |f: mock_provider::Faults| app.mock.provider.set_faults(f);
    // COMPLETED.
    assert_eq!(app.charge("k-ok", CHARGE).await.status(), 200);
    // FAILED (a permanent 402).
    faults(mock_provider::Faults {
        fail_status_times: 1,
        fail_status: 402,
        ..Default::default()
    });
    assert_eq!(app.charge("k-declined", CHARGE).await.status(), 402);
    // Dead letter (503 until the retry budget is spent).
    faults(mock_provider::Faults {
        fail_503_times: 100,
        ..Default::default()
    });
    assert_eq!(app.charge("k-dead", CHARGE).await.status(), 503);
    assert_eq!(app.op_json("k-dead").await["dead_letter"], true);
    // UNKNOWN, then reconciled by its webhook.
    faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    assert!(
        app.charge("k-lost", CHARGE)
            .await
            .status()
            .is_server_error()
    );
    let n = app.mock.provider.charges().len() - 1;
    let lost_charge = app.mock.provider.charges()[n].id.clone();
    let body = event_for(&app, n, "evt_lost", "charge.succeeded");
    assert_eq!(stripe_event(&app, &body).await.status(), 200);
    assert_eq!(app.op_json("k-lost").await["state"], "COMPLETED");

    // UNKNOWN again; two reconciliation leases: the older one's write is
    // fenced off and rolls back, reporting nothing; the newer one's is
    // reported once.
    faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    assert!(
        app.charge("k-fence", CHARGE)
            .await
            .status()
            .is_server_error()
    );
    let ledger = &app.gw.state.ledger;
    let op = ledger.get("a", "k-fence").await.unwrap().unwrap();
    let old = ledger
        .lease_for_reconcile("a", "k-fence", op.version, "gw-old", 1_000, "test")
        .await
        .unwrap()
        .unwrap();
    ledger.shift_clock(1_001).await.unwrap();
    let op = ledger.get("a", "k-fence").await.unwrap().unwrap();
    let new = ledger
        .lease_for_reconcile("a", "k-fence", op.version, "gw-new", 60_000, "test")
        .await
        .unwrap()
        .unwrap();
    let done =
        effectgate::ledger::Outcome::new(effectgate::ledger::State::Completed, "test: found");
    assert!(
        !ledger
            .record_outcome(
                "a",
                "k-fence",
                old.fence,
                effectgate::ledger::State::Unknown,
                "gw-old",
                &done
            )
            .await
            .unwrap()
    );
    assert!(
        ledger
            .record_outcome(
                "a",
                "k-fence",
                new.fence,
                effectgate::ledger::State::Unknown,
                "gw-new",
                &done
            )
            .await
            .unwrap()
    );

    let want = vec![
        ("operation.completed", "k-ok"),
        ("operation.failed", "k-declined"),
        ("operation.dead_lettered", "k-dead"),
        ("operation.unknown", "k-lost"),
        ("operation.reconciled", "k-lost"),
        ("operation.unknown", "k-fence"),
        ("operation.reconciled", "k-fence"),
    ];
    let mut got = Vec::new();
    for _ in 0..100 {
        got = operation_events(&deliveries(&app, &rx, 0).await);
        if got.len() >= want.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let want: Vec<(String, String)> = want
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect();
    let mut sorted_got = got.clone();
    sorted_got.sort();
    let mut sorted_want = want.clone();
    sorted_want.sort();
    assert_eq!(sorted_got, sorted_want, "delivered: {got:?}");
    // Each delivery names the transition it reports.
    let all = rx.got.lock().unwrap().clone();
    let reconciled = all
        .iter()
        .map(Delivery::json)
        .find(|v| v["type"] == "operation.reconciled" && v["data"]["operation_id"] == "k-lost")
        .unwrap();
    assert_eq!(reconciled["data"]["from_state"], "UNKNOWN");
    assert_eq!(reconciled["data"]["to_state"], "COMPLETED");
    assert_eq!(
        reconciled["data"]["provider_reference"],
        lost_charge.as_str()
    );
}
both!(
    every_transition_reports_its_event_and_a_fenced_off_one_none_sqlite,
    every_transition_reports_its_event_and_a_fenced_off_one_none_postgres,
    every_transition_reports_its_event_and_a_fenced_off_one_none
);

async fn without_a_subscription_only_the_default_operation_events_go_out(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(app.charge("k-ok", CHARGE).await.status(), 200);
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    assert!(
        app.charge("k-lost", CHARGE)
            .await
            .status()
            .is_server_error()
    );
    let got = operation_events(&deliveries(&app, &rx, 1).await);
    assert_eq!(
        got,
        vec![("operation.unknown".to_owned(), "k-lost".to_owned())]
    );
}
both!(
    without_a_subscription_only_the_default_operation_events_go_out_sqlite,
    without_a_subscription_only_the_default_operation_events_go_out_postgres,
    without_a_subscription_only_the_default_operation_events_go_out
);

// ---------------------------------------------------------------------------
// The console's Inbox page.
// ---------------------------------------------------------------------------

fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

fn csrf_of(html: &str) -> String {
    let field = "name=\"csrf\" value=\"";
    let at = html.find(field).expect("a csrf field") + field.len();
    html[at..].split('"').next().unwrap().to_owned()
}

/// A console session cookie (`eg_session=…`) for `key`.
async fn console_session(app: &App, key: &str) -> String {
    let r = no_redirects()
        .get(app.admin("/console/login"))
        .send()
        .await
        .unwrap();
    let cookie = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .find(|c| c.starts_with("eg_login="))
        .unwrap();
    let login = cookie.split(';').next().unwrap().to_owned();
    let token = csrf_of(&r.text().await.unwrap());
    let r = no_redirects()
        .post(app.admin("/console/login"))
        .header("cookie", login)
        .form(&[("key", key), ("csrf", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    r.headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .find(|c| c.starts_with("eg_session="))
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned()
}

async fn the_console_lists_inbox_events_and_an_operator_releases_a_quarantined_one(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: ordered("quarantine"),
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("e3", "cus_1", 3)).await, "held");
    app.gw.state.ledger.shift_clock(60_001).await.unwrap();
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    let page = |cookie: String, q: &'static str| {
        let app = &app;
        async move {
            no_redirects()
                .get(app.admin(&format!("/console/inbox{q}")))
                .header("cookie", cookie)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    // An approver sees the events, without the buttons.
    let approver = console_session(&app, APPROVER_A).await;
    let html = page(approver, "?state=quarantined").await;
    assert!(html.contains("<h1>Inbox: quarantined</h1>"), "{html}");
    assert!(html.contains(">e3<") && !html.contains(">e1<"), "{html}");
    assert!(!html.contains("value=\"release\""), "{html}");
    // An operator releases it: delivered with the gap flag.
    let operator = console_session(&app, OPERATOR_A).await;
    let html = page(operator.clone(), "").await;
    assert!(
        html.contains(">e1<") && html.contains("value=\"release\""),
        "{html}"
    );
    let action = format!("/console/inbox/{}/e3/decide", app.src);
    let forged = no_redirects()
        .post(app.admin(&action))
        .header("cookie", &operator)
        .form(&[("action", "release"), ("csrf", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    // Another action is named as the form's field, quoted in part.
    let odd = no_redirects()
        .post(app.admin(&action))
        .header("cookie", &operator)
        .form(&[
            ("action", "burn".repeat(100).as_str()),
            ("csrf", csrf_of(&html).as_str()),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(odd.status(), 400);
    let p: Value = odd.json().await.unwrap();
    assert_eq!(p["field"], "form:action", "{p}");
    assert!(p["detail"].as_str().unwrap().len() < 200, "{p}");
    let done = no_redirects()
        .post(app.admin(&action))
        .header("cookie", &operator)
        .form(&[("action", "release"), ("csrf", csrf_of(&html).as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(done.status(), 200);
    assert!(done.text().await.unwrap().contains("release: e3"));
    let got = deliveries(&app, &rx, 2).await;
    assert_eq!(delivered_ids(&got), vec!["e1", "e3"]);
    assert_eq!(got[1].header("effectgate-gap"), Some("true"));
}
both!(
    the_console_lists_inbox_events_and_an_operator_releases_a_quarantined_one_sqlite,
    the_console_lists_inbox_events_and_an_operator_releases_a_quarantined_one_postgres,
    the_console_lists_inbox_events_and_an_operator_releases_a_quarantined_one
);

async fn a_match_rule_finds_the_unknown_operation_by_its_body_and_provider_key(
    storage: Option<StorageSpec>,
) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra:
                "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nroute = \"payments\"\n\
                 reference = \"/data/object/id\"\n\
                 match = { \"/data/object/metadata/order\" = \"{body:/client_ref}\", \
                 \"/data/object/metadata/fee\" = \"{body:/fee}\", \
                 \"/data/object/metadata/idempotency_key\" = \"{provider_key}\" }\n"
                    .into(),
            ..Setup::default()
        },
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 2,
        ..Default::default()
    });
    // A decimal field matches as written (`19.99`).
    let charge = CHARGE.replace("}", ",\"fee\":19.99}");
    assert!(app.charge("k1", &charge).await.status().is_server_error());
    assert!(
        app.charge("k2", &charge.replace("r-1", "r-2"))
            .await
            .status()
            .is_server_error()
    );
    let c = app.mock.provider.charges()[0].clone();
    // The body field alone does not match (another order's key).
    let wrong = charge_event(
        "evt_wrong",
        "charge.succeeded",
        json!({"id": c.id, "metadata": {"order": "r-2", "fee": 19.99, "idempotency_key": c.idempotency_key}}),
    );
    assert_eq!(stripe_event(&app, &wrong).await.status(), 200);
    assert_eq!(app.op_json("k1").await["state"], "UNKNOWN");
    assert_eq!(app.op_json("k2").await["state"], "UNKNOWN");
    let right = charge_event(
        "evt_right",
        "charge.succeeded",
        json!({"id": c.id, "metadata": {"order": "r-1", "fee": 19.99, "idempotency_key": c.idempotency_key}}),
    );
    assert_eq!(stripe_event(&app, &right).await.status(), 200);
    let op = app.op_json("k1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], c.id.as_str());
    assert_eq!(app.op_json("k2").await["state"], "UNKNOWN");
    // A reference holding U+0000 (which PostgreSQL's text can't hold) is
    // not recorded; the event still completes the operation it matches.
    let c2 = app.mock.provider.charges()[1].clone();
    let nul_ref = charge_event(
        "evt_nul_ref",
        "charge.succeeded",
        json!({"id": "ch_\u{0}x", "metadata": {"order": "r-2", "fee": 19.99, "idempotency_key": c2.idempotency_key}}),
    );
    assert_eq!(stripe_event(&app, &nul_ref).await.status(), 200);
    let op = app.op_json("k2").await;
    assert_eq!(
        (op["state"].as_str(), op["provider_reference"].as_str()),
        (Some("COMPLETED"), None),
        "{op}"
    );
    assert_eq!(app.mock.provider.readbacks(), 0);
}
both!(
    a_match_rule_finds_the_unknown_operation_by_its_body_and_provider_key_sqlite,
    a_match_rule_finds_the_unknown_operation_by_its_body_and_provider_key_postgres,
    a_match_rule_finds_the_unknown_operation_by_its_body_and_provider_key
);

// ---------------------------------------------------------------------------
// Resolution by the provider's reference.
// ---------------------------------------------------------------------------

const BY_REFERENCE: &str =
    "[[inbox.resolves]]\nsucceeded = [\"charge.succeeded\"]\nreference = \"/data/object/id\"\n";

/// Records `reference` on UNKNOWN operation `id` of `tenant` the way a
/// reconciliation lease holder records what it learnt (UNKNOWN → UNKNOWN
/// under a new fencing token, the stored response kept, the lease
/// released): the ledger now knows the provider's reference.
async fn note_reference(app: &TestApp, tenant: &str, id: &str, reference: &str) {
    use effectgate::ledger::{Outcome, State};
    let ledger = &app.gw.state.ledger;
    let op = ledger.get(tenant, id).await.unwrap().unwrap();
    assert_eq!(op.state, State::Unknown);
    let lease = ledger
        .lease_for_reconcile(tenant, id, op.version, "test", 60_000, "test: lease")
        .await
        .unwrap()
        .unwrap();
    let mut o = Outcome::new(State::Unknown, "test: the provider's reference is known");
    o.keep_response = true;
    o.error_kind = op.error_kind.clone();
    o.error_detail = op.error_detail.clone();
    o.provider_reference = Some(reference.to_owned());
    assert!(
        ledger
            .record_outcome(tenant, id, lease.fence, State::Unknown, "test", &o)
            .await
            .unwrap()
    );
    let op = ledger.get(tenant, id).await.unwrap().unwrap();
    assert_eq!(op.provider_reference.as_deref(), Some(reference));
}

async fn a_reference_rule_completes_the_unknown_operation_it_names(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: BY_REFERENCE.into(),
            ..Setup::default()
        },
    )
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 2,
        ..Default::default()
    });
    // A lost reply for tenant a and one for tenant b; the ledger knows
    // both charges' references.
    assert!(app.charge("k1", CHARGE).await.status().is_server_error());
    assert!(
        app.charge_as(KEY_B, "kb", CHARGE)
            .await
            .status()
            .is_server_error()
    );
    let charges = app.mock.provider.charges();
    let (ca, cb) = (charges[0].clone(), charges[1].clone());
    note_reference(&app, "a", "k1", &ca.id).await;
    note_reference(&app, "b", "kb", &cb.id).await;
    let event = |id: &str, c: &mock_provider::Charge| {
        // No idempotency key in the event: only the reference names it.
        charge_event(
            id,
            "charge.succeeded",
            json!({"id": c.id, "object": "charge", "amount": c.amount}),
        )
    };

    // Tenant a's source names tenant b's charge: ignored, b's operation
    // stays UNKNOWN and the event names no operation.
    let r = stripe_event(&app, &event("evt_b", &cb)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "accepted");
    let b: Value = app
        .operation(ADMIN_B, "b", "kb")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        b["state"], "UNKNOWN",
        "another tenant's event resolves nothing"
    );
    assert_eq!(b["inbox_events"], json!([]));
    assert_eq!(app.op_json("k1").await["state"], "UNKNOWN");
    let ev = &inbox_list(&app, "").await[0];
    assert_eq!(ev["event_id"], "evt_b");
    assert_eq!(ev["operation_id"], Value::Null);
    assert_eq!(ev["resolution"], Value::Null);

    // Its own charge, by reference: COMPLETED from the event.
    let r = stripe_event(&app, &event("evt_a", &ca)).await;
    assert_eq!(r.status(), 200);
    let op = app.op_json("k1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], ca.id.as_str());
    let reasons: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| *r
            == format!(
                "inbox: {} event evt_a (charge.succeeded) says the effect exists",
                app.src
            )),
        "{reasons:?}"
    );
    assert_eq!(op["inbox_events"][0]["event_id"], "evt_a");
    assert_eq!(
        op["inbox_events"][0]["resolution"],
        "completed: charge.succeeded"
    );
    // The caller's retry is the replay of the event's object; no
    // read-back was made, and b's operation is still UNKNOWN.
    let retry = app.charge("k1", CHARGE).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let v: Value = retry.json().await.unwrap();
    assert_eq!(v["id"], ca.id.as_str());
    assert_eq!(v["object"], "charge");
    assert_eq!(app.mock.provider.readbacks(), 0, "no read-back call");
    assert_eq!(app.mock.provider.charges().len(), 2);
    let b: Value = app
        .operation(ADMIN_B, "b", "kb")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(b["state"], "UNKNOWN");
}
both!(
    a_reference_rule_completes_the_unknown_operation_it_names_sqlite,
    a_reference_rule_completes_the_unknown_operation_it_names_postgres,
    a_reference_rule_completes_the_unknown_operation_it_names
);

// ---------------------------------------------------------------------------
// Operation events of requeues and refused approvals.
// ---------------------------------------------------------------------------

const BIG: &str = r#"{"amount":5000,"currency":"eur","client_ref":"r-big"}"#;

const ALL_OPERATION_EVENTS: &str = "[\"operation.unknown\", \"operation.dead_lettered\", \
     \"operation.reconciled\", \"operation.completed\", \"operation.failed\"]";

/// A 202 for an approval; returns its id.
async fn pending_approval(app: &App, key: &str) -> String {
    let r = app.charge(key, BIG).await;
    assert_eq!(r.status(), 202);
    r.json::<Value>().await.unwrap()["approval_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn requeues_and_refused_approvals_report_their_events_once(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            hook_events: Some(ALL_OPERATION_EVENTS.into()),
            route_extra: "effect_class = \"payment\"\n".into(),
            tenant_a_extra: format!(
                "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000 }}\n",
                policy_wasm("amount_threshold").display()
            ),
            ..Setup::default()
        },
    )
    .await;
    let ledger = &app.gw.state.ledger;

    // An approval nobody decides expires: AWAITING_APPROVAL → FAILED,
    // `operation.failed`; expiring again changes nothing.
    pending_approval(&app, "k-exp").await;
    ledger.shift_clock(86_400_001).await.unwrap();
    assert_eq!(ledger.expire_approvals(100).await.unwrap(), 1);
    assert_eq!(ledger.expire_approvals(100).await.unwrap(), 0);
    assert_eq!(app.op_json("k-exp").await["state"], "FAILED");

    // A rejected approval: FAILED, `operation.failed`; a second decision
    // is refused and reports nothing.
    let id = pending_approval(&app, "k-rej").await;
    let path = format!("/admin/tenants/a/approvals/{id}/reject");
    let decide = || app.admin_post(APPROVER_A, &path, r#"{"comment":"no"}"#);
    assert_eq!(decide().await.status(), 200);
    assert_eq!(decide().await.status(), 409);
    assert_eq!(app.op_json("k-rej").await["state"], "FAILED");

    // A dead letter an operator requeues: FAILED → UNKNOWN
    // (`operation.unknown`); its read-back finds nothing and the new
    // attempt completes it (`operation.completed`).
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 100,
        ..Default::default()
    });
    assert_eq!(app.charge("k-dead", CHARGE).await.status(), 503);
    let dead = ledger.get("a", "k-dead").await.unwrap().unwrap();
    assert!(dead.dead_letter);
    app.mock
        .provider
        .set_faults(mock_provider::Faults::default());
    let r = app
        .admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/k-dead/requeue",
            r#"{"reason":"the provider is back"}"#,
        )
        .await;
    assert_eq!(r.status(), 202);
    let mut state = Value::Null;
    for _ in 0..300 {
        state = app.op_json("k-dead").await["state"].clone();
        if state == "COMPLETED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state, "COMPLETED");
    // The same requeue at the old version loses its compare-and-swap:
    // rolled back, nothing reported.
    assert_eq!(
        ledger
            .requeue(
                "a",
                "k-dead",
                dead.version,
                effectgate::ledger::State::Unknown,
                "test",
                "again"
            )
            .await
            .unwrap(),
        None
    );

    let want = vec![
        ("operation.completed", "k-dead"),
        ("operation.dead_lettered", "k-dead"),
        ("operation.failed", "k-exp"),
        ("operation.failed", "k-rej"),
        ("operation.unknown", "k-dead"),
    ];
    let want: Vec<(String, String)> = want
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect();
    let mut got = Vec::new();
    for _ in 0..100 {
        got = operation_events(&deliveries(&app, &rx, 0).await);
        if got.len() >= want.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // One more pass: nothing else comes.
    let mut sorted = operation_events(&deliveries(&app, &rx, 0).await);
    sorted.sort();
    assert_eq!(sorted, want, "delivered: {got:?}");
    let all = rx.got.lock().unwrap().clone();
    let find = |ty: &str, id: &str| {
        all.iter()
            .map(Delivery::json)
            .find(|v| v["type"] == ty && v["data"]["operation_id"] == id)
            .unwrap()
    };
    let rejected = find("operation.failed", "k-rej");
    assert_eq!(rejected["data"]["from_state"], "AWAITING_APPROVAL");
    assert_eq!(rejected["data"]["to_state"], "FAILED");
    assert!(
        rejected["data"]["reason"]
            .as_str()
            .unwrap()
            .contains("rejected by a:approver"),
        "{rejected}"
    );
    let expired = find("operation.failed", "k-exp");
    assert_eq!(expired["data"]["from_state"], "AWAITING_APPROVAL");
    let requeued = find("operation.unknown", "k-dead");
    assert_eq!(requeued["data"]["from_state"], "FAILED");
    assert_eq!(requeued["data"]["to_state"], "UNKNOWN");
    assert_eq!(
        requeued["data"]["reason"],
        "requeued by operator: the provider is back"
    );
}
both!(
    requeues_and_refused_approvals_report_their_events_once_sqlite,
    requeues_and_refused_approvals_report_their_events_once_postgres,
    requeues_and_refused_approvals_report_their_events_once
);

// ---------------------------------------------------------------------------
// Ordering rows are swept.
// ---------------------------------------------------------------------------

async fn idle_ordering_rows_are_swept_after_the_sequence_window(storage: Option<StorageSpec>) {
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: format!(
                "{}dedupe_window_ms = 300000\nsequence_window_ms = 600000\n",
                ordered("quarantine")
            ),
            ..Setup::default()
        },
    )
    .await;
    let ledger = &app.gw.state.ledger;
    let last = |key: &'static str| {
        let app = &app;
        async move {
            app.gw
                .state
                .ledger
                .inbox_sequence(("a", app.src.as_str(), key))
                .await
                .unwrap()
        }
    };
    let tick = || effectgate::workers::inbox::tick(&app.gw.state);
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(
        state_of(&app, &versioned("e2", "cus_1", 2)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("g3", "cus_2", 3)).await, "held");
    assert_eq!(last("cus_1").await, Some(2));
    assert_eq!(last("cus_2").await, Some(0));

    // Inside the window both stay (g3 is quarantined meanwhile).
    ledger.shift_clock(599_000).await.unwrap();
    tick().await.unwrap();
    assert_eq!(last("cus_1").await, Some(2));
    assert_eq!(last("cus_2").await, Some(0));
    assert_eq!(
        inbox_list(&app, "?state=quarantined").await[0]["event_id"],
        "g3"
    );
    // Past it the idle key's row goes.
    ledger.shift_clock(2_000).await.unwrap();
    tick().await.unwrap();
    assert_eq!(last("cus_1").await, None, "swept");
    // The swept key starts over (its events are past the dedupe window
    // too): v1 is accepted again.
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(last("cus_1").await, Some(1));
    // A key whose quarantined event waits keeps its row however idle.
    ledger.shift_clock(600_001).await.unwrap();
    tick().await.unwrap();
    assert_eq!(last("cus_1").await, None);
    assert_eq!(last("cus_2").await, Some(0), "still ordering g3");

    // Once the operator drops g3, its key's row is swept in turn.
    let r = app
        .http
        .post(app.admin(&format!("/admin/tenants/a/inbox/{}/g3/drop", app.src)))
        .bearer_auth(OPERATOR_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(last("cus_2").await, Some(3));
    ledger.shift_clock(600_001).await.unwrap();
    tick().await.unwrap();
    assert_eq!(last("cus_2").await, None);
}
both!(
    idle_ordering_rows_are_swept_after_the_sequence_window_sqlite,
    idle_ordering_rows_are_swept_after_the_sequence_window_postgres,
    idle_ordering_rows_are_swept_after_the_sequence_window
);

// ---------------------------------------------------------------------------
// The console's Inbox page in a real browser.
// ---------------------------------------------------------------------------

async fn an_operator_releases_a_quarantined_event_in_the_browser(storage: Option<StorageSpec>) {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let node_path = std::env::var("NODE_PATH").unwrap_or_else(|_| {
        format!(
            "{}/.cache/effectgate-node/node_modules",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let have_browser = std::path::Path::new(&chromium).exists()
        && std::path::Path::new(&node_path)
            .join("playwright-core")
            .exists();
    if !have_browser {
        skips::skip(
            "Chromium and playwright-core",
            &format!(
                "no {chromium}, or no playwright-core in {node_path} (apt-get install chromium; npm install --prefix ~/.cache/effectgate-node playwright-core@1; or set CHROMIUM and NODE_PATH; .ci/run does both)"
            ),
        );
        return;
    }
    let rx = spawn_receiver().await;
    let app = app_with(
        &rx,
        Setup {
            storage,
            stripe_extra: ordered("quarantine"),
            ..Setup::default()
        },
    )
    .await;
    assert_eq!(
        state_of(&app, &versioned("e1", "cus_1", 1)).await,
        "accepted"
    );
    assert_eq!(state_of(&app, &versioned("e3", "cus_1", 3)).await, "held");
    app.gw.state.ledger.shift_clock(60_001).await.unwrap();
    effectgate::workers::inbox::tick(&app.gw.state)
        .await
        .unwrap();
    assert_eq!(delivered_ids(&deliveries(&app, &rx, 1).await), vec!["e1"]);

    let artifacts =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join(format!("console-inbox-{}.png", app.src));
    let _ = std::fs::remove_file(&shot);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console/inbox.cjs");
    let admin = format!("http://{}", app.gw.admin_addr);
    let out = tokio::process::Command::new("node")
        .arg(&script)
        .args([&admin, OPERATOR_A, "e3"])
        .arg(&shot)
        .env("NODE_PATH", &node_path)
        .env("CHROMIUM", &chromium)
        .output()
        .await
        .expect("run node");
    assert!(
        out.status.success(),
        "browser flow failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 1000,
        "screenshot saved"
    );
    // Released in the browser: delivered once, after e1, flagged, and the
    // row keeps the operator.
    let got = deliveries(&app, &rx, 2).await;
    assert_eq!(delivered_ids(&got), vec!["e1", "e3"]);
    assert_eq!(got[1].header("effectgate-gap"), Some("true"));
    assert_eq!(got[1].json()["data"]["gap"], true);
    let accepted = inbox_list(&app, "?state=accepted").await;
    let e3 = accepted.iter().find(|e| e["event_id"] == "e3").unwrap();
    assert_eq!(e3["decided_by"], "a:operator");
}
both!(
    an_operator_releases_a_quarantined_event_in_the_browser_sqlite,
    an_operator_releases_a_quarantined_event_in_the_browser_postgres,
    an_operator_releases_a_quarantined_event_in_the_browser
);
