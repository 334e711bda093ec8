//! Compensation: a COMPLETED charge undone by its route's compensating
//! request as an operation of its own (`<id>#compensation`): once, fenced,
//! audited, policy-governed, read back when its reply is lost, replayed
//! to duplicates of the original with `Effectgate-Compensated: true`.

use std::time::{Duration, Instant};

use effectgate_tests::*;
use mock_provider::Faults;
use serde_json::Value;

const CHARGE: &str = r#"{"amount":100,"currency":"eur","client_ref":"c-1"}"#;

/// The payments route with a refund as its compensation.
fn refund_route(effect_class: &str, compensation_extra: &str) -> String {
    format!(
        r#"effect_class = "{effect_class}"
[routes.read_back]
path = "/v1/charges?idempotency_key={{provider_key}}"
found_pointer = "/data/0"
reference_pointer = "/id"
[routes.compensation]
method = "POST"
path = "/v1/refunds"
body = {{ charge = "{{reference}}", reason = "requested_by_customer" }}
read_back = {{ path = "/v1/refunds?charge={{reference}}", found_pointer = "/data/0", match = {{ "/charge" = "{{reference}}" }} }}
{compensation_extra}
"#
    )
}

async fn app(route_extra: String, tenant_a: String) -> TestApp {
    spawn_with(Opts {
        route_extra,
        tenant_a,
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await
}

fn gate(verdict: &str) -> String {
    format!(
        "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ compensate = \"{verdict}\" }}\n",
        policy_wasm("compensation_gate").display()
    )
}

async fn compensate(app: &TestApp, key: &str, id: &str) -> reqwest::Response {
    app.admin_post(
        key,
        &format!("/admin/tenants/a/operations/{id}/compensate"),
        r#"{"reason":"charged against policy"}"#,
    )
    .await
}

fn child(id: &str) -> String {
    format!("{id}%23compensation")
}

fn refunds(app: &TestApp) -> Vec<mock_provider::Refund> {
    app.mock.provider.refunds()
}

async fn until_compensated(app: &TestApp, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = app.op_json(id).await;
        if v["state"] == "COMPENSATED" {
            return v;
        }
        assert!(Instant::now() < deadline, "never COMPENSATED: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_compensation_refunds_once_and_the_charge_is_compensated() {
    let app = app(refund_route("payment", ""), String::new()).await;
    let first = app.charge("k1", CHARGE).await;
    assert_eq!(first.status(), 200);
    let original_body = first.text().await.unwrap();

    // A reason over `limits.max_reason_chars` (1024) is refused, not cut:
    // nothing is reserved or sent.
    let long = app
        .admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/k1/compensate",
            &format!(r#"{{"reason":"{}"}}"#, "x".repeat(1025)),
        )
        .await;
    assert_eq!(long.status(), 400);
    let p: Value = long.json().await.unwrap();
    assert_eq!(p["field"], "body.reason");
    assert_eq!(
        app.operation(ADMIN_A, "a", &child("k1")).await.status(),
        404
    );
    assert!(refunds(&app).is_empty());

    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "COMPENSATED");
    assert_eq!(v["compensation"]["operation_id"], "k1#compensation");
    assert_eq!(v["compensation"]["state"], "COMPLETED");

    // One refund at the provider, of this charge, with the compensation's
    // own provider key (not the charge's).
    let original = app.op_json("k1").await;
    let comp = app.op_json(&child("k1")).await;
    let rs = refunds(&app);
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0].charge, "ch_1");
    assert_eq!(rs[0].reason, "requested_by_customer");
    assert_eq!(
        rs[0].idempotency_key.as_deref(),
        comp["provider_key"].as_str()
    );
    assert_ne!(comp["provider_key"], original["provider_key"]);
    assert_eq!(comp["compensates"], "k1");
    assert_eq!(comp["route"], "payments#compensation");
    assert_eq!(comp["principal"], "a:operator");

    // The timeline: the request audited on the original, then COMPENSATED
    // naming the compensation, the operator and the reason.
    let ts = original["transitions"].as_array().unwrap();
    let n = ts.len();
    assert_eq!(ts[n - 2]["from_state"], "COMPLETED");
    assert_eq!(ts[n - 2]["to_state"], "COMPLETED");
    assert_eq!(ts[n - 2]["actor"], "a:operator");
    assert_eq!(ts[n - 1]["from_state"], "COMPLETED");
    assert_eq!(ts[n - 1]["to_state"], "COMPENSATED");
    assert_eq!(ts[n - 1]["actor"], "a:operator");
    let reason = ts[n - 1]["reason"].as_str().unwrap();
    assert!(
        reason.contains("k1#compensation") && reason.contains("charged against policy"),
        "{reason}"
    );
    assert_eq!(
        original["compensation"]["compensation_id"],
        "k1#compensation"
    );
    assert_eq!(original["compensation"]["requested_by"], "a:operator");
    assert_eq!(original["compensation"]["reference"], "ch_1");
    assert_eq!(original["compensation"]["state"], "COMPLETED");
    let cts: Vec<(Value, Value)> = comp["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["from_state"].clone(), t["to_state"].clone()))
        .collect();
    assert_eq!(
        cts,
        vec![
            (Value::Null, "RESERVED".into()),
            ("RESERVED".into(), "EXECUTING".into()),
            ("EXECUTING".into(), "COMPLETED".into()),
        ]
    );
    assert!(
        comp["transitions"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("compensation of operation k1 requested by a:operator"),
        "{}",
        comp["transitions"][0]
    );

    // Asking again is the same compensation: no second refund.
    let again = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(again.status(), 200);
    let v: Value = again.json().await.unwrap();
    assert_eq!(v["compensation"]["operation_id"], "k1#compensation");
    assert_eq!(refunds(&app).len(), 1);

    // A duplicate of the charge: the stored answer, marked compensated,
    // never executed again.
    let dup = app.charge("k1", CHARGE).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.headers()["effectgate-compensated"], "true");
    assert_eq!(
        dup.headers()["effectgate-compensation-id"],
        "k1#compensation"
    );
    assert_eq!(dup.text().await.unwrap(), original_body);
    assert_eq!(app.mock.provider.effects(), 1);
    // An operator's replay leaves it as it is.
    let replay = app
        .admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/k1/replay",
            r#"{"force":true,"reason":"try"}"#,
        )
        .await;
    assert_eq!(replay.status(), 200);
    let rv: Value = replay.json().await.unwrap();
    assert_eq!(rv["provider_called"], false, "{rv}");
    assert_eq!(app.mock.provider.effects(), 1);
    let metrics = app.metrics().await;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("effectgate_compensations_total{"))
        .unwrap_or_default();
    assert!(
        line.contains(r#"route="payments""#)
            && line.contains(r#"outcome="requested""#)
            && line.ends_with(" 1"),
        "{line}"
    );
}

#[tokio::test]
async fn twenty_concurrent_compensations_make_one_refund() {
    let app = app(refund_route("payment", ""), String::new()).await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    let calls = (0..20).map(|_| compensate(&app, OPERATOR_A, "k1"));
    let answers = futures_util::future::join_all(calls).await;
    for r in answers {
        let status = r.status();
        assert!(status == 200 || status == 202, "{status}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["compensation"]["operation_id"], "k1#compensation");
    }
    until_compensated(&app, "k1").await;
    assert_eq!(refunds(&app).len(), 1);
    let comp = app.op_json(&child("k1")).await;
    assert_eq!(comp["attempts"], 1);
}

#[tokio::test]
async fn a_lost_refund_reply_is_read_back_and_both_end_final() {
    let app = app(refund_route("payment", ""), String::new()).await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    app.mock.provider.set_faults(Faults {
        refund_drop_after_effect_times: 1,
        ..Faults::default()
    });
    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "COMPLETED");
    assert_eq!(v["compensation"]["state"], "UNKNOWN");
    assert_eq!(refunds(&app).len(), 1);
    // The reconciler reads the refund back: the compensation COMPLETED,
    // the charge COMPENSATED, never a second refund.
    let steps = app.tick().await;
    assert!(
        steps.iter().any(|(_, id, step)| id == "k1#compensation"
            && *step == effectgate::ops::reconcile::Step::Found),
        "{steps:?}"
    );
    let original = app.op_json("k1").await;
    assert_eq!(original["state"], "COMPENSATED");
    let comp = app.op_json(&child("k1")).await;
    assert_eq!(comp["state"], "COMPLETED");
    assert_eq!(comp["provider_reference"], Value::Null);
    assert_eq!(refunds(&app).len(), 1);
    let again = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(again.status(), 200);
    assert_eq!(refunds(&app).len(), 1);
}

#[tokio::test]
async fn a_policy_requiring_approval_sends_nothing_until_approved() {
    let app = app(refund_route("payment", ""), gate("approval")).await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["compensation"]["state"], "AWAITING_APPROVAL");
    let approval = v["compensation"]["approval_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(refunds(&app).is_empty());
    assert!(
        !app.mock
            .provider
            .requests()
            .iter()
            .any(|r| r.uri.starts_with("/v1/refunds"))
    );
    // The approval is bound to the exact compensating request.
    let a: Value = app
        .http
        .get(app.admin(&format!("/admin/tenants/a/approvals/{approval}")))
        .bearer_auth(APPROVER_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["operation_id"], "k1#compensation");
    assert_eq!(a["method"], "POST");
    assert_eq!(a["path"], "/v1/refunds");
    assert_eq!(
        a["fingerprint"],
        app.op_json(&child("k1")).await["fingerprint"]
    );
    assert_eq!(a["requested_by"], "a:operator");
    assert!(
        a["reason"]
            .as_str()
            .unwrap()
            .contains("POST /v1/refunds undoing k1"),
        "{a}"
    );
    // Asking again before the decision: the same pending compensation.
    let again = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(again.status(), 202);
    assert!(refunds(&app).is_empty());
    // The operator can't approve its own request; an approver can.
    let own = app
        .admin_post(
            OPERATOR_A,
            &format!("/admin/tenants/a/approvals/{approval}/approve"),
            "{}",
        )
        .await;
    assert_eq!(own.status(), 403);
    let long = app
        .admin_post(
            APPROVER_A,
            &format!("/admin/tenants/a/approvals/{approval}/approve"),
            &format!(r#"{{"comment":"{}"}}"#, "x".repeat(1025)),
        )
        .await;
    assert_eq!(long.status(), 400);
    let p: Value = long.json().await.unwrap();
    assert_eq!(p["field"], "body.comment");
    // A comment of another type names the member too, and an unknown
    // member is refused by name.
    for (body, field) in [
        (r#"{"comment":5}"#, "body.comment"),
        (r#"{"coment":"x"}"#, "body.coment"),
        (r#"{"comment":"x"} trailing"#, "body"),
        (r#"{"comment":"#, "body"),
        // Read by position into the struct, were it not refused.
        (r#"["by position"]"#, "body"),
    ] {
        let r = app
            .admin_post(
                APPROVER_A,
                &format!("/admin/tenants/a/approvals/{approval}/approve"),
                body,
            )
            .await;
        assert_eq!(r.status(), 400, "{body}");
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["field"], field, "{body}: {p}");
    }
    // No id holds U+0000: refused before any lookup (PostgreSQL's text
    // can't hold it, and the lookup failed 503). Nor may a query name a
    // parameter twice.
    for (path, field) in [
        ("/admin/tenants/a/operations/k%00x", "path"),
        ("/admin/tenants/a/inbox?source=s%00x", "query"),
        // The last one would have won, silently.
        ("/admin/tenants/a/operations?limit=1&limit=2", "query:limit"),
    ] {
        let r = app
            .http
            .get(app.admin(path))
            .bearer_auth(ADMIN_A)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{path}");
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["field"], field, "{path}: {p}");
    }
    assert!(refunds(&app).is_empty());
    let ok = app
        .admin_post(
            APPROVER_A,
            &format!("/admin/tenants/a/approvals/{approval}/approve"),
            r#"{"comment":"refund it"}"#,
        )
        .await;
    assert_eq!(ok.status(), 200);
    until_compensated(&app, "k1").await;
    assert_eq!(refunds(&app).len(), 1);
    // Asking after it ran: still one refund.
    assert_eq!(compensate(&app, OPERATOR_A, "k1").await.status(), 200);
    assert_eq!(refunds(&app).len(), 1);
}

#[tokio::test]
async fn a_denying_policy_refuses_and_nothing_is_reserved() {
    let app = app(refund_route("payment", ""), gate("deny")).await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 403);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "urn:effectgate:problem:policy-denied");
    assert_eq!(v["policy"], "compensation_gate");
    assert!(refunds(&app).is_empty());
    assert_eq!(
        app.operation(ADMIN_A, "a", &child("k1")).await.status(),
        404
    );
    assert_eq!(app.op_json("k1").await["state"], "COMPLETED");
}

/// A `compensate` verdict whose reason is over `policy.max_reason_bytes`
/// (a deny or an approval of 64 KiB) breaks the output rules, as it would
/// from `evaluate`: the compensation fails closed, nothing is reserved or
/// sent, and the reason is stored nowhere.
#[tokio::test]
async fn a_compensate_reason_over_the_limit_fails_closed() {
    for verdict in ["long-deny", "long-approval"] {
        let app = app(refund_route("payment", ""), gate(verdict)).await;
        assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
        let r = compensate(&app, OPERATOR_A, "k1").await;
        assert_eq!(r.status(), 503, "{verdict}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["type"], "urn:effectgate:problem:policy-failed",
            "{verdict}: {v}"
        );
        let detail = v["detail"].as_str().unwrap();
        assert!(
            detail.contains("is 65536 bytes; the limit is 1024"),
            "{verdict}: {detail}"
        );
        assert!(
            v.to_string().len() < 4096,
            "{verdict}: the reason is not echoed"
        );
        assert!(refunds(&app).is_empty(), "{verdict}");
        assert_eq!(
            app.operation(ADMIN_A, "a", &child("k1")).await.status(),
            404,
            "{verdict}"
        );
        let op = app.op_json("k1").await;
        assert_eq!(op["state"], "COMPLETED", "{verdict}");
        let approvals: Value = app
            .http
            .get(app.admin("/admin/tenants/a/approvals"))
            .bearer_auth(ADMIN_A)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(approvals["approvals"], serde_json::json!([]), "{verdict}");
    }
}

#[tokio::test]
async fn defaults_by_effect_class_and_older_policy_components() {
    // Irreversible, no policy: an approval is required.
    let app1 = app(refund_route("irreversible", ""), String::new()).await;
    assert_eq!(app1.charge("k1", CHARGE).await.status(), 200);
    let r = compensate(&app1, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["compensation"]["state"], "AWAITING_APPROVAL");
    assert!(refunds(&app1).is_empty());

    // Payment with a policy built for world 0.1.0 (no `compensate`): the
    // default, allow.
    let old = format!(
        "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{}}\n",
        policy_wasm("world_0_1").display()
    );
    let app2 = app(refund_route("payment", ""), old.clone()).await;
    assert_eq!(app2.charge("k1", CHARGE).await.status(), 200);
    assert_eq!(compensate(&app2, OPERATOR_A, "k1").await.status(), 200);
    assert_eq!(refunds(&app2).len(), 1);
    // The same 0.1.0 component on a permission route: the default there,
    // an approval.
    let app3 = app(refund_route("permission", ""), old).await;
    assert_eq!(app3.charge("k1", CHARGE).await.status(), 200);
    assert_eq!(compensate(&app3, OPERATOR_A, "k1").await.status(), 202);
    assert!(refunds(&app3).is_empty());
}

#[tokio::test]
async fn a_stripe_shaped_form_refund() {
    let route = r#"effect_class = "payment"
[routes.compensation]
path = "/v1/refunds"
content_type = "application/x-www-form-urlencoded"
body = { charge = "{response:/id}", reason = "requested_by_customer", metadata = { order = "{body:/metadata/order}", note = "undo & refund" } }
success = { pointer = "/status", equals = "succeeded" }
read_back = { path = "/v1/refunds?charge={response:/id}", found_pointer = "/data/0", match = { "/charge" = "{reference}" } }
"#;
    // `{response:…}` is not allowed in a read-back: a config error naming it.
    assert_eq!(config_error(route), "routes[0].compensation.read_back.path");
    let route = route.replace(
        "path = \"/v1/refunds?charge={response:/id}\"",
        "path = \"/v1/refunds?charge={reference}\"",
    );
    let app = app(
        format!("{route}reference_pointer = \"/id\"\n"),
        String::new(),
    )
    .await;
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "f1")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("amount=100&currency=eur&metadata[order]=42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = compensate(&app, OPERATOR_A, "f1").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let rs = refunds(&app);
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].charge, "ch_1");
    assert_eq!(rs[0].metadata["order"], "42");
    assert_eq!(rs[0].metadata["note"], "undo & refund");
    let seen = app
        .mock
        .provider
        .requests()
        .into_iter()
        .find(|r| r.method == "POST" && r.uri == "/v1/refunds")
        .unwrap();
    let ct = seen
        .headers
        .iter()
        .find(|(n, _)| n == "content-type")
        .map(|(_, v)| v.clone());
    assert_eq!(ct.as_deref(), Some("application/x-www-form-urlencoded"));
    let comp = app.op_json(&child("f1")).await;
    assert_eq!(
        comp["request_content_type"],
        "application/x-www-form-urlencoded"
    );
}

#[tokio::test]
async fn a_success_pointer_that_disagrees_fails_the_compensation() {
    let app = app(
        refund_route(
            "payment",
            "success = { pointer = \"/status\", equals = \"pending\" }",
        ),
        String::new(),
    )
    .await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 409);
    let v: Value = r.json().await.unwrap();
    assert!(v["detail"].as_str().unwrap().contains("FAILED"), "{v}");
    let comp = app.op_json(&child("k1")).await;
    assert_eq!(comp["state"], "FAILED");
    assert_eq!(comp["error_kind"], "success-not-confirmed");
    assert_eq!(app.op_json("k1").await["state"], "COMPLETED");
}

