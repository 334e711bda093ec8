//! Reconciliation by read-back, retries, dead letters and operator actions,
//! with the reconciler driven by hand (`tick`) and time by a manual clock.

use std::sync::Arc;

use effectgate::ledger::ManualClock;
use effectgate::ops::reconcile::Step;
use effectgate_tests::*;
use mock_provider::Faults;
use serde_json::Value;

const BODY: &str = r#"{"amount":100,"currency":"eur","client_ref":"r-1"}"#;
const READ_BACK: &str = r#"effect_class = "payment"
retry = { max_attempts = 3, base_delay_ms = 1, max_delay_ms = 2 }
[routes.read_back]
path = "/v1/charges?idempotency_key={provider_key}"
found_pointer = "/data/0"
reference_pointer = "/id"
settle_delay_ms = 1000
"#;
const MANUAL: &str = "[reconcile]\nenabled = false\nmax_read_backs = 2\nbackoff_base_ms = 100\nbackoff_max_ms = 100\n";

async fn app_with_read_back() -> (TestApp, Arc<ManualClock>) {
    let clock = ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: READ_BACK.into(),
        more: MANUAL.into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    (app, clock)
}

async fn lose_reply(app: &TestApp, key: &str) {
    let r = app
        .charge_with(key, BODY, &[("X-Mock-Fault", "drop-after-effect")])
        .await;
    assert_eq!(r.status(), 502);
    assert_eq!(app.op_json(key).await["state"], "UNKNOWN");
}

fn steps_for<'a>(steps: &'a [(String, String, Step)], id: &str) -> Vec<&'a Step> {
    steps
        .iter()
        .filter(|(_, o, _)| o == id)
        .map(|(_, _, s)| s)
        .collect()
}

#[tokio::test]
async fn reply_lost_after_commit_is_reconciled_to_completed() {
    let (app, _clock) = app_with_read_back().await;
    lose_reply(&app, "lost").await;
    let steps = app.tick().await;
    assert_eq!(steps_for(&steps, "lost"), vec![&Step::Found]);
    let op = app.op_json("lost").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], "ch_1");
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(
        app.provider_calls().0,
        1,
        "reconciliation never re-sends when the effect exists"
    );
    // A duplicate afterwards gets the replay: what the read-back returned.
    let dup = app.charge("lost", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    let charge: Value = dup.json().await.unwrap();
    assert_eq!(charge["id"], "ch_1");
}

