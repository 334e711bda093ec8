//! Model Context Protocol routes (`mode = "mcp"`, streamable HTTP
//! transport): each `tools/call` of a tool that changes the world becomes
//! one identifiable business operation in the effect ledger.
//!
//! - Identity, in this order: the `Idempotency-Key` header; the intent id in
//!   `params._meta["effectgate/operation-id"]` (configurable); a derived id
//!   (tenant + principal + scope header + tool + canonical-JSON hash of the
//!   arguments) when the route opts in. The JSON-RPC `id` never identifies
//!   an operation.
//! - Fingerprint: the tool name and the canonical arguments, so a
//!   regenerated call with a new JSON-RPC id is the same request.
//! - Read-only tools (the server's `readOnlyHint`, or the route's override)
//!   pass through without the ledger; `tools/list` answers are cached per
//!   route and filtered by the tenant's policies.
//! - Results: `isError: true` → FAILED; a JSON-RPC error → FAILED
//!   (permanent); transport failure or timeout → UNKNOWN. Replays are
//!   re-addressed to the new JSON-RPC id.
//! - Policies decide on the body. Their request has path `/tools/<name>`
//!   and a gateway-made header `effectgate-tool-annotations` (the tool's
//!   annotations as JSON, after overrides).
//! - While an approval is pending, the agent gets a well-formed tool result
//!   with `isError: true`, a text and `structuredContent` naming the
//!   approval and how to poll it.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::config::{EffectClass, Principal, Route};
use crate::ops::{OpError, Reply};
use crate::policy::{Verdict, evaluate_chain_async};
use crate::state::{AppState, Runtime};

mod upstream;
pub use crate::mcp::protocol::{
    PROTOCOL_VERSION, ToolCache, is_event_stream, rpc_message, tool_outcome,
};
pub use upstream::{open_session, read_back, reconciled_result};

/// A `tools/call` that goes through the ledger.
#[derive(Debug, Clone)]
pub struct McpCall {
    /// The request's JSON-RPC id (answers are addressed to it).
    pub rpc_id: Value,
    /// Tool name.
    pub tool: String,
    /// Operation id.
    pub key: String,
    /// Fingerprint: tool + canonical arguments.
    pub fingerprint: String,
    /// Effect class of the tool, if overridden.
    pub effect_class: Option<EffectClass>,
    /// Annotations after overrides (for the policy).
    pub annotations: Value,
}

/// What to do with an MCP request.
pub enum Prepared {
    /// Answer now.
    Respond(Reply),
    /// Forward as is, without the ledger.
    Forward,
    /// A world-changing tool call: run the effectful flow.
    Call(McpCall),
}

/// A JSON-RPC error answer (HTTP 200) addressed to `id`.
pub fn rpc_error(id: &Value, code: i64, message: &str, data: Value) -> Reply {
    let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message, "data": data}});
    json_response(StatusCode::OK, &body)
}

/// `body` as `application/json` with `status`.
pub fn json_response(status: StatusCode, body: &Value) -> Reply {
    Reply::json(status, body)
}

/// The effective annotations of a tool: the server's, with the route's overrides.
fn effective(
    route: &Route,
    app: &AppState,
    endpoint: (&str, &str),
    tenant: &str,
    tool: &str,
) -> (Value, bool, Option<EffectClass>) {
    let mut ann = app.mcp_tools.annotations(endpoint, tool);
    let rt = app.settings();
    // The server's hints, then the route's overrides, then the tenant's.
    let overrides = [
        route.mcp.as_ref().and_then(|m| m.tools.get(tool)).cloned(),
        rt.mcp_tools.get(tenant).and_then(|m| m.get(tool)).cloned(),
    ];
    let mut class = None;
    for ov in overrides.into_iter().flatten() {
        if let Some(ro) = ov.read_only {
            if !ann.is_object() {
                ann = json!({});
            }
            ann["readOnlyHint"] = json!(ro);
        }
        if ov.effect_class.is_some() {
            class = ov.effect_class;
        }
    }
    let read_only = ann["readOnlyHint"].as_bool().unwrap_or(false);
    (ann, read_only, class)
}

/// A tool as a policy sees it: its name, its annotations (after
/// overrides) and, for a world-changing call, its operation id and
/// fingerprint (empty otherwise).
struct ToolView<'a> {
    tool: &'a str,
    annotations: &'a Value,
    key: &'a str,
    fingerprint: &'a str,
}

