//! The gateway's own MCP client: sessions it opens itself (for read-back
//! and for new attempts of reconciled tool calls) and the read-back tool
//! call.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use crate::config::Route;
use crate::mcp::protocol::rpc_message_with_text;

/// Posts one JSON-RPC message of the gateway's own and reads the answer:
/// the whole exchange within the route's `response_timeout_ms`, the body at
/// most [`Route::mcp_answer_bytes`].
///
/// Errors: the message says what failed (the URL, the connection, the
/// time limit, a body too large or broken off).
async fn post_rpc(
    route: &Route,
    path: &str,
    session: Option<&str>,
    msg: &Value,
) -> Result<(StatusCode, HeaderMap, Bytes), String> {
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    tokio::time::timeout(timeout, exchange(route, path, session, msg))
        .await
        .map_err(|_| format!("no answer within {} ms", route.response_timeout_ms))?
}

/// [`post_rpc`] without its time limit.
async fn exchange(
    route: &Route,
    path: &str,
    session: Option<&str>,
    msg: &Value,
) -> Result<(StatusCode, HeaderMap, Bytes), String> {
    let uri = crate::forward::upstream_uri(route, path, None).map_err(|e| e.to_string())?;
    let body = Bytes::from(msg.to_string());
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::ACCEPT,
        HeaderValue::from_static("application/json, text/event-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    h.insert(
        "mcp-protocol-version",
        HeaderValue::from_static(crate::mcp::protocol::PROTOCOL_VERSION),
    );
    if let Some(s) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
        h.insert("mcp-session-id", s);
    }
    crate::forward::add_route_headers(route, &mut h, None);
    let req = crate::forward::build_request(
        http::Method::POST,
        uri,
        h,
        crate::forward::OutboundBody::from(body),
    );
    let resp = route.client.request(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    // The outer limit ends the wait; this one only has to be as long.
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    let bytes = crate::forward::read_whole(body, route.mcp_answer_bytes(), timeout)
        .await
        .map_err(|e| e.to_string())?;
    Ok((parts.status, parts.headers, bytes))
}

/// Opens an MCP session of the gateway's own (initialize + initialized)
/// and returns its id, if the server uses sessions; both messages within
/// the route's `response_timeout_ms` in all.
///
/// Errors: the message says which step failed, or that the time ran out.
pub async fn open_session(route: &Route, path: &str) -> Result<Option<String>, String> {
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    tokio::time::timeout(timeout, open(route, path))
        .await
        .map_err(|_| format!("no session within {} ms", route.response_timeout_ms))?
}

/// [`open_session`] without its overall time limit.
async fn open(route: &Route, path: &str) -> Result<Option<String>, String> {
    let init = json!({"jsonrpc": "2.0", "id": "effectgate-init", "method": "initialize", "params": {
        "protocolVersion": crate::mcp::protocol::PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "effectgate", "version": env!("CARGO_PKG_VERSION")}}});
    let (status, headers, _) = post_rpc(route, path, None, &init).await?;
    if !status.is_success() {
        return Err(format!("initialize answered {status}"));
    }
    let session = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let _ = post_rpc(route, path, session.as_deref(), &note).await?;
    Ok(session)
}

/// Reads back an MCP tool call's effect by calling the route's read-only
/// read-back tool in a session of the gateway's own. `found_pointer`
/// applies to the tool result's `structuredContent`, or to the JSON of its
/// first text content.
pub async fn read_back(
    route: &Route,
    rb: &crate::config::ReadBack,
    op: &crate::ledger::Operation,
    reference: Option<&str>,
) -> crate::ops::read_back::ReadBackResult {
    use crate::ops::read_back::ReadBackResult;
    let Some(tool) = &rb.tool else {
        return ReadBackResult::Error("no read-back tool".into());
    };
    let body: Value = serde_json::from_slice(&op.request_body).unwrap_or(Value::Null);
    let vars = crate::template::Vars {
        operation_id: &op.operation_id,
        provider_key: &op.provider_key,
        body: &body,
        tenant: &op.tenant_id,
        reference,
        response: &Value::Null,
    };
    let path = match rb.path.render_strict(&vars, crate::template::url_encode) {
        Ok(p) => p,
        Err(u) => return crate::ops::read_back::unresolved(&u),
    };
    let mut args = serde_json::Map::new();
    for (k, t) in &rb.tool_arguments {
        match t.render_strict(&vars, |s| s.to_owned()) {
            Ok(v) => args.insert(k.clone(), Value::String(v)),
            Err(u) => return crate::ops::read_back::unresolved(&u),
        };
    }
    let expected = crate::ops::read_back::expected(rb, &vars);
    let work = async {
        let session = open_session(route, &path).await?;
        let call = json!({"jsonrpc": "2.0", "id": "effectgate-read-back", "method": "tools/call",
                          "params": {"name": tool, "arguments": args}});
        let (status, headers, bytes) = post_rpc(route, &path, session.as_deref(), &call).await?;
        if !status.is_success() {
            return Err(format!("read-back tool call answered {status}"));
        }
        let (msg, text) = rpc_message_with_text(&headers, &bytes)
            .ok_or_else(|| "no JSON-RPC answer to the read-back call".to_owned())?;
        // As an HTTP read-back's answer (RFC 7493 §2.3): the message as
        // sent, a JSON body or an SSE event's data.
        if crate::idempotency::has_duplicate_keys(&text) {
            return Err("the read-back answer repeats a key in a JSON object".to_owned());
        }
        Ok(msg)
    };
    let msg = match tokio::time::timeout(std::time::Duration::from_millis(rb.timeout_ms), work)
        .await
    {
        Err(_) => return ReadBackResult::Error(format!("no answer within {} ms", rb.timeout_ms)),
        Ok(Err(e)) => return ReadBackResult::Error(e),
        Ok(Ok(m)) => m,
    };
    if msg.get("error").is_some() || msg["result"]["isError"].as_bool() == Some(true) {
        return ReadBackResult::Error(format!("the read-back tool failed: {msg}"));
    }
    let result = &msg["result"];
    let value = match result.get("structuredContent") {
        Some(s) if !s.is_null() => s.clone(),
        _ => match result["content"][0]["text"].as_str() {
            Some(t) if crate::idempotency::has_duplicate_keys(t.as_bytes()) => {
                return ReadBackResult::Error(
                    "the read-back tool's text repeats a key in a JSON object".into(),
                );
            }
            Some(t) => serde_json::from_str(t).unwrap_or(Value::Null),
            None => Value::Null,
        },
    };
    crate::ops::read_back::judge(rb, &value, &expected)
}

/// The stored answer of a tool call whose effect a read-back confirmed
/// (its own reply was lost): a successful tool result saying so.
pub fn reconciled_result(matched: &Value) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": null, "result": {
        "content": [{"type": "text", "text": "The tool's reply was lost; effectgate confirmed by read-back that the call took effect."}],
        "structuredContent": {"reconciled": true, "read_back": matched},
        "isError": false,
    }})
    .to_string()
    .into_bytes()
}
