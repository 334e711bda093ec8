//! Hostile input and noisy neighbours: each test reproduces a defect found
//! by attacking the gateway, and asserts the fixed behaviour.

use std::time::{Duration, Instant};

use effectgate::ledger::ManualClock;
use effectgate_tests::*;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A key reused after its retention names a new operation: it must get a
/// new provider key, or a provider that keeps keys longer (Stripe: 24 h)
/// replays the old effect for the new request.
#[tokio::test]
async fn a_key_reused_after_retention_gets_a_new_provider_key_and_a_new_effect() {
    let clock = ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: "key_retention_hours = 1".into(),
        more: "[reconcile]\nenabled = false\n".into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let first = app
        .charge("order-1", r#"{"amount":100,"currency":"eur"}"#)
        .await;
    assert_eq!(first.status(), 200);
    let first: Value = first.json().await.unwrap();
    let old_key = app.op_json("order-1").await["provider_key"]
        .as_str()
        .unwrap()
        .to_owned();
    // Within retention another body is refused (422): the key is taken.
    assert_eq!(
        app.charge("order-1", r#"{"amount":999,"currency":"eur"}"#)
            .await
            .status(),
        422
    );
    clock.advance(2 * 3_600_000);
    let second = app
        .charge("order-1", r#"{"amount":999,"currency":"eur"}"#)
        .await;
    assert_eq!(second.status(), 200);
    assert!(second.headers().get("idempotent-replayed").is_none());
    let second: Value = second.json().await.unwrap();
    let op = app.op_json("order-1").await;
    assert_ne!(op["provider_key"], old_key.as_str(), "a new incarnation");
    assert_eq!(
        second["amount"], 999,
        "the new request's effect, not the old one"
    );
    assert_ne!(second["id"], first["id"]);
    assert_eq!(app.mock.provider.effects(), 2);
    // Every attempt of one incarnation carries its one key.
    let keys: Vec<String> = app
        .mock
        .provider
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .filter_map(|r| {
            r.headers
                .iter()
                .find(|(n, _)| n == "idempotency-key")
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert_eq!(
        keys,
        vec![old_key, op["provider_key"].as_str().unwrap().to_owned()]
    );
}

const BY_CLIENT_REF: &str = "[routes.read_back]\npath = \"/v1/charges?client_ref={body:/client_ref}\"\nfound_pointer = \"/data\"\nsettle_delay_ms = 0\n";

/// A read-back keyed on a body field, with nothing tying it to the
/// operation, is refused by the config (it once completed one tenant's
/// operation with another tenant's charge).
#[tokio::test]
async fn a_read_back_not_tied_to_the_operation_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("l.db");
    // Tied by {provider_key} in the match, or by a tenant_scoped_field:
    // accepted (`settings_from` also sets the credential variable).
    for extra in [
        format!("{BY_CLIENT_REF}match = {{ \"/idempotency_key\" = \"{{provider_key}}\" }}\n"),
        format!("tenant_scoped_field = \"/metadata/tenant\"\n{BY_CLIENT_REF}"),
    ] {
        settings_from(&config_toml("http://127.0.0.1:1", &db, &extra), dir.path());
    }
    for extra in [
        BY_CLIENT_REF.to_owned(),
        format!("{BY_CLIENT_REF}match = {{ \"/client_ref\" = \"{{body:/client_ref}}\" }}\n"),
        format!("{BY_CLIENT_REF}match = {{ \"/op\" = \"{{operation_id}}\" }}\n"),
        // A provider may ignore a header: it ties nothing.
        format!("{BY_CLIENT_REF}headers = {{ \"Idempotency-Key\" = \"{{provider_key}}\" }}\n"),
        // {tenant} without the gateway's stamp: any caller could write it.
        format!("{BY_CLIENT_REF}match = {{ \"/metadata/tenant\" = \"{{tenant}}\" }}\n"),
    ] {
        let p = dir.path().join("c.toml");
        std::fs::write(&p, config_toml("http://127.0.0.1:1", &db, &extra)).unwrap();
        let e = effectgate::config::load(Some(&p)).unwrap_err();
        assert_eq!(e.path, "routes[0].read_back.match", "{extra}");
        assert!(e.message.contains("not tied to this operation"), "{e}");
        assert!(e.message.contains("tenant_scoped_field"), "{e}");
    }
}

/// The same `client_ref` in two tenants, tied by `tenant_scoped_field`:
/// tenant `a`'s failed call is read back as absent (tenant `b`'s charge
/// doesn't count), attempted again, and gets its own charge.
#[tokio::test]
async fn a_tenant_scoped_read_back_never_takes_another_tenants_effect() {
    let app = spawn_with(Opts {
        route_extra: format!("tenant_scoped_field = \"/metadata/tenant\"\n{BY_CLIENT_REF}"),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let b = app
        .charge_as(
            KEY_B,
            "b-1",
            r#"{"amount":700,"currency":"eur","client_ref":"shared-1"}"#,
        )
        .await;
    assert_eq!(b.status(), 200);
    // The caller can't forge the tenant: the gateway overwrites it.
    let body_a =
        r#"{"amount":5,"currency":"eur","client_ref":"shared-1","metadata":{"tenant":"b"}}"#;
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_status_times: 1,
        fail_status: 500,
        ..Default::default()
    });
    let r = app.charge("a-1", body_a).await;
    assert_eq!(r.status(), 502);
    assert_eq!(app.op_json("a-1").await["state"], "UNKNOWN");
    app.tick().await;
    let op = app.op_json("a-1").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    let dup = app.charge("a-1", body_a).await;
    assert_eq!(dup.status(), 200);
    let v: Value = dup.json().await.unwrap();
    assert_eq!(v["amount"], 5, "tenant a's own charge");
    assert_eq!(v["metadata"]["tenant"], "a");
    assert_eq!(v["id"], "ch_2");
    let charges = app.mock.provider.charges();
    assert_eq!(charges.len(), 2, "two operations, two effects");
    assert_eq!(charges[0].metadata["tenant"], "b");
    assert_eq!(charges[1].metadata["tenant"], "a");
}

/// Reads until the peer closes (EOF or reset); `Some(elapsed)` if it did
/// within `limit`.
async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout(limit.saturating_sub(start.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

/// 80 connections that never finish their request head, against a cap of
/// 40: a normal caller and the admin listener are still served, and every
/// slow socket is closed (the oldest at once to make room, the rest when
/// their header timeout runs out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_header_flood_locks_out_neither_callers_nor_the_admin_listener() {
    let app = spawn_with(Opts {
        more: "[limits]\nmax_connections = 40\nheader_read_timeout_ms = 1500\n".into(),
        ..Default::default()
    })
    .await;
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..80 {
        let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
            .await
            .unwrap();
        s.write_all(b"POST /pay/v1/charges HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    // A normal caller on a fresh connection is served during the flood.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let r = fresh
        .get(app.proxy("/pay/v1/charges?client_ref=x"))
        .bearer_auth(KEY_A)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = fresh
        .get(app.admin("/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Every slow socket is closed within its header timeout (plus slack).
    let mut closed = 0;
    for s in &mut slow {
        if closed_within(s, Duration::from_millis(1500 + 3000))
            .await
            .is_some()
        {
            closed += 1;
        }
    }
    assert_eq!(closed, 80, "every slow socket was closed");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    let metrics = app.metrics().await;
    let count = |reason: &str| -> u64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("effectgate_connections_closed_total")
                    && l.contains("listener=\"proxy\"")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert!(count("no-request-head") >= 41, "{metrics}");
    assert!(count("header-timeout") >= 39, "{metrics}");
}

/// A body that stops arriving gets 408 and nothing is reserved or sent.
#[tokio::test]
async fn a_body_that_stops_arriving_gets_408_and_nothing_is_reserved() {
    let app = spawn_with(Opts {
        more: "[limits]\nbody_read_timeout_ms = 800\n".into(),
        ..Default::default()
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    let head = format!(
        "POST /pay/v1/charges HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {KEY_A}\r\n\
         Idempotency-Key: slow-body\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"amount\":"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer))
        .await
        .expect("answered and closed in time")
        .unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("urn:effectgate:problem:request-timeout"),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(app.operation(ADMIN_A, "a", "slow-body").await.status(), 404);
    assert!(app.mock.provider.requests().is_empty());
}

/// The admin listener reads a body before its handlers authenticate: a
/// declared length over `limits.max_admin_body_bytes` is 413 at once, a
/// body that stops arriving is 408 at `limits.body_read_timeout_ms` (it
/// held the connection forever: enough of them locked out `/healthz`),
/// an endpoint that reads no body (`/admin/reload`, an inbox event's
/// release) is held to the limit too, and a transfer coding other than
/// chunked is 501.
#[tokio::test]
async fn the_admin_listener_bounds_every_body_in_size_and_time() {
    let app = spawn_with(Opts {
        more: "[limits]\nbody_read_timeout_ms = 800\nmax_admin_body_bytes = 100\n".into(),
        ..Default::default()
    })
    .await;
    let answer = |head: String| async move {
        let mut s = tokio::net::TcpStream::connect(app.gw.admin_addr)
            .await
            .unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let started = Instant::now();
        // The connection stays open after a 413 (keep-alive): read the
        // answer's head and body, not to the end.
        let mut buf = [0_u8; 4096];
        loop {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("answered in time")
                .unwrap();
            answer.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&answer);
            if n == 0 || text.contains("}") {
                break;
            }
        }
        (
            String::from_utf8_lossy(&answer).into_owned(),
            started.elapsed(),
        )
    };
    // No credentials, a million bytes declared, none sent.
    let (text, took) = answer(
        "POST /admin/tenants/a/operations/x/requeue HTTP/1.1\r\nHost: admin\r\n\
         Content-Length: 1000000\r\n\r\n"
            .into(),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("\"limit_bytes\":100"), "{text}");
    assert!(took < Duration::from_millis(700), "{took:?}");
    let (text, took) = answer(
        "POST /admin/tenants/a/operations/x/requeue HTTP/1.1\r\nHost: admin\r\n\
         Content-Length: 50\r\n\r\n{\"reason\":"
            .into(),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("urn:effectgate:problem:request-timeout"),
        "{text}"
    );
    assert!(took >= Duration::from_millis(700), "{took:?}");
    // Chunked, no length declared, to endpoints whose handlers read no body.
    for path in ["/admin/reload", "/admin/tenants/a/inbox/src/e1/release"] {
        let chunk = "x".repeat(150);
        let (text, _) = answer(format!(
            "POST {path} HTTP/1.1\r\nHost: admin\r\nAuthorization: Bearer {ADMIN_A}\r\n\
             Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
            chunk.len()
        ))
        .await;
        assert!(text.starts_with("HTTP/1.1 413"), "{path}: {text}");
        assert!(text.contains("\"field\":\"body\""), "{path}: {text}");
    }
    // A transfer coding other than chunked: 501, as on the proxy listener
    // (the parser would take `gzip, chunked` as chunked and hand on the
    // gzip bytes as the JSON body).
    let (text, _) = answer(format!(
        "POST /admin/tenants/a/operations/x/requeue HTTP/1.1\r\nHost: admin\r\n\
         Authorization: Bearer {ADMIN_A}\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
         2\r\n{{}}\r\n0\r\n\r\n"
    ))
    .await;
    assert!(text.starts_with("HTTP/1.1 501"), "{text}");
    assert!(
        text.contains("urn:effectgate:problem:transfer-coding-not-implemented"),
        "{text}"
    );
    assert!(text.contains("\"coding\":\"gzip\""), "{text}");
    // Within the limit the listener answers as ever.
    let r = app.http.get(app.admin("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_tenants_rate_and_in_flight_limits_answer_429_and_spare_other_tenants() {
    let app = spawn_with(Opts {
        tenant_a: "rate_limit = { per_second = 1, burst = 2 }\nmax_in_flight = 1".into(),
        ..Default::default()
    })
    .await;
    let get = |key: &'static str| {
        app.http
            .get(app.proxy("/pay/v1/charges?client_ref=x"))
            .bearer_auth(key)
            .send()
    };
    assert_eq!(get(KEY_A).await.unwrap().status(), 200);
    assert_eq!(get(KEY_A).await.unwrap().status(), 200);
    let r = get(KEY_A).await.unwrap();
    assert_eq!(r.status(), 429);
    let wait: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&wait), "{wait}");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:tenant-limited");
    assert_eq!(p["limit"], "rate");
    for _ in 0..5 {
        assert_eq!(
            get(KEY_B).await.unwrap().status(),
            200,
            "tenant b has no limit"
        );
    }

    // In flight: one slow charge holds tenant a's only slot.
    let app2 = spawn_with(Opts {
        tenant_a: "max_in_flight = 1".into(),
        ..Default::default()
    })
    .await;
    let slow = {
        let (http, url) = (app2.http.clone(), app2.proxy("/pay/v1/charges"));
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(KEY_A)
                .header("Idempotency-Key", "slow")
                .header("Content-Type", "application/json")
                .header("X-Mock-Delay-Ms", "1500")
                .body(r#"{"amount":1}"#)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while app2.mock.provider.requests().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the slow charge reached the provider"
        );
        tokio::task::yield_now().await;
    }
    let r = app2.charge("second", r#"{"amount":2}"#).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(app2.operation(ADMIN_A, "a", "second").await.status(), 404);
    assert_eq!(
        app2.charge_as(KEY_B, "b-ok", r#"{"amount":3}"#)
            .await
            .status(),
        200
    );
    assert_eq!(slow.await.unwrap(), 200);
    assert_eq!(app2.charge("second", r#"{"amount":2}"#).await.status(), 200);
}

/// An effect that shows up in the provider's search a little after the
/// lost reply is found at the next read-back, not only once the whole
/// settle delay has passed.
#[tokio::test]
async fn read_backs_continue_during_the_settle_window() {
    let clock = ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: "[routes.read_back]\npath = \"/v1/charges?idempotency_key={provider_key}\"\n\
                      found_pointer = \"/data/0\"\nsettle_delay_ms = 6000\n"
            .into(),
        more: "[reconcile]\nenabled = false\nbackoff_base_ms = 200\nbackoff_max_ms = 60000\n"
            .into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    app.mock.provider.set_faults(mock_provider::Faults {
        readback_hidden: true,
        ..Default::default()
    });
    let r = app
        .charge_with(
            "lagging",
            r#"{"amount":1}"#,
            &[("X-Mock-Fault", "drop-after-effect")],
        )
        .await;
    assert_eq!(r.status(), 502);
    app.tick().await;
    assert_eq!(app.op_json("lagging").await["state"], "UNKNOWN");
    assert_eq!(app.mock.provider.readbacks(), 1);
    // One second later the provider's search shows the charge.
    app.mock
        .provider
        .set_faults(mock_provider::Faults::default());
    clock.advance(1_000);
    app.tick().await;
    let op = app.op_json("lagging").await;
    assert_eq!(op["state"], "COMPLETED", "found within the window: {op}");
    assert_eq!(app.mock.provider.readbacks(), 2);
    assert_eq!(app.mock.provider.effects(), 1);
}

/// A gateway whose route `tools` (`/tools/`, MCP, effect class
/// `notification`, plus `route_extra`) goes to `server`, served on a port
/// of its own; reconciliation off.
async fn mcp_gateway(server: axum::Router, route_extra: &str) -> TestApp {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, server).await.unwrap() });
    spawn_with(Opts {
        more: format!(
            "[[routes]]\nname = \"tools\"\nprefix = \"/tools/\"\nupstream = \"http://{addr}\"\n\
             mode = \"mcp\"\neffect_class = \"notification\"\n{route_extra}\n\
             [reconcile]\nenabled = false\n"
        ),
        ..Default::default()
    })
    .await
}

/// An MCP server that streams its tool result as SSE and then leaves the
/// stream open: the result message decides (COMPLETED, stored whole), and
/// the gateway closes the stream after it instead of waiting it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_tool_result_decides_even_when_the_stream_stays_open() {
    use axum::response::IntoResponse;
    use futures_util::StreamExt as _;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = calls.clone();
    let server = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |body: axum::body::Bytes| {
            let c = c.clone();
            async move {
                let msg: Value = serde_json::from_slice(&body).unwrap();
                let id = msg["id"].clone();
                match msg["method"].as_str() {
                    Some("tools/call") => {
                        c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let events = format!(
                            "event: message\ndata: {}\n\nevent: message\ndata: {}\n\n",
                            serde_json::json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}),
                            serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"content":[{"type":"text","text":"sent"}],"isError":false}})
                        );
                        let stream = futures_util::stream::once(async move {
                            Ok::<_, std::io::Error>(axum::body::Bytes::from(events))
                        })
                        .chain(futures_util::stream::pending());
                        (
                            [("content-type", "text/event-stream")],
                            axum::body::Body::from_stream(stream),
                        )
                            .into_response()
                    }
                    Some("tools/list") => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,
                        "result":{"tools":[{"name":"send","inputSchema":{"type":"object"}}]}}))
                    .into_response(),
                    _ => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,"result":{}}))
                        .into_response(),
                }
            }
        }),
    );
    let app = mcp_gateway(server, "response_timeout_ms = 20000").await;
    let started = Instant::now();
    let r = app
        .http
        .post(app.proxy("/tools/mcp"))
        .bearer_auth(KEY_A)
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .body(r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send","arguments":{"to":"x"},"_meta":{"effectgate/operation-id":"sse-open"}}}"#)
        .timeout(Duration::from_secs(15))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["result"]["content"][0]["text"], "sent", "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "not held until the response timeout: {:?}",
        started.elapsed()
    );
    let op = app.op_json("sse-open").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An MCP read-back whose answer repeats a key, in the JSON body, in the
