//! `x-request-id`: kept from the caller when valid, generated otherwise,
//! returned on every answer and stored with each attempt.

use std::collections::BTreeSet;

use effectgate_tests::*;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;

#[tokio::test]
async fn request_ids_are_kept_or_generated_returned_and_stored_with_attempts() {
    let app = spawn_app().await;
    // A valid id from the caller is kept, returned, and stored with the
    // attempt made for it.
    let r = app
        .charge_with("rid", BODY, &[("x-request-id", "caller-req-42")])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "caller-req-42");
    let op = app.op_json("rid").await;
    assert_eq!(op["attempts_log"][0]["request_id"], "caller-req-42", "{op}");
    // A replay answers with the duplicate's own id.
    let r = app
        .charge_with("rid", BODY, &[("x-request-id", "caller-req-43")])
        .await;
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(r.headers()["x-request-id"], "caller-req-43");
    // Invalid ids (too long, with a space) are replaced by a generated one.
    for bad in ["x".repeat(129), "two words".to_owned()] {
        let r = app
            .charge_with(
                &format!("rid-{}", bad.len()),
                BODY,
                &[("x-request-id", bad.as_str())],
            )
            .await;
        let got = r.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert_ne!(got, bad);
        assert_eq!(got.len(), 36, "a UUID: {got}");
    }
    // Problem answers carry one too, on both listeners.
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert_eq!(r.headers()["x-request-id"].len(), 36);
    let r = app.http.get(app.admin("/readyz")).send().await.unwrap();
    assert!(r.headers().contains_key("x-request-id"));
    let ids: BTreeSet<String> = futures_util::future::join_all((0..5).map(|_| async {
        let r = app.http.get(app.admin("/healthz")).send().await.unwrap();
        r.headers()["x-request-id"].to_str().unwrap().to_owned()
    }))
    .await
    .into_iter()
    .collect();
    assert_eq!(ids.len(), 5, "a fresh id per request");
}
