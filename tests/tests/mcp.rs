//! MCP tool calls through effectgate, with the official MCP Python SDK on
//! both sides: `examples/mcp-server/server.py` upstream and
//! `examples/mcp-client/agent.py` as the agent.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use effectgate_tests::*;
use serde_json::{Value, json};

fn python() -> Option<PathBuf> {
    let p = std::env::var("MCP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(format!(
                "{}/.cache/effectgate-py/bin/python",
                std::env::var("HOME").unwrap_or_default()
            ))
        });
    if p.exists() {
        return Some(p);
    }
    skips::skip(
        "Python with the MCP SDK",
        &format!(
            "none at {} (set MCP_PYTHON to a python that has `mcp` and `uvicorn`; .ci/run makes ~/.cache/effectgate-py)",
            p.display()
        ),
    );
    None
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Upstream {
    child: std::process::Child,
    port: u16,
    outbox: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Upstream {
    fn count(&self, kind: &str) -> usize {
        std::fs::read_to_string(&self.outbox)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<Value>(l)
                    .map(|v| v["kind"] == kind)
                    .unwrap_or(false)
            })
            .count()
    }
}

async fn upstream(py: &PathBuf) -> Upstream {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let outbox = dir.path().join("outbox.jsonl");
    let child = std::process::Command::new(py)
        .arg(root().join("examples/mcp-server/server.py"))
        .args(["--port", &port.to_string(), "--outbox"])
        .arg(&outbox)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the MCP server did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Upstream {
        child,
        port,
        outbox,
        _dir: dir,
    }
}

async fn agent(py: &PathBuf, app: &TestApp, prefix: &str, steps: Value) -> Vec<Value> {
    agent_as(py, app, prefix, KEY_A, steps).await
}

