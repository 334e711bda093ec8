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

/// Tool annotations seen in `tools/list` answers, per endpoint (a route
/// and a path) and tool, for a bounded number of endpoints (see
/// [`ToolCache::store`]).
#[derive(Debug, Default, Clone)]
pub struct ToolCache(Arc<Mutex<Endpoints>>);

/// Each endpoint's tools, with the number of the `store` that last listed
/// it.
#[derive(Debug, Default)]
struct Endpoints {
    tools: HashMap<String, (u64, HashMap<String, Value>)>,
    stores: u64,
}

impl ToolCache {
    /// The annotations of `tool` on the route cached under `route`
    /// (`null` when never listed).
    pub fn annotations(&self, route: &str, tool: &str) -> Value {
        self.0
            .lock()
            .unwrap()
            .tools
            .get(route)
            .and_then(|(_, m)| m.get(tool))
            .cloned()
            .unwrap_or(Value::Null)
    }

    /// Merges a page of tools (pages of a paginated list add up). At most
    /// `max_endpoints` endpoints are kept (`limits.mcp_tool_endpoints`): a
    /// new one past it makes room by forgetting the one listed longest ago
    /// (its tools then count as world-changing, the safe reading, until
    /// listed again). An empty page keeps nothing.
    pub fn store(&self, route: &str, tools: &[Value], max_endpoints: usize) {
        if tools.is_empty() {
            return;
        }
        let mut all = self.0.lock().unwrap();
        all.stores += 1;
        let stamp = all.stores;
        if !all.tools.contains_key(route) {
            while all.tools.len() >= max_endpoints.max(1) {
                let Some(oldest) = all
                    .tools
                    .iter()
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                all.tools.remove(&oldest);
            }
        }
        let (at, map) = all.tools.entry(route.to_owned()).or_default();
        *at = stamp;
        for t in tools {
            if let Some(name) = t["name"].as_str() {
                map.insert(
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
                found = Some(v);
            }
        }
        found
    } else {
        serde_json::from_slice(body).ok()
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
        cache.store("r/a", &page("x"), 2);
        cache.store("r/b", &page("y"), 2);
        cache.store("r/a", &page("x2"), 2);
        cache.store("r/c", &page("z"), 2);
        assert_eq!(
            cache.annotations("r/b", "y"),
            Value::Null,
            "listed longest ago"
        );
        assert_eq!(cache.annotations("r/a", "x")["readOnlyHint"], true);
        assert_eq!(cache.annotations("r/a", "x2")["readOnlyHint"], true);
        assert_eq!(cache.annotations("r/c", "z")["readOnlyHint"], true);
        cache.store("r/d", &[], 2);
        assert_eq!(cache.0.lock().unwrap().tools.len(), 2);
        assert_eq!(cache.annotations("r/a", "x")["readOnlyHint"], true);
    }
}