/// A read-back whose template names a field the stored request lacks is
/// never sent with an empty value (a lookup by an empty filter may match
/// another operation's charge): the step is a read-back error, the
/// provider sees no lookup, and the operation stays UNKNOWN, saying why.
#[tokio::test]
async fn a_read_back_naming_a_field_the_request_lacks_is_not_sent() {
    let clock = ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: READ_BACK.replace(
            "idempotency_key={provider_key}",
            "idempotency_key={provider_key}&client_ref={body:/client_ref}",
        ),
        more: MANUAL.into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with(
            "nofield",
            r#"{"amount":100,"currency":"eur"}"#,
            &[("X-Mock-Fault", "drop-after-effect")],
        )
        .await;
    assert_eq!(r.status(), 502);
    let steps = app.tick().await;
    assert_eq!(steps_for(&steps, "nofield"), vec![&Step::ReadBackError]);
    assert_eq!(app.mock.provider.readbacks(), 0, "no lookup was sent");
    let op = app.op_json("nofield").await;
    assert_eq!(op["state"], "UNKNOWN", "{op}");
    assert!(
        op["error_detail"]
            .as_str()
            .is_some_and(|d| d.contains("read-back can't be built from {body:/client_ref}")),
        "{op}"
    );
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn a_duplicate_of_an_unknown_operation_reconciles_at_once() {
    let (app, _clock) = app_with_read_back().await;
    lose_reply(&app, "lost").await;
    let dup = app.charge("lost", BODY).await;
    assert_eq!(
        dup.status(),
        200,
        "the duplicate waits for the read-back instead of a blind 409"
    );
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(app.op_json("lost").await["state"], "COMPLETED");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// Concurrent duplicates of an UNKNOWN operation share the read-back one
/// of them runs: the others wait for it, then answer with its result (a
/// 409 naming when the next read-back is due) instead of each reading
/// back the provider in turn.
#[tokio::test]
async fn concurrent_duplicates_of_an_unknown_operation_share_one_read_back() {
    let (app, _clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        readback_hidden: true,
        readback_delay_ms: 300,
        ..Default::default()
    });
    lose_reply(&app, "shared").await;
    let answers = futures_util::future::join_all((0..8).map(|_| app.charge("shared", BODY))).await;
    // The one that ran the read-back is told what it found; the others,
    // which waited for it, when the next read-back is due.
    let mut details = Vec::new();
    for r in answers {
        assert_eq!(r.status(), 409);
        // The next read-back is due 100 ms on (`backoff_base_ms`): retry
        // after 1 s, not the default 5.
        assert_eq!(r.headers()["retry-after"], "1");
        let p: Value = r.json().await.unwrap();
        assert_eq!(
            p["type"],
            "urn:effectgate:problem:operation-outcome-unknown"
        );
        details.push(p["detail"].as_str().unwrap().to_owned());
    }
    let ran = "the read-back settle delay has not passed";
    let waited = "the last read-back did not settle it, and the next is due at";
    assert_eq!(
        details.iter().filter(|d| d.contains(ran)).count(),
        1,
        "{details:#?}"
    );
    assert_eq!(
        details.iter().filter(|d| d.contains(waited)).count(),
        7,
        "{details:#?}"
    );
    assert_eq!(app.mock.provider.readbacks(), 1, "one read-back for all");
    let op = app.op_json("shared").await;
    assert_eq!(op["state"], "UNKNOWN");
    assert_eq!(op["dead_letter"], false);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn read_back_lag_is_waited_out_not_retried() {
    let (app, clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        readback_hidden: true,
        ..Default::default()
    });
    lose_reply(&app, "lag").await;
    // Within the settle delay: absent is not trusted; no new attempt.
    let steps = app.tick().await;
    assert_eq!(steps_for(&steps, "lag"), vec![&Step::Settling]);
    assert_eq!(app.provider_calls().0, 1);
    clock.advance(999);
    // Still within the delay: read back again (absent, still settling),
    // never a new attempt.
    assert_eq!(
        steps_for(&app.tick().await, "lag"),
        vec![&Step::Settling],
        "read back again within the window"
    );
    assert_eq!(app.provider_calls().0, 1);
    assert_eq!(app.mock.provider.readbacks(), 2);
    // The provider's index catches up; after the delay the effect is found.
    app.mock.provider.set_faults(Faults::default());
    clock.advance(1);
    assert_eq!(steps_for(&app.tick().await, "lag"), vec![&Step::Found]);
    assert_eq!(app.op_json("lag").await["state"], "COMPLETED");
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 1);
}

#[tokio::test]
async fn absent_after_the_settle_delay_retries_the_same_operation_with_the_same_key() {
    let (app, clock) = app_with_read_back().await;
    // A 504 with no effect behind it: the outcome is unknown to the gateway.
    app.mock.provider.set_faults(Faults {
        fail_status_times: 1,
        fail_status: 504,
        ..Default::default()
    });
    let r = app.charge("gone", BODY).await;
    assert_eq!(r.status(), 502);
    assert_eq!(steps_for(&app.tick().await, "gone"), vec![&Step::Settling]);
    clock.advance(1000);
    let steps = app.tick().await;
    assert_eq!(
        steps_for(&steps, "gone"),
        vec![&Step::Retried(Some(effectgate::ledger::State::Completed))]
    );
    let op = app.op_json("gone").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 2);
    assert_eq!(app.mock.provider.effects(), 1);
    let keys: Vec<String> = app
        .mock
        .provider
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .map(|r| {
            r.headers
                .iter()
                .find(|(n, _)| n == "idempotency-key")
                .unwrap()
                .1
                .clone()
        })
        .collect();
    assert_eq!(
        keys,
        vec![op["provider_key"].as_str().unwrap().to_owned(); 2]
    );
}

