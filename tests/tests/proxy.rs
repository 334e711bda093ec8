//! End-to-end tests of the proxy path on real sockets.

use effectgate_tests::*;
use serde_json::Value;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

fn states(op: &Value) -> Vec<(String, String)> {
    op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["from_state"].as_str().unwrap_or("-").to_owned(),
                t["to_state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn first_call_applies_one_effect_and_records_three_transitions() {
    let app = spawn_app().await;
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let before = now_ms();
    let r = app.charge("k1", BODY).await;
    let after = now_ms();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("idempotent-replayed").is_none());
    let charge: Value = r.json().await.unwrap();
    assert_eq!(charge["amount"], 100);
    assert_eq!(app.mock.provider.effects(), 1);

    let op = app.op_json("k1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 1);
    assert_eq!(op["response_status"], 200);
    assert_eq!(
        states(&op),
        vec![
            ("-".into(), "RESERVED".into()),
            ("RESERVED".into(), "EXECUTING".into()),
            ("EXECUTING".into(), "COMPLETED".into())
        ]
    );
    // The provider saw the derived provider key, not the caller's key.
    let seen = app.mock.provider.requests();
    let key = seen[0]
        .headers
        .iter()
        .find(|(n, _)| n == "idempotency-key")
        .map(|(_, v)| v.clone());
    assert_eq!(key.as_deref(), op["provider_key"].as_str());
    assert_ne!(key.as_deref(), Some("k1"));
    // `eg_`, the reservation time (ms, 11 hex digits), 21 hex digits.
    let key = key.unwrap();
    assert_eq!(key.len(), 35, "{key}");
    let at = i64::from_str_radix(&key[3..14], 16).unwrap();
    assert!(
        (before..=after).contains(&at),
        "{before} <= {at} <= {after}"
    );
    assert!(key[14..].bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
}

#[tokio::test]
async fn non_ascii_header_values_reach_the_provider_byte_for_byte() {
    let app = spawn_app().await;
    let r = app
        .charge_with(
            "k-utf8",
            BODY,
            &[("x-note", "café ☕"), ("x-note", "plain")],
        )
        .await;
    assert_eq!(r.status(), 200);
    let seen = app.mock.provider.requests();
    assert_eq!(seen.len(), 1);
    let notes: Vec<&str> = seen[0]
        .headers
        .iter()
        .filter(|(n, _)| n == "x-note")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(notes, vec!["café ☕", "plain"]);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn duplicate_is_replayed_without_a_provider_call() {
    let app = spawn_app().await;
    let first = app.charge("k1", BODY).await;
    let first_status = first.status();
    let first_type = first.headers()["content-type"].clone();
    let first_body = first.text().await.unwrap();
    let dup = app.charge("k1", BODY).await;
    assert_eq!(dup.status(), first_status);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.headers()["content-type"], first_type);
    assert_eq!(dup.text().await.unwrap(), first_body);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.mock.provider.requests().len(), 1);
}

#[tokio::test]
async fn same_key_other_body_is_422_and_leaves_the_original_untouched() {
    let app = spawn_app().await;
    assert_eq!(app.charge("k1", BODY).await.status(), 200);
    let before = app.op_json("k1").await;
    let r = app
        .charge("k1", r#"{"amount":10000,"currency":"eur"}"#)
        .await;
    assert_eq!(r.status(), 422);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:idempotency-key-reused");
    assert_eq!(p["field"], "header:Idempotency-Key");
    let after = app.op_json("k1").await;
    assert_eq!(
        before, after,
        "a rejected duplicate must not change the original row"
    );
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn reordered_json_with_other_whitespace_is_a_replay() {
    let app = spawn_app().await;
    assert_eq!(
        app.charge("k1", r#"{"amount":100,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    let r = app
        .charge("k1", "{ \"currency\": \"eur\",\n  \"amount\": 100 }")
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_requests_with_one_key_make_one_effect() {
    let app = spawn_app().await;
    let futs = (0..50).map(|_| app.charge("same", BODY));
    let responses = futures_util::future::join_all(futs).await;
    let mut originals = 0;
    let mut replays = 0;
    let mut conflicts = 0;
    for r in responses {
        match (
            r.status().as_u16(),
            r.headers().get("idempotent-replayed").is_some(),
        ) {
            (200, false) => originals += 1,
            (200, true) => replays += 1,
            (409, _) => {
                assert!(r.headers().get("retry-after").is_some());
                conflicts += 1
            }
            (s, _) => panic!("unexpected status {s}: {}", r.text().await.unwrap()),
        }
    }
    assert_eq!(originals, 1, "exactly one original");
    assert_eq!(originals + replays + conflicts, 50);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.mock.provider.requests().len(), 1);
}

#[tokio::test]
async fn bad_input_gets_a_problem_naming_the_field() {
    let app = spawn_app().await;
    let url = app.proxy("/pay/v1/charges");
    let post = || {
        app.http
            .post(&url)
            .header("Content-Type", "application/json")
            .body(BODY)
    };

    let r = post().bearer_auth(KEY_A).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:idempotency-key-missing");
    assert_eq!(p["field"], "header:Idempotency-Key");

    let r = post()
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "x".repeat(256))
        .header("Content-Type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = post()
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "x".repeat(255))
        .header("Content-Type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let r = post()
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "a")
        .header("Content-Type", "application/json")
        .header("Idempotency-Key", "b")
        .header("Content-Type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:idempotency-key-invalid");

    let big = format!(r#"{{"amount":100,"pad":"{}"}}"#, "x".repeat(5000));
    let r = app
        .http
        .post(&url)
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "big")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["limit_bytes"], 4096);
    assert_eq!(
        p["detail"],
        "request body exceeds the route's max_body_bytes of 4096 bytes"
    );

    let r = app
        .http
        .post(app.proxy("/nowhere/x"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let r = post()
        .bearer_auth("wrong-key")
        .header("Idempotency-Key", "w")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let r = post().header("Idempotency-Key", "w").send().await.unwrap();
    assert_eq!(r.status(), 401);

    // None of the rejected requests reached the provider or the ledger.
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.operation(ADMIN_A, "a", "big").await.status(), 404);
}

#[tokio::test]
async fn reply_lost_after_the_effect_is_unknown_and_never_re_executed() {
    let app = spawn_app().await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "lost")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "drop-after-effect")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let p: Value = r.json().await.unwrap();
    assert_eq!(
        p["type"],
        "urn:effectgate:problem:operation-outcome-unknown"
    );
    assert_eq!(p["operation_id"], "lost");
    assert_eq!(app.op_json("lost").await["state"], "UNKNOWN");

    let dup = app.charge("lost", BODY).await;
    assert_eq!(dup.status(), 409);
    let p: Value = dup.json().await.unwrap();
    assert_eq!(
        p["type"],
        "urn:effectgate:problem:operation-outcome-unknown"
    );
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(
        app.mock.provider.requests().len(),
        1,
        "the duplicate must not reach the provider"
    );
}

#[tokio::test]
async fn provider_5xx_is_unknown_not_a_stored_final_answer() {
    let app = spawn_app().await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "gw504")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "status:504")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let op = app.op_json("gw504").await;
    assert_eq!(op["state"], "UNKNOWN");
    assert_eq!(op["error_kind"], "provider-5xx");
    assert_eq!(app.charge("gw504", BODY).await.status(), 409);
    assert_eq!(app.mock.provider.requests().len(), 1);
}