/// data of the SSE event that carries it, or in the tool's text, decides
/// nothing: the operation stays UNKNOWN and the tool isn't called again,
/// where a parser that keeps a key's last value would have found the
/// effect (RFC 7493 §2.3). The same answer without the repeated key
/// completes its operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_read_back_answer_that_repeats_a_key_decides_nothing() {
    use axum::response::IntoResponse;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let sends = std::sync::Arc::new(AtomicUsize::new(0));
    let s = sends.clone();
    let server = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |body: axum::body::Bytes| {
            let s = s.clone();
            async move {
                let msg: Value = serde_json::from_slice(&body).unwrap();
                let id = msg["id"].clone();
                let args = &msg["params"]["arguments"];
                match (msg["method"].as_str(), msg["params"]["name"].as_str()) {
                    (Some("tools/call"), Some("send")) => {
                        s.fetch_add(1, Ordering::SeqCst);
                        (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "lost").into_response()
                    }
                    (Some("tools/call"), Some("status")) => {
                        let key = args["key"].as_str().unwrap();
                        // `found` twice, false then true.
                        let repeated = format!(r#"{{"key":"{key}","found":false,"found":true}}"#);
                        let answer = |result: String| format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#);
                        let structured = answer(format!(
                            r#"{{"content":[],"structuredContent":{repeated},"isError":false}}"#
                        ));
                        match args["to"].as_str().unwrap() {
                            "json" => ([("content-type", "application/json")], structured)
                                .into_response(),
                            "sse" => (
                                [("content-type", "text/event-stream")],
                                format!("event: message\ndata: {structured}\n\n"),
                            )
                                .into_response(),
                            "text" => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,
                                "result":{"content":[{"type":"text","text":repeated}],"isError":false}}))
                            .into_response(),
                            _ => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,
                                "result":{"content":[],"structuredContent":{"key":key,"found":true},"isError":false}}))
                            .into_response(),
                        }
                    }
                    (Some("tools/list"), _) => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,
                        "result":{"tools":[
                            {"name":"send","inputSchema":{"type":"object"}},
                            {"name":"status","inputSchema":{"type":"object"},"annotations":{"readOnlyHint":true}}
                        ]}}))
                    .into_response(),
                    _ => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,"result":{}}))
                        .into_response(),
                }
            }
        }),
    );
    let app = mcp_gateway(
        server,
        "[routes.read_back]\ntool = \"status\"\n\
         arguments = { to = \"{body:/params/arguments/to}\", key = \"{provider_key}\" }\n\
         found_pointer = \"\"\nmatch = { \"/found\" = \"true\", \"/key\" = \"{provider_key}\" }\n\
         settle_delay_ms = 0\n",
    )
    .await;
    let modes = ["json", "sse", "text", "good"];
    for mode in modes {
        let call = serde_json::json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{
            "name":"send","arguments":{"to":mode},"_meta":{"effectgate/operation-id":format!("rb-{mode}")}}});
        let r = app
            .http
            .post(app.proxy("/tools/mcp"))
            .bearer_auth(KEY_A)
            .header("Accept", "application/json, text/event-stream")
            .json(&call)
            .send()
            .await
            .unwrap();
        // A JSON-RPC error, in a 200, for the lost reply.
        assert_eq!(r.status(), 200, "{mode}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["error"]["data"]["type"], "urn:effectgate:problem:operation-outcome-unknown",
            "{mode}: {v}"
        );
        assert_eq!(app.op_json(&format!("rb-{mode}")).await["state"], "UNKNOWN");
    }
    app.tick().await;
    for mode in modes {
        let op = app.op_json(&format!("rb-{mode}")).await;
        let want = if mode == "good" {
            "COMPLETED"
        } else {
            "UNKNOWN"
        };
        assert_eq!(op["state"], want, "{mode}: {op}");
    }
    assert_eq!(
        sends.load(Ordering::SeqCst),
        modes.len(),
        "no call sent again"
    );
}

