//! Traces end to end: the gateway exports OpenTelemetry spans over
//! OTLP/HTTP (protobuf) to a receiver in the test, decoded with the
//! `opentelemetry-proto` types. One test function: the tracer is
//! process-wide and sends its exports on this test's runtime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use effectgate_tests::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

impl Collector {
    fn spans(&self) -> Vec<(String, Span)> {
        self.spans.lock().unwrap().clone()
    }
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf
/// `ExportTraceServiceRequest`; records (service.name, span).
async fn spawn_collector() -> (String, Collector) {
    let c = Collector::default();
    let c2 = c.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let c = c2.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("a protobuf export");
                for rs in req.resource_spans {
                    let service = rs
                        .resource
                        .as_ref()
                        .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                        .and_then(|a| a.value.as_ref())
                        .and_then(|v| match &v.value {
                            Some(AnyValue::StringValue(s)) => Some(s.clone()),
                            _ => None,
                        })
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            c.spans.lock().unwrap().push((service.clone(), s));
                        }
                    }
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, c)
}

fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref())
        .and_then(|v| match &v.value {
            Some(AnyValue::StringValue(s)) => Some(s.clone()),
            Some(AnyValue::IntValue(i)) => Some(i.to_string()),
            Some(AnyValue::BoolValue(b)) => Some(b.to_string()),
            _ => None,
        })
}

/// A provider attempt's span: kind client, with an attempt number.
fn is_attempt(s: &Span) -> bool {
    s.kind == 3 && attr(s, "effectgate.attempt").is_some()
}