#[tokio::test]
async fn response_timeout_after_send_is_unknown() {
    let app = spawn_with(Opts {
        route_extra: String::new(),
        ..Default::default()
    })
    .await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "slow")
        .header("Content-Type", "application/json")
        .header("X-Mock-Delay-Ms", "5000")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    let op = app.op_json("slow").await;
    assert_eq!(op["state"], "UNKNOWN");
    assert_eq!(op["error_kind"], "timeout");
}

#[tokio::test]
async fn tenants_are_isolated() {
    let app = spawn_app().await;
    assert_eq!(app.charge_as(KEY_A, "order-1", BODY).await.status(), 200);
    let rb = app
        .charge_as(KEY_B, "order-1", r#"{"amount":5,"currency":"usd"}"#)
        .await;
    assert_eq!(
        rb.status(),
        200,
        "B's key is its own operation, not a 422 or A's replay"
    );
    assert!(rb.headers().get("idempotent-replayed").is_none());
    let cb: Value = rb.json().await.unwrap();
    assert_eq!(cb["amount"], 5);
    assert_eq!(app.mock.provider.effects(), 2);

    let a = app.op_json("order-1").await;
    let b: Value = app
        .operation(ADMIN_B, "b", "order-1")
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(
        a["provider_key"], b["provider_key"],
        "provider keys must not collide across tenants"
    );
    // A's admin can't read B's operations: 404, not 403.
    assert_eq!(app.operation(ADMIN_A, "b", "order-1").await.status(), 404);
    let r = app
        .http
        .get(app.admin("/admin/tenants/b/operations"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // A client key can't use the admin API.
    assert_eq!(app.operation(KEY_A, "a", "order-1").await.status(), 403);
    // An admin key can't send proxy calls.
    assert_eq!(app.charge_as(ADMIN_A, "x", BODY).await.status(), 403);
}

#[tokio::test]
async fn the_ledger_survives_a_restart() {
    let app = spawn_app().await;
    let first = app.charge("durable", BODY).await.text().await.unwrap();
    let app = app.restart().await;
    let dup = app.charge("durable", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.text().await.unwrap(), first);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn provider_credentials_are_injected_and_the_gateway_key_never_forwarded() {
    let app = spawn_app().await;
    app.charge("cred", BODY).await;
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges?client_ref=x"))
        .bearer_auth(KEY_A)
        .header("Connection", "keep-alive, x-hop")
        .header("X-Hop", "secret-hop")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = app.mock.provider.requests();
    assert_eq!(seen.len(), 2);
    for req in &seen {
        let auth: Vec<_> = req
            .headers
            .iter()
            .filter(|(n, _)| n == "authorization")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(auth, vec![format!("Bearer {PROVIDER_SECRET}").as_str()]);
        assert!(
            req.headers.iter().all(|(_, v)| !v.contains(KEY_A)),
            "gateway key leaked: {:?}",
            req.headers
        );
        assert!(req.headers.iter().any(|(n, _)| n == "x-forwarded-for"));
        assert!(
            req.headers.iter().all(|(n, _)| n != "x-hop"),
            "header named in Connection must be stripped"
        );
    }
}

#[tokio::test]
async fn non_effectful_requests_pass_through_without_the_ledger() {
    let app = spawn_app().await;
    app.charge("k1", r#"{"amount":1,"currency":"eur","client_ref":"r1"}"#)
        .await;
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges?client_ref=r1"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    let list: Value = app
        .http
        .get(app.admin("/admin/tenants/a/operations"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        list["operations"].as_array().unwrap().len(),
        1,
        "the GET is not in the ledger"
    );
}

#[tokio::test]
async fn transient_503s_are_retried_with_the_same_provider_key() {
    let app = spawn_with(Opts {
        route_extra: "retry = { max_attempts = 3, base_delay_ms = 1, max_delay_ms = 5 }".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "flaky")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "fail-503:2")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(app.mock.provider.effects(), 1);
    let op = app.op_json("flaky").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["attempts"], 3);
    let log: Vec<&str> = op["attempts_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(log, vec!["status-503", "status-503", "status-200"]);
    let keys: Vec<String> = app
        .mock
        .provider
        .requests()
        .iter()
        .map(|r| {
            r.headers
                .iter()
                .find(|(n, _)| n == "idempotency-key")
                .unwrap()
                .1
                .clone()
        })
        .collect();
    assert_eq!(keys.len(), 3);
    assert!(
        keys.iter()
            .all(|k| k == op["provider_key"].as_str().unwrap()),
        "{keys:?}"
    );
}

#[tokio::test]
async fn exhausted_retries_end_failed_with_the_last_answer() {
    let app = spawn_with(Opts {
        route_extra: "retry = { max_attempts = 2, base_delay_ms = 1, max_delay_ms = 2 }".into(),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 10,
        ..Default::default()
    });
    let r = app.charge("down", BODY).await;
    assert_eq!(r.status(), 503);
    let op = app.op_json("down").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["error_kind"], "retries-exhausted");
    assert_eq!(op["attempts"], 2);
    assert_eq!(op["dead_letter_reason"], "retries-exhausted");
    assert_eq!(
        TestApp::last_reason(&op),
        "retries exhausted: provider answered 503"
    );
    assert_eq!(
        op["operator_check"].as_str().unwrap(),
        format!(
            "Every attempt failed with a transient error (last: status 503); the provider reported no effect. \
             Check the provider's health, and that no effect exists for provider key {}, before requeueing.",
            op["provider_key"].as_str().unwrap()
        )
    );
    assert_eq!(app.mock.provider.effects(), 0);
}

#[tokio::test]
async fn a_retry_after_past_the_routes_limit_ends_the_retries_with_its_own_reason() {
    // Three attempts allowed, but the provider asks for 30 s, more than
    // the route honours (10 s): one attempt, and the dead letter says why
    // it stopped early rather than "retries exhausted".
    let app = spawn_with(Opts {
        route_extra: "retry = { max_attempts = 3, base_delay_ms = 1, max_delay_ms = 2, max_retry_after_ms = 10000 }".into(),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 10,
        retry_after_s: Some(30),
        ..Default::default()
    });
    let r = app.charge("later", BODY).await;
    assert_eq!(r.status(), 503);
    assert_eq!(app.provider_calls().0, 1, "no retry was sent");
    let op = app.op_json("later").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["attempts"], 1);
    assert_eq!(op["error_kind"], "retry-after-too-long");
    assert_eq!(op["dead_letter"], true);
    assert_eq!(op["dead_letter_reason"], "retry-after-too-long");
    assert_eq!(
        TestApp::last_reason(&op),
        "retries stopped: the provider asked to wait 30000 ms (Retry-After), more than retry.max_retry_after_ms (10000 ms)"
    );
    assert_eq!(
        op["operator_check"].as_str().unwrap(),
        format!(
            "The provider answered with a transient error (status 503) and asked to wait 30000 ms (Retry-After) before another attempt, \
             longer than the route's retry.max_retry_after_ms (10000 ms); it reported no effect. After that time, check that \
             no effect exists for provider key {}, then requeue.",
            op["provider_key"].as_str().unwrap()
        )
    );
    assert_eq!(app.mock.provider.effects(), 0);

    // A wait the route honours is still retried (and exhausts as before).
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 10,
        retry_after_s: Some(0),
        ..Default::default()
    });
    let r = app.charge("soon", BODY).await;
    assert_eq!(r.status(), 503);
    let op = app.op_json("soon").await;
    assert_eq!(op["attempts"], 3);
    assert_eq!(op["dead_letter_reason"], "retries-exhausted");
}

#[tokio::test]
async fn permanent_failure_is_failed_once_and_replayed() {
    let app = spawn_app().await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "declined")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "status:402")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 402);
    let body = r.text().await.unwrap();
    let op = app.op_json("declined").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["attempts"], 1);
    let dup = app.charge("declined", BODY).await;
    assert_eq!(dup.status(), 402);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.text().await.unwrap(), body);
    assert_eq!(app.mock.provider.requests().len(), 1);
}

