//! The Model Context Protocol's wire pieces the gateway reads, free of
//! I/O: JSON-RPC messages out of JSON or SSE answers, what a tool result
//! means for the ledger, and the cache of tools' annotations.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::{HeaderMap, header};
use serde_json::Value;

use crate::ledger::State as OpState;

/// The MCP protocol revision the gateway speaks to servers.
pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// Tool annotations seen in `tools/list` answers, per route, endpoint (the
/// path the list went to) and tool, for a bounded number of endpoints of
/// each route (see [`ToolCache::store`]).
#[derive(Debug, Default, Clone)]
pub struct ToolCache(Arc<Mutex<Routes>>);

/// Each route's endpoints.
#[derive(Debug, Default)]
struct Routes {
    routes: HashMap<String, HashMap<String, Listed>>,
    /// `store` calls so far: the stamp of the next.
    stores: u64,
}

/// One endpoint's tools, with the stamp of the `store` that last listed it.
#[derive(Debug, Default)]
struct Listed {
    at: u64,
    tools: HashMap<String, Value>,
}

impl ToolCache {
    /// The annotations of `tool` at `endpoint` (route name, path); `null`
    /// when never listed there (or forgotten).
    pub fn annotations(&self, (route, path): (&str, &str), tool: &str) -> Value {
        self.0
            .lock()
            .unwrap()
            .routes
            .get(route)
            .and_then(|r| r.get(path))
            .and_then(|l| l.tools.get(tool))
            .cloned()
            .unwrap_or(Value::Null)
    }

    /// Keeps a page of `tools` listed at `endpoint` (route name, path).
    /// A `fresh` page (a list without a cursor) replaces what the endpoint
    /// had; a cursor's page adds to it. A route keeps at most
    /// `max_endpoints` endpoints (`limits.mcp_tool_endpoints`): a new one
    /// past it makes room by forgetting that route's endpoint listed
    /// longest ago, whose tools then count as world-changing (the safe
    /// reading) until listed again. An empty page keeps nothing new.
    pub fn store(
        &self,
        (route, path): (&str, &str),
        tools: &[Value],
        fresh: bool,
        max_endpoints: usize,
    ) {
        let mut all = self.0.lock().unwrap();
        all.stores += 1;
        let at = all.stores;
        let endpoints = all.routes.entry(route.to_owned()).or_default();
        if fresh && let Some(l) = endpoints.get_mut(path) {
            l.tools.clear();
        }
        if tools.is_empty() {
            return;
        }
        if !endpoints.contains_key(path) {
            while endpoints.len() >= max_endpoints.max(1) {
                let Some(oldest) = endpoints
                    .iter()
                    .min_by_key(|(_, l)| l.at)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                endpoints.remove(&oldest);
            }
        }
        let listed = endpoints.entry(path.to_owned()).or_default();
        listed.at = at;
        for t in tools {
            if let Some(name) = t["name"].as_str() {
                listed.tools.insert(
                    name.to_owned(),
                    t.get("annotations").cloned().unwrap_or(Value::Null),
                );
            }
        }
    }
}

/// Whether a `Content-Type` value names `text/event-stream`. Media types
/// are case-insensitive (RFC 9110 §8.3.1), and parameters may follow.
pub fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Reads one JSON-RPC message out of an upstream answer, JSON or SSE
/// (`text/event-stream`, the last `data:` event carrying a result or error).
pub fn rpc_message(headers: &HeaderMap, body: &[u8]) -> Option<Value> {
    rpc_message_with_text(headers, body).map(|(msg, _)| msg)
}

/// As [`rpc_message`], with the message's own JSON text: the whole body,
/// or the data of the SSE event that carried it (for checks a parsed
/// [`Value`] can no longer make, such as a repeated key).
pub fn rpc_message_with_text<'a>(
    headers: &HeaderMap,
    body: &'a [u8],
) -> Option<(Value, std::borrow::Cow<'a, [u8]>)> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if is_event_stream(ct) {
        // SSE lines end in CRLF, LF or CR (and events in a blank line).
        let text = String::from_utf8_lossy(body)
            .replace("\r\n", "\n")
            .replace('\r', "\n");
        let mut found = None;
        for event in text.split("\n\n") {
            let data: String = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect::<Vec<_>>()
                .join("\n");
            // Notifications (logs, progress) come first; the answer is the
            // message with an id and a result or error.
            if let Ok(v) = serde_json::from_str::<Value>(&data)
                && v.get("id").is_some()
                && (v.get("result").is_some() || v.get("error").is_some())
            {
                found = Some((v, std::borrow::Cow::Owned(data.into_bytes())));
            }
        }
        found
    } else {
        let msg = serde_json::from_slice(body).ok()?;
        Some((msg, std::borrow::Cow::Borrowed(body)))
    }
}

/// The ledger state a tool call's answer means: `isError: true` or a
/// JSON-RPC error is FAILED, a result COMPLETED.
pub fn tool_outcome(msg: &Value) -> (OpState, Option<&'static str>) {
    if msg.get("error").is_some() {
        (OpState::Failed, Some("jsonrpc-error"))
    } else if msg["result"]["isError"].as_bool() == Some(true) {
        (OpState::Failed, Some("tool-error"))
    } else {
        (OpState::Completed, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At most `max_endpoints` endpoints are kept; the one listed longest
    /// ago goes first (listing again refreshes it), an empty page keeps
    /// nothing, and a forgotten tool reads as never listed.
    #[test]
    fn the_tool_cache_keeps_a_bounded_number_of_endpoints() {
        let cache = ToolCache::default();
        let page = |tool: &str| {
            vec![serde_json::json!({"name": tool, "annotations": {"readOnlyHint": true}})]
        };
        let ro = |route, path, tool| cache.annotations((route, path), tool)["readOnlyHint"] == true;
        cache.store(("r", "/a"), &page("x"), true, 2);
        cache.store(("r", "/b"), &page("y"), true, 2);
        // Another route's endpoints count apart.
        cache.store(("s", "/a"), &page("w"), true, 1);
        // A cursor's page adds to /a, and lists it again.
        cache.store(("r", "/a"), &page("x2"), false, 2);
        cache.store(("r", "/c"), &page("z"), true, 2);
        assert_eq!(
            cache.annotations(("r", "/b"), "y"),
            Value::Null,
            "listed longest ago"
        );
        assert!(ro("r", "/a", "x") && ro("r", "/a", "x2") && ro("r", "/c", "z"));
        assert!(ro("s", "/a", "w"));
        // A list that starts over forgets the tools no longer listed.
        cache.store(("r", "/a"), &page("x3"), true, 2);
        assert!(ro("r", "/a", "x3") && !ro("r", "/a", "x") && !ro("r", "/a", "x2"));
        // An empty page adds no endpoint.
        cache.store(("r", "/d"), &[], true, 2);
        assert_eq!(cache.0.lock().unwrap().routes["r"].len(), 2);
        assert!(ro("r", "/c", "z"));
    }
}
