//! Approvals bound to the exact intent, single use, expiry, tenancy, and
//! policy-governed replay.

use std::sync::Arc;

use effectgate::ledger::ManualClock;
use effectgate_tests::*;
use serde_json::Value;

const BIG: &str = r#"{"amount":5000,"currency":"eur"}"#;

fn threshold(config: &str) -> String {
    format!(
        "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {config}\n",
        policy_wasm("amount_threshold").display()
    )
}

async fn app_with(route_extra: &str, clock: Option<Arc<ManualClock>>) -> TestApp {
    spawn_with(Opts {
        route_extra: format!("effect_class = \"payment\"\n{route_extra}"),
        tenant_a: threshold("{ threshold = 1000 }"),
        tenant_b: threshold("{ threshold = 1000 }"),
        more: "[reconcile]\nenabled = false\n".into(),
        clock: clock.map(|c| c as Arc<dyn effectgate::ledger::Clock>),
        ..Default::default()
    })
    .await
}

async fn pending(app: &TestApp, key: &str, body: &str) -> String {
    let r = app.charge(key, body).await;
    assert_eq!(r.status(), 202);
    let loc = r.headers()["location"].to_str().unwrap().to_owned();
    let v: Value = r.json().await.unwrap();
    let id = v["approval_id"].as_str().unwrap().to_owned();
    assert_eq!(loc, format!("/approvals/{id}"));
    id
}

async fn decide(app: &TestApp, key: &str, tenant: &str, id: &str, what: &str) -> reqwest::Response {
    app.admin_post(
        key,
        &format!("/admin/tenants/{tenant}/approvals/{id}/{what}"),
        r#"{"comment":"checked with finance"}"#,
    )
    .await
}

#[tokio::test]
async fn an_approval_is_bound_to_the_arguments() {
    let app = app_with("", None).await;
    let id = pending(&app, "k1", BIG).await;
    // The caller polls with its own key.
    let poll: Value = app
        .http
        .get(app.proxy(&format!("/approvals/{id}")))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(poll["status"], "pending");
    assert_eq!(
        decide(&app, APPROVER_A, "a", &id, "approve").await.status(),
        200
    );

    // Same key, other arguments: 422; the approval doesn't carry over.
    let r = app
        .charge("k1", r#"{"amount":9000,"currency":"eur"}"#)
        .await;
    assert_eq!(r.status(), 422);
    // A new key with the same (approved) arguments needs its own approval.
    let other = pending(&app, "k2", BIG).await;
    assert_ne!(other, id);
    assert_eq!(
        app.mock.provider.effects(),
        0,
        "nothing ran without its own approval"
    );
    // The approved request itself runs once, and a re-send replays.
    assert_eq!(app.charge("k1", BIG).await.status(), 200);
    let again = app.charge("k1", BIG).await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 1);
    let op = app.op_json("k1").await;
    let reasons: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("approved by a:approver: checked with finance")),
        "{reasons:?}"
    );
    let poll: Value = app
        .http
        .get(app.proxy(&format!("/approvals/{id}")))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(poll["status"], "used");
}