#[tokio::test]
async fn a_response_over_the_stored_limit_reaches_the_caller_but_is_not_stored() {
    let app = spawn_with(Opts {
        route_extra: "max_stored_response_bytes = 16".into(),
        ..Default::default()
    })
    .await;
    let r = app.charge("large", BODY).await;
    assert_eq!(r.status(), 200);
    // Streamed to the caller whole; the provider sent it with a
    // Content-Length, which is what the ledger records as its size.
    let text = r.text().await.unwrap();
    let sent_length = text.len();
    let full: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(full["amount"], 100, "the first caller gets the whole body");
    let op = app.op_json("large").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["response_body_omitted"], true);
    assert_eq!(op["response_body"], Value::Null);
    // The size is the provider's Content-Length.
    assert_eq!(op["response_body_bytes"], sent_length, "{op}");
    let dup = app.charge("large", BODY).await;
    assert_eq!(dup.status(), 200, "the replay keeps the original status");
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(
        dup.headers()["effectgate-stored-body"],
        format!("omitted; size={sent_length}").as_str()
    );
    assert_eq!(dup.text().await.unwrap(), "");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// A 2xx whose body breaks off (the provider sends 10 bytes of a longer
/// `Content-Length`, then closes) reaches the caller broken as well: the
/// status and what arrived, then no end to the body, never a shorter body
/// that looks whole. The effect happened: COMPLETED, the body recorded as
/// lost; a duplicate gets the status with `effectgate-stored-body: omitted`
/// and the provider is not called again.
#[tokio::test]
async fn a_success_whose_body_breaks_off_reaches_the_caller_broken() {
    let app = spawn_app().await;
    let r = app
        .charge_with("cut", BODY, &[("X-Mock-Fault", "cut-body-after-effect")])
        .await;
    assert_eq!(r.status(), 200);
    let body = r.bytes().await;
    assert!(body.is_err(), "the caller must see the break: {body:?}");
    let op = app.op_json("cut").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    assert_eq!(op["error_kind"], "response-body-lost", "{op}");
    assert_eq!(op["response_body_omitted"], true, "{op}");
    let dup = app.charge("cut", BODY).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert!(
        dup.headers()["effectgate-stored-body"]
            .to_str()
            .unwrap()
            .starts_with("omitted"),
        "{:?}",
        dup.headers()
    );
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(app.mock.provider.requests().len(), 1);
}