async fn agent_as(
    py: &PathBuf,
    app: &TestApp,
    prefix: &str,
    key: &str,
    steps: Value,
) -> Vec<Value> {
    let out = tokio::process::Command::new(py)
        .arg(root().join("examples/mcp-client/agent.py"))
        .arg(app.proxy(&format!("{prefix}mcp")))
        .arg(key)
        .arg(steps.to_string())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "agent failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

async fn setup(py: &PathBuf) -> (Upstream, TestApp) {
    let up = upstream(py).await;
    let url = format!("http://127.0.0.1:{}", up.port);
    let allow = format!(
        "[[tenants.policies]]\nroute = \"tools\"\nmodule = \"{}\"\nconfig = {{ rules = [{{ path_prefix = \"/tools/send_email\" }}, {{ path_prefix = \"/tools/search_docs\" }}, {{ path_prefix = \"/tools/always_fails\" }}, {{ path_prefix = \"/tools/get_email_status\" }}] }}\n[[tenants.policies]]\nroute = \"money\"\nmodule = \"{}\"\nconfig = {{ threshold = 100, amount_pointer = \"/params/arguments/amount\" }}\n",
        policy_wasm("allow_list").display(),
        policy_wasm("amount_threshold").display()
    );
    let more = format!(
        r#"
[[routes]]
name = "tools"
prefix = "/tools/"
upstream = "{url}"
mode = "mcp"
effect_class = "notification"
response_timeout_ms = 1500

[[routes]]
name = "derived"
prefix = "/derived/"
upstream = "{url}"
mode = "mcp"
effect_class = "notification"
mcp = {{ derived_identity = true }}

[[routes]]
name = "money"
prefix = "/money/"
upstream = "{url}"
mode = "mcp"
effect_class = "payment"

[[routes]]
name = "rb"
prefix = "/rb/"
upstream = "{url}"
mode = "mcp"
effect_class = "notification"
response_timeout_ms = 1500
tenant_scoped_field = "/params/arguments/tenant"
[routes.read_back]
tool = "get_email_status"
arguments = {{ to = "{{body:/params/arguments/to}}", subject = "{{body:/params/arguments/subject}}", tenant = "{{tenant}}" }}
found_pointer = ""
match = {{ "/found" = "true", "/tenant" = "{{tenant}}" }}
reference_pointer = "/message_id"
settle_delay_ms = 0

[reconcile]
enabled = false
"#
    );
    // Tenant b distrusts the server's readOnlyHint for search_docs.
    let tenant_b = "mcp_tools = { search_docs = { read_only = false } }".to_owned();
    let app = spawn_with(Opts {
        tenant_a: allow,
        tenant_b,
        more,
        ..Default::default()
    })
    .await;
    (up, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tool_calls_are_one_operation_per_intent() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let email = json!({"tool": "send_email", "args": {"to": "ann@example.com", "subject": "hi", "body": "hello"}, "intent": "intent-1"});

    // The same intent three times, each a new JSON-RPC id: one e-mail, three identical results.
    let r = agent(
        &py,
        &app,
        "/tools/",
        json!([{"list": true}, email, email, email]),
    )
    .await;
    assert_eq!(
        r[0]["tools"],
        json!([
            "always_fails",
            "get_email_status",
            "search_docs",
            "send_email"
        ]),
        "refund is denied, so not offered"
    );
    assert_eq!(up.count("email"), 1);
    assert_eq!(r[1]["is_error"], false);
    assert_eq!(r[1], r[2]);
    assert_eq!(r[1], r[3]);
    // A regenerated turn after a checkpoint (a new session, same intent): still one.
    let again = agent(&py, &app, "/tools/", json!([email])).await;
    assert_eq!(again[0], r[1]);
    assert_eq!(up.count("email"), 1);
    let op = app.op_json("intent-1").await;
    assert_eq!(op["state"], "COMPLETED");

    // A read-only tool is never recorded; a denied tool is refused.
    let before = app
        .gw
        .state
        .ledger
        .list(Some("a"), None, 100)
        .await
        .unwrap()
        .len();
    let r = agent(
        &py,
        &app,
        "/tools/",
        json!([
            {"tool": "search_docs", "args": {"q": "refunds"}},
            {"tool": "refund", "args": {"charge_id": "ch_1", "amount": 5}, "intent": "no-refund"},
            {"tool": "always_fails", "args": {"reason": "nope"}, "intent": "fails-1"},
        ]),
    )
    .await;
    assert_eq!(r[0]["is_error"], false);
    assert!(
        r[1]["rpc_error"]["message"]
            .as_str()
            .unwrap()
            .contains("allow-list"),
        "{:?}",
        r[1]
    );
    assert_eq!(up.count("refund"), 0);
    // The tool-level error is a FAILED operation, not a success.
    assert_eq!(r[2]["is_error"], true);
    let failed = app.op_json("fails-1").await;
    assert_eq!(failed["state"], "FAILED");
    assert_eq!(failed["error_kind"], "tool-error");
    let after = app
        .gw
        .state
        .ledger
        .list(Some("a"), None, 100)
        .await
        .unwrap()
        .len();
    assert_eq!(after, before + 1, "only always_fails was recorded");
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("effectgate_mcp_tool_calls_total{route=\"tools\",outcome=\"tool-error\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derived_identity_dedupes_identical_calls_only() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let call =
        |to: &str| json!({"tool": "send_email", "args": {"to": to, "subject": "s", "body": "b"}});
    agent(&py, &app, "/derived/", json!([call("a@x"), call("a@x")])).await;
    assert_eq!(
        up.count("email"),
        1,
        "byte-identical arguments are the same intent"
    );
    agent(&py, &app, "/derived/", json!([call("b@x")])).await;
    assert_eq!(up.count("email"), 2, "other arguments are another intent");
    // Without derived identity and without an intent id, a world-changing call is refused.
    let r = agent(&py, &app, "/tools/", json!([call("c@x")])).await;
    assert!(
        r[0]["rpc_error"]["message"]
            .as_str()
            .unwrap()
            .contains("intent id"),
        "{:?}",
        r[0]
    );
    assert_eq!(up.count("email"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_over_the_threshold_wait_for_an_approval_bound_to_the_arguments() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let refund = |amount: i64, intent: &str| json!({"tool": "refund", "args": {"charge_id": "ch_1", "amount": amount}, "intent": intent});
    let listed = agent(
        &py,
        &app,
        "/money/",
        json!([{"list": true}, refund(500, "refund-1")]),
    )
    .await;
    assert!(
        listed[0]["tools"]
            .as_array()
            .unwrap()
            .contains(&json!("refund")),
        "amounts are judged per call, so refund is offered: {:?}",
        listed[0]
    );
    let r = &listed[1..];
    assert_eq!(
        r[0]["is_error"], true,
        "the agent gets a well-formed tool result"
    );
    let s = &r[0]["structured"];
    assert_eq!(s["status"], "approval-pending");
    let id = s["approval_id"].as_str().unwrap().to_owned();
    assert!(r[0]["text"].as_str().unwrap().contains(&id));
    assert_eq!(up.count("refund"), 0);

    let ok = app
        .admin_post(
            APPROVER_A,
            &format!("/admin/tenants/a/approvals/{id}/approve"),
            "{}",
        )
        .await;
    assert_eq!(ok.status(), 200);
    let r = agent(
        &py,
        &app,
        "/money/",
        json!([refund(500, "refund-1"), refund(500, "refund-1")]),
    )
    .await;
    assert_eq!(r[0]["is_error"], false, "{:?}", r[0]);
    assert_eq!(r[0], r[1]);
    assert_eq!(up.count("refund"), 1, "executed once");

    // A regenerated call with another amount is a new operation with a new approval.
    let r = agent(&py, &app, "/money/", json!([refund(900, "refund-2")])).await;
    let other = r[0]["structured"]["approval_id"].as_str().unwrap();
    assert_ne!(other, id);
    assert_eq!(up.count("refund"), 1);
    // The same intent with other arguments is refused, not re-approved,
    // in the agent's terms.
    let r = agent(&py, &app, "/money/", json!([refund(900, "refund-1")])).await;
    let message = r[0]["rpc_error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("operation \"refund-1\" (the tool call's intent id"),
        "{message}"
    );
    assert!(message.contains("other arguments"), "{message}");
    let data = &r[0]["rpc_error"]["data"];
    assert_eq!(
        (data["type"].as_str(), data["field"].as_str()),
        (
            Some("urn:effectgate:problem:idempotency-key-reused"),
            Some("params")
        ),
        "{data}"
    );
    assert_eq!(up.count("refund"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_after_the_side_effect_is_unknown_and_not_run_again() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let slow = json!({"tool": "send_email", "args": {"to": "z@x", "subject": "s", "body": "b", "delay_s": 3}, "intent": "slow-1"});
    let r = agent(&py, &app, "/tools/", json!([slow, slow])).await;
    assert!(r[0]["rpc_error"].is_object(), "{:?}", r[0]);
    assert!(
        r[1]["rpc_error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown"),
        "{:?}",
        r[1]
    );
    assert_eq!(app.op_json("slow-1").await["state"], "UNKNOWN");
    assert_eq!(
        up.count("email"),
        1,
        "the duplicate did not run the tool again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_headers_must_agree_with_the_body() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": "x", "subject": "s", "body": "b"}, "_meta": {"effectgate/operation-id": "hdr"}}});
    let r = app
        .http
        .post(app.proxy("/tools/mcp"))
        .bearer_auth(KEY_A)
        .header("Mcp-Method", "tools/call")
        .header("Mcp-Name", "search_docs")
        .header("Accept", "application/json, text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], -32600, "{v}");
    assert_eq!(v["id"], 7);
    assert_eq!(up.count("email"), 0);
    assert_eq!(app.operation(ADMIN_A, "a", "hdr").await.status(), 404);
    // An Idempotency-Key header and an intent id that disagree name two
    // operations: neither runs.
    let r = app
        .http
        .post(app.proxy("/tools/mcp"))
        .bearer_auth(KEY_A)
        .header("Idempotency-Key", "other")
        .header("Accept", "application/json, text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], -32602, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("disagree"),
        "{v}"
    );
    assert_eq!(up.count("email"), 0);
    for id in ["hdr", "other"] {
        assert_eq!(app.operation(ADMIN_A, "a", id).await.status(), 404);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_is_reconciled_by_a_read_back_tool_call() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let slow = json!({"tool": "send_email", "args": {"to": "rb@x", "subject": "invoice", "body": "b", "delay_s": 3}, "intent": "rb-1"});
    let r = agent(&py, &app, "/rb/", json!([slow])).await;
    assert!(
        r[0]["rpc_error"].is_object(),
        "the first call's reply is lost: {:?}",
        r[0]
    );
    assert_eq!(app.op_json("rb-1").await["state"], "UNKNOWN");
    // The duplicate triggers the read-back (get_email_status), which finds the e-mail.
    let r = agent(&py, &app, "/rb/", json!([slow])).await;
    assert_eq!(r[0]["is_error"], false, "{:?}", r[0]);
    assert_eq!(r[0]["structured"]["reconciled"], true);
    let op = app.op_json("rb-1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(op["provider_reference"], "msg-1");
    assert_eq!(up.count("email"), 1, "reconciled, never sent twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_overrides_the_servers_tool_hints() {
    let Some(py) = python() else { return };
    let (_up, app) = setup(&py).await;
    let search = json!({"tool": "search_docs", "args": {"q": "x"}});
    // Tenant a trusts readOnlyHint: passes through, nothing recorded.
    let r = agent(&py, &app, "/tools/", json!([{"list": true}, search])).await;
    assert_eq!(r[1]["is_error"], false);
    // Tenant b says search_docs changes the world: it needs an intent id and is recorded.
    let r = agent_as(&py, &app, "/tools/", KEY_B, json!([{"list": true}, search, {"tool": "search_docs", "args": {"q": "x"}, "intent": "s-1"}])).await;
    assert!(
        r[1]["rpc_error"]["message"]
            .as_str()
            .unwrap()
            .contains("intent id"),
        "{:?}",
        r[1]
    );
    assert_eq!(r[2]["is_error"], false);
    let op: Value = app
        .operation(ADMIN_B, "b", "s-1")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(op["state"], "COMPLETED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_before_the_result_and_large_results_are_completed() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let r = agent(
        &py,
        &app,
        "/derived/",
        json!([
            {"tool": "post_note", "args": {"text": "hello"}, "intent": "note-1"},
            {"tool": "export_report", "args": {"rows": 100000}, "intent": "report-1"},
            {"tool": "export_report", "args": {"rows": 100000}, "intent": "report-1"},
        ]),
    )
    .await;
    assert_eq!(r[0]["is_error"], false, "{:?}", r[0]);
    assert_eq!(
        app.op_json("note-1").await["state"],
        "COMPLETED",
        "a log notification before the result is not the result"
    );
    assert_eq!(r[1]["is_error"], false);
    assert_eq!(
        r[1]["text"].as_str().unwrap().len(),
        400000,
        "the first call gets the whole result"
    );
    let op = app.op_json("report-1").await;
    assert_eq!(op["state"], "COMPLETED");
    assert_eq!(r[2], r[1], "the replay is the whole result");
    assert_eq!(up.count("report"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_or_malformed_calls_are_never_forwarded() {
    let Some(py) = python() else { return };
    let (up, app) = setup(&py).await;
    let post = |body: &'static str, session: Option<&'static str>| {
        let mut b = app
            .http
            .post(app.proxy("/money/mcp"))
            .bearer_auth(KEY_A)
            .header("Accept", "application/json, text/event-stream")
            .header("Content-Type", "application/json")
            .body(body);
        if let Some(s) = session {
            b = b.header("Mcp-Session-Id", s);
        }
        b.send()
    };
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500},"_meta":{"x":NaN}}}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500}}}]"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500},"_meta":{"effectgate/operation-id":"n1"}}}"#,
        // Repeated keys: a last-wins reader sees a read-only call or a
        // listing, a first-wins server would run the refund.
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500}},"params":{"name":"search_docs","arguments":{"query":"x"}}}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","method":"tools/list","params":{"name":"refund","arguments":{"charge_id":"c","amount":500}}}"#,
        r#"{"jsonrpc":"2.0","id":4,"method":"ping","params":{"a":1,"a":2}}"#,
        // Numbers a double doesn't hold: two such amounts would fingerprint
        // alike, and an id would come back as another number.
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":9007199254740993},"_meta":{"effectgate/operation-id":"n1"}}}"#,
        r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":0.10000000000000000001},"_meta":{"effectgate/operation-id":"n1"}}}"#,
        r#"{"jsonrpc":"2.0","id":123456789012345678901234567890,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500},"_meta":{"effectgate/operation-id":"n1"}}}"#,
        // Not JSON-RPC 2.0.
        r#"{"jsonrpc":"1.0","id":7,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500},"_meta":{"effectgate/operation-id":"n1"}}}"#,
        r#"{"id":8,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500},"_meta":{"effectgate/operation-id":"n1"}}}"#,
    ] {
        let v: Value = post(body, None).await.unwrap().json().await.unwrap();
        assert!(
            v["error"]["code"].as_i64().unwrap() <= -32600,
            "{body}: {v}"
        );
    }
    assert_eq!(up.count("refund"), 0);
    assert_eq!(app.operation(ADMIN_A, "a", "n1").await.status(), 404);
    // A refusal is addressed to the request's id whenever it reads back as
    // sent, so the client's wait ends.
    for (body, id, code) in [
        (
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":9007199254740993}}}"#,
            json!(5),
            -32602,
        ),
        (
            r#"{"jsonrpc":"1.0","id":"seven","method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":500}}}"#,
            json!("seven"),
            -32600,
        ),
    ] {
        let v: Value = post(body, None).await.unwrap().json().await.unwrap();
        assert_eq!((&v["id"], &v["error"]["code"]), (&id, &json!(code)), "{v}");
    }
    // An intent id of the gateway's own compensations is refused as the
    // intent id it is, not as a header the agent never sent.
    let reserved = r#"{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":5},"_meta":{"effectgate/operation-id":"n2#compensation"}}}"#;
    let v: Value = post(reserved, None).await.unwrap().json().await.unwrap();
    assert_eq!(v["error"]["code"], -32602, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("the intent id in _meta must not end in \"#compensation\""),
        "{v}"
    );
    assert_eq!(up.count("refund"), 0);
    // An intent id that is no string is refused as such, with or without
    // the header, and on a route that derives ids too: never read as
    // absent.
    for (path, with_header) in [
        ("/money/mcp", false),
        ("/money/mcp", true),
        ("/derived/mcp", false),
    ] {
        let mut b = app
            .http
            .post(app.proxy(path))
            .bearer_auth(KEY_A)
            .header("Accept", "application/json, text/event-stream")
            .header("Content-Type", "application/json")
            .body(r#"{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":5},"_meta":{"effectgate/operation-id":42}}}"#);
        if with_header {
            b = b.header("Idempotency-Key", "n3");
        }
        let v: Value = b.send().await.unwrap().json().await.unwrap();
        assert_eq!(v["error"]["code"], -32602, "{path} {with_header}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(
                "the intent id in _meta[\"effectgate/operation-id\"] must be a string"
            ),
            "{path} {with_header}: {v}"
        );
    }
    assert_eq!(up.count("refund"), 0);
    assert_eq!(app.operation(ADMIN_A, "a", "n3").await.status(), 404);
    // A stale session: the server refuses (404) before running; the gateway
    // retries in a session of its own, so the intent is not lost.
    let stale = r#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"refund","arguments":{"charge_id":"c","amount":5},"_meta":{"effectgate/operation-id":"stale-1"}}}"#;
    let v: Value = post(stale, Some("deadbeef"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["result"]["isError"], false, "{v}");
    assert_eq!(up.count("refund"), 1);
    assert_eq!(app.op_json("stale-1").await["state"], "COMPLETED");
}