#[tokio::test]
async fn a_read_back_error_never_creates_a_provider_call_and_ends_in_a_dead_letter() {
    let (app, clock) = app_with_read_back().await;
    lose_reply(&app, "rb").await;
    app.mock.provider.set_faults(Faults {
        readback_fail_times: 10,
        ..Default::default()
    });
    clock.advance(1000);
    assert_eq!(
        steps_for(&app.tick().await, "rb"),
        vec![&Step::ReadBackError]
    );
    let op = app.op_json("rb").await;
    assert_eq!(op["state"], "UNKNOWN");
    assert_eq!(op["reconcile_attempts"], 1);
    assert!(steps_for(&app.tick().await, "rb").is_empty(), "backing off");
    clock.advance(100);
    assert_eq!(
        steps_for(&app.tick().await, "rb"),
        vec![&Step::DeadLettered]
    );
    assert_eq!(
        app.provider_calls().0,
        1,
        "read-back errors never lead to a new attempt"
    );
    assert_eq!(app.mock.provider.effects(), 1);

    let op = app.op_json("rb").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["dead_letter"], true);
    let dl: Value = app
        .http
        .get(app.admin("/admin/tenants/a/dead-letters"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let item = &dl["dead_letters"][0];
    assert_eq!(item["operation_id"], "rb");
    assert_eq!(item["reason"], "reconciliation-out-of-bounds");
    assert_eq!(item["attempts"], 1);
    assert_eq!(item["last_error"]["kind"], "read-back-error");
    // `since` (ms) comes with its RFC 3339 twin, as every time does.
    let since = item["since"].as_i64().unwrap();
    assert_eq!(
        item["since_rfc3339"].as_str(),
        effectgate::times::rfc3339(since).as_deref()
    );
    assert!(
        item["operator_check"]
            .as_str()
            .unwrap()
            .contains(op["provider_key"].as_str().unwrap())
    );
    // A duplicate is told it's a dead letter, not replayed as a success.
    let dup = app.charge("rb", BODY).await;
    assert_eq!(dup.status(), 409);
    let p: Value = dup.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:operation-dead-lettered");

    // Requeue: a client key can't; an operator can, and the read-back now finds it.
    assert_eq!(
        app.admin_post(KEY_A, "/admin/tenants/a/operations/rb/requeue", "")
            .await
            .status(),
        403
    );
    app.mock.provider.set_faults(Faults::default());
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/rb/requeue",
            r#"{"reason":"provider is back"}"#,
        )
        .await;
    assert_eq!(r.status(), 202);
    // The requeue read back at once and found the effect.
    let dup = app.charge("rb", BODY).await;
    assert_eq!(dup.status(), 200);
    let op = app.op_json("rb").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["requeues"], 1);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 1);
}