/// A 2xx whose body stalls past the route's response timeout reaches the
/// caller with the bytes that arrived before the stall, then the break:
/// they are not dropped with the read that timed out.
#[tokio::test]
async fn a_success_whose_body_stalls_reaches_the_caller_with_what_arrived() {
    let app = spawn_with(Opts {
        more: "[[routes]]\nname = \"slow\"\nprefix = \"/slow/\"\nupstream = \"$MOCK_URL\"\n\
               response_timeout_ms = 500\n"
            .into(),
        ..Default::default()
    })
    .await;
    let mut r = app
        .http
        .post(app.proxy("/slow/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "stall")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "stall-body-after-effect")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = Vec::new();
    let end = loop {
        match r.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    assert!(end.is_err(), "the caller must see the break");
    assert_eq!(got, br#"{"id":"ch_"#, "what arrived before the stall");
    let op = app.op_json("stall").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    assert_eq!(op["error_kind"], "response-body-lost", "{op}");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// A provider that answers `101 Switching Protocols` to a request that
/// asked for no upgrade has broken HTTP after the request reached it: the
/// outcome is unknown (502 to the caller, UNKNOWN in the ledger), never a
/// stored 101 replayed to every duplicate on a connection that then dies.
#[tokio::test]
async fn a_101_the_gateway_never_asked_for_leaves_the_outcome_unknown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                let _ = s.shutdown().await;
            });
        }
    });
    let app = spawn_with(Opts {
        more: format!(
            "[[routes]]\nname = \"odd\"\nprefix = \"/odd/\"\nupstream = \"http://{addr}\"\n"
        ),
        ..Default::default()
    })
    .await;
    let r = app
        .http
        .post(app.proxy("/odd/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "switch")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let p: Value = r.json().await.unwrap();
    assert_eq!(
        p["type"], "urn:effectgate:problem:operation-outcome-unknown",
        "{p}"
    );
    let op = app.op_json("switch").await;
    assert_eq!(op["state"], "UNKNOWN", "{op}");
    assert_eq!(op["error_kind"], "provider-protocol", "{op}");
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn connect_refused_is_retried_then_failed_without_an_effect() {
    let more = r#"
[[routes]]
name = "dead"
prefix = "/dead/"
upstream = "http://127.0.0.1:9"
retry = { max_attempts = 2, base_delay_ms = 1, max_delay_ms = 2 }
"#;
    let app = spawn_with(Opts {
        more: more.into(),
        ..Default::default()
    })
    .await;
    let r = app
        .http
        .post(app.proxy("/dead/x"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "d1")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let op = app.op_json("d1").await;
    assert_eq!(op["state"], "FAILED");
    assert_eq!(op["attempts"], 2);
    let log: Vec<&str> = op["attempts_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(log, vec!["connect-failed", "connect-failed"]);
}

#[tokio::test]
async fn admin_lists_by_state_and_rejects_bad_parameters() {
    let app = spawn_app().await;
    app.charge("ok", BODY).await;
    app.http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "lost")
        .header("Content-Type", "application/json")
        .header("X-Mock-Fault", "drop-after-effect")
        .body(BODY)
        .send()
        .await
        .unwrap();
    let list = |q: &'static str| {
        let url = app.admin(&format!("/admin/tenants/a/operations{q}"));
        let http = app.http.clone();
        async move { http.get(url).bearer_auth(ADMIN_A).send().await.unwrap() }
    };
    let v: Value = list("?state=UNKNOWN").await.json().await.unwrap();
    let ids: Vec<&str> = v["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["operation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["lost"]);
    let r = list("?state=BOGUS").await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "query:state");
    assert_eq!(list("?limit=0").await.status(), 400);
    assert_eq!(
        app.http
            .get(app.admin("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        app.http
            .get(app.admin("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn unusual_methods_are_effectful_and_trace_is_never_forwarded() {
    let more = r#"
[[routes]]
name = "any"
prefix = "/any/"
upstream = "UPSTREAM"
"#;
    let app = spawn_app().await;
    // /pay/ names only POST as effectful; a default route treats every
    // method but GET/HEAD/OPTIONS as effectful.
    let app2 = spawn_with(Opts {
        more: more.replace("UPSTREAM", &app.mock.url()),
        ..Default::default()
    })
    .await;
    let purge = reqwest::Method::from_bytes(b"PURGE").unwrap();
    let r = app2
        .http
        .request(purge, app2.proxy("/any/v1/thing"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "PURGE needs an Idempotency-Key");
    let r = app2
        .http
        .request(reqwest::Method::TRACE, app2.proxy("/any/v1/thing"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:method-not-allowed");
    assert_eq!(app2.mock.provider.requests().len(), 0);
}

#[tokio::test]
async fn dot_segments_and_forged_forwarding_headers_are_refused() {
    let app = spawn_app().await;
    for path in ["/pay/../admin/x", "/pay/v1/%2e%2e/x", "/pay/v1/a%2Fb"] {
        // Raw, so no client normalises the path first.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
            .await
            .unwrap();
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 400"), "{path}: {resp}");
    }
    assert_eq!(app.mock.provider.requests().len(), 0);
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges?client_ref=x"))
        .bearer_auth(KEY_A)
        .header("X-Forwarded-For", "6.6.6.6")
        .header("Forwarded", "for=6.6.6.6")
        .header("X-Real-IP", "6.6.6.6")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = &app.mock.provider.requests()[0];
    assert!(
        seen.headers.iter().all(|(_, v)| !v.contains("6.6.6.6")),
        "{:?}",
        seen.headers
    );
    assert_eq!(
        seen.headers
            .iter()
            .find(|(n, _)| n == "x-forwarded-for")
            .unwrap()
            .1,
        "127.0.0.1"
    );
    // Oversized headers: 431.
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("X-Big", "x".repeat(70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    // The admin listener holds the same limit, with the same answer.
    let r = app
        .http
        .get(app.admin("/healthz"))
        .header("X-Big", "x".repeat(70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    assert_eq!(
        r.headers()["content-type"],
        "application/problem+json",
        "admin 431"
    );
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:headers-too-large", "{p}");
}

#[tokio::test]
async fn the_media_type_is_part_of_the_fingerprint_and_rejected_reuse_records_nothing() {
    let app = spawn_app().await;
    assert_eq!(app.charge("mt", BODY).await.status(), 200);
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "mt")
        .header("Content-Type", "text/plain")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
}

#[tokio::test]
async fn a_json_body_that_repeats_a_key_is_refused() {
    let app = spawn_app().await;
    let r = app
        .charge(
            "dup",
            r#"{"amount":99999999,"currency":"eur","amount":150}"#,
        )
        .await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "body");
    assert_eq!(app.mock.provider.requests().len(), 0);
    assert_eq!(app.operation(ADMIN_A, "a", "dup").await.status(), 404);
    let r = app
        .http
        .post(app.proxy("/approvals/apr_x"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
}

/// Polls `probe` until it answers `want`, for at most 5 s.
async fn until_status<F, Fut>(what: &str, want: u16, probe: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = u16>,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let got = probe().await;
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: still {got}, not {want}"
        );
        tokio::task::yield_now().await;
    }
}

/// A caller that hangs up while its call waits for the ledger (another
/// writer holds the SQLite file's write lock) drops only its own wait:
/// once the ledger frees up the call is reserved, forwarded once and
/// recorded, and the caller's retry with the same key is its replay. (A
/// call dropped there half-way would lose a reservation or claim queued
/// for the commit, or leave a claimed operation unrun until its lease
/// ends.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_hangs_up_while_the_ledger_is_busy_still_gets_its_call_carried_out_once() {
    use sqlx::Connection;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = spawn_with(Opts {
        tenant_a: "max_in_flight = 1".into(),
        ..Default::default()
    })
    .await;
    // Tenant a's one in-flight slot, probed without holding it: an
    // effectful call without a key is 400 once it has the slot, 429 while
    // another call holds it.
    let probe = || async {
        app.http
            .post(app.proxy("/pay/v1/charges"))
            .bearer_auth(KEY_A)
            .header("Content-Type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(probe().await, 400);

    let mut blocker = sqlx::SqliteConnection::connect(&format!("sqlite://{}", app.db.display()))
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let body = r#"{"amount":7}"#;
    let request = format!(
        "POST /pay/v1/charges HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY_A}\r\n\
         Idempotency-Key: hung-up\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // The caller's call takes the slot unless a probe holds it at that
    // moment; then the caller is answered 429 at once (nothing reserved)
    // and sends again on a new connection.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut caller = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    caller.write_all(request.as_bytes()).await.unwrap();
    loop {
        let got = probe().await;
        if got == 429 {
            break;
        }
        let mut answer = [0u8; 64];
        if let Ok(mut n) = caller.try_read(&mut answer) {
            // The status line, whole.
            while n > 0 && n < 12 {
                match caller.read(&mut answer[n..]).await.unwrap() {
                    0 => break,
                    more => n += more,
                }
            }
            let head = String::from_utf8_lossy(&answer[..n]).into_owned();
            assert!(
                head.starts_with("HTTP/1.1 429"),
                "the caller was answered while the ledger is held: {head}"
            );
            caller = tokio::net::TcpStream::connect(app.gw.proxy_addr)
                .await
                .unwrap();
            caller.write_all(request.as_bytes()).await.unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the call waits for the ledger: still {got}, not 429"
        );
        tokio::task::yield_now().await;
    }
    drop(caller);
    until_status("the gateway saw the hang-up", 400, probe).await;
    assert!(
        app.mock.provider.requests().is_empty(),
        "nothing is forwarded while the ledger is held"
    );

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut blocker)
        .await
        .unwrap();
    drop(blocker);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = app.operation(ADMIN_A, "a", "hung-up").await;
        if r.status() == 200 {
            let op: Value = r.json().await.unwrap();
            if op["state"] == "COMPLETED" {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the call of the caller that hung up was never carried out"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(app.provider_calls().0, 1, "forwarded once");
    let again = app.charge("hung-up", body).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(app.provider_calls().0, 1, "the retry is a replay");
}

/// The proxy listener remembers the principal of a connection's last
/// `Authorization` for one settings snapshot: another key on the same
/// keep-alive connection is its own tenant's, and a reload that revokes a
/// key refuses that connection's next call with it.
#[tokio::test]
async fn a_connection_that_changes_keys_or_outlives_a_revocation_is_judged_afresh() {
    let app = spawn_app().await;
    // One client, one call at a time: every call rides the same connection.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let charge = |api_key: &'static str, key: &'static str| {
        http.post(app.proxy("/pay/v1/charges"))
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(BODY)
            .send()
    };
    let r = charge(KEY_A, "same").await.unwrap();
    assert_eq!(r.status(), 200);
    // Tenant b's `same` is another operation than tenant a's: a fresh
    // effect, not a replay of a's.
    let r = charge(KEY_B, "same").await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("idempotent-replayed").is_none());
    assert_eq!(app.mock.provider.effects(), 2);
    let r = charge(KEY_A, "same").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");

    // Tenant a's client key revoked (its digest replaced) by a reload.
    let digest = |k: &str| -> String {
        effectgate::config::key_digest(k)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let revoked = text.replace(&digest(KEY_A), &digest("a-new-client-key"));
    assert_ne!(revoked, text);
    std::fs::write(&path, revoked).unwrap();
    app.gw.state.reload(None).await.unwrap();
    let r = charge(KEY_A, "after-revocation").await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(app.mock.provider.effects(), 2);
    let r = charge(KEY_B, "b-after-reload").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(app.mock.provider.effects(), 3);
}

/// Sends a POST of `len` declared bytes to `path` on `app`'s proxy as
/// raw bytes: the head (with `Connection: close` when `ask_close`), then
/// each of `parts` in its own write; with `close` the sending side is shut
/// after them. Returns the status line's
/// text, the answer's headers (lower case) and its body as JSON (`Null`
/// when it isn't), read until the gateway closes (at most 20 s).
async fn raw_post(
    app: &TestApp,
    path: &str,
    len: usize,
    parts: &[&str],
    (ask_close, close): (bool, bool),
) -> (String, String, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\n{}\r\n",
        if ask_close {
            "Connection: close\r\n"
        } else {
            ""
        }
    );
    s.write_all(head.as_bytes()).await.unwrap();
    for part in parts {
        s.write_all(part.as_bytes()).await.unwrap();
        s.flush().await.unwrap();
    }
    if close {
        s.shutdown().await.unwrap();
    }
    let mut resp = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        s.read_to_string(&mut resp),
    )
    .await
    .expect("the gateway answers and closes")
    .unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    let json = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, head.to_ascii_lowercase(), json)
}

/// A pass-through body of a declared length reaches the provider whole,
/// in one request with its head or in parts; one whose bytes don't come
/// within the route's `response_timeout_ms` is a 408 naming `body` with
/// the limit, the connection closed, and nothing sent to the provider;
/// one that starts and then stalls is the same 408, and one that breaks
/// off a 400 naming `body`: the caller's doing, never a 502 naming the
/// provider.
#[tokio::test]
async fn a_pass_through_body_is_forwarded_whole_and_a_stalled_one_is_refused() {
    let app = spawn_with(Opts {
        more: "[[routes]]\nname = \"direct\"\nprefix = \"/direct/\"\nupstream = \"$MOCK_URL\"\n\
               effectful_methods = []\nresponse_timeout_ms = 300\n\
               inject_headers = [{ name = \"Authorization\", value_env = \"MOCK_PROVIDER_SECRET\", prefix = \"Bearer \" }]\n"
            .into(),
        ..Default::default()
    })
    .await;
    let path = "/direct/v1/charges";
    let r = app
        .http
        .post(app.proxy(path))
        .bearer_auth(KEY_A)
        .header("content-type", "application/json")
        .body(r#"{"amount":7,"currency":"eur"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].amount, 7);
    assert_eq!(app.mock.provider.requests().len(), 1);

    // A body sent in two parts reaches the provider whole.
    let (first, rest) = (r#"{"amount":8,"#, r#""currency":"eur"}"#);
    let (status, _, _) = raw_post(
        &app,
        path,
        first.len() + rest.len(),
        &[first, rest],
        (true, false),
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 2);
    assert_eq!(
        (&charges[1].amount, &charges[1].currency),
        (&8.into(), &"eur".into())
    );
    assert_eq!(app.mock.provider.requests().len(), 2);

    // No byte of the body: 408, and nothing sent.
    let (status, head, p) = raw_post(&app, path, 30, &[], (false, false)).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("nothing was recorded or sent"),
        "{p}"
    );
    assert_eq!(
        (&p["field"], &p["limit_ms"]),
        (&"body".into(), &300.into()),
        "{p}"
    );
    assert_eq!(
        app.mock.provider.requests().len(),
        2,
        "nothing more was sent"
    );

    // A body that starts and then breaks off (the caller closes its side)
    // is the caller's 400 naming body; one that starts and then stalls is
    // its 408. Neither is a 502 naming the provider, and neither charges.
    for (close, want) in [(true, "HTTP/1.1 400"), (false, "HTTP/1.1 408")] {
        let (status, _, p) = raw_post(&app, path, 30, &[r#"{"amount":9,"#], (false, close)).await;
        assert!(status.starts_with(want), "{status} {p}");
        assert_eq!(p["field"], "body", "{p}");
        if !close {
            // Its first part was forwarded: the detail says so.
            assert_eq!(p["limit_ms"], 300, "{p}");
            assert_eq!(p["type"], "urn:effectgate:problem:request-timeout", "{p}");
            assert!(
                p["detail"]
                    .as_str()
                    .unwrap()
                    .contains("the provider may have got part of it"),
                "{p}"
            );
        }
    }
    assert_eq!(app.mock.provider.charges().len(), 2);
}

/// Full duplex through the gateway: a provider that answers at once,
/// with more than the sockets hold, before it reads the upload; and a
/// caller that sends its whole upload before it reads any of the answer
/// (as most HTTP/1.1 clients do). The upload reaches the provider whole
/// while the answer waits, and then the caller reads the whole answer.
#[tokio::test]
async fn a_pass_through_upload_goes_on_while_an_early_answer_waits() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const UPLOAD: usize = 16 * 1024 * 1024;
    const ANSWER: usize = 16 * 1024 * 1024;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let provider = listener.local_addr().unwrap();
    let (got_tx, got) = tokio::sync::oneshot::channel::<usize>();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        let mut chunk = vec![0u8; 64 * 1024];
        let (buf, head_end) = read_head(&mut rd, &mut chunk, "the request head came").await;
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        assert!(
            head.contains(&format!("content-length: {UPLOAD}")),
            "{head}"
        );
        tokio::spawn(async move {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {ANSWER}\r\n\r\n");
            wr.write_all(head.as_bytes()).await.unwrap();
            wr.write_all(&vec![b'a'; ANSWER]).await.unwrap();
            std::future::pending::<()>().await;
        });
        let mut body = buf.len() - head_end;
        while body < UPLOAD {
            let k = rd.read(&mut chunk).await.unwrap();
            assert!(k > 0, "the upload broke off after {body} bytes");
            body += k;
        }
        let _ = got_tx.send(body);
    });
    let app = spawn_with(Opts {
        more: format!(
            "[[routes]]\nname = \"upload\"\nprefix = \"/upload/\"\n\
             upstream = \"http://{provider}\"\nmode = \"pass\"\n"
        ),
        ..Default::default()
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    let exchange = async {
        let head = format!(
            "POST /upload/v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\
             Content-Type: application/octet-stream\r\nContent-Length: {UPLOAD}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let piece = vec![b'u'; 64 * 1024];
        for _ in 0..UPLOAD / piece.len() {
            s.write_all(&piece).await.unwrap();
        }
        let sent = got.await.expect("the provider counted the upload");
        // Only now the answer: its head, then its body to the end.
        let mut chunk = vec![0u8; 64 * 1024];
        let (resp, head_end) = read_head(&mut s, &mut chunk, "the answer's head came").await;
        let head = String::from_utf8_lossy(&resp[..head_end]).to_string();
        let mut body = resp.len() - head_end;
        while body < ANSWER {
            let k = s.read(&mut chunk).await.unwrap();
            assert!(k > 0, "the answer broke off after {body} bytes");
            body += k;
        }
        (sent, head, body)
    };
    let (sent, head, body) = tokio::time::timeout(std::time::Duration::from_secs(60), exchange)
        .await
        .expect("the upload went on while the answer waited");
    assert_eq!(sent, UPLOAD);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, ANSWER);
}

/// Reads from `stream` until a head's blank line has come, in `chunk`
/// sized reads: what was read, and where the head ends in it. Panics
/// (naming `what`) when the stream ends first.
async fn read_head<R: tokio::io::AsyncRead + Unpin>(
    stream: &mut R,
    chunk: &mut [u8],
    what: &str,
) -> (Vec<u8>, usize) {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    loop {
        let k = stream.read(chunk).await.unwrap();
        assert!(k > 0, "{what}");
        buf.extend_from_slice(&chunk[..k]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return (buf, end + 4);
        }
    }
}
