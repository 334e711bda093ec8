//! `POST /admin/clock/step` (builds with the `failpoints` feature, as this
//! suite's gateway binary is): a running gateway's ledger clock stepped
//! forward and back on SQLite; refused on PostgreSQL, where the database
//! clock rules. That a build without the feature has no such endpoint is
//! checked by `.ci/run` (`chaos --expect-no-clock-step` against the plain
//! binary).

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

mod common;
use common::{Gw, fresh_schema, pg_url, sha, spawn_gateway};

const CLIENT_KEY: &str = "clock-client-key";
const ADMIN_KEY: &str = "clock-admin-key";
const HOUR_MS: i64 = 3_600_000;

fn write_config(
    dir: &Path,
    storage: &str,
    provider: &str,
    proxy: u16,
    admin: u16,
) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
{storage}
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
effect_class = "payment"
tenant_scoped_field = "/metadata/tenant"
"#,
        ck = sha(CLIENT_KEY),
        ak = sha(ADMIN_KEY),
    );
    let p = dir.join(format!("gw-{proxy}.toml"));
    std::fs::write(&p, cfg).unwrap();
    p
}

fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn step(gw: &Gw, key: Option<&str>, body: &str) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/admin/clock/step", gw.admin))
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Makes charge `key` and returns its ledger row's `created_at`.
async fn charge_created_at(gw: &Gw, key: &str) -> i64 {
    let http = reqwest::Client::new();
    let r = http
        .post(format!("http://127.0.0.1:{}/pay/v1/charges", gw.proxy))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(json!({"amount": 100, "currency": "eur", "client_ref": key}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "charge {key}");
    let op: Value = http
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
        .unwrap();
    assert_eq!(op["state"], "COMPLETED");
    op["created_at"].as_i64().unwrap()
}

#[tokio::test]
async fn a_running_gateways_ledger_clock_steps_forward_and_back_on_sqlite() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let storage = format!("path = \"{}\"", dir.path().join("ledger.db").display());
    let gw = spawn_gateway(
        |proxy, admin| write_config(dir.path(), &storage, &mock.url(), proxy, admin),
        &[],
        None,
    )
    .await;

    // Authenticated like the other admin endpoints; an admin's only.
    assert_eq!(step(&gw, None, r#"{"ms": 1000}"#).await.0, 401);
    let (status, p) = step(&gw, Some(CLIENT_KEY), r#"{"ms": 1000}"#).await;
    assert_eq!(status, 403, "{p}");
    // Bad bodies name the field.
    for (body, field) in [
        (r#"{"ms": "soon"}"#, "body.ms"),
        ("", "body.ms"),
        (r#"{"ms": 1.5}"#, "body.ms"),
        (r#"{"ms": 1, "by": 2}"#, "body.by"),
        ("{", "body"),
    ] {
        let (status, p) = step(&gw, Some(ADMIN_KEY), body).await;
        assert_eq!(status, 400, "{body}: {p}");
        assert_eq!(p["field"], field, "{body}: {p}");
    }

    let before = wall_ms();
    let first = charge_created_at(&gw, "before-the-step").await;
    assert!(first >= before && first < before + HOUR_MS);

    // An hour forward: the step answers the ledger's new time, and the
    // next row is stamped with it.
    let (status, v) = step(&gw, Some(ADMIN_KEY), &json!({"ms": HOUR_MS}).to_string()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stepped_ms"], HOUR_MS);
    let now = v["now_ms"].as_i64().unwrap();
    assert!(now >= before + HOUR_MS && now <= wall_ms() + HOUR_MS, "{v}");
    let ahead = charge_created_at(&gw, "after-a-step-forward").await;
    assert!(ahead >= before + HOUR_MS, "stamped {ahead}, wall {before}");

    // Two hours back: an hour behind the wall clock, behind the last row.
    let (status, v) = step(
        &gw,
        Some(ADMIN_KEY),
        &json!({"ms": -2 * HOUR_MS}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stepped_ms"], -2 * HOUR_MS);
    let behind = charge_created_at(&gw, "after-a-step-back").await;
    assert!(
        behind < first && behind >= before - HOUR_MS && behind <= wall_ms() - HOUR_MS,
        "stamped {behind}, wall {before}"
    );
    assert_eq!(mock.provider.effects(), 3);
}

#[tokio::test]
async fn the_clock_step_is_refused_on_postgres() {
    let Some(url) = pg_url() else { return };
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let storage = format!("url = \"{url}\"\nschema = \"{}\"", fresh_schema());
    let gw = spawn_gateway(
        |proxy, admin| write_config(dir.path(), &storage, &mock.url(), proxy, admin),
        &[],
        None,
    )
    .await;
    let before = wall_ms();
    let (status, p) = step(&gw, Some(ADMIN_KEY), r#"{"ms": 3600000}"#).await;
    assert_eq!(status, 409, "{p}");
    assert_eq!(p["type"], "urn:effectgate:problem:conflict");
    assert!(
        p["detail"].as_str().unwrap().contains("database clock"),
        "{p}"
    );
    // Nothing moved: the next row is stamped with the database's time.
    let created = charge_created_at(&gw, "refused-step").await;
    assert!(
        created < before + 60_000,
        "stamped {created}, wall {before}"
    );
}
