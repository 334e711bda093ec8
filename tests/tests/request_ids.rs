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

/// Every log line the gateway writes in this test process, in the text
/// format (`effectgate::telemetry::LogFields`), one string per line. The
/// subscriber is the process-wide one: a policy call runs on a blocking
/// thread and an execution on a task of its own, which a thread-local
/// subscriber would not see.
fn captured_logs() -> &'static std::sync::Mutex<Vec<u8>> {
    use std::sync::{Arc, Mutex, OnceLock};
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        #[derive(Clone)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink(logs.clone());
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(effectgate::telemetry::LogFields)
            .with_ansi(false)
            .without_time()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        logs
    })
}

/// The captured lines that contain `needle`.
fn lines_with(needle: &str) -> Vec<String> {
    let logs = captured_logs().lock().unwrap();
    String::from_utf8_lossy(&logs)
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_policy_calls_and_a_detached_executions_log_lines_name_the_request_they_serve() {
    captured_logs();
    // A policy that traps: its failure is logged on the blocking thread
    // the policy call runs on.
    let app = spawn_with(Opts {
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{}}\n",
            policy_wasm("trap").display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = app
        .charge_with(
            "trapped",
            BODY,
            &[
                ("x-request-id", "policy-req-1"),
                ("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01")),
            ],
        )
        .await;
    assert_eq!(r.status(), 503);
    let failed = lines_with("policy call failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].ends_with(&format!(
            "request_id=\"policy-req-1\" trace_id=\"{trace}\" effectgate.operation_id=\"trapped\""
        )),
        "{}",
        failed[0]
    );
    assert_eq!(app.mock.provider.effects(), 0);

    // An operator who resolves an UNKNOWN operation as absent starts a new
    // attempt detached from the request; that execution's 'operation
    // recorded' line names the operator's request, not the caller's.
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"derived\"".into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let r = app
        .charge_with(
            "resolved",
            BODY,
            &[
                ("x-request-id", "first-req-1"),
                ("X-Mock-Fault", "status:500"),
            ],
        )
        .await;
    assert_eq!(r.status(), 502);
    assert_eq!(app.op_json("resolved").await["state"], "UNKNOWN");
    let r = app
        .http
        .post(app.admin("/admin/tenants/a/operations/resolved/resolve"))
        .bearer_auth(OPERATOR_A)
        .header("x-request-id", "resolve-req-1")
        .body(r#"{"outcome":"absent","reason":"not in the dashboard"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    // The event's own fields, after its message (a test subscriber also
    // prints the spans the line is in, before it).
    let recorded = || -> Vec<String> {
        lines_with("operation recorded")
            .iter()
            .filter_map(|l| {
                l.split_once("operation recorded")
                    .map(|(_, f)| f.to_owned())
            })
            .filter(|f| f.contains("operation_id=\"resolved\""))
            .collect()
    };
    // The answer may come before the detached execution has recorded its
    // outcome (the operator waits at most `duplicate_wait_ms`): read the
    // operation until its second attempt is in the ledger and the line is
    // written, for at most 10 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let op = app.op_json("resolved").await;
        if op["attempts_log"].as_array().map_or(0, Vec::len) == 2 && recorded().len() == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let recorded = recorded();
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    assert!(
        recorded[0].contains(" request_id=\"first-req-1\""),
        "{}",
        recorded[0]
    );
    assert!(
        recorded[1].contains(" request_id=\"resolve-req-1\""),
        "{}",
        recorded[1]
    );
}
