//! The official `stripe` Python SDK, unmodified, through effectgate to the
//! mock provider over TLS (a CA made in the test). The provider drops the
//! first reply after committing the charge; the SDK retries with its own
//! `Idempotency-Key` and gets the one charge.

use effectgate_tests::pki::Ca;
use effectgate_tests::*;
use serde_json::Value;

const SCRIPT: &str = r#"
import json, sys
import stripe
stripe.api_key = sys.argv[2]          # the gateway's client key
stripe.api_base = sys.argv[1]         # the gateway route
stripe.max_network_retries = 2
charge = stripe.Charge.create(
    amount=100, currency="eur", source="tok_visa", metadata={"order": "42"}
)
print(json.dumps({"id": charge.id, "amount": charge.amount,
                  "order": charge.metadata["order"], "object": charge.object}))
"#;

#[tokio::test]
async fn stripe_sdk_retries_a_lost_reply_and_gets_the_one_charge() {
    let Some(python) = test_python(&["stripe", "requests"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let leaf = ca.server("provider", &["localhost"]);
    let app = spawn_with(Opts {
        mock_tls: Some(mock_provider::TlsOptions::new(leaf.cert, leaf.key)),
        route_extra: format!(
            "[routes.tls]\nca_file = \"{}\"\n\
             [routes.read_back]\npath = \"/v1/charges?idempotency_key={{provider_key}}\"\n\
             found_pointer = \"/data/0\"\nmatch = {{ \"/idempotency_key\" = \"{{provider_key}}\" }}\n\
             reference_pointer = \"/id\"\nsettle_delay_ms = 0\n",
            ca.pem.cert_file.display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    let out = tokio::process::Command::new(&python)
        .args(["-c", SCRIPT, &app.proxy("/pay"), KEY_A])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "stripe SDK: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["id"], "ch_1");
    assert_eq!(got["amount"], 100);
    assert_eq!(got["order"], "42");
    assert_eq!(got["object"], "charge");

    // Exactly one charge at the provider; it saw the SDK's form body.
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].metadata["order"], "42");
    let posts: Vec<_> = app
        .mock
        .provider
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(posts.len(), 1, "the retry never reached the provider");

    // The ledger: the SDK's key names one operation, resolved by read-back.
    let seen_key = posts[0]
        .headers
        .iter()
        .find(|(n, _)| n == "idempotency-key")
        .map(|(_, v)| v.clone())
        .unwrap();
    let ops: Value = app
        .http
        .get(app.admin("/admin/tenants/a/operations"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ops = ops["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 1, "{ops:?}");
    let op = app.op_json(ops[0]["operation_id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_key"], seen_key.as_str());
    assert_eq!(op["provider_reference"], "ch_1");
    let states: Vec<&str> = op["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["to_state"].as_str().unwrap())
        .collect();
    // Lost reply → UNKNOWN → read back (under a reconciliation lease) →
    // COMPLETED; never a second execution.
    assert_eq!(
        states[..3],
        ["RESERVED", "EXECUTING", "UNKNOWN"],
        "{states:?}"
    );
    assert_eq!(states.last(), Some(&"COMPLETED"), "{states:?}");
    assert!(!states[3..].contains(&"EXECUTING"), "{states:?}");
}