/// The policy request for a tool call: path `/tools/<name>`, the JSON-RPC
/// body, and the tool's annotations in `effectgate-tool-annotations`.
fn policy_request(
    principal: &Principal,
    route: &Route,
    headers: &HeaderMap,
    body: &[u8],
    tool: &ToolView<'_>,
) -> crate::policy::Request {
    let mut h = headers.clone();
    if let Ok(v) = HeaderValue::from_str(&tool.annotations.to_string()) {
        h.insert("effectgate-tool-annotations", v);
    }
    crate::ops::admit::policy_request(
        principal,
        route,
        &crate::ops::admit::PolicyView {
            method: "POST",
            path: &format!("/tools/{}", tool.tool),
            query: None,
            headers: &h,
            body,
            operation_id: tool.key,
            fingerprint: tool.fingerprint,
            existing: None,
        },
    )
}

/// An MCP POST being decided (see [`Post::prepare`]).
pub struct Post<'a> {
    /// The shared state.
    pub app: &'a AppState,
    /// The settings snapshot the request is served from.
    pub rt: &'a Runtime,
    /// The MCP route.
    pub route: &'a Route,
    /// The caller.
    pub principal: &'a Principal,
    /// The caller's headers.
    pub headers: &'a HeaderMap,
    /// The JSON-RPC message, as read.
    pub body: &'a Bytes,
    /// The upstream endpoint.
    pub uri: &'a http::Uri,
    /// The caller's address and the scheme it used.
    pub peer: (std::net::SocketAddr, &'static str),
}

/// A JSON-RPC error answer to send at once.
fn refuse(id: &Value, code: i64, message: &str, data: Value) -> Result<Prepared, OpError> {
    Ok(Prepared::Respond(rpc_error(id, code, message, data)))
}

impl Post<'_> {
    /// Decides what the POST is: refused (a JSON-RPC error answer),
    /// forwarded as is, or a world-changing tool call for the ledger.
    ///
    /// Errors: an `Idempotency-Key` header that is malformed (400); the
    /// provider unreachable while listing tools (502).
    pub async fn prepare(&self) -> Result<Prepared, OpError> {
        let (msg, method, id) = match envelope(self.headers, self.body) {
            Ok(parsed) => parsed,
            Err(prepared) => return Ok(*prepared),
        };
        match method.as_str() {
            // A list without a cursor starts over; a cursor's page adds to it.
            "tools/list" => self.list_tools(msg["params"]["cursor"].is_null()).await,
            "tools/call" => self.call_tool(&msg, id).await,
            _ => Ok(Prepared::Forward),
        }
    }

    /// Annotations are cached per route and upstream endpoint (the
    /// path the list went to).
    fn endpoint(&self) -> (&str, &str) {
        (&self.route.name, self.uri.path())
    }
}

