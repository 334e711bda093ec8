//! Turning a finished attempt into the ledger outcome and the caller's
//! answer (the table in the parent module), with the tenant's
//! `classify-failure` policies consulted for failed attempts.

use super::*;
use crate::ops::reply::ReplyBody;

fn stored_headers(route: &Route, headers: &HeaderMap) -> Vec<(String, String)> {
    route
        .stored_response_headers
        .iter()
        .flat_map(|n| {
            headers
                .get_all(n)
                .iter()
                .map(move |v| (n.as_str().to_owned(), crate::forward::value_text(v)))
        })
        .collect()
}

/// Why a transient failure was the attempt's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stopped {
    /// The route's retry budget (`retry.max_attempts`) is spent.
    BudgetSpent,
    /// Retries were left, but the provider's `Retry-After` asked to wait
    /// `wait_ms`, longer than the route's `retry.max_retry_after_ms`.
    RetryAfterTooLong {
        /// The wait the provider asked for, ms.
        wait_ms: u64,
    },
}

/// The FAILED outcome (dead-lettered) of a transient failure that ended
/// the retries for `stopped`: `what` names the failure in the outcome's
/// reason ("provider unreachable", "provider answered 503"), `last` in
/// the operator's check ("connect failed", "status 503").
fn stopped_outcome(
    stopped: Stopped,
    route: &Route,
    op: &Operation,
    what: &str,
    last: &str,
) -> Outcome {
    match stopped {
        Stopped::BudgetSpent => {
            let mut o = Outcome::new(OpState::Failed, format!("retries exhausted: {what}"));
            o.error_kind = Some("retries-exhausted".into());
            o.dead_letter = Some(DeadLetter {
                reason: "retries-exhausted".into(),
                operator_check: format!(
                    "Every attempt failed with a transient error (last: {last}); the provider reported no effect. \
                     Check the provider's health, and that no effect exists for provider key {}, before requeueing.",
                    op.provider_key
                ),
            });
            o
        }
        Stopped::RetryAfterTooLong { wait_ms } => {
            let most = route.retry.max_retry_after_ms;
            let mut o = Outcome::new(
                OpState::Failed,
                format!(
                    "retries stopped: the provider asked to wait {wait_ms} ms (Retry-After), more than retry.max_retry_after_ms ({most} ms)"
                ),
            );
            o.error_kind = Some("retry-after-too-long".into());
            o.dead_letter = Some(DeadLetter {
                reason: "retry-after-too-long".into(),
                operator_check: format!(
                    "The provider answered with a transient error ({last}) and asked to wait {wait_ms} ms (Retry-After) before another attempt, \
                     longer than the route's retry.max_retry_after_ms ({most} ms); it reported no effect. After that time, check that \
                     no effect exists for provider key {}, then requeue.",
                    op.provider_key
                ),
            });
            o
        }
    }
}

/// Asks the tenant's policies on the route how to treat a failed response;
/// `None` when there are none or they have no opinion.
pub(super) async fn classify_by_policy(
    app: &AppState,
    route: &Route,
    op: &Operation,
    head: &http::response::Parts,
    body: &ReadBody,
) -> Option<FailureClass> {
    let rt = app.settings();
    let policies = rt.policies.for_route(&op.tenant_id, &route.name);
    if policies.is_empty() {
        return None;
    }
    let bytes = match body {
        ReadBody::Whole(b) | ReadBody::Overflow(b, _) | ReadBody::Broken(b, _) => b,
    };
    // A classifier reads the body: decoded when the provider compressed
    // it (bounded), as it was otherwise.
    let coding = head
        .headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let bytes = if coding.is_empty() {
        bytes.clone()
    } else {
        crate::encoding::decode(&coding, bytes, 1 << 20)
            .map(Bytes::from)
            .unwrap_or_else(|_| bytes.clone())
    };
    let head = crate::policy::bindings::ResponseHead {
        status: head.status.as_u16(),
        headers: crate::forward::visible_pairs(&head.headers)
            .into_iter()
            .map(|(name, value)| crate::policy::bindings::Header { name, value })
            .collect(),
    };
    match crate::policy::classify_failure_async(
        app.engine.clone(),
        policies,
        &op.tenant_id,
        head,
        bytes,
    )
    .await
    {
        FailureClass::Unknown => None,
        c => Some(c),
    }
}