/// Each answer on the approval path counts once in
/// `effectgate_requests_total`, under the outcome it gave: the first call
/// and a re-send while pending (`awaiting-approval`), the approved call
/// that executes (`forwarded`), and its replay.
#[tokio::test]
async fn every_answer_on_the_approval_path_is_counted_by_its_outcome() {
    // A route of its own: the recorder is process-wide, and the other
    // tests here count on "payments".
    let app = spawn_with(Opts {
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"held\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000 }}\n",
            policy_wasm("amount_threshold").display()
        ),
        more: "[reconcile]\nenabled = false\n[[routes]]\nname = \"held\"\nprefix = \"/held/\"\n\
               upstream = \"$MOCK_URL\"\neffectful_methods = [\"POST\"]\n\
               provider_idempotency_header = \"Idempotency-Key\"\neffect_class = \"payment\"\n\
               inject_headers = [{ name = \"Authorization\", value_env = \"MOCK_PROVIDER_SECRET\", prefix = \"Bearer \" }]\n"
            .into(),
        ..Default::default()
    })
    .await;
    let send = || {
        app.http
            .post(app.proxy("/held/v1/charges"))
            .bearer_auth(KEY_A)
            .header("Idempotency-Key", "h1")
            .header("Content-Type", "application/json")
            .body(BIG)
            .send()
    };
    let counts = |m: &str| {
        ["awaiting-approval", "forwarded", "replayed", "in-flight"].map(|o| {
            counter(
                m,
                "effectgate_requests_total",
                &["route=\"held\"", &format!("outcome=\"{o}\"")],
            )
        })
    };
    // The first call and a re-send while the approval is pending: 202 each.
    let r = send().await.unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["approval_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(send().await.unwrap().status(), 202);
    assert_eq!(counts(&app.metrics().await), [2.0, 0.0, 0.0, 0.0]);
    // Approved: the re-send executes (the provider sees it), then a replay.
    assert_eq!(
        decide(&app, APPROVER_A, "a", &id, "approve").await.status(),
        200
    );
    assert_eq!(send().await.unwrap().status(), 200);
    assert_eq!(app.mock.provider.effects(), 1);
    assert_eq!(counts(&app.metrics().await), [2.0, 1.0, 0.0, 0.0]);
    let r = send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(counts(&app.metrics().await), [2.0, 1.0, 1.0, 0.0]);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_approved_request_executes_once_under_20_concurrent_resends() {
    let app = app_with("", None).await;
    let id = pending(&app, "k", BIG).await;
    assert_eq!(
        decide(&app, APPROVER_A, "a", &id, "approve").await.status(),
        200
    );
    let responses = futures_util::future::join_all((0..20).map(|_| app.charge("k", BIG))).await;
    let mut originals = 0;
    for r in responses {
        match (
            r.status().as_u16(),
            r.headers().get("idempotent-replayed").is_some(),
        ) {
            (200, false) => originals += 1,
            (200, true) | (409, _) => {}
            (s, _) => panic!("unexpected {s}"),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn rejected_and_expired_approvals_fail_the_operation_for_good() {
    let clock = ManualClock::new(1_000_000_000);
    let app = app_with("approval_ttl_ms = 60000", Some(clock.clone())).await;
    let rejected = pending(&app, "rej", BIG).await;
    assert_eq!(
        decide(&app, APPROVER_A, "a", &rejected, "reject")
            .await
            .status(),
        200
    );
    let op = app.op_json("rej").await;
    assert_eq!(op["state"], "FAILED");
    assert!(
        op["error_detail"]
            .as_str()
            .unwrap()
            .contains("rejected by a:approver")
    );
    let r = app.charge("rej", BIG).await;
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:approval-rejected");
    // A rejected approval can never authorise anything again.
    assert_eq!(
        decide(&app, APPROVER_A, "a", &rejected, "approve")
            .await
            .status(),
        409
    );

    let expiring = pending(&app, "exp", BIG).await;
    clock.advance(60_000);
    // Past its expiry, before the reconciler's scan has marked it: refused
    // as expired.
    let r = decide(&app, APPROVER_A, "a", &expiring, "approve").await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.contains("expired at 1970-01-12T13:47:40.000Z"),
        "{p}"
    );
    app.tick().await;
    let op = app.op_json("exp").await;
    assert_eq!(op["state"], "FAILED");
    assert!(op["error_detail"].as_str().unwrap().contains("expired"));
    assert_eq!(
        decide(&app, APPROVER_A, "a", &expiring, "approve")
            .await
            .status(),
        409
    );
    let r = app.charge("exp", BIG).await;
    assert_eq!(r.status(), 403);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:approval-expired");
    assert_eq!(app.mock.provider.effects(), 0);
}

#[tokio::test]
async fn a_used_approval_cannot_authorise_another_operation() {
    let app = app_with("", None).await;
    let first = pending(&app, "one", BIG).await;
    let second = pending(&app, "two", BIG).await;
    assert_eq!(
        decide(&app, APPROVER_A, "a", &first, "approve")
            .await
            .status(),
        200
    );
    assert_eq!(app.charge("one", BIG).await.status(), 200);
    // Deciding the used approval again is refused, and "two" stays pending.
    assert_eq!(
        decide(&app, APPROVER_A, "a", &first, "approve")
            .await
            .status(),
        409
    );
    assert_eq!(app.charge("two", BIG).await.status(), 202);
    let v: Value = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{second}")))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "pending");
    assert_eq!(v["operation_id"], "two");
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn no_self_approval_and_no_cross_tenant_decisions() {
    let app = app_with("", None).await;
    let id = pending(&app, "mine", BIG).await;
    // The approver key whose principal is the requester: refused.
    assert_eq!(
        decide(&app, SELF_APPROVER_A, "a", &id, "approve")
            .await
            .status(),
        403
    );
    // Tenant b's approver can neither see nor decide a's approvals.
    let r = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{id}")))
        .bearer_auth(APPROVER_B)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        decide(&app, APPROVER_B, "a", &id, "approve").await.status(),
        404
    );
    assert_eq!(
        decide(&app, APPROVER_B, "b", &id, "approve").await.status(),
        404
    );
    // Tenant b's client can't poll it either.
    assert_eq!(
        app.http
            .get(app.proxy(&format!("/approvals/{id}")))
            .bearer_auth(KEY_B)
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // Only the approver role decides: an operator or a client can't.
    assert_eq!(
        decide(&app, OPERATOR_A, "a", &id, "approve").await.status(),
        403
    );
    assert_eq!(decide(&app, KEY_A, "a", &id, "approve").await.status(), 403);
    assert_eq!(app.charge("mine", BIG).await.status(), 202, "still pending");
}

#[tokio::test]
async fn a_route_can_execute_the_approved_request_itself() {
    let app = app_with("execute_on_approval = true", None).await;
    let id = pending(&app, "auto", BIG).await;
    assert_eq!(
        decide(&app, APPROVER_A, "a", &id, "approve").await.status(),
        200
    );
    // The caller polls by re-sending; the gateway ran the stored request.
    let mut status = 0;
    for _ in 0..200 {
        let r = app.charge("auto", BIG).await;
        status = r.status().as_u16();
        if status == 200 {
            assert_eq!(r.headers()["idempotent-replayed"], "true");
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(status, 200);
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].amount, 5000, "the approved body, byte for byte");
}

async fn completed(app: &TestApp, key: &str) {
    assert_eq!(
        app.charge(key, r#"{"amount":10,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
}

async fn replay(app: &TestApp, api_key: &str, id: &str, body: &str) -> reqwest::Response {
    app.admin_post(
        api_key,
        &format!("/admin/tenants/a/operations/{id}/replay"),
        body,
    )
    .await
}

fn replay_app(class: &str, tenant_a: String) -> Opts {
    Opts {
        route_extra: format!("effect_class = \"{class}\""),
        tenant_a,
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn replay_allow_serves_the_stored_result_unless_forced() {
    let app = spawn_with(replay_app("derived", String::new())).await;
    completed(&app, "d").await;
    let r = replay(&app, OPERATOR_A, "d", "{}").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["verdict"], "allow");
    assert_eq!(v["provider_called"], false);
    assert_eq!(app.provider_calls().0, 1);
    let r = replay(
        &app,
        OPERATOR_A,
        "d",
        r#"{"force":true,"reason":"rebuild the index"}"#,
    )
    .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["provider_called"], true);
    assert_eq!(app.provider_calls().0, 2);
    let op = app.op_json("d").await;
    assert_eq!(op["state"], "COMPLETED");
    let last = op["transitions"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        last["reason"]
            .as_str()
            .unwrap()
            .contains("forced replay by a:operator (audited)"),
        "{last}"
    );
    // A client key can never replay.
    assert_eq!(replay(&app, KEY_A, "d", "{}").await.status(), 403);
}

#[tokio::test]
async fn replay_same_operation_only_never_calls_the_provider_for_a_completed_operation() {
    let app = spawn_with(replay_app("payment", String::new())).await;
    completed(&app, "p").await;
    let v: Value = replay(&app, OPERATOR_A, "p", r#"{"force":true}"#)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["verdict"], "same-operation-only");
    assert_eq!(v["provider_called"], false, "force needs an allow verdict");
    assert_eq!(app.provider_calls().0, 1);
}

#[tokio::test]
async fn replay_revalidate_runs_evaluate_again() {
    // Permission changes: the replay proceeds only if the current policy allows.
    let app = spawn_with(replay_app("permission", threshold("{ threshold = 1000 }"))).await;
    completed(&app, "perm").await;
    let v: Value = replay(&app, OPERATOR_A, "perm", "{}")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["verdict"], "revalidate");
    assert_eq!(v["outcome"], "stored result stands");
    // Now the tenant's policy has tightened: the same request would need approval.
    let path = app.gw.state.settings().source.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("threshold = 1000", "threshold = 1")).unwrap();
    app.gw.state.reload(None).await.unwrap();
    let r = replay(&app, OPERATOR_A, "perm", "{}").await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert!(
        p["detail"].as_str().unwrap().contains("revalidation"),
        "{p}"
    );
}

#[tokio::test]
async fn replay_manual_creates_an_approval() {
    let app = spawn_with(replay_app("irreversible", String::new())).await;
    completed(&app, "irr").await;
    let r = replay(&app, OPERATOR_A, "irr", "{}").await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["verdict"], "manual");
    let id = v["approval_id"].as_str().unwrap();
    let a: Value = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{id}")))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["kind"], "replay");
    assert_eq!(a["status"], "pending");
    assert_eq!(
        decide(&app, APPROVER_A, "a", id, "approve").await.status(),
        200
    );
    let a: Value = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{id}")))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["status"], "used");
    assert_eq!(
        app.provider_calls().0,
        1,
        "a completed irreversible effect is not sent again"
    );
}

/// A replay asked of an operation that has not run yet (AWAITING_APPROVAL)
/// is refused before any replay approval is asked: the tenant's pending
/// approvals stay the one of the request itself, which still executes the
/// call once when approved.
#[tokio::test]
async fn a_replay_of_an_operation_awaiting_approval_is_refused_without_an_approval() {
    let app = spawn_with(replay_app(
        "irreversible",
        threshold("{ threshold = 1000 }"),
    ))
    .await;
    let request_approval = pending(&app, "wait", BIG).await;
    let r = replay(&app, OPERATOR_A, "wait", "{}").await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:conflict", "{p}");
    assert!(
        p["detail"].as_str().unwrap().contains("AWAITING_APPROVAL"),
        "{p}"
    );
    let list: Value = app
        .http
        .get(app.admin("/admin/tenants/a/approvals?status=pending"))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = list["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [request_approval.as_str()],
        "no replay approval was asked"
    );
    assert_eq!(app.provider_calls().0, 0);
    assert_eq!(
        decide(&app, APPROVER_A, "a", &request_approval, "approve")
            .await
            .status(),
        200
    );
    assert_eq!(app.charge("wait", BIG).await.status(), 200);
    assert_eq!(app.mock.provider.charges().len(), 1);
}

#[tokio::test]
async fn replay_deny_is_409_with_the_reason() {
    let matrix = format!(
        "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ overrides = {{ payment = \"deny\" }} }}\n",
        policy_wasm("replay_matrix").display()
    );
    let app = spawn_with(replay_app("payment", matrix)).await;
    completed(&app, "no").await;
    let r = replay(&app, OPERATOR_A, "no", "{}").await;
    assert_eq!(r.status(), 409);
    let p: Value = r.json().await.unwrap();
    assert!(
        p["detail"].as_str().unwrap().contains("replay denied"),
        "{p}"
    );
}

#[tokio::test]
async fn approval_events_reach_the_webhook_signed() {
    let rx = effectgate_tests::receiver::spawn_receiver().await;
    // SAFETY: set before the gateway reads its config; the value is the same in every test.
    unsafe { std::env::set_var("TEST_WEBHOOK_SECRET", "whsec_test") };
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        tenant_a: format!(
            "webhook = {{ url = \"{}\", secret_env = \"TEST_WEBHOOK_SECRET\" }}\n{}",
            rx.url,
            threshold("{ threshold = 1000 }")
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let id = pending(&app, "hooked", BIG).await;
    assert_eq!(
        decide(&app, APPROVER_A, "a", &id, "approve").await.status(),
        200
    );
    effectgate::workers::outbox::relay_once(&app.gw.state)
        .await
        .unwrap();
    let got = rx.got.lock().unwrap().clone();
    let types: Vec<String> = got
        .iter()
        .map(|d| d.json()["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(types, vec!["approval.created", "approval.approved"]);
    for d in &got {
        let sig = effectgate::workers::outbox::signature(b"whsec_test", &d.body);
        assert_eq!(
            d.header("effectgate-signature"),
            Some(sig.as_str()),
            "signature verifies"
        );
        assert_eq!(
            d.header("effectgate-event-id"),
            d.json()["event_id"].as_str()
        );
        assert_eq!(d.json()["data"]["approval_id"], id.as_str());
    }
    // Delivered events are not sent again.
    effectgate::workers::outbox::relay_once(&app.gw.state)
        .await
        .unwrap();
    assert_eq!(rx.got.lock().unwrap().len(), 2);
    assert_eq!(app.gw.state.ledger.pending_events().await.unwrap(), 0);
}

#[tokio::test]
async fn resolving_a_dead_letter_as_absent_needs_the_replay_verdict() {
    let app = spawn_with(replay_app("irreversible", String::new())).await;
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_503_times: 100,
        ..Default::default()
    });
    assert_eq!(
        app.charge("i1", r#"{"amount":10,"currency":"eur"}"#)
            .await
            .status(),
        503
    );
    let calls = app.provider_calls().0;
    let r = app
        .admin_post(
            ADMIN_A,
            "/admin/tenants/a/operations/i1/resolve",
            r#"{"outcome":"absent"}"#,
        )
        .await;
    assert_eq!(
        r.status(),
        409,
        "retries-exhausted did not lose track of an effect"
    );
    assert_eq!(app.provider_calls().0, calls, "nothing re-executed");
    // Asking twice for a manual replay gives the same pending approval.
    let a: Value = replay(&app, OPERATOR_A, "i1", "{}")
        .await
        .json()
        .await
        .unwrap();
    let b: Value = replay(&app, OPERATOR_A, "i1", "{}")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(a["approval_id"], b["approval_id"]);
}
