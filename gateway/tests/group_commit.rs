//! Group commit with a real gateway process: a batch whose `COMMIT`
//! fails (injected with `FAILPOINTS="ledger-commit-fail=return(fail-)"`:
//! every batch holding a reservation of an operation id starting `fail-`
//! fails its commit) answers every caller in it 503 `ledger-unavailable`,
//! and nothing of it reaches the provider or stays in the ledger; batches
//! without such a write commit as usual, and the failures are counted in
//! `effectgate_ledger_batch_failures_total`.

use std::path::Path;

mod common;
use common::{sha, spawn_gateway};

const CLIENT_KEY: &str = "group-client-key";
const ADMIN_KEY: &str = "group-admin-key";

fn write_config(dir: &Path, provider: &str, proxy: u16, admin: u16) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
path = "{db}"
[[tenants]]
id = "t"
keys = [{{ role = "client", sha256 = "{ck}" }}, {{ role = "admin", sha256 = "{ak}" }}]
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
effect_class = "payment"
"#,
        db = dir.join("ledger.db").display(),
        ck = sha(CLIENT_KEY),
        ak = sha(ADMIN_KEY),
    );
    let p = dir.join("effectgate.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

async fn charge(http: &reqwest::Client, proxy: u16, key: &str) -> (u16, serde_json::Value) {
    let r = http
        .post(format!("http://127.0.0.1:{proxy}/pay/v1/charges"))
        .bearer_auth(CLIENT_KEY)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(format!(
            r#"{{"amount":100,"currency":"eur","client_ref":"{key}"}}"#
        ))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

async fn ledger_state(http: &reqwest::Client, admin: u16, key: &str) -> u16 {
    http.get(format!(
        "http://127.0.0.1:{admin}/admin/tenants/t/operations/{key}"
    ))
    .bearer_auth(ADMIN_KEY)
    .send()
    .await
    .unwrap()
    .status()
    .as_u16()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_answers_every_caller_of_its_batch_and_forwards_nothing() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let provider = mock.url();
    let gw = spawn_gateway(
        |proxy, admin| write_config(dir.path(), &provider, proxy, admin),
        &[("FAILPOINTS", "ledger-commit-fail=return(fail-)")],
        None,
    )
    .await;
    let http = reqwest::Client::new();

    // Alone in its batch: the commit fails, the caller gets 503.
    let (status, body) = charge(&http, gw.proxy, "fail-alone").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "urn:effectgate:problem:ledger-unavailable");

    // Many at once: those sharing a batch with a `fail-` reservation fail
    // with it; every `fail-` call fails; whatever succeeded was forwarded
    // exactly once and whatever failed not at all.
    let mut calls = Vec::new();
    for i in 0..24 {
        let key = if i % 3 == 0 {
            format!("fail-{i}")
        } else {
            format!("ok-{i}")
        };
        let http = http.clone();
        let proxy = gw.proxy;
        calls.push(tokio::spawn(async move {
            let (status, body) = charge(&http, proxy, &key).await;
            (key, status, body)
        }));
    }
    let mut failed = 1;
    for call in calls {
        let (key, status, body) = call.await.unwrap();
        let effects = mock
            .provider
            .charges()
            .iter()
            .filter(|c| c.client_ref.as_deref() == Some(key.as_str()))
            .count();
        if key.starts_with("fail-") {
            assert_eq!(status, 503, "{key}: {body}");
        }
        match status {
            503 if body["type"] == "urn:effectgate:problem:operation-outcome-unknown" => {
                // Its reservation committed and it was forwarded, then the
                // batch holding its outcome failed with a `fail-` one: sent
                // once, left for reconciliation, never sent again.
                assert!(!key.starts_with("fail-"), "{key}: {body}");
                assert_eq!(effects, 1, "{key}");
                failed += 1;
            }
            503 => {
                assert_eq!(
                    body["type"], "urn:effectgate:problem:ledger-unavailable",
                    "{key}"
                );
                assert_eq!(effects, 0, "{key} failed to commit but was forwarded");
                // Nothing of it was kept: the key is free.
                assert_eq!(ledger_state(&http, gw.admin, &key).await, 404, "{key}");
                failed += 1;
            }
            s => {
                assert!((200..300).contains(&s), "{key}: {s} {body}");
                assert_eq!(effects, 1, "{key}");
            }
        }
    }
    assert!(
        mock.provider.charges().iter().all(|c| !c
            .client_ref
            .as_deref()
            .unwrap_or("")
            .starts_with("fail-")),
        "no fail- call reached the provider"
    );

    // A call alone afterwards commits.
    let (status, body) = charge(&http, gw.proxy, "ok-after").await;
    assert!((200..300).contains(&status), "{status} {body}");

    let text = http
        .get(format!("http://127.0.0.1:{}/metrics", gw.admin))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let failures = metric(&text, "effectgate_ledger_batch_failures_total");
    assert!(
        failures >= 1.0 && failures <= f64::from(failed),
        "{failures} failed batches for {failed} failed calls"
    );
    assert!(metric(&text, "effectgate_ledger_batch_size_count") >= 1.0);
    assert!(metric(&text, "effectgate_ledger_commit_seconds_count") >= 1.0);
}