#[tokio::test]
async fn bad_requests_are_refused_and_nothing_is_sent() {
    let app = app(
        refund_route("payment", "").replace(
            "reason = \"requested_by_customer\"",
            "reason = \"{response:/nope/deeper}\"",
        ),
        String::new(),
    )
    .await;
    assert_eq!(app.charge("k1", CHARGE).await.status(), 200);
    // A pointer the stored response lacks: 422 naming it, nothing sent.
    let r = compensate(&app, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 422);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "urn:effectgate:problem:compensation-unresolved");
    assert_eq!(v["field"], "{response:/nope/deeper}");
    assert!(
        v["detail"].as_str().unwrap().contains("/nope/deeper"),
        "{v}"
    );
    assert!(refunds(&app).is_empty());
    assert_eq!(
        app.operation(ADMIN_A, "a", &child("k1")).await.status(),
        404
    );
    assert_eq!(app.op_json("k1").await["state"], "COMPLETED");

    // Not COMPLETED: 409 naming its state.
    let failed = app
        .charge_with("k2", CHARGE, &[("X-Mock-Fault", "status:400")])
        .await;
    assert_eq!(failed.status(), 400);
    // The refusal's detail is on the row; a duplicate still gets the
    // provider's own answer, replayed.
    let k2 = app.op_json("k2").await;
    assert_eq!(
        (k2["error_kind"].as_str(), k2["error_detail"].as_str()),
        (Some("permanent"), Some("provider answered 400 Bad Request")),
        "{k2}"
    );
    let again = app.charge("k2", CHARGE).await;
    assert_eq!(again.status(), 400);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_ne!(
        again.headers()["content-type"],
        "application/problem+json",
        "the provider's body, not the gateway's problem"
    );
    let r = compensate(&app, OPERATOR_A, "k2").await;
    assert_eq!(r.status(), 409);
    let v: Value = r.json().await.unwrap();
    assert!(v["detail"].as_str().unwrap().contains("is FAILED"), "{v}");
    // Roles: a client or an admin key may not; another tenant's is 404.
    assert_eq!(compensate(&app, KEY_A, "k1").await.status(), 403);
    assert_eq!(compensate(&app, ADMIN_A, "k1").await.status(), 403);
    assert_eq!(compensate(&app, OPERATOR_A, "nope").await.status(), 404);
    let other = app
        .admin_post(ADMIN_B, "/admin/tenants/a/operations/k1/compensate", "{}")
        .await;
    assert_eq!(other.status(), 404);
    // Callers can't use the compensations' ids.
    let r = app.charge("k1#compensation", CHARGE).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "urn:effectgate:problem:idempotency-key-invalid");

    // A route without a compensation: 409 "no compensation defined".
    let plain = app_without().await;
    assert_eq!(plain.charge("k1", CHARGE).await.status(), 200);
    let r = compensate(&plain, OPERATOR_A, "k1").await;
    assert_eq!(r.status(), 409);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("no compensation defined"),
        "{v}"
    );
}