/// Classifies one attempt's result into the outcome to record and the
/// caller's answer (see the module docs for the table). `stopped` is set
/// when the attempt failed transiently and was the last: why no retry
/// follows.
pub(super) fn classify(
    result: Attempt,
    stopped: Option<Stopped>,
    policy_class: Option<FailureClass>,
    route: &Route,
    op: &Operation,
    now: i64,
) -> (Outcome, Answer) {
    let when = Schedule {
        settle: now.saturating_add(
            route
                .read_back
                .as_ref()
                .map_or(0, |rb| rb.settle_delay_ms as i64),
        ),
        // Only routes with a read-back are scheduled for automatic reconciliation.
        next: route.read_back.as_ref().map(|_| now),
    };
    match result {
        Attempt::ConnectFailed(detail) => {
            // A connection never made is transient: the retries stopped.
            let stopped = stopped.unwrap_or(Stopped::BudgetSpent);
            let mut o =
                stopped_outcome(stopped, route, op, "provider unreachable", "connect failed");
            o.error_detail = Some(detail.clone());
            o.attempt_outcome = Some("connect-failed".into());
            (o, Err(OpError::ProviderUnreachable(detail)))
        }
        Attempt::Lost { kind, detail } => {
            let mut o = Outcome::new(
                OpState::Unknown,
                "outcome unknown after the request was sent",
            );
            o.error_kind = Some(kind.into());
            o.error_detail = Some(detail.clone());
            o.attempt_outcome = Some(kind.into());
            when.unknown(&mut o);
            let status = if kind == "timeout" {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::BAD_GATEWAY
            };
            let e = OpError::OutcomeUnknown {
                operation_id: op.operation_id.clone(),
                detail,
                status,
                retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
            };
            (o, Err(e))
        }
        Attempt::Response { head, body } => {
            let code = head.status.as_u16();
            let mut o = by_status(code, stopped, policy_class, route, op, &when);
            o.attempt_outcome = Some(format!("status-{code}"));
            o.response_status = Some(code);
            o.response_headers = stored_headers(route, &head.headers);
            let reply_body = store_body(&mut o, body, content_length(&head.headers));
            if o.state == OpState::Completed {
                check_success(route, &head.headers, &mut o);
            }
            if o.state == OpState::Unknown {
                let e = OpError::OutcomeUnknown {
                    operation_id: op.operation_id.clone(),
                    detail: o.reason.clone(),
                    status: StatusCode::BAD_GATEWAY,
                    retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
                };
                return (o, Err(e));
            }
            let mut parts = head;
            strip_hop_by_hop(&mut parts.headers);
            if o.response_body_omitted {
                parts.headers.remove(header::CONTENT_LENGTH);
            }
            let reply = Reply {
                status: parts.status,
                headers: parts.headers,
                body: reply_body,
                stored_replay: false,
            };
            if route.mcp.is_some() && o.state == OpState::Completed {
                return mcp_result(o, reply, route, op, &when);
            }
            (o, Ok(reply))
        }
    }
}

