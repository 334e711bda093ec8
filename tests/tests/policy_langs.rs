//! Policies written in JavaScript and Python, end to end: the JavaScript
//! amount-threshold requires an approval, the Python replay-matrix decides
//! a replay. `cargo test` doesn't build these components: `.ci/run` does
//! and names their folders in `POLICY_JS_WASM_DIR` and `POLICY_PY_WASM_DIR`;
//! without them each test says it is skipped (and fails under `CI`).

use effectgate_tests::*;
use serde_json::Value;

/// `[policy]` for components that carry an interpreter: room above their
/// initial memory (9 MiB for JavaScript, 12.5 MiB for Python), and a
/// deadline that a loaded CI machine can't miss (these tests check
/// decisions; the bench measures time).
const LANG_LIMITS: &str = "[policy]\nmemory_bytes = 33554432\ndeadline_ms = 1000\n";

fn js_amount_threshold() -> Option<std::path::PathBuf> {
    lang_policy_wasm(
        "POLICY_JS_WASM_DIR",
        "policies/js/amount-threshold",
        "amount_threshold_js.wasm",
    )
}

fn py_replay_matrix() -> Option<std::path::PathBuf> {
    lang_policy_wasm(
        "POLICY_PY_WASM_DIR",
        "policies/python/replay-matrix",
        "replay_matrix_py.wasm",
    )
}

#[tokio::test]
async fn the_javascript_amount_threshold_requires_an_approval() {
    let Some(module) = js_amount_threshold() else {
        return;
    };
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000, currencies = [\"eur\"] }}\n",
            module.display()
        ),
        more: format!("[reconcile]\nenabled = false\n{LANG_LIMITS}"),
        ..Default::default()
    })
    .await;

    // Above the threshold: 202, AWAITING_APPROVAL, nothing sent.
    let r = app
        .charge("big", r#"{"amount":5000,"currency":"eur"}"#)
        .await;
    assert_eq!(r.status(), 202);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "AWAITING_APPROVAL");
    let op = app.op_json("big").await;
    assert_eq!(op["state"], "AWAITING_APPROVAL");
    let to: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["to_state"].as_str().unwrap())
        .collect();
    assert_eq!(to, vec!["RESERVED", "AWAITING_APPROVAL"]);
    let d = &op["policy_decisions"][0];
    assert_eq!(d["policy"], "amount_threshold_js");
    assert_eq!(d["decision"], "require-approval");
    assert_eq!(d["reason"], "amount 5000 exceeds the threshold 1000");
    assert_eq!(app.mock.provider.effects(), 0);

    // Below it: runs once. Off the currency list: the policy's 403.
    assert_eq!(
        app.charge("small", r#"{"amount":100,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    assert_eq!(app.op_json("small").await["state"], "COMPLETED");
    let r = app.charge("btc", r#"{"amount":5,"currency":"btc"}"#).await;
    assert_eq!(r.status(), 403);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:policy-denied");
    assert_eq!(p["policy"], "amount_threshold_js");
    assert_eq!(app.mock.provider.effects(), 1);
}

#[tokio::test]
async fn the_python_replay_matrix_decides_a_replay() {
    let Some(module) = py_replay_matrix() else {
        return;
    };
    // Payments replay as the same operation by default; this tenant's
    // Python policy makes them manual.
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ overrides = {{ payment = \"manual\" }} }}\n",
            module.display()
        ),
        more: format!("[reconcile]\nenabled = false\n{LANG_LIMITS}"),
        ..Default::default()
    })
    .await;
    let r = app.charge("p1", r#"{"amount":10,"currency":"eur"}"#).await;
    assert_eq!(r.status(), 200, "evaluate allows");
    assert_eq!(
        app.op_json("p1").await["policy_decisions"][0]["policy"],
        "replay_matrix_py"
    );

    let r = app
        .admin_post(OPERATOR_A, "/admin/tenants/a/operations/p1/replay", "{}")
        .await;
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
    assert_eq!(app.op_json("p1").await["state"], "COMPLETED");
    assert_eq!(app.provider_calls().0, 1, "nothing sent again");
}