/// An MCP server that never ends its answers, or never answers its
/// `initialize`: the gateway reads at most the route's MCP answer limit
/// (16 MiB) of any answer it reads itself, and waits for its own session
/// at most `response_timeout_ms`. Each caller gets an answer saying so,
/// long before any of those answers would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_that_never_ends_its_answers_is_read_within_bounds() {
    use axum::response::IntoResponse;
    use futures_util::StreamExt as _;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    // A JSON head, then spaces without end.
    fn endless(head: String) -> axum::body::Body {
        let spaces = axum::body::Bytes::from(vec![b' '; 64 << 10]);
        axum::body::Body::from_stream(
            futures_util::stream::once(async move { Ok::<_, std::io::Error>(head.into()) }).chain(
                futures_util::stream::repeat_with(move || Ok(spaces.clone())),
            ),
        )
    }
    let sends = std::sync::Arc::new(AtomicUsize::new(0));
    let inits = std::sync::Arc::new(AtomicUsize::new(0));
    let (s, i) = (sends.clone(), inits.clone());
    let server = axum::Router::new().route(
        "/mcp",
        axum::routing::post(move |body: axum::body::Bytes| {
            let (s, i) = (s.clone(), i.clone());
            async move {
                let msg: Value = serde_json::from_slice(&body).unwrap();
                let id = msg["id"].clone();
                match (msg["method"].as_str(), msg["params"]["name"].as_str()) {
                    (Some("tools/list"), _) => (
                        [("content-type", "application/json")],
                        endless(format!(
                            r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":["#
                        )),
                    )
                        .into_response(),
                    (Some("tools/call"), Some("refuse")) => (
                        axum::http::StatusCode::BAD_REQUEST,
                        endless("not json ".into()),
                    )
                        .into_response(),
                    // The caller's session is gone (404), once; the
                    // gateway's own session then never opens.
                    (Some("tools/call"), Some("send")) if s.fetch_add(1, SeqCst) == 0 => {
                        axum::http::StatusCode::NOT_FOUND.into_response()
                    }
                    (Some("tools/call"), _) => {
                        axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,
                        "result":{"content":[{"type":"text","text":"sent"}],"isError":false}}))
                        .into_response()
                    }
                    (Some("initialize"), _) => {
                        i.fetch_add(1, SeqCst);
                        std::future::pending::<axum::response::Response>().await
                    }
                    _ => axum::Json(serde_json::json!({"jsonrpc":"2.0","id":id,"result":{}}))
                        .into_response(),
                }
            }
        }),
    );
    let app = mcp_gateway(
        server,
        "response_timeout_ms = 5000\n\
         retry = { max_attempts = 3, base_delay_ms = 1, max_delay_ms = 1 }",
    )
    .await;
    let call = |body: String| {
        app.http
            .post(app.proxy("/tools/mcp"))
            .bearer_auth(KEY_A)
            .header("Accept", "application/json, text/event-stream")
            .header("Content-Type", "application/json")
            .body(body)
            .timeout(Duration::from_secs(30))
            .send()
    };
    let tool_call = |name: &str, intent: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"{name}","arguments":{{"to":"x"}},"_meta":{{"effectgate/operation-id":"{intent}"}}}}}}"#
        )
    };

    // tools/list: read up to the limit, then refused.
    let started = Instant::now();
    let r = call(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#.into())
        .await
        .unwrap();
    let (status, text) = (r.status(), r.text().await.unwrap());
    assert!(
        text.contains("larger than 16777216 bytes") && text.contains("provider-answer-unreadable"),
        "{status}: {text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );

    // A refused tool call whose error body never ends: FAILED, and the
    // caller's JSON-RPC error says how much was read.
    let r = call(tool_call("refuse", "refuse-1")).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("400 Bad Request") && message.contains("bytes read, the rest dropped"),
        "{v}"
    );
    assert_eq!(app.op_json("refuse-1").await["state"], "FAILED");

    // A lost session (404), then an `initialize` that never answers: the
    // new attempt goes out without a session after `response_timeout_ms`.
    let started = Instant::now();
    let r = call(tool_call("send", "send-1")).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["result"]["content"][0]["text"], "sent", "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(inits.load(SeqCst), 1);
    assert_eq!(sends.load(SeqCst), 2);
    assert_eq!(app.op_json("send-1").await["state"], "COMPLETED");
}