async fn app_without() -> TestApp {
    app("effect_class = \"payment\"\n".into(), String::new()).await
}

#[test]
fn a_template_that_does_not_parse_is_a_config_error_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for (route, field) in [
        (
            refund_route("payment", "").replace("{reference}\", reason", "{referenc}\", reason"),
            "routes[0].compensation.body.charge",
        ),
        (
            refund_route("payment", "content_type = \"text/plain\""),
            "routes[0].compensation.content_type",
        ),
        (
            refund_route("payment", "success = \"3xx\""),
            "routes[0].compensation.success",
        ),
        (
            refund_route("payment", "")
                .replace("path = \"/v1/refunds\"", "path = \"v1/{reference\""),
            "routes[0].compensation.path",
        ),
        (
            refund_route("payment", "tool = \"cancel\""),
            "routes[0].compensation.tool",
        ),
    ] {
        assert_eq!(config_error(&route), field, "{route}");
    }
    let _ = dir;
}

/// The path of the field the config with `route` lines is refused for.
fn config_error(route: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    // The route's credential comes from the environment, as in every test.
    let _ = settings_from(
        &config_toml("http://127.0.0.1:9", &dir.path().join("l.db"), ""),
        dir.path(),
    );
    let text = config_toml("http://127.0.0.1:9", &dir.path().join("l.db"), route);
    let path = dir.path().join("c.toml");
    std::fs::write(&path, &text).unwrap();
    match effectgate::config::load(Some(&path)) {
        Ok(_) => panic!("accepted: {route}"),
        Err(e) => {
            eprintln!("{e}");
            e.path
        }
    }
}
