//! The MCP transport: the effectful flow's answer re-addressed as a
//! JSON-RPC answer to the caller's id.

use axum::response::Response;
use http::StatusCode;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::http::error::Problem;
use crate::http::reply_response;
use crate::ops::Answer;
use crate::ops::mcp::{json_response, rpc_error};
use crate::ops::reply::ReplyBody;

/// The most of a non-JSON answer body an MCP error quotes, bytes.
pub const QUOTED_BYTES: usize = 1024;

/// A gateway error as a JSON-RPC error's message, in the agent's terms: a
/// reused operation id is the tool call's intent id (or the identity the
/// gateway derived, or its `Idempotency-Key`), reused with another tool or
/// other arguments; the error's `data` keeps the problem's type
/// (`idempotency-key-reused`).
fn message(e: &crate::ops::OpError) -> String {
    match e {
        crate::ops::OpError::FingerprintMismatch { key } => format!(
            "operation {key:?} (the tool call's intent id, derived identity or Idempotency-Key) \
             was already used for a different request: another tool or other arguments \
             (fingerprint mismatch); a new call needs a new intent id"
        ),
        other => other.to_string(),
    }
}

/// The problem (RFC 9457) carried as a JSON-RPC error's `data`, its
/// `field` in the tool call's terms: a reused operation id was refused for
/// the call's `params` (another tool or other arguments), whichever of the
/// intent id, the derived identity or an `Idempotency-Key` header named it.
fn data(e: &crate::ops::OpError) -> Value {
    let mut p = e.problem();
    if matches!(e, crate::ops::OpError::FingerprintMismatch { .. }) {
        p["field"] = json!("params");
    }
    p
}

/// Turns the effectful flow's answer into an MCP answer addressed to
/// `rpc_id`: stored JSON-RPC answers are re-addressed; a pending approval
/// becomes a tool result with `isError: true` and `structuredContent`
/// naming it; any gateway error becomes a JSON-RPC error (HTTP 200, so the
/// agent's loop keeps working).
///
/// The answer's body is read whole only when it is in memory already (at
/// most the MCP answer limit, [`crate::config::Route::mcp_answer_bytes`]):
/// the rest of a larger provider body is dropped unread, and the error
/// says how much was read. An error quotes at most [`QUOTED_BYTES`] of a
/// body that isn't JSON.
pub async fn readdress(result: Answer, rpc_id: &Value) -> Response {
    let mut reply = match result {
        Ok(r) => r,
        Err(e) => return reply_response(rpc_error(rpc_id, -32000, &message(&e), data(&e))),
    };
    let mut cut = None;
    if let ReplyBody::Streamed(prefix, _) = &reply.body {
        cut = Some(prefix.len());
        reply.body = ReplyBody::Full(bytes::Bytes::new());
    }
    let (parts, body) = reply_response(reply).into_parts();
    let replayed = parts
        .headers
        .get(crate::idempotency::IDEMPOTENT_REPLAYED)
        .cloned();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let out = if v.get("jsonrpc").is_some() {
        let mut v = v;
        v["id"] = rpc_id.clone();
        json_response(StatusCode::OK, &v)
    } else if parts.status == StatusCode::ACCEPTED {
        let (status, text) = match v["approval_id"].as_str() {
            Some(a) => (
                "approval-pending",
                format!(
                    "This call needs a human approval before it runs (approval {a}: {}). Nothing was done yet. \
                     Poll /approvals/{a} on the gateway, then call the tool again with the same arguments and intent.",
                    v["reason"].as_str().unwrap_or("")
                ),
            ),
            None => (
                "in-progress",
                "The call is still running; call the tool again with the same intent later."
                    .to_owned(),
            ),
        };
        let structured = json!({
            "status": status,
            "approval_id": v["approval_id"],
            "operation_id": v["operation_id"],
            "poll": v["approval_id"].as_str().map(|a| format!("/approvals/{a}")),
        });
        let result = json!({"content": [{"type": "text", "text": text}], "structuredContent": structured, "isError": true});
        json_response(
            StatusCode::OK,
            &json!({"jsonrpc": "2.0", "id": rpc_id, "result": result}),
        )
    } else {
        let detail = v["detail"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| match cut {
                Some(read) => format!(
                    "the gateway answered {}: the provider's body was larger than the gateway \
                 reads ({read} bytes read, the rest dropped)",
                    parts.status
                ),
                None => format!(
                    "the gateway answered {}: {}",
                    parts.status,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(QUOTED_BYTES)])
                ),
            });
        rpc_error(rpc_id, -32000, &detail, v)
    };
    let mut out = reply_response(out);
    if let Some(r) = replayed {
        out.headers_mut()
            .insert(crate::idempotency::IDEMPOTENT_REPLAYED, r);
    }
    out
}