/// A refused call's policy decisions never show up in the history of an
/// operation that later uses the same key, and the sweeper removes them.
#[tokio::test]
async fn refused_calls_decisions_are_scoped_and_swept() {
    let clock = ManualClock::new(1_000_000_000);
    let app = spawn_with(Opts {
        route_extra: "key_retention_hours = 1".into(),
        tenant_a: format!(
            "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000, currencies = [\"eur\"] }}\n",
            policy_wasm("amount_threshold").display()
        ),
        more: "[reconcile]\nenabled = false\n".into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let ledger = &app.gw.state.ledger;
    // Refused (btc is not allowed): a decision, no operation.
    assert_eq!(
        app.charge("k", r#"{"amount":5,"currency":"btc"}"#)
            .await
            .status(),
        403
    );
    assert_eq!(ledger.decisions("a", "k").await.unwrap().len(), 1);
    clock.advance(1_000);
    // The same key, allowed: its history holds only its own decision.
    assert_eq!(
        app.charge("k", r#"{"amount":5,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    let op = app.op_json("k").await;
    let decisions = op["policy_decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert_eq!(decisions[0]["decision"], "allow");
    // A refusal under a key that never becomes an operation is swept.
    assert_eq!(
        app.charge("never", r#"{"amount":5,"currency":"btc"}"#)
            .await
            .status(),
        403
    );
    effectgate::workers::sweeper::sweep(&app.gw.state, 100, 10)
        .await
        .unwrap();
    assert_eq!(
        ledger.decisions("a", "never").await.unwrap().len(),
        1,
        "young: kept"
    );
    clock.advance(2 * 3_600_000);
    effectgate::workers::sweeper::sweep(&app.gw.state, 100, 10)
        .await
        .unwrap();
    assert!(
        ledger.decisions("a", "never").await.unwrap().is_empty(),
        "old: swept"
    );
}

/// One tenant's backlog of slow reconciliations doesn't hold another
/// tenant's lost reply behind it: a's one operation is reconciled in the
/// scan's first wave, ahead of b's twenty older ones.
#[tokio::test]
async fn the_reconciler_serves_tenants_fairly() {
    let app = spawn_with(Opts {
        route_extra: "[routes.read_back]\npath = \"/v1/charges?idempotency_key={provider_key}\"\n\
                      found_pointer = \"/data/0\"\nsettle_delay_ms = 0\n"
            .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    let lose = |api_key: &'static str, key: String| {
        let app = &app;
        async move {
            let r = app.charge_as(api_key, &key, r#"{"amount":1}"#).await;
            assert_eq!(r.status(), 502, "{key}");
        }
    };
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 21,
        ..Default::default()
    });
    for i in 0..20 {
        lose(KEY_B, format!("b-{i}")).await;
    }
    lose(KEY_A, "a-1".into()).await;
    app.mock.provider.set_faults(mock_provider::Faults {
        readback_delay_ms: 150,
        ..Default::default()
    });
    let steps = app.tick().await;
    assert_eq!(steps.len(), 21);
    let pos = steps
        .iter()
        .position(|(t, id, _)| t == "a" && id == "a-1")
        .unwrap();
    assert!(pos < 8, "a's operation ran in the first wave (step {pos})");
    assert_eq!(app.op_json("a-1").await["state"], "COMPLETED");
}

/// A webhook event that can't be delivered is tried within its budget,
/// then dead-lettered (admin API), never retried forever; delivered events
/// are swept after their retention.
#[tokio::test]
async fn undeliverable_webhook_events_are_dead_lettered_and_delivered_ones_swept() {
    let clock = ManualClock::new(1_000_000_000);
    let rx = effectgate_tests::receiver::spawn_receiver().await;
    // SAFETY: set before the gateway reads its config; the same value in every test.
    unsafe { std::env::set_var("TEST_WEBHOOK_SECRET", "whsec_test") };
    let threshold = format!(
        "[[tenants.policies]]\nroute = \"payments\"\nmodule = \"{}\"\nconfig = {{ threshold = 1000 }}\n",
        policy_wasm("amount_threshold").display()
    );
    let app = spawn_with(Opts {
        route_extra: "effect_class = \"payment\"".into(),
        // Tenant a's receiver is down (nothing listens on port 9).
        tenant_a: format!(
            "webhook = {{ url = \"http://127.0.0.1:9/hook\", secret_env = \"TEST_WEBHOOK_SECRET\" }}\n{threshold}"
        ),
        tenant_b: format!(
            "webhook = {{ url = \"{}\", secret_env = \"TEST_WEBHOOK_SECRET\" }}\n{threshold}",
            rx.url
        ),
        more: "[reconcile]\nenabled = false\noutbox_max_attempts = 2\noutbox_retention_ms = 60000\n".into(),
        clock: Some(clock.clone()),
        ..Default::default()
    })
    .await;
    let big = r#"{"amount":5000,"currency":"eur"}"#;
    assert_eq!(app.charge("hook-a", big).await.status(), 202);
    assert_eq!(app.charge_as(KEY_B, "hook-b", big).await.status(), 202);
    let relay = || effectgate::workers::outbox::relay_once(&app.gw.state);
    assert_eq!(relay().await.unwrap(), 1, "b's event delivered");
    assert_eq!(rx.got.lock().unwrap().len(), 1);
    let ledger = &app.gw.state.ledger;
    assert_eq!(
        ledger.pending_events().await.unwrap(),
        1,
        "a's waits for its retry"
    );
    clock.advance(10_000);
    assert_eq!(relay().await.unwrap(), 0);
    assert_eq!(
        ledger.pending_events().await.unwrap(),
        0,
        "a's budget is spent"
    );
    let r = app
        .http
        .get(app.admin("/admin/tenants/a/events/dead-letters"))
        .bearer_auth(OPERATOR_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let dead = v["dead_events"].as_array().unwrap();
    assert_eq!(dead.len(), 1, "{v}");
    assert_eq!(dead[0]["event_type"], "approval.created");
    assert_eq!(dead[0]["attempts"], 2);
    assert!(dead[0]["last_error"].as_str().unwrap().len() > 3, "{v}");
    assert!(
        dead[0]["dead_lettered_at_rfc3339"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
    clock.advance(600_000);
    assert_eq!(relay().await.unwrap(), 0, "never tried again");
    // b's delivered event is past its retention: swept; a's dead one kept.
    assert!(ledger.events("b").await.unwrap().is_empty());
    assert_eq!(ledger.events("a").await.unwrap().len(), 1);
}

/// The reconciler's scan doesn't wait for the executions it starts: b's
/// eight new attempts at a slow provider (2.5 s each, inside the route's
/// 3 s response timeout) go on in the
/// background while a's lost reply is found in the same scan, which
/// returns well before any of b's attempts could have ended.
#[tokio::test]
async fn reconciler_executions_run_detached_from_the_scan() {
    let app = spawn_with(Opts {
        route_extra: "[routes.read_back]\npath = \"/v1/charges?idempotency_key={provider_key}\"\n\
                      found_pointer = \"/data/0\"\nsettle_delay_ms = 0\n"
            .into(),
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    // b: eight 500s, nothing applied: UNKNOWN, and absent on read-back.
    app.mock.provider.set_faults(mock_provider::Faults {
        fail_status: 500,
        fail_status_times: 8,
        ..Default::default()
    });
    for i in 0..8 {
        let r = app
            .charge_as(KEY_B, &format!("b-{i}"), r#"{"amount":1}"#)
            .await;
        assert_eq!(r.status(), 502);
    }
    // a: the effect is applied and the reply lost.
    app.mock.provider.set_faults(mock_provider::Faults {
        drop_after_effect_times: 1,
        ..Default::default()
    });
    assert_eq!(
        app.charge_as(KEY_A, "a-1", r#"{"amount":1}"#)
            .await
            .status(),
        502
    );
    assert_eq!(app.mock.provider.effects(), 1);
    // b's new attempts will each take 2.5 s at the provider.
    app.mock.provider.set_faults(mock_provider::Faults {
        delay_ms: 2_500,
        delay_times: 8,
        ..Default::default()
    });
    let tracker = tokio_util::task::TaskTracker::new();
    let started = Instant::now();
    let steps = effectgate::workers::reconciler::scan(
        &app.gw.state,
        effectgate::ops::reconcile::Execution::Detach(&tracker),
    )
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2_500),
        "the scan took {took:?}"
    );
    use effectgate::ops::reconcile::Step;
    let step_of = |id: &str| {
        steps
            .iter()
            .find(|(_, i, _)| i == id)
            .map(|(_, _, s)| s.clone())
    };
    assert_eq!(step_of("a-1"), Some(Step::Found));
    for i in 0..8 {
        assert_eq!(
            step_of(&format!("b-{i}")),
            Some(Step::ExecutionStarted),
            "b-{i}"
        );
    }
    assert_eq!(app.op_json("a-1").await["state"], "COMPLETED");
    // The detached attempts finish on their own, one effect each.
    tracker.close();
    tokio::time::timeout(Duration::from_secs(30), tracker.wait())
        .await
        .expect("the detached executions end");
    assert_eq!(app.mock.provider.effects(), 9);
    let b = app
        .http
        .get(app.admin("/admin/tenants/b/operations/b-0"))
        .bearer_auth(ADMIN_B)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(b["state"], "COMPLETED", "{b}");
}

/// A tenant's stored-bytes quota: new operations past it get 507 and
/// reach neither the ledger nor the provider; a duplicate of a stored
/// operation is still replayed, and another tenant is unaffected.
#[tokio::test]
async fn a_tenants_stored_bytes_quota_refuses_new_operations_with_507() {
    let app = spawn_with(Opts {
        tenant_a: "max_stored_bytes = 1500".into(),
        ..Default::default()
    })
    .await;
    let body = format!(r#"{{"amount":1,"pad":"{}"}}"#, "x".repeat(200));
    let mut accepted = 0;
    let mut refused = None;
    for i in 0..20 {
        let r = app.charge_as(KEY_A, &format!("q-{i}"), &body).await;
        if r.status() == 507 {
            refused = Some((i, r.json::<Value>().await.unwrap()));
            break;
        }
        assert_eq!(r.status(), 200, "q-{i}");
        accepted += 1;
    }
    let (i, p) = refused.expect("the quota refuses a call within 20");
    assert!(accepted >= 1, "room for at least one call");
    assert_eq!(p["type"], "urn:effectgate:problem:tenant-quota-exceeded");
    assert_eq!(p["status"], 507);
    assert_eq!(p["limit_bytes"], 1500);
    let stored = app.gw.state.ledger.stored_bytes("a").await.unwrap();
    assert_eq!(p["stored_bytes"], stored, "{p}");
    assert!(stored as usize + body.len() > 1500, "{stored}");
    // Nothing of the refused call was recorded or sent.
    assert_eq!(
        app.operation(ADMIN_A, "a", &format!("q-{i}"))
            .await
            .status(),
        404
    );
    assert_eq!(app.mock.provider.effects(), accepted);
    // A duplicate is answered from the ledger, quota or not.
    let dup = app.charge_as(KEY_A, "q-0", &body).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    // Tenant b has no quota.
    assert_eq!(app.charge_as(KEY_B, "b-1", &body).await.status(), 200);
    assert!(
        app.metrics()
            .await
            .lines()
            .any(|l| l.starts_with("effectgate_tenant_limited_total")
                && l.contains("limit=\"stored-bytes\"")
                && l.contains("tenant=\"a\"")
                && l.ends_with(" 1")),
        "the refusal is counted"
    );
}

/// A key reused with an amount that differs from the first only past a
/// double's precision is 422, not a replay of the first charge; the same
/// body sent again is replayed.
#[tokio::test]
async fn amounts_past_a_doubles_precision_are_other_arguments() {
    let app = spawn_app().await;
    let first = r#"{"amount":1234567890123456789,"currency":"eur"}"#;
    let other = r#"{"amount":1234567890123456788,"currency":"eur"}"#;
    assert_eq!(app.charge_as(KEY_A, "big-1", first).await.status(), 200);
    let r = app.charge_as(KEY_A, "big-1", other).await;
    assert_eq!(r.status(), 422);
    let p = r.json::<Value>().await.unwrap();
    assert_eq!(
        p["type"], "urn:effectgate:problem:idempotency-key-reused",
        "{p}"
    );
    let again = app.charge_as(KEY_A, "big-1", first).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// Calls checked against the stored-bytes quota at once are counted
/// together: of twelve concurrent new operations with room for three
/// bodies, at most three are recorded and sent, the rest get 507. (Tenant
/// `b`: the refusal counter is the process's, and the test above counts
/// tenant `a`'s.)
#[tokio::test]
async fn concurrent_calls_do_not_pass_the_stored_bytes_quota_together() {
    let body = format!(r#"{{"amount":1,"pad":"{}"}}"#, "x".repeat(200));
    let limit = body.len() * 7 / 2;
    let app = spawn_with(Opts {
        tenant_b: format!("max_stored_bytes = {limit}"),
        ..Default::default()
    })
    .await;
    let calls = (0..12).map(|i| {
        let (app, body) = (&app, &body);
        async move {
            app.charge_as(KEY_B, &format!("cq-{i}"), body)
                .await
                .status()
        }
    });
    let statuses = futures_util::future::join_all(calls).await;
    let accepted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 507).count();
    assert_eq!(accepted + refused, 12, "{statuses:?}");
    assert!(
        (1..=3).contains(&accepted),
        "{accepted} admitted: {statuses:?}"
    );
    assert_eq!(app.mock.provider.effects(), accepted);
    assert_eq!(
        app.gw.state.quota_holds.held("b"),
        0,
        "every hold is given back"
    );
}

/// A body that can't be read whole (shorter than its Content-Length and
/// then closed, a chunk cut off, a chunk size that is no number) is a 400
/// naming the body, not a 413 (a body over the limit: the proxy's unit
/// test of `exceeds_limit`). Nothing is reserved or forwarded for any of
/// them.
#[tokio::test]
async fn a_body_cut_off_or_malformed_is_400_not_413() {
    let app = spawn_app().await;
    let head = |key: &str, framing: &str| {
        format!(
            "POST /pay/v1/charges HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {KEY_A}\r\n\
             Idempotency-Key: {key}\r\nContent-Type: application/json\r\n{framing}\r\n"
        )
    };
    for (key, request) in [
        (
            "short",
            head("short", "Content-Length: 100\r\n") + "{\"amount\":1}",
        ),
        (
            "cut-chunk",
            head("cut-chunk", "Transfer-Encoding: chunked\r\n") + "20\r\n{\"amount\":1",
        ),
        (
            "bad-chunk",
            head("bad-chunk", "Transfer-Encoding: chunked\r\n") + "zz\r\n{}\r\n0\r\n\r\n",
        ),
    ] {
        let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
            .await
            .unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        // The caller stops sending: the body ends short.
        s.shutdown().await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer))
            .await
            .expect("answered and closed in time")
            .unwrap();
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 400"), "{key}: {text}");
        assert!(
            text.contains("urn:effectgate:problem:bad-request"),
            "{key}: {text}"
        );
        assert!(text.contains("\"field\":\"body\""), "{key}: {text}");
        assert_eq!(
            app.operation(ADMIN_A, "a", key).await.status(),
            404,
            "{key}"
        );
    }
    assert!(app.mock.provider.requests().is_empty());
}

/// An HTTP/1.1 request without a Host, or any with two, is 400 naming
/// `header:Host` (RFC 9112 §3.2), before authentication, the ledger or the
/// provider; HTTP/1.0 needs none.
#[tokio::test]
async fn a_request_without_exactly_one_host_is_400() {
    const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;
    let app = spawn_app().await;
    let request = |version: &str, hosts: &str, key: &str| {
        format!(
            "POST /pay/v1/charges {version}\r\n{hosts}Authorization: Bearer {KEY_A}\r\n\
             Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{BODY}",
            BODY.len()
        )
    };
    for (version, hosts, key) in [
        ("HTTP/1.1", "", "no-host"),
        ("HTTP/1.1", "Host: a\r\nHost: b\r\n", "two-hosts"),
    ] {
        let status = raw_status(&app, request(version, hosts, key)).await;
        assert_eq!(status, "HTTP/1.1 400 Bad Request", "{key}");
        assert_eq!(
            app.operation(ADMIN_A, "a", key).await.status(),
            404,
            "{key}"
        );
    }
    assert!(app.mock.provider.requests().is_empty());
    let status = raw_status(&app, request("HTTP/1.0", "", "http-1-0")).await;
    assert_eq!(status, "HTTP/1.0 200 OK");
    assert_eq!(app.mock.provider.effects(), 1);
}

/// Sends `head` (a raw HTTP/1.1 request head, CRLFs included, body after)
/// to the proxy and returns the status line.
async fn raw_status(app: &TestApp, head: String) -> String {
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut resp = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut resp)).await;
    resp.lines().next().unwrap_or_default().to_owned()
}

/// What an outsider found from the README alone, each refused before any
/// policy, ledger row or provider call: a standard method in another case
/// (`post` skipped the ledger on `effectful_methods = ["POST"]`), a method
/// override header, a JSON body with a repeated key under another media
/// type, a key with structured-field parameters (`k;a=1` and `k;a=2` were
/// one key), and `..;` path segments. A caller's credential header is
/// forwarded and stored for new attempts, but shown redacted.
#[tokio::test]
async fn outsider_findings_are_refused() {
    let app = spawn_app().await;
    let body = r#"{"amount":5}"#;
    for method in ["post", "Post"] {
        let head = format!(
            "{method} /pay/v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let status = raw_status(&app, head).await;
        assert!(status.starts_with("HTTP/1.1 400"), "{method}: {status}");
    }
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("X-HTTP-Method-Override", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "header:x-http-method-override");
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "dup-text")
        .header("Content-Type", "text/plain")
        .body(r#"{"amount":5000,"amount":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "a repeated key under text/plain");
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "order-42;item=1")
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:idempotency-key-invalid");
    let status = raw_status(
        &app,
        format!(
            "GET /pay/..;/admin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    assert_eq!(
        app.mock.provider.requests().len(),
        0,
        "nothing reached the provider"
    );

    // A credential header: forwarded and stored, shown redacted.
    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "with-cookie")
        .header("Content-Type", "application/json")
        .header("Cookie", "session=s3cr3t")
        .header("X-Api-Key", "s3cr3t")
        .header("Ocp-Apim-Subscription-Key", "s3cr3t")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = &app.mock.provider.requests()[0];
    assert!(
        seen.headers
            .iter()
            .any(|(n, v)| n == "cookie" && v == "session=s3cr3t")
    );
    let op = app.op_json("with-cookie").await;
    let text = op.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    let headers = op["request_headers"].as_array().unwrap();
    assert!(
        headers
            .iter()
            .any(|h| h[0] == "cookie" && h[1] == "[redacted]"),
        "{headers:?}"
    );
    // The list of operations shows the same row redacted too.
    let r = app
        .http
        .get(app.admin("/admin/tenants/a/operations?limit=10"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let list: Value = r.json().await.unwrap();
    let row = list["operations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["operation_id"] == "with-cookie")
        .expect("the operation is listed");
    let text = row.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    let redacted: Vec<&str> = row["request_headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h[1] == "[redacted]")
        .map(|h| h[0].as_str().unwrap())
        .collect();
    for name in ["cookie", "x-api-key", "ocp-apim-subscription-key"] {
        assert!(redacted.contains(&name), "{name} in {redacted:?}");
    }
    // Other headers are shown as sent.
    assert!(
        row["request_headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "content-type" && h[1] == "application/json"),
        "{row}"
    );
}

/// A request head that never completes is answered 408 `request-timeout`
/// at `limits.header_read_timeout_ms` and the connection closed; nothing
/// reaches the ledger or the provider.
#[tokio::test]
async fn a_head_that_never_completes_gets_408() {
    let app = spawn_with(Opts {
        more: "[limits]\nheader_read_timeout_ms = 500\n".into(),
        ..Default::default()
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(app.gw.proxy_addr)
        .await
        .unwrap();
    let started = Instant::now();
    s.write_all(
        b"POST /pay/v1/charges HTTP/1.1\r\nHost: gateway\r\nIdempotency-Key: never\r\nX-Slow: ",
    )
    .await
    .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut resp))
        .await
        .expect("the gateway closes the connection")
        .unwrap();
    let took = started.elapsed();
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(
        resp.contains("urn:effectgate:problem:request-timeout"),
        "{resp}"
    );
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_millis(2_000),
        "{took:?}"
    );
    assert_eq!(app.operation(ADMIN_A, "a", "never").await.status(), 404);
    assert_eq!(app.mock.provider.requests().len(), 0);
    // A head that arrives whole is served as ever.
    let r = app
        .http
        .get(app.proxy("/pay/v1/charges?client_ref=x"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// What a second outsider found: a request head whose lines end in a bare
/// LF (RFC 9112 §2.2 lets a server take it) waited for the header timeout
/// and got 408 (here that timeout is 60 s, past `raw_status`' 10 s wait);
/// a method override header spelt with `_` for `-` (which CGI-style
/// servers read as the same variable) was forwarded; a second
/// `Authorization` was ignored, so a proxy in front that takes the last
/// one would disagree about the tenant; `Transfer-Encoding: gzip, chunked`
/// was read as chunked, the gzip bytes taken for the body. Nothing of the
/// refused ones reaches the ledger or the provider.
#[tokio::test]
async fn second_outsider_findings() {
    let app = spawn_with(Opts {
        more: "[limits]\nheader_read_timeout_ms = 60000\n".into(),
        ..Default::default()
    })
    .await;
    let body = r#"{"amount":5}"#;
    let status = raw_status(
        &app,
        format!(
            "POST /pay/v1/charges HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY_A}\n\
             Idempotency-Key: bare-lf\nContent-Type: application/json\nContent-Length: {}\n\
             Connection: close\n\n{body}",
            body.len()
        ),
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(app.mock.provider.effects(), 1);

    let r = app
        .http
        .get(app.proxy("/pay/v1/charges"))
        .bearer_auth(KEY_A)
        .header("X_HTTP_METHOD_OVERRIDE", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "header:x_http_method_override");

    let r = app
        .http
        .post(app.proxy("/pay/v1/charges"))
        .header("Authorization", format!("Bearer {KEY_A}"))
        .header("Authorization", format!("Bearer {KEY_B}"))
        .header("Idempotency-Key", "two-credentials")
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "header:Authorization");
    assert_eq!(
        app.operation(ADMIN_A, "a", "two-credentials")
            .await
            .status(),
        404
    );
    // `gzip, chunked`: the parser takes it as chunked and would hand on
    // the gzip bytes as the body (RFC 9112 §6.1: 501).
    let status = raw_status(
        &app,
        format!(
            "POST /pay/v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\
             Idempotency-Key: coded\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n\
             {:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        ),
    )
    .await;
    assert_eq!(status, "HTTP/1.1 501 Not Implemented");
    assert_eq!(app.operation(ADMIN_A, "a", "coded").await.status(), 404);
    assert_eq!(
        app.mock.provider.requests().len(),
        1,
        "only the bare-LF call reached the provider"
    );
}

/// Operators' and callers' input mistakes on the admin API and the proxy's
/// own routes: each is a problem+json naming its field, asked in the
/// right order (who, then what), and changes nothing.
#[tokio::test]
async fn admin_and_own_route_mistakes_are_named_and_change_nothing() {
    let app = spawn_with(Opts {
        more: "[reconcile]\nenabled = false\n".into(),
        ..Default::default()
    })
    .await;
    assert_eq!(
        app.charge("k", r#"{"amount":100,"currency":"eur"}"#)
            .await
            .status(),
        200
    );
    let before = app.op_json("k").await;
    let problem = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(ct.starts_with("application/problem+json"), "{status} {ct}");
        let v: Value = r.json().await.unwrap();
        (status, v["field"].as_str().unwrap_or_default().to_owned())
    };

    // A requeue carrying a resolution's fields is refused by name.
    let r = app
        .admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/k/requeue",
            r#"{"outcome":"completed","provider_reference":"ch_1"}"#,
        )
        .await;
    assert_eq!(problem(r).await, (400, "body.outcome".to_owned()));
    let after = app.op_json("k").await;
    assert_eq!(
        (&after["state"], &after["version"]),
        (&before["state"], &before["version"])
    );
    assert_eq!(app.mock.provider.effects(), 1);

    // A resolution's reference longer than the limit (255 bytes) is
    // refused before anything is looked up or leased.
    // A NUL would be stored as three bytes (U+FFFD): refused too.
    let long = "r".repeat(256);
    for bad in [long.as_str(), "ch\\u0000_1"] {
        let r = app
            .admin_post(
                OPERATOR_A,
                "/admin/tenants/a/operations/k/resolve",
                &format!(r#"{{"outcome":"completed","provider_reference":"{bad}"}}"#),
            )
            .await;
        assert_eq!(
            problem(r).await,
            (400, "body.provider_reference".to_owned()),
            "{bad}"
        );
    }
    let r = app
        .admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/k/resolve",
            &format!(
                r#"{{"outcome":"completed","provider_reference":"{}"}}"#,
                &long[1..]
            ),
        )
        .await;
    assert_eq!(r.status(), 409, "255 bytes pass, to the state check");
    let after = app.op_json("k").await;
    assert_eq!(after["version"], before["version"]);

    // No key and a bad body: 401 first, on every action.
    for path in [
        "/admin/tenants/a/approvals/x/approve",
        "/admin/tenants/a/approvals/x/reject",
        "/admin/tenants/a/operations/k/replay",
        "/admin/tenants/a/operations/k/compensate",
        "/admin/tenants/a/operations/k/requeue",
    ] {
        let r = app
            .http
            .post(app.admin(path))
            .body("[1]")
            .send()
            .await
            .unwrap();
        assert_eq!(problem(r).await.0, 401, "{path}");
    }

    // The proxy's own routes name a path segment that is no UTF-8.
    let r = app
        .http
        .get(app.proxy("/approvals/%FF"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(problem(r).await, (400, "path:id".to_owned()));
    let r = app
        .http
        .post(app.proxy("/inbox/%FF"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(problem(r).await, (400, "path:name".to_owned()));

    // The approvals list checks its parameters like every other list.
    for (query, field) in [
        ("limit=abc", "query:limit"),
        ("limit=0", "query:limit"),
        ("stauts=pending", "query:stauts"),
    ] {
        let r = app
            .http
            .get(app.admin(&format!("/admin/tenants/a/approvals?{query}")))
            .bearer_auth(ADMIN_A)
            .send()
            .await
            .unwrap();
        assert_eq!(problem(r).await, (400, field.to_owned()), "{query}");
    }
    let r = app
        .http
        .get(app.admin("/admin/tenants/a/approvals?status=pending&limit=5"))
        .bearer_auth(ADMIN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A provider written by hand: it answers each request with the bytes
/// `reply` gives for its path (`None`: no answer at all, the connection
/// kept open), and counts the requests per path.
async fn scripted_provider(
    reply: fn(&str) -> Option<Vec<u8>>,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let counts = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < end + 4 + len {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    }
                    buf.drain(..end + 4 + len);
                    *seen.lock().unwrap().entry(path.clone()).or_insert(0) += 1;
                    match reply(&path) {
                        Some(bytes) => s.write_all(&bytes).await.unwrap(),
                        None => std::future::pending::<()>().await,
                    }
                }
            });
        }
    });
    (addr, counts)
}

/// What a hostile or broken provider sends is not passed on as it came:
/// - an answer with both `Content-Length` and `Transfer-Encoding` reaches
///   the caller whole, read by its transfer coding (RFC 9112 §6.3), on
///   an effectful route (stored and replayed) and a pass-through one: its
///   `Content-Length` would have told the caller a shorter length;
/// - a status of no class HTTP defines (999) leaves the effect unknown:
///   UNKNOWN `provider-protocol`, 502, where it was FAILED (no effect);
/// - a `Retry-After` date an hour past the answer's `Date` ends the
///   retries at once (dead letter `retry-after-too-long`), one attempt;
/// - on a pass-through route, a `101` nobody asked for is 502
///   `provider-answer-unreadable`, and an answer that never comes is 504
///   `provider-timeout` with the limit (it was 502 "could not be
///   reached", though the request had been sent); so is an MCP call the
///   gateway forwards outside the ledger.
#[tokio::test]
async fn what_a_broken_provider_sends_is_not_passed_on_as_it_came() {
    fn reply(path: &str) -> Option<Vec<u8>> {
        let bytes: &[u8] = match path.rsplit('/').next().unwrap_or_default() {
            "length-and-chunked" => {
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 3\r\n\
                  transfer-encoding: chunked\r\n\r\n\
                  c\r\n{\"id\":\"ch_1\"\r\n8\r\n,\"n\":42}\r\n0\r\n\r\n"
            }
            "status-999" => b"HTTP/1.1 999 Weird\r\ncontent-length: 2\r\n\r\n{}",
            "retry-at-a-date" => {
                b"HTTP/1.1 503 Service Unavailable\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\n\
                  retry-after: Sun, 06 Nov 1994 09:49:37 GMT\r\ncontent-length: 2\r\n\r\n{}"
            }
            "switch" => {
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
            }
            _ => return None,
        };
        Some(bytes.to_vec())
    }
    let (provider, seen) = scripted_provider(reply).await;
    let app = spawn_with(Opts {
        more: format!(
            "[[routes]]\nname = \"broken\"\nprefix = \"/broken/\"\nupstream = \"http://{provider}\"\n\
             effectful_methods = [\"POST\"]\nprovider_idempotency_header = \"Idempotency-Key\"\n\
             retry = {{ max_attempts = 3, base_delay_ms = 1, max_delay_ms = 2, max_retry_after_ms = 10000 }}\n\
             [[routes]]\nname = \"broken-pass\"\nprefix = \"/broken-pass/\"\nupstream = \"http://{provider}\"\n\
             mode = \"pass\"\nresponse_timeout_ms = 300\n\
             [[routes]]\nname = \"broken-mcp\"\nprefix = \"/broken-mcp/\"\nupstream = \"http://{provider}\"\n\
             mode = \"mcp\"\neffect_class = \"notification\"\nresponse_timeout_ms = 300\n"
        ),
        ..Default::default()
    })
    .await;
    let effectful = |path: &str, key: &str| {
        app.http
            .post(app.proxy(&format!("/broken/v1/{path}")))
            .bearer_auth(KEY_A)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(r#"{"amount":1}"#)
            .send()
    };
    let passed = |path: &str| {
        app.http
            .get(app.proxy(&format!("/broken-pass/v1/{path}")))
            .bearer_auth(KEY_A)
            .send()
    };
    let count = |path: &str| seen.lock().unwrap().get(path).copied().unwrap_or(0);
    let whole = r#"{"id":"ch_1","n":42}"#;

    for attempt in ["first", "duplicate"] {
        let r = effectful("length-and-chunked", "k-length").await.unwrap();
        assert_eq!(r.status(), 200, "{attempt}");
        assert_ne!(r.content_length(), Some(3), "{attempt}");
        assert_eq!(r.text().await.unwrap(), whole, "{attempt}");
    }
    assert_eq!(count("/v1/length-and-chunked"), 1);
    let op = app.op_json("k-length").await;
    assert_eq!(op["state"], "COMPLETED", "{op}");
    let r = passed("length-and-chunked").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_ne!(r.content_length(), Some(3));
    assert_eq!(r.text().await.unwrap(), whole);

    let r = effectful("status-999", "k-999").await.unwrap();
    assert_eq!(r.status(), 502);
    let p: Value = r.json().await.unwrap();
    assert_eq!(
        p["type"], "urn:effectgate:problem:operation-outcome-unknown",
        "{p}"
    );
    let op = app.op_json("k-999").await;
    assert_eq!(
        (&op["state"], &op["error_kind"]),
        (&"UNKNOWN".into(), &"provider-protocol".into()),
        "{op}"
    );

    let r = effectful("retry-at-a-date", "k-date").await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(count("/v1/retry-at-a-date"), 1, "no second attempt");
    let op = app.op_json("k-date").await;
    assert_eq!(
        (&op["state"], &op["error_kind"]),
        (&"FAILED".into(), &"retry-after-too-long".into()),
        "{op}"
    );

    let r = passed("switch").await.unwrap();
    assert_eq!(r.status(), 502);
    let p: Value = r.json().await.unwrap();
    assert_eq!(
        p["type"], "urn:effectgate:problem:provider-answer-unreadable",
        "{p}"
    );
    assert!(p["detail"].as_str().unwrap().contains("101"), "{p}");

    let r = passed("silent").await.unwrap();
    assert_eq!(r.status(), 504);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:provider-timeout", "{p}");
    assert_eq!(p["limit_ms"], 300, "{p}");
    assert_eq!(count("/v1/silent"), 1);

    // The same for an MCP call forwarded outside the ledger.
    let r = app
        .http
        .post(app.proxy("/broken-mcp/silent"))
        .bearer_auth(KEY_A)
        .header("Content-Type", "application/json")
        .header("Accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["type"], "urn:effectgate:problem:provider-timeout", "{p}");
    assert_eq!(count("/silent"), 1);
}