/// An MCP route's compensation is a tool call: `cancel_email` undoes a
/// `send_email`, once, in a session of the gateway's own, and its
/// read-back tool confirms it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_email_is_compensated_by_cancel_email_once() {
    let Some(py) = python() else { return };
    let up = upstream(&py).await;
    let url = format!("http://127.0.0.1:{}", up.port);
    let more = format!(
        r#"
[[routes]]
name = "mail"
prefix = "/mail/"
upstream = "{url}"
mode = "mcp"
effect_class = "notification"
response_timeout_ms = 3000
[routes.compensation]
tool = "cancel_email"
arguments = {{ message_id = "{{reference}}" }}
reference_pointer = "/message_id"
read_back = {{ tool = "get_cancellation", arguments = {{ message_id = "{{reference}}" }}, found_pointer = "", match = {{ "/cancelled" = "true", "/message_id" = "{{reference}}" }} }}

[reconcile]
enabled = false
"#
    );
    let app = spawn_with(Opts {
        more,
        ..Default::default()
    })
    .await;
    let email = json!({"tool": "send_email", "args": {"to": "ann@example.com", "subject": "offer", "body": "50% off"}, "intent": "mail-1"});
    let r = agent(&py, &app, "/mail/", json!([email])).await;
    assert_eq!(r[0]["is_error"], false, "{:?}", r[0]);
    assert_eq!(up.count("email"), 1);
    let compensate = || {
        app.admin_post(
            OPERATOR_A,
            "/admin/tenants/a/operations/mail-1/compensate",
            r#"{"reason":"sent to the wrong list"}"#,
        )
    };
    let res = compensate().await;
    let status = res.status();
    let v: Value = res.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "COMPENSATED");
    assert_eq!(v["compensation"]["state"], "COMPLETED");
    assert_eq!(up.count("cancel"), 1);
    let cancel = std::fs::read_to_string(&up.outbox)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["kind"] == "cancel")
        .unwrap();
    assert_eq!(cancel["message_id"], "msg-1");
    let child = app.op_json("mail-1%23compensation").await;
    assert_eq!(child["route"], "mail#compensation");
    let body: Value = serde_json::from_str(child["response_body"].as_str().unwrap()).unwrap();
    let result: Value = match body["result"].get("structuredContent") {
        Some(s) if !s.is_null() => s.clone(),
        _ => serde_json::from_str(body["result"]["content"][0]["text"].as_str().unwrap()).unwrap(),
    };
    assert_eq!(result["status"], "cancelled", "{body}");
    // Asking again: the same compensation, no second cancellation.
    assert_eq!(compensate().await.status(), 200);
    assert_eq!(up.count("cancel"), 1);
    // The agent's retry of the e-mail is its stored result; nothing is sent.
    let again = agent(&py, &app, "/mail/", json!([email])).await;
    assert_eq!(again[0], r[0]);
    assert_eq!(up.count("email"), 1);
    assert_eq!(app.op_json("mail-1").await["state"], "COMPENSATED");
}