/// The message, its method and its id, when the POST carries one readable
/// JSON-RPC request whose routing headers agree with it; otherwise the
/// answer (`Forward` for a response to a server-initiated request).
///
/// Fails closed: what the gateway can't read, it doesn't forward. A
/// server's parser may accept what this one refuses (NaN, 1e400, deep
/// nesting), and a call the gateway didn't see would run unrecorded. A
/// repeated key reads differently to different parsers (two `params`, two
/// `method`s): refused on every path, before any decision.
fn envelope(headers: &HeaderMap, body: &[u8]) -> Result<(Value, String, Value), Box<Prepared>> {
    let err = |id: &Value, code, message: &str, data| {
        Box::new(Prepared::Respond(rpc_error(id, code, message, data)))
    };
    let null = Value::Null;
    let Ok(msg) = serde_json::from_slice::<Value>(body) else {
        return Err(err(
            &null,
            -32700,
            "parse error: the gateway forwards only JSON it can read",
            null.clone(),
        ));
    };
    if crate::idempotency::has_duplicate_keys(body) {
        return Err(err(
            &null,
            -32600,
            "a JSON object in the message repeats a key (RFC 7493 §2.3)",
            null.clone(),
        ));
    }
    if !msg.is_object() {
        return Err(err(
            &null,
            -32600,
            "a POST must carry one JSON-RPC message (no batches)",
            null.clone(),
        ));
    }
    let Some(method) = msg.get("method") else {
        // A response to a server-initiated request (sampling, elicitation).
        if msg.get("result").is_some() || msg.get("error").is_some() {
            return Err(Box::new(Prepared::Forward));
        }
        return Err(err(
            &null,
            -32600,
            "not a JSON-RPC request, notification or response",
            null.clone(),
        ));
    };
    let Some(method) = method.as_str().map(str::to_owned) else {
        return Err(err(&null, -32600, "method must be a string", null.clone()));
    };
    // The id a refusal is addressed to, whenever it can be read back as
    // sent: a string, or an integer a double holds (JSON-RPC 2.0 §5: null
    // only when it can't be detected), so the client's wait ends.
    let reply_id = match msg.get("id") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Number(n))
            if n.as_i64().is_some_and(|i| i.unsigned_abs() <= 1 << 53)
                || n.as_u64().is_some_and(|u| u <= 1 << 53) =>
        {
            Value::Number(n.clone())
        }
        _ => Value::Null,
    };
    if msg.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(err(
            &reply_id,
            -32600,
            "jsonrpc must be \"2.0\" (JSON-RPC 2.0 §4)",
            null.clone(),
        ));
    }
    if method == "tools/call" && !crate::idempotency::numbers_survive_jcs(body) {
        // The fingerprint is of the arguments as RFC 8785 writes them, as
        // doubles: two amounts past a double's precision would be one
        // call, and an id past it would come back as another number.
        return Err(err(
            &reply_id,
            -32602,
            "a number in the tool call is not exactly an IEEE-754 double (past 2^53, or with more \
             digits than a double holds; RFC 8785 §3.2.2.3): send it as a string",
            null.clone(),
        ));
    }
    let id = msg.get("id").cloned().unwrap_or(Value::Null);
    if method == "tools/call" && !(id.is_string() || id.is_number()) {
        return Err(err(
            &null,
            -32600,
            "tools/call must be a request with a string or number id",
            null.clone(),
        ));
    }
    // The routing headers of the current spec must agree with the body: the
    // gateway (and its policies) decide on the body, and a header that says
    // otherwise could steer something in between.
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(m) = header("mcp-method")
        && m != method
    {
        return Err(err(
            &id,
            -32600,
            "the Mcp-Method header does not match the body",
            json!({"header": m, "body": method}),
        ));
    }
    if method == "tools/call"
        && let Some(n) = header("mcp-name")
        && Some(n.as_str()) != msg["params"]["name"].as_str()
    {
        return Err(err(
            &id,
            -32600,
            "the Mcp-Name header does not match params.name",
            null.clone(),
        ));
    }
    Ok((msg, method, id))
}