/// A compensation's `success = { pointer, equals }`: a 2xx whose JSON body
/// holds another value there (or none) did not take effect: FAILED,
/// stored, never retried.
fn check_success(route: &Route, headers: &HeaderMap, o: &mut Outcome) {
    let crate::config::SuccessRule::Pointer { pointer, equals } = &route.success else {
        return;
    };
    let coding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok());
    let body = o.response_body.as_deref().unwrap_or_default();
    let decoded = match coding {
        Some(c) => crate::encoding::decode(c, body, 1 << 20).ok(),
        None => Some(body.to_vec()),
    };
    let found = decoded
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.pointer(pointer).cloned())
        .map(|v| match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        });
    if found.as_deref() != Some(equals.as_str()) {
        o.state = OpState::Failed;
        o.error_kind = Some("success-not-confirmed".into());
        o.reason = format!(
            "the provider answered 2xx, but {pointer} is {} where the route's success rule expects {equals:?}",
            found.map_or("missing".to_owned(), |f| format!("{f:?}"))
        );
        o.error_detail = Some(o.reason.clone());
    }
}

/// When an UNKNOWN outcome is read back: not before `settle`, first at
/// `next` (`None`: the route has no read-back, an operator resolves it).
struct Schedule {
    settle: i64,
    next: Option<i64>,
}

impl Schedule {
    fn unknown(&self, o: &mut Outcome) {
        o.next_reconcile_at = self.next;
        o.settle_until = Some(self.settle);
    }
}

/// The outcome a provider's status means: 2xx COMPLETED; a 1xx as the
/// final answer UNKNOWN (only `101 Switching Protocols` can end an
/// exchange, RFC 9110 §15.2, and the gateway never asks to upgrade: the
/// provider broke the protocol after the request reached it), and so is
/// a status of no class HTTP defines (600–999); a transient
/// one past the budget FAILED (dead letter); a classifier's `permanent`
/// FAILED; other 5xx but 501/505 UNKNOWN; the rest FAILED (permanent).
fn by_status(
    code: u16,
    stopped: Option<Stopped>,
    policy_class: Option<FailureClass>,
    route: &Route,
    op: &Operation,
    when: &Schedule,
) -> Outcome {
    match (code, stopped) {
        (200..=299, _) => Outcome::new(OpState::Completed, "provider applied the effect"),
        // A 1xx as the final answer, or a status of no class RFC 9110 §15
        // defines (600–999; HTTP/1.1's parser takes any three digits),
        // says nothing of the effect.
        (100..=199 | 600.., _) => {
            let what = if code < 200 {
                " to a request that asked for no upgrade"
            } else {
                ", a status of no class HTTP defines (RFC 9110 §15)"
            };
            let mut o = Outcome::new(
                OpState::Unknown,
                format!("provider answered {code}{what}; the effect may have been applied"),
            );
            o.error_kind = Some("provider-protocol".into());
            o.error_detail = Some(answered(code));
            when.unknown(&mut o);
            o
        }
        (_, Some(stopped)) => {
            let mut o = stopped_outcome(
                stopped,
                route,
                op,
                &format!("provider answered {code}"),
                &format!("status {code}"),
            );
            // The last attempt's detail, worded as the retried attempts'
            // (`provider answered 503 Service Unavailable`).
            o.error_detail = Some(answered(code));
            o
        }
        _ if policy_class == Some(FailureClass::Permanent) => {
            let mut o = Outcome::new(
                OpState::Failed,
                format!("provider refused with {code} (permanent by policy)"),
            );
            o.error_kind = Some("permanent".into());
            o.error_detail = Some(answered(code));
            o
        }
        (500..=599, _) if code != 501 && code != 505 => {
            let mut o = Outcome::new(
                OpState::Unknown,
                format!("provider answered {code}; the effect may have been applied"),
            );
            o.error_kind = Some("provider-5xx".into());
            when.unknown(&mut o);
            o
        }
        _ => {
            let mut o = Outcome::new(OpState::Failed, format!("provider refused with {code}"));
            o.error_kind = Some("permanent".into());
            o.error_detail = Some(answered(code));
            o
        }
    }
}

/// `provider answered 400 Bad Request`: a status as the attempts log and
/// an operation's `error_detail` word it.
fn answered(code: u16) -> String {
    match StatusCode::from_u16(code) {
        Ok(status) => format!("provider answered {status}"),
        Err(_) => format!("provider answered {code}"),
    }
}