#[tokio::test]
async fn exhausted_retries_are_dead_lettered_with_reason_and_context() {
    let (app, _clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        fail_503_times: 100,
        ..Default::default()
    });
    let r = app.charge("busy", BODY).await;
    assert_eq!(r.status(), 503);
    let op = app.op_json("busy").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["dead_letter"], true);
    assert_eq!(op["dead_letter_reason"], "retries-exhausted");
    assert_eq!(op["attempts"], 3);
    // Each attempt's log row says what the provider answered, the last
    // one (which ended the retries) too.
    let details: Vec<&str> = op["attempts_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["detail"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(details, ["provider answered 503 Service Unavailable"; 3]);
    assert!(app.mock.provider.effects() <= 1);
    app.mock.provider.set_faults(Faults::default());
    let out = app
        .admin_post(ADMIN_A, "/admin/tenants/a/operations/busy/requeue", "{}")
        .await;
    assert_eq!(out.status(), 202);
    // The requeued operation is read back first (absent: no attempt was
    // ambiguous, so no settle delay applies), then attempted again.
    let dup = app.charge("busy", BODY).await;
    assert_eq!(dup.status(), 200);
    let op = app.op_json("busy").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 4);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn a_dead_letter_of_an_irreversible_route_is_not_requeued() {
    let app = spawn_with(Opts {
        route_extra: "retry = { max_attempts = 1 }".into(),
        more: MANUAL.into(),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(Faults {
        fail_503_times: 1,
        ..Default::default()
    });
    assert_eq!(app.charge("irr", BODY).await.status(), 503);
    let r = app
        .admin_post(ADMIN_A, "/admin/tenants/a/operations/irr/requeue", "{}")
        .await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert!(p["detail"].as_str().unwrap().contains("irreversible"));
    assert_eq!(app.op_json("irr").await["dead_letter"], true);
}

#[tokio::test]
async fn an_operator_resolves_an_unknown_operation_on_a_route_without_read_back() {
    let app = spawn_with(Opts {
        more: MANUAL.into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with("op", BODY, &[("X-Mock-Fault", "drop-after-effect")])
        .await;
    assert_eq!(r.status(), 502);
    assert!(
        steps_for(&app.tick().await, "op").is_empty(),
        "no read-back: nothing automatic"
    );
    let bad = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/op/resolve",
            r#"{"outcome":"maybe"}"#,
        )
        .await;
    assert_eq!(bad.status(), 400);
    let p: Value = bad.json().await.unwrap();
    assert_eq!(p["field"], "body.outcome");
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/op/resolve",
            r#"{"outcome":"completed","provider_reference":"ch_1","reason":"seen in dashboard"}"#,
        )
        .await;
    assert_eq!(r.status(), 200);
    let op: Value = r.json().await.unwrap();
    assert_eq!(op["state"], "COMPLETED");
    let last = op["transitions"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["actor"], "a:admin");
    let dup = app.charge("op", BODY).await;
    assert_eq!(dup.status(), 200, "{:?}", dup.text().await);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// An "absent" resolution refused because the operation's route is gone
/// takes no lease and writes nothing: the next resolution ("completed")
/// goes through at once.
#[tokio::test]
async fn a_resolution_refused_for_a_missing_route_leaves_no_lease_behind() {
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        more: MANUAL.into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with("gone", BODY, &[("X-Mock-Fault", "drop-after-effect")])
        .await;
    assert_eq!(r.status(), 502);
    let before = app.op_json("gone").await;
    assert_eq!(before["state"], "UNKNOWN");
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("name = \"payments\"", "name = \"payments-v2\""),
    )
    .unwrap();
    app.gw.state.reload(None).await.unwrap();
    let resolve = |body: &'static str| {
        app.admin_post(ADMIN_A, "/admin/tenants/a/operations/gone/resolve", body)
    };
    let r = resolve(r#"{"outcome":"absent"}"#).await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("route \"payments\" is no longer configured"),
        "{p}"
    );
    let after = app.op_json("gone").await;
    assert_eq!(after["version"], before["version"], "nothing was written");
    assert_eq!(after["lease_owner"], Value::Null);
    let r = resolve(r#"{"outcome":"completed","provider_reference":"ch_1"}"#).await;
    assert_eq!(r.status(), 200);
    let op: Value = r.json().await.unwrap();
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn background_retry_mode_answers_202_and_finishes_the_operation() {
    let app = spawn_with(Opts {
        route_extra: r#"retry = { mode = "background", max_attempts = 3, base_delay_ms = 1, max_delay_ms = 2 }"#.into(),
        more: MANUAL.into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with("bg", BODY, &[("X-Mock-Fault", "fail-503:1")])
        .await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["operation_id"], "bg");
    // Re-sending gets the result once the background attempt recorded it.
    let mut last = 0;
    for _ in 0..200 {
        let r = app.charge("bg", BODY).await;
        last = r.status().as_u16();
        if last == 200 {
            break;
        }
        assert_eq!(last, 409);
        tokio::task::yield_now().await;
    }
    assert_eq!(last, 200);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.op_json("bg").await["attempts"], 2);
}

#[tokio::test]
async fn metrics_are_exported() {
    let (app, _clock) = app_with_read_back().await;
    app.charge("m1", BODY).await;
    app.charge("m1", BODY).await;
    lose_reply(&app, "m2").await;
    let text = app.metrics().await;
    for needle in [
        "effectgate_requests_total",
        "effectgate_replays_total",
        "effectgate_operations_recorded_total",
        "effectgate_unknown_operations{tenant=\"a\"}",
        "effectgate_dead_letters{tenant=\"b\"} 0",
        "effectgate_upstream_latency_seconds",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[tokio::test]
async fn a_read_back_by_a_body_field_only_accepts_this_operations_effect() {
    let clock = ManualClock::new(1_000_000_000);
    let route = r#"effect_class = "payment"
[routes.read_back]
path = "/v1/charges?client_ref={body:/client_ref}"
found_pointer = "/data"
match = { "/idempotency_key" = "{provider_key}" }
reference_pointer = "/id"
settle_delay_ms = 0
"#;
    let app = spawn_with(Opts {
        route_extra: route.into(),
        more: MANUAL.into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    // Tenant b already has a charge under the same client_ref.
    assert_eq!(
        app.charge_as(
            KEY_B,
            "b-1",
            r#"{"amount":777,"currency":"usd","client_ref":"order-1"}"#
        )
        .await
        .status(),
        200
    );
    // Tenant a's call fails with a 500 that applied nothing.
    app.mock.provider.set_faults(Faults {
        fail_status_times: 1,
        fail_status: 500,
        ..Default::default()
    });
    assert_eq!(
        app.charge(
            "a-1",
            r#"{"amount":5,"currency":"eur","client_ref":"order-1"}"#
        )
        .await
        .status(),
        502
    );
    // Read-back sees b's charge but it isn't this operation's: absent → a's own attempt.
    let steps = app.tick().await;
    assert_eq!(
        steps_for(&steps, "a-1"),
        vec![&Step::Retried(Some(effectgate::ledger::State::Completed))]
    );
    assert_eq!(app.mock.provider.effects(), 2);
    let dup = app
        .charge(
            "a-1",
            r#"{"amount":5,"currency":"eur","client_ref":"order-1"}"#,
        )
        .await;
    let v: Value = dup.json().await.unwrap();
    assert_eq!(v["amount"], 5, "tenant a never sees tenant b's charge");
}

#[tokio::test]
async fn an_operator_resolves_a_dead_letter_whose_effect_may_exist() {
    let (app, clock) = app_with_read_back().await;
    lose_reply(&app, "maybe").await;
    app.mock.provider.set_faults(Faults {
        readback_fail_times: 10,
        ..Default::default()
    });
    clock.advance(1000);
    app.tick().await;
    clock.advance(100);
    assert_eq!(
        steps_for(&app.tick().await, "maybe"),
        vec![&Step::DeadLettered]
    );
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/maybe/resolve",
            r#"{"outcome":"completed","provider_reference":"ch_1"}"#,
        )
        .await;
    assert_eq!(r.status(), 200);
    let op: Value = r.json().await.unwrap();
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["dead_letter"], false);
    assert_eq!(app.provider_calls().0, 1);
    let dup = app.charge("maybe", BODY).await;
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
}

#[tokio::test]
async fn admin_errors_are_always_problem_json() {
    let (app, _clock) = app_with_read_back().await;
    let r = app
        .http
        .post(app.admin("/admin/tenants/a/operations"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:method-not-allowed");
    assert_eq!(p["status"], 405);
    let r = app
        .http
        .get(app.admin("/admin/tenants/a/operations/%FF"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["status"], 400);
    // A reason over `limits.max_reason_chars` (1024 by default).
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/maybe/resolve",
            &format!(r#"{{"outcome":"absent","reason":"{}"}}"#, "é".repeat(1025)),
        )
        .await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "body.reason");
    assert!(p["detail"].as_str().unwrap().contains("1025"), "{p}");
    // One byte over `limits.max_admin_body_bytes` (65536 by default).
    let reason = "x".repeat(65536);
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/none/requeue",
            &format!(r#"{{"reason":"{reason}"}}"#)[..65537],
        )
        .await;
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:payload-too-large");
    assert_eq!(p["field"], "body");
    assert_eq!(p["limit_bytes"], 65536);
    // The admin listener's own limit, not a route's.
    assert_eq!(
        p["detail"],
        "request body exceeds limits.max_admin_body_bytes of 65536 bytes"
    );
}

#[tokio::test]
async fn a_long_healthy_call_keeps_its_lease() {
    // A 300 ms lease, a provider that takes 1.2 s, and a reconciler that
    // scans every 20 ms: without extension it would take the call over.
    let app = spawn_with(Opts {
        route_extra: READ_BACK.into(),
        more: "[limits]\nlease_ms = 300\n[reconcile]\ninterval_ms = 20\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with("long", BODY, &[("X-Mock-Delay-Ms", "1200")])
        .await;
    assert_eq!(r.status(), 200);
    let op = app.op_json("long").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 1);
    let to: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["to_state"].as_str().unwrap())
        .collect();
    assert_eq!(
        to,
        vec!["RESERVED", "EXECUTING", "COMPLETED"],
        "no takeover, no UNKNOWN"
    );
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.gw.state.ledger.stale_fence_rejections(), 0);
}

#[tokio::test]
async fn the_reconciler_sweeps_expired_keys_but_keeps_dead_letters_and_unknowns() {
    let (app, clock) = app_with_read_back().await;
    assert_eq!(app.charge("done", BODY).await.status(), 200);
    lose_reply(&app, "lost").await;
    app.mock.provider.set_faults(Faults {
        readback_fail_times: 100,
        ..Default::default()
    });
    // Past the 24 h key retention; "lost" backs off and dead-letters.
    clock.advance(25 * 3_600_000);
    app.tick().await;
    clock.advance(100);
    app.tick().await;
    assert_eq!(app.op_json("lost").await["dead_letter"], true);
    let ledger = &app.gw.state.ledger;
    assert!(
        ledger.get("a", "done").await.unwrap().is_none(),
        "the completed operation past its retention is swept"
    );
    assert!(ledger.transitions("a", "done").await.unwrap().is_empty());
    clock.advance(100 * 3_600_000);
    app.tick().await;
    assert!(
        ledger.get("a", "lost").await.unwrap().is_some(),
        "dead letters stay"
    );
}

#[tokio::test]
async fn a_retry_after_a_pause_past_the_lease_sends_nothing() {
    // The first attempt gets a 503 with `Retry-After: 1`. While the
    // executor waits to retry, its lease runs out (the clock jumps past it,
    // as for a process paused that long) and another owner claims the
    // operation. The retry must renew the lease under its fencing token
    // first, find it taken, and send nothing.
    let (app, clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        fail_503_times: 1,
        retry_after_s: Some(1),
        ..Default::default()
    });
    let ledger = &app.gw.state.ledger;
    let takeover = async {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ledger.attempts("a", "paused").await.unwrap().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the 503 was never noted"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        clock.advance(10 * 60_000);
        let op = ledger.get("a", "paused").await.unwrap().unwrap();
        assert_eq!(op.state, effectgate::ledger::State::Executing);
        ledger
            .claim(
                ("a", "paused"),
                effectgate::ledger::State::Executing,
                op.version,
                "other-owner",
                60_000,
                "lease expired",
            )
            .await
            .unwrap()
            .expect("the expired lease is taken over")
    };
    let (r, claim) = tokio::join!(app.charge("paused", BODY), takeover);
    assert_eq!(r.status(), 409);
    assert_eq!(
        app.provider_calls().0,
        1,
        "only the attempt that got the 503 reached the provider"
    );
    assert_eq!(app.mock.provider.effects(), 0);
    let op = ledger.get("a", "paused").await.unwrap().unwrap();
    assert_eq!(op.state, effectgate::ledger::State::Executing);
    assert_eq!(op.fence, claim.fence);
    assert_eq!(op.lease_owner.as_deref(), Some("other-owner"));
}

#[tokio::test]
async fn an_absent_read_back_sent_within_the_settle_delay_is_not_trusted_later() {
    // Found by the chaos soak: a read-back sent within the settle delay
    // whose answer is judged after it (a slow answer, or this process
    // paused) was trusted as "absent", and a second attempt was sent
    // while the first one's effect was still on its way to read-back.
    let (app, clock) = app_with_read_back().await;
    lose_reply(&app, "slow-rb").await;
    app.mock.provider.set_faults(Faults {
        readback_hidden: true,
        readback_delay_ms: 300,
        ..Default::default()
    });
    let pass_the_settle_delay = async {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while app.provider_calls().1 == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no read-back was sent"
            );
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        // The read-back is in flight: the settle delay (1000 ms) ends
        // before its answer comes.
        clock.advance(5_000);
    };
    let (steps, ()) = tokio::join!(app.tick(), pass_the_settle_delay);
    assert_eq!(steps_for(&steps, "slow-rb"), vec![&Step::Settling]);
    assert_eq!(app.provider_calls().0, 1, "no second attempt");
    assert_eq!(app.op_json("slow-rb").await["state"], "UNKNOWN");
}

#[tokio::test]
async fn a_forward_clock_step_past_the_settle_delay_does_not_make_absent_trusted() {
    // The settle delay is measured on the ledger's clock and on the
    // monotonic one: a step of the wall clock forward past the delay
    // (1000 ms) must not let an "absent" read-back, sent before the
    // provider could show the effect, start a second attempt.
    let (app, clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        readback_hidden: true,
        ..Default::default()
    });
    lose_reply(&app, "step").await;
    assert_eq!(steps_for(&app.tick().await, "step"), vec![&Step::Settling]);
    let ledger = &app.gw.state.ledger;
    ledger.shift_clock(5_000).await.unwrap();
    // The ledger's clock is 5 s past the settle delay; no time passed.
    assert_eq!(
        steps_for(&app.tick().await, "step"),
        vec![&Step::Settling],
        "absent is not trusted before the delay passed on the monotonic clock"
    );
    assert_eq!(app.provider_calls().0, 1, "no second attempt");
    // Not due again at once: the next look waits inside the window.
    assert!(steps_for(&app.tick().await, "step").is_empty());
    clock.advance(999);
    assert_eq!(steps_for(&app.tick().await, "step"), vec![&Step::Settling]);
    assert_eq!(app.provider_calls().0, 1);
    // The provider's index catches up; once the delay passed, found.
    app.mock.provider.set_faults(Faults::default());
    clock.advance(1);
    assert_eq!(steps_for(&app.tick().await, "step"), vec![&Step::Found]);
    assert_eq!(app.op_json("step").await["state"], "COMPLETED");
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 1);
}

#[tokio::test]
async fn after_a_restart_the_first_absent_read_back_opens_a_fresh_settle_window() {
    // The new process has no monotonic record of the window: the ledger's
    // clock (here far past the delay) is not trusted alone; the first
    // "absent" starts the window, and only a read-back sent a settle
    // delay later may start a new attempt.
    let (app, clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        fail_status_times: 1,
        fail_status: 504,
        ..Default::default()
    });
    assert_eq!(app.charge("restarted", BODY).await.status(), 502);
    clock.advance(60_000);
    let app = app.restart_with_clock(clock.clone()).await;
    assert_eq!(
        steps_for(&app.tick().await, "restarted"),
        vec![&Step::Settling]
    );
    assert_eq!(app.provider_calls().0, 1, "no second attempt yet");
    clock.advance(999);
    assert_eq!(
        steps_for(&app.tick().await, "restarted"),
        vec![&Step::Settling]
    );
    clock.advance(1);
    assert_eq!(
        steps_for(&app.tick().await, "restarted"),
        vec![&Step::Retried(Some(effectgate::ledger::State::Completed))]
    );
    let op = app.op_json("restarted").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 2);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.provider_calls().0, 2);
}

#[tokio::test]
async fn a_backward_clock_step_does_not_shorten_the_settle_delay_either() {
    // Stepped back, the ledger's clock holds "absent" off longer than the
    // delay (by the step): never shorter, and the operation still resolves.
    let (app, clock) = app_with_read_back().await;
    app.mock.provider.set_faults(Faults {
        fail_status_times: 1,
        fail_status: 504,
        ..Default::default()
    });
    assert_eq!(app.charge("back", BODY).await.status(), 502);
    app.gw.state.ledger.shift_clock(-2_000).await.unwrap();
    // 2 s passed: the delay is over on the monotonic clock, but the
    // ledger's clock is where the window began.
    clock.advance(2_000);
    assert_eq!(steps_for(&app.tick().await, "back"), vec![&Step::Settling]);
    assert_eq!(app.provider_calls().0, 1);
    clock.advance(1_000);
    assert_eq!(
        steps_for(&app.tick().await, "back"),
        vec![&Step::Retried(Some(effectgate::ledger::State::Completed))]
    );
    assert_eq!(app.op_json("back").await["attempts"], 2);
    assert_eq!(app.mock.provider.effects(), 1);
}