impl Post<'_> {
    fn policies(&self) -> &[crate::policy::BoundPolicy] {
        self.rt
            .policies
            .for_route(&self.principal.tenant, &self.route.name)
    }

    async fn verdict(&self, body: &[u8], tool: &ToolView<'_>) -> Verdict {
        let req = policy_request(self.principal, self.route, self.headers, body, tool);
        evaluate_chain_async(
            self.app.engine.clone(),
            self.policies(),
            self.route,
            &self.principal.tenant,
            req,
        )
        .await
        .0
    }

    /// `tools/list`: the server's answer, its tools' annotations cached,
    /// and only the tools this tenant's policies would let run offered.
    async fn list_tools(&self, fresh: bool) -> Result<Prepared, OpError> {
        let (status, head, bytes) = forward_buffered(
            self.route,
            self.headers,
            self.body.clone(),
            self.uri,
            self.peer,
        )
        .await?;
        let Some(mut answer) = rpc_message(&head, &bytes) else {
            return Ok(Prepared::Respond(raw(status, head, bytes)));
        };
        if let Some(tools) = answer["result"]["tools"].as_array().cloned() {
            let max = self.app.settings().limits.mcp_tool_endpoints;
            self.app
                .mcp_tools
                .store(self.endpoint(), &tools, fresh, max);
            let mut kept = Vec::new();
            for t in tools {
                let name = t["name"].as_str().unwrap_or_default().to_owned();
                let probe = json!({"jsonrpc": "2.0", "id": 0, "method": "tools/call", "params": {"name": name, "arguments": {}}});
                let (ann, _, _) = effective(
                    self.route,
                    self.app,
                    self.endpoint(),
                    &self.principal.tenant,
                    &name,
                );
                let view = ToolView {
                    tool: &name,
                    annotations: &ann,
                    key: "",
                    fingerprint: "",
                };
                let verdict = self.verdict(probe.to_string().as_bytes(), &view).await;
                if !matches!(verdict, Verdict::Deny { .. }) {
                    kept.push(t);
                }
            }
            answer["result"]["tools"] = Value::Array(kept);
        }
        Ok(Prepared::Respond(json_response(StatusCode::OK, &answer)))
    }

    /// `tools/call`: a read-only tool passes (after the policies), a
    /// world-changing one becomes a [`McpCall`] with its intent id.
    async fn call_tool(&self, msg: &Value, id: Value) -> Result<Prepared, OpError> {
        let Some(tool) = msg["params"]["name"].as_str().map(str::to_owned) else {
            return refuse(&id, -32602, "tools/call needs params.name", Value::Null);
        };
        let args = msg["params"]
            .get("arguments")
            .cloned()
            .unwrap_or_else(|| json!({}));
        let (annotations, read_only, class) = effective(
            self.route,
            self.app,
            self.endpoint(),
            &self.principal.tenant,
            &tool,
        );
        if read_only {
            return self.read_only_call(&id, &tool, &annotations).await;
        }
        let canonical = serde_json_canonicalizer::to_vec(&args).unwrap_or_default();
        let fingerprint = crate::idempotency::fingerprint(
            "MCP",
            &self.route.name,
            &format!("/tools/{tool}"),
            None,
            Some("application/json"),
            &canonical,
        );
        let key = match self.intent_id(msg, &tool, &canonical)? {
            Ok(k) => k,
            Err(message) => return refuse(&id, -32602, &message, Value::Null),
        };
        Ok(Prepared::Call(McpCall {
            rpc_id: id,
            tool,
            key,
            fingerprint,
            effect_class: class,
            annotations,
        }))
    }

    /// A read-only tool call: forwarded without the ledger, unless a
    /// policy refuses it.
    async fn read_only_call(
        &self,
        id: &Value,
        tool: &str,
        annotations: &Value,
    ) -> Result<Prepared, OpError> {
        if self.policies().is_empty() {
            return Ok(Prepared::Forward);
        }
        let view = ToolView {
            tool,
            annotations,
            key: "",
            fingerprint: "",
        };
        match self.verdict(self.body, &view).await {
            Verdict::Allow { .. } => Ok(Prepared::Forward),
            Verdict::Deny { reason, policy, .. } => refuse(
                id,
                -32003,
                &format!("denied by policy {policy}: {reason}"),
                Value::Null,
            ),
            Verdict::RequireApproval { .. } => refuse(
                id,
                -32003,
                "approval is only possible for tools that change the world",
                Value::Null,
            ),
            Verdict::Failed { policy, failure } => refuse(
                id,
                -32004,
                &format!("policy {policy} failed: {failure}"),
                Value::Null,
            ),
        }
    }

    /// The operation id of a world-changing call, in this order: the
    /// `Idempotency-Key` header; the intent id in `params._meta`; a derived
    /// id when the route opts in. `Ok(Err(message))` refuses the call.
    ///
    /// Errors: a malformed `Idempotency-Key` header (400).
    fn intent_id(
        &self,
        msg: &Value,
        tool: &str,
        canonical: &[u8],
    ) -> Result<Result<String, String>, OpError> {
        let max_len = self.rt.limits.max_idempotency_key_len;
        let spec = self.route.mcp.clone().unwrap_or_default();
        // An intent id that is there but no string (`42`, `{}`) is the
        // caller's mistake, never "no intent id": read as absent it would
        // be ignored beside a header, or replaced by a derived id that two
        // calls meant apart could share.
        let meta = &msg["params"]["_meta"][spec.intent_meta_field.as_str()];
        if !meta.is_null() && !meta.is_string() {
            return Ok(Err(format!(
                "the intent id in _meta[\"{}\"] must be a string of 1 to max_idempotency_key_len printable ASCII characters",
                spec.intent_meta_field
            )));
        }
        if let Some(k) = crate::idempotency::parse_key(self.headers, max_len)? {
            // Two identities that disagree name two operations: which one
            // the caller meant is unknowable, so neither runs.
            return Ok(
                match msg["params"]["_meta"][spec.intent_meta_field.as_str()].as_str() {
                    Some(intent) if intent != k => Err(format!(
                        "the Idempotency-Key header ({k:?}) and the intent id in _meta ({intent:?}) disagree; send one, or the same in both"
                    )),
                    _ => Ok(k),
                },
            );
        }
        Ok(match msg["params"]["_meta"][spec.intent_meta_field.as_str()].as_str() {
            Some(k) if crate::config::compensated_id(k).is_some() => Err(format!(
                "the intent id in _meta must not end in {:?}: those ids are the gateway's own \
                 compensating operations",
                crate::config::COMPENSATION_SUFFIX
            )),
            Some(k)
                if !k.is_empty()
                    && k.len() <= max_len
                    && k.bytes().all(|b| (0x20..0x7f).contains(&b)) =>
            {
                Ok(k.to_owned())
            }
            Some(_) => Err("the intent id in _meta must be 1 to max_idempotency_key_len printable ASCII characters".into()),
            None if spec.derived_identity => {
                let scope = self
                    .headers
                    .get(spec.scope_header.as_str())
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                let mut h = Sha256::new();
                for part in [
                    self.principal.tenant.as_bytes(),
                    self.principal.name.as_bytes(),
                    scope.as_bytes(),
                    tool.as_bytes(),
                    canonical,
                ] {
                    h.update((part.len() as u64).to_be_bytes());
                    h.update(part);
                }
                Ok(format!("mcp-{}", &hex::encode(h.finalize())[..40]))
            }
            None => Err(format!(
                "tool {tool:?} changes the world: pass an intent id (Idempotency-Key header or params._meta[\"{}\"])",
                spec.intent_meta_field
            )),
        })
    }
}