/// A read-back's span: kind client, with a read-back result.
fn is_read_back(s: &Span) -> bool {
    s.kind == 3 && attr(s, "effectgate.result").is_some()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Flushes the exporter and waits (at most 10 s) until `pred` holds over
/// the spans received.
async fn wait_for(
    t: &Arc<effectgate::telemetry::Telemetry>,
    c: &Collector,
    what: &str,
    pred: impl Fn(&[(String, Span)]) -> bool,
) -> Vec<(String, Span)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t2 = t.clone();
        tokio::task::spawn_blocking(move || t2.flush())
            .await
            .unwrap();
        let spans = c.spans();
        if pred(&spans) {
            return spans;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: spans seen: {:#?}",
            names(&spans)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn names(spans: &[(String, Span)]) -> Vec<String> {
    spans
        .iter()
        .map(|(_, s)| {
            let keys: Vec<&str> = s.attributes.iter().map(|a| a.key.as_str()).collect();
            format!("{} (kind {}) {keys:?}", s.name, s.kind)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_an_effectful_call_and_of_a_reconciled_lost_reply() {
    let (endpoint, collector) = spawn_collector().await;
    let settings = effectgate::telemetry::TelemetrySettings {
        traces_endpoint: Some(effectgate::telemetry::traces_url(&endpoint)),
        service_name: "effectgate-test".into(),
        ..Default::default()
    };
    let telemetry = Arc::new(
        effectgate::telemetry::init(effectgate::telemetry::LogFormat::Text, &settings).unwrap(),
    );
    assert!(telemetry.exporting());
    let app = spawn_with(Opts {
        route_extra: r#"
[routes.read_back]
path = "/v1/charges?idempotency_key={provider_key}"
found_pointer = "/data/0"
reference_pointer = "/id"
"#
        .into(),
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 100000 }}\n",
            policy_wasm("amount_threshold").display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;

    // 1. An effectful call whose first attempt gets a 503: two attempts.
    let caller_tp = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let r = app
        .charge_with(
            "traced",
            BODY,
            &[
                ("traceparent", caller_tp.as_str()),
                ("tracestate", "vendor=opaque"),
                ("X-Mock-Fault", "fail-503:1"),
            ],
        )
        .await;
    assert_eq!(r.status(), 200);
    // The provider saw two attempts, each with its own span id in the
    // caller's trace, never the caller's own traceparent.
    let sent: Vec<String> = app
        .mock
        .provider
        .requests()
        .iter()
        .filter(|q| q.method == "POST")
        .filter_map(|q| {
            q.headers
                .iter()
                .find(|(n, _)| n == "traceparent")
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_ne!(sent[0], sent[1]);
    for tp in &sent {
        assert!(tp.starts_with(&format!("00-{CALLER_TRACE}-")), "{tp}");
        assert_ne!(tp, &caller_tp);
    }
    // The stored caller headers carry no trace context.
    let op = app.op_json("traced").await;
    let stored = op["request_headers"].to_string();
    assert!(
        !stored.contains("traceparent") && !stored.contains("tracestate"),
        "{stored}"
    );

    let spans = wait_for(&telemetry, &collector, "effectful call", |s| {
        s.iter().filter(|(_, s)| is_attempt(s)).count() >= 2
            && s.iter().any(|(_, s)| s.name == "POST /pay/")
    })
    .await;
    let of_trace: Vec<&Span> = spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| hex(&s.trace_id) == CALLER_TRACE)
        .collect();
    assert!(spans.iter().all(|(svc, _)| svc == "effectgate-test"));
    let request = of_trace
        .iter()
        .find(|s| s.name == "POST /pay/")
        .expect("the request span, named {method} {route}");
    assert_eq!(request.kind, 2, "kind server");
    assert_eq!(
        hex(&request.parent_span_id),
        CALLER_SPAN,
        "the caller's span is the parent"
    );
    assert_eq!(attr(request, "http.route").as_deref(), Some("/pay/"));
    assert_eq!(
        attr(request, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(attr(request, "effectgate.tenant").as_deref(), Some("a"));
    assert_eq!(
        attr(request, "effectgate.operation_id").as_deref(),
        Some("traced")
    );
    assert_eq!(
        attr(request, "effectgate.state").as_deref(),
        Some("COMPLETED")
    );
    assert!(attr(request, "request_id").is_some_and(|r| !r.is_empty()));
    // Children of the request span: the policy, ledger commands, attempts.
    let by_id: HashMap<String, &Span> = of_trace.iter().map(|s| (hex(&s.span_id), *s)).collect();
    let under_request = |s: &Span| {
        let mut p = hex(&s.parent_span_id);
        for _ in 0..8 {
            if p == hex(&request.span_id) {
                return true;
            }
            match by_id.get(&p) {
                Some(parent) => p = hex(&parent.parent_span_id),
                None => return false,
            }
        }
        false
    };
    let policy = of_trace
        .iter()
        .find(|s| s.name == "policy amount_threshold")
        .expect("a policy span");
    assert!(under_request(policy));
    assert_eq!(
        attr(policy, "effectgate.decision").as_deref(),
        Some("allow")
    );
    assert!(attr(policy, "effectgate.policy_hash").is_some_and(|h| h.len() == 64));
    assert!(
        of_trace
            .iter()
            .any(|s| s.name.starts_with("ledger ") && under_request(s)),
        "ledger command spans under the request: {:?}",
        of_trace.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    // The reservation (claimed in the same commit) carries the size of
    // the group commit it rode in.
    let reserve = of_trace
        .iter()
        .find(|s| s.name == "ledger reserve" && under_request(s))
        .expect("a ledger reserve span");
    assert!(
        attr(reserve, "effectgate.batch_size")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n >= 1),
        "effectgate.batch_size on {reserve:?}"
    );
    let mut attempts: Vec<&&Span> = of_trace.iter().filter(|s| is_attempt(s)).collect();
    attempts.sort_by_key(|s| attr(s, "effectgate.attempt"));
    assert_eq!(attempts.len(), 2);
    for (a, tp) in attempts.iter().zip(&sent) {
        assert!(under_request(a));
        assert_eq!(a.kind, 3, "kind client");
        assert_eq!(a.name, "POST", "client spans are named by method");
        // What the provider got is this attempt's own span.
        assert_eq!(tp, &format!("00-{CALLER_TRACE}-{}-01", hex(&a.span_id)));
    }
    assert_eq!(
        attr(attempts[0], "http.response.status_code").as_deref(),
        Some("503")
    );
    assert_eq!(
        attr(attempts[0], "effectgate.outcome").as_deref(),
        Some("transient")
    );
    assert_eq!(
        attr(attempts[1], "effectgate.outcome").as_deref(),
        Some("COMPLETED")
    );
    assert_eq!(
        attr(attempts[1], "http.request.resend_count").as_deref(),
        Some("1")
    );
    // Nothing secret in any span: the provider credential, the gateway key.
    for (_, s) in &spans {
        for a in &s.attributes {
            let v = format!("{:?}", a.value);
            assert!(
                !v.contains(PROVIDER_SECRET) && !v.contains(KEY_A),
                "{}: {v}",
                a.key
            );
        }
    }

    // 2. A lost reply: UNKNOWN, reconciled later by read-back in a trace of
    // its own, linked to the request that created the operation.
    let lost_trace = "11112222333344445555666677778888";
    let r = app
        .charge_with(
            "lost",
            BODY,
            &[
                (
                    "traceparent",
                    &format!("00-{lost_trace}-1111222233334444-01"),
                ),
                ("X-Mock-Fault", "drop-after-effect"),
            ],
        )
        .await;
    assert!(
        r.status().is_server_error() || r.status() == 202,
        "{}",
        r.status()
    );
    assert_eq!(app.op_json("lost").await["state"], "UNKNOWN");
    let steps = app.tick().await;
    assert!(
        steps
            .iter()
            .any(|(_, id, s)| id == "lost" && *s == effectgate::ops::reconcile::Step::Found),
        "{steps:?}"
    );
    assert_eq!(app.op_json("lost").await["state"], "COMPLETED");
    let spans = wait_for(&telemetry, &collector, "reconciliation", |s| {
        s.iter()
            .any(|(_, s)| is_read_back(s) && hex(&s.trace_id) != lost_trace)
    })
    .await;
    let original = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.kind == 2 && hex(&s.trace_id) == lost_trace)
        .expect("the original request span");
    let read_back = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| is_read_back(s))
        .unwrap();
    let reconcile = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == "reconcile" && s.span_id == read_back.parent_span_id)
        .expect("the read-back's parent is the reconcile span");
    assert_ne!(hex(&reconcile.trace_id), lost_trace, "a trace of its own");
    assert_eq!(reconcile.links.len(), 1, "linked to the original trace");
    assert_eq!(hex(&reconcile.links[0].trace_id), lost_trace);
    assert_eq!(reconcile.links[0].span_id, original.span_id);
    assert_eq!(
        attr(read_back, "effectgate.result").as_deref(),
        Some("found")
    );
    assert_eq!(
        attr(read_back, "effectgate.operation_id").as_deref(),
        Some("lost")
    );
    app.gw.shutdown().await;
}
