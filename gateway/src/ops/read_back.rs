//! Read-back: asking the provider whether an operation's effect exists
//! (the route's `[routes.read_back]` request and its `match`), and judging
//! the answer. MCP routes read back through a tool call
//! ([`crate::ops::mcp::read_back`]).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;

use crate::config::{ReadBack, Route};
use crate::forward::{add_route_headers, build_request};
use crate::ledger::Operation;
use crate::template::{Vars, url_encode};
use tracing::Instrument;

/// What a read-back said.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadBackResult {
    /// The effect exists; `matched` is the value at the found pointer.
    Found {
        /// The matched JSON.
        matched: Value,
        /// The provider's reference, if the route names a pointer for it.
        reference: Option<String>,
    },
    /// The effect does not exist (404, or nothing at the found pointer).
    Absent,
    /// No definite answer.
    Error(String),
}

impl ReadBackResult {
    /// `found`, `absent` or `error` (a span attribute).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Found { .. } => "found",
            Self::Absent => "absent",
            Self::Error(_) => "error",
        }
    }
}

/// Largest read-back answer read, bytes (16 MiB); larger is a read-back error.
pub const READ_BACK_MAX_BYTES: usize = 16 << 20;

/// Asks the provider whether `op`'s effect exists, in a span `read-back`
/// (kind client; its result `found`, `absent` or `error`), timing it in
/// `effectgate_read_back_latency_seconds`.
/// `reference` is what `{reference}` stands for: for a compensation, the
/// provider's reference of the operation it undoes (`None` elsewhere).
pub async fn read_back(
    route: &Route,
    rb: &ReadBack,
    op: &Operation,
    reference: Option<&str>,
) -> ReadBackResult {
    let span = tracing::debug_span!(
        "read-back",
        otel.name = if rb.tool.is_some() {
            "POST"
        } else {
            rb.method.as_str()
        },
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = if rb.tool.is_some() {
            "POST"
        } else {
            rb.method.as_str()
        },
        http.response.status_code = tracing::field::Empty,
        server.address = route.upstream.host_str().unwrap_or(""),
        effectgate.tenant = op.tenant_id.as_str(),
        effectgate.route = route.name.as_str(),
        effectgate.operation_id = op.operation_id.as_str(),
        effectgate.result = tracing::field::Empty,
    );
    let started = std::time::Instant::now();
    let result = if rb.tool.is_some() {
        crate::ops::mcp::read_back(route, rb, op, reference)
            .instrument(span.clone())
            .await
    } else {
        http_read_back(route, rb, op, reference, &span).await
    };
    crate::metrics::read_back_latency(&route.name, started.elapsed());
    span.record("effectgate.result", result.kind());
    if matches!(result, ReadBackResult::Error(_)) {
        span.record("otel.status_code", "ERROR");
    }
    result
}

/// A read-back that can't be built: a placeholder of its request has no
/// value (a field the stored request lacks, no reference recorded). An
/// error, so the operation stays unresolved, never "absent" or "found"
/// by a lookup with an empty value.
pub(crate) fn unresolved(u: &crate::template::Unresolved) -> ReadBackResult {
    ReadBackResult::Error(format!(
        "read-back can't be built from {{{}}}: {}",
        u.placeholder, u.reason
    ))
}

async fn http_read_back(
    route: &Route,
    rb: &ReadBack,
    op: &Operation,
    reference: Option<&str>,
    span: &tracing::Span,
) -> ReadBackResult {
    let body = crate::template::body_value(op.request_content_type.as_deref(), &op.request_body);
    let vars = Vars {
        operation_id: &op.operation_id,
        provider_key: &op.provider_key,
        body: &body,
        tenant: &op.tenant_id,
        reference,
        response: &Value::Null,
    };
    // A placeholder without a value is never sent as an empty one: a
    // lookup by an empty filter may find another operation's resource.
    let path_and_query = match rb.path.render_strict(&vars, url_encode) {
        Ok(p) => p,
        Err(u) => return unresolved(&u),
    };
    let base = route.upstream.as_str().trim_end_matches('/');
    let uri: http::Uri = match format!("{base}{path_and_query}").parse() {
        Ok(u) => u,
        Err(e) => return ReadBackResult::Error(format!("read-back URL is invalid: {e}")),
    };
    let mut headers = http::HeaderMap::new();
    for (name, tpl) in &rb.headers {
        let value = match tpl.render_strict(&vars, |s| s.to_owned()) {
            Ok(v) => v,
            Err(u) => return unresolved(&u),
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name.clone(), v);
        }
    }
    add_route_headers(route, &mut headers, None);
    crate::telemetry::inject_attempt(span, op.trace_context.as_deref(), &mut headers);
    let client = &route.client;
    let req = build_request(
        rb.method.clone(),
        uri,
        headers,
        crate::forward::OutboundBody::empty(),
    );
    let call = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| crate::forward::error_detail(&e))?;
        let status = resp.status();
        let coding = resp
            .headers()
            .get(http::header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // Bounded like a stored response: a read-back answer is one object
        // or one page of them.
        let body = http_body_util::Limited::new(resp.into_body(), READ_BACK_MAX_BYTES)
            .collect()
            .await
            .map_err(|e| {
                format!("read-back answer unreadable (at most {READ_BACK_MAX_BYTES} bytes): {e}")
            })?
            .to_bytes();
        // Read-backs ask for no coding, but a provider may compress anyway;
        // what is matched and stored is the decoded JSON.
        let body = match coding {
            Some(c) => Bytes::from(
                crate::encoding::decode(&c, &body, READ_BACK_MAX_BYTES)
                    .map_err(|e| format!("read-back answer: {e}"))?,
            ),
            None => body,
        };
        Ok::<(StatusCode, Bytes), String>((status, body))
    };
    match tokio::time::timeout(Duration::from_millis(rb.timeout_ms), call)
        .instrument(span.clone())
        .await
    {
        Err(_) => ReadBackResult::Error(format!("no answer within {} ms", rb.timeout_ms)),
        Ok(Err(e)) => ReadBackResult::Error(e),
        Ok(Ok((status, body))) => {
            span.record("http.response.status_code", status.as_u16());
            interpret(rb, status, &body, &expected(rb, &vars))
        }
    }
}