/// The policy request for a world-changing call (see the module docs).
pub fn call_policy_request(
    call: &McpCall,
    principal: &Principal,
    route: &Route,
    headers: &HeaderMap,
    body: &[u8],
) -> crate::policy::Request {
    let view = ToolView {
        tool: &call.tool,
        annotations: &call.annotations,
        key: &call.key,
        fingerprint: &call.fingerprint,
    };
    policy_request(principal, route, headers, body, &view)
}

fn raw(status: StatusCode, head: HeaderMap, bytes: Bytes) -> Reply {
    let mut r = Reply::new(status, bytes);
    r.headers = head;
    r
}

/// Sends an (already read) MCP request upstream as is and reads the answer
/// ([`crate::forward::read_whole`]: at most the route's
/// [`Route::mcp_answer_bytes`], within its `response_timeout_ms`).
///
/// Errors: [`OpError::ProviderUnreachable`] when nothing was sent,
/// [`OpError::ProviderTimeout`] when no answer's head came within the
/// route's `response_timeout_ms`, [`OpError::ProviderAnswerUnreadable`]
/// when the exchange failed after the request went out, or the answer
/// was larger, slower or broken off.
pub async fn forward_buffered(
    route: &Route,
    headers: &HeaderMap,
    body: Bytes,
    uri: &http::Uri,
    (peer, proto): (std::net::SocketAddr, &'static str),
) -> Result<(StatusCode, HeaderMap, Bytes), OpError> {
    let mut h = crate::forward::caller_headers(route, headers, Some(peer), proto);
    crate::forward::trace_context(headers, &mut h);
    crate::forward::add_route_headers(route, &mut h, None);
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let req = crate::forward::build_request(
        http::Method::POST,
        uri.clone(),
        h,
        crate::forward::OutboundBody::from(body),
    );
    let timeout = std::time::Duration::from_millis(route.response_timeout_ms);
    let resp = crate::forward::send_within(route, req, timeout)
        .await
        .map_err(|e| {
            if e.timed_out {
                OpError::ProviderTimeout {
                    limit_ms: route.response_timeout_ms,
                }
            } else if e.nothing_sent {
                OpError::ProviderUnreachable(e.detail)
            } else {
                OpError::ProviderAnswerUnreadable(e.detail)
            }
        })?;
    let (mut parts, body) = resp.into_parts();
    let bytes = crate::forward::read_whole(body, route.mcp_answer_bytes(), timeout)
        .await
        .map_err(|e| OpError::ProviderAnswerUnreadable(e.to_string()))?;
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok((parts.status, parts.headers, bytes))
}
