//! The gateway on a PostgreSQL ledger: the proxy path end to end, and what
//! happens while the database is unreachable (effectful requests fail with
//! 503 problem+json and are never forwarded unrecorded; non-effectful
//! routes keep working). Skipped, with one line, without
//! `TEST_POSTGRES_URL`.

use effectgate::config::StorageSpec;
use effectgate_tests::*;
use serde_json::Value;

const BODY: &str = r#"{"amount":100,"currency":"eur","client_ref":"r-1"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effectful_requests_get_503_while_the_database_is_unreachable_and_reads_pass() {
    let Some(url) = pg::url() else { return };
    let relay = pg::Relay::start(&url).await;
    let app = spawn_with(Opts {
        storage: Some(StorageSpec {
            acquire_timeout_ms: 300,
            call_timeout_ms: 2_000,
            ..pg::storage(&relay.url)
        }),
        ..Default::default()
    })
    .await;
    assert_eq!(app.gw.state.ledger.backend_name(), "postgres");
    let first = app.charge("k1", BODY).await;
    assert_eq!(first.status(), 200);
    let charge: Value = first.json().await.unwrap();
    let id = charge["id"].as_str().unwrap().to_owned();

    relay.cut();
    let r = app.charge("k2", BODY).await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.headers()["content-type"],
        "application/problem+json",
        "a problem document"
    );
    let problem: Value = r.json().await.unwrap();
    assert_eq!(problem["status"], 503);
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("ledger-unavailable"),
        "{problem}"
    );
    assert_eq!(
        app.mock.provider.effects(),
        1,
        "nothing is forwarded unrecorded"
    );
    // A read needs no ledger: it still reaches the provider.
    let read = app
        .http
        .get(app.proxy(&format!("/pay/v1/charges/{id}")))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    let ready = app.http.get(app.admin("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503, "not ready without the ledger");

    relay.restore();
    let again = app.charge("k2", BODY).await;
    assert_eq!(
        again.status(),
        200,
        "the same key runs once the ledger is back"
    );
    let dup = app.charge("k1", BODY).await;
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_is_reconciled_on_postgres_with_its_history() {
    let Some(url) = pg::url() else { return };
    let app = spawn_with(Opts {
        storage: Some(pg::storage(&url)),
        route_extra: r#"effect_class = "payment"
tenant_scoped_field = "/metadata/tenant"
[routes.read_back]
path = "/v1/charges?client_ref={body:/client_ref}"
found_pointer = "/data/0"
reference_pointer = "/id"
settle_delay_ms = 0
"#
        .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with("lost", BODY, &[("X-Mock-Fault", "drop-after-effect")])
        .await;
    assert_eq!(r.status(), 502);
    assert_eq!(app.op_json("lost").await["state"], "UNKNOWN");
    let steps = app.tick().await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    let op = app.op_json("lost").await;
    assert_eq!(op["state"], "COMPLETED");
    let history: Vec<String> = app
        .gw
        .state
        .ledger
        .transitions("a", "lost")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.to_state.to_string())
        .collect();
    assert_eq!(
        history,
        vec!["RESERVED", "EXECUTING", "UNKNOWN", "UNKNOWN", "COMPLETED"]
    );
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_lost_after_the_provider_call_is_an_unknown_outcome_then_reconciled() {
    let Some(url) = pg::url() else { return };
    let relay = pg::Relay::start(&url).await;
    let app = spawn_with(Opts {
        storage: Some(StorageSpec {
            acquire_timeout_ms: 300,
            ..pg::storage(&relay.url)
        }),
        route_extra: r#"effect_class = "payment"
tenant_scoped_field = "/metadata/tenant"
[routes.read_back]
path = "/v1/charges?client_ref={body:/client_ref}"
found_pointer = "/data/0"
reference_pointer = "/id"
settle_delay_ms = 0
"#
        .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let call = {
        let (http, url) = (app.http.clone(), app.proxy("/pay/v1/charges"));
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(KEY_A)
                .header("Idempotency-Key", "mid")
                .header("Content-Type", "application/json")
                .header("X-Mock-Fault", "delay-reply:500")
                .body(BODY)
                .send()
                .await
                .unwrap()
        })
    };
    // The provider applied the effect and holds its reply; the database goes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while app.mock.provider.effects() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the call never reached the provider"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    relay.cut();
    let r = call.await.unwrap();
    assert_eq!(r.status(), 503);
    let problem: Value = r.json().await.unwrap();
    assert_eq!(
        problem["type"], "urn:effectgate:problem:operation-outcome-unknown",
        "not a refusal: the provider was called ({problem})"
    );
    assert_eq!(problem["operation_id"], "mid");

    relay.restore();
    let ledger = &app.gw.state.ledger;
    let op = ledger.get("a", "mid").await.unwrap().unwrap();
    assert_eq!(
        op.state.as_str(),
        "EXECUTING",
        "the attempt's outcome was never recorded"
    );
    // Past the lease (database clock), the reconciler reads the effect back.
    ledger
        .shift_clock(op.lease_expires_at.unwrap() - ledger.clock().now_ms() + 1)
        .await
        .unwrap();
    app.tick().await;
    assert_eq!(app.op_json("mid").await["state"], "COMPLETED");
    let dup = app.charge("mid", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 1, "one effect");
}