/// The route's `match` list rendered for one operation: (pointer into the
/// found value, required value). Shared by HTTP and MCP read-backs.
/// With a route's `tenant_scoped_field`, the found value must also hold
/// the operation's tenant at that pointer.
pub(crate) fn expected(rb: &ReadBack, vars: &Vars) -> Vec<(String, String)> {
    rb.match_fields
        .iter()
        .map(|(p, t)| (p.clone(), t.render(vars, |s| s.to_owned())))
        .chain(
            rb.tenant_field
                .iter()
                .map(|p| (p.clone(), vars.tenant.to_owned())),
        )
        .collect()
}

/// Reads a read-back answer: 404 → absent; 2xx with a non-empty value at
/// the found pointer that meets every `match` condition → found; 2xx with
/// nothing (matching) there → absent; anything else → error. When the found
/// value is an array, its first element meeting the conditions is the match.
///
/// `expected` is the route's `match` list rendered for this operation:
/// (pointer into the found value, required value).
pub fn interpret(
    rb: &ReadBack,
    status: StatusCode,
    body: &[u8],
    expected: &[(String, String)],
) -> ReadBackResult {
    if status == StatusCode::NOT_FOUND {
        return ReadBackResult::Absent;
    }
    if !status.is_success() {
        return ReadBackResult::Error(format!("read-back answered {status}"));
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return ReadBackResult::Error("read-back body is not JSON".into());
    };
    // Read first value wins by one parser and last by another: the
    // provider may mean the other record (RFC 7493 §2.3).
    if crate::idempotency::has_duplicate_keys(body) {
        return ReadBackResult::Error(
            "read-back body repeats a key in a JSON object (RFC 7493 §2.3)".into(),
        );
    }
    judge(rb, &v, expected)
}

/// Looks for the effect in a read-back answer `v`: a non-empty value at the
/// found pointer (`false` counts as empty) that meets every `match`
/// condition; the first such element when the value is an array.
pub fn judge(rb: &ReadBack, v: &Value, expected: &[(String, String)]) -> ReadBackResult {
    let text = |x: &Value| match x {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let empty = |x: &Value| match x {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Bool(b) => !b,
        _ => false,
    };
    let Some(found) = v.pointer(&rb.found_pointer).filter(|f| !empty(f)) else {
        return ReadBackResult::Absent;
    };
    let meets = |c: &Value| {
        expected
            .iter()
            .all(|(ptr, want)| c.pointer(ptr).is_some_and(|got| text(got) == *want))
    };
    let matched = match found {
        Value::Array(items) if !expected.is_empty() => items.iter().find(|c| meets(c)),
        other if meets(other) => Some(other),
        _ => None,
    };
    match matched {
        None => ReadBackResult::Absent,
        Some(m) => ReadBackResult::Found {
            matched: m.clone(),
            reference: rb
                .reference_pointer
                .as_ref()
                .and_then(|p| m.pointer(p))
                .map(text),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read-back answer that repeats a key is an error, not read by its
    /// last (or first) value: `{"charge":"other","charge":"ch_1"}` would
    /// match `ch_1` by one parser and not by another.
    #[test]
    fn a_read_back_answer_that_repeats_a_key_is_an_error() {
        let rb = ReadBack {
            method: http::Method::GET,
            path: crate::template::Template::parse("/v1/charges").unwrap(),
            tool: None,
            tool_arguments: Vec::new(),
            headers: Vec::new(),
            found_pointer: "/data/0".into(),
            match_fields: Vec::new(),
            reference_pointer: None,
            tenant_field: None,
            settle_delay_ms: 0,
            timeout_ms: 1000,
        };
        let expected = [("/charge".to_owned(), "ch_1".to_owned())];
        let one = br#"{"data":[{"charge":"ch_1"}]}"#;
        assert!(matches!(
            interpret(&rb, StatusCode::OK, one, &expected),
            ReadBackResult::Found { .. }
        ));
        let twice = br#"{"data":[{"charge":"other","charge":"ch_1"}]}"#;
        match interpret(&rb, StatusCode::OK, twice, &expected) {
            ReadBackResult::Error(e) => assert!(e.contains("repeats a key"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}