/// A response's `Content-Length` (RFC 9110 §8.6), when it has one valid
/// value: what an omitted body's size is recorded as.
fn content_length(headers: &http::HeaderMap) -> Option<i64> {
    let mut values = headers.get_all(http::header::CONTENT_LENGTH).iter();
    let v = values.next()?;
    if values.next().is_some() {
        return None;
    }
    v.to_str().ok()?.parse::<u64>().ok()?.try_into().ok()
}

/// Stores what was read of the body in `o` and returns the caller's body:
/// the whole body, or the prefix and the rest streamed (not stored, its
/// size recorded as the provider's `content_length` when it sent one), or
/// the prefix of a body that broke off, followed by the same break (the
/// caller must not take a cut-off body for a whole one).
fn store_body(o: &mut Outcome, body: ReadBody, content_length: Option<i64>) -> ReplyBody {
    match body {
        ReadBody::Whole(b) => {
            o.response_body_bytes = Some(b.len() as i64);
            o.response_body = Some(b.to_vec());
            ReplyBody::Full(b)
        }
        ReadBody::Overflow(prefix, rest) => {
            o.response_body_omitted = true;
            o.response_body_bytes = content_length;
            ReplyBody::Streamed(prefix, rest)
        }
        ReadBody::Broken(prefix, err) => {
            o.response_body_omitted = true;
            o.error_detail = Some(format!("response body unreadable: {err}"));
            if o.state == OpState::Completed {
                o.error_kind = Some("response-body-lost".into());
            }
            ReplyBody::CutShort(prefix, err)
        }
    }
}

/// MCP: the tool-level outcome decides, not the HTTP 200. The JSON-RPC
/// answer (out of JSON or SSE) is what is stored and sent. A 200 whose
/// answer never arrived (an SSE stream cut short) says nothing about the
/// tool: the outcome is unknown.
fn mcp_result(
    mut o: Outcome,
    mut reply: Reply,
    route: &Route,
    op: &Operation,
    when: &Schedule,
) -> (Outcome, Answer) {
    let msg = if o.response_body_omitted {
        None
    } else {
        o.response_body
            .as_deref()
            .and_then(|b| crate::ops::mcp::rpc_message(&reply.headers, b))
    };
    let Some(msg) = msg else {
        let mut u = Outcome::new(
            OpState::Unknown,
            "the tool's answer never arrived; it may have run",
        );
        u.error_kind = Some("tool-result-lost".into());
        u.error_detail = o.error_detail.clone();
        u.attempt_outcome = o.attempt_outcome.clone();
        u.response_status = o.response_status;
        when.unknown(&mut u);
        let e = OpError::OutcomeUnknown {
            operation_id: op.operation_id.clone(),
            detail: u.reason.clone(),
            status: StatusCode::GATEWAY_TIMEOUT,
            retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
        };
        return (u, Err(e));
    };
    let (state, kind) = crate::ops::mcp::tool_outcome(&msg);
    let bytes = msg.to_string().into_bytes();
    o.state = state;
    o.error_kind = kind.map(str::to_owned);
    if let Some(k) = kind {
        o.reason = format!("the tool reported an error ({k})");
        o.error_detail = Some(
            msg["error"]["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| {
                    msg["result"]["content"][0]["text"]
                        .as_str()
                        .unwrap_or("isError: true")
                        .to_owned()
                }),
        );
    }
    o.response_headers = vec![("content-type".into(), "application/json".into())];
    o.response_body_bytes = Some(bytes.len() as i64);
    // Stored whole (MCP answers are read up to 16 MiB): a replay must be a
    // valid tool result, which a truncated one isn't.
    o.response_body = Some(bytes.clone());
    reply.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    reply.headers.remove(header::CONTENT_LENGTH);
    reply.body = ReplyBody::Full(bytes.into());
    crate::metrics::mcp_tool_call(&route.name, kind.unwrap_or("ok"));
    (o, Ok(reply))
}
