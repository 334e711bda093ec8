//! Executing an effectful operation under a held lease: call the provider
//! (retrying transient failures with the same provider key), classify the
//! result, record it under the fencing token, answer.
//!
//! Classification of one attempt:
//!
//! | provider result | outcome |
//! |---|---|
//! | 2xx | COMPLETED |
//! | connect refused / connect timeout (nothing written) | transient |
//! | 429, 503 | transient (retried; `Retry-After` honoured, seconds or an HTTP-date) |
//! | 500, 502, 504 and other 5xx but 501/505 | UNKNOWN |
//! | a 1xx as the final answer (a `101` to a request that asked for no upgrade), or a status of no class HTTP defines (600–999) | UNKNOWN |
//! | timeout or connection lost after the request was sent | UNKNOWN |
//! | any other status (3xx, 4xx, 501, 505) | FAILED (permanent) |
//!
//! Transient failures past the route's retry budget end FAILED on the
//! terminal route (dead letter, reason `retries-exhausted`); so does one
//! whose `Retry-After` asks for a longer wait than the route's
//! `retry.max_retry_after_ms` (reason `retry-after-too-long`).
//!
//! The same code runs the first attempt of a call (the proxy), a new attempt
//! after an "absent" read-back (the reconciler) and a requeued dead letter.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::config::{RetryMode, Route};
use crate::forward::{build_request, strip_hop_by_hop, upstream_uri};
use crate::ledger::{Claim, DeadLetter, Operation, Outcome, State as OpState};
use crate::ops::{Answer, OpError, Reply};
use crate::policy::FailureClass;
use crate::state::AppState;

mod attempt;
mod classify;
use attempt::{
    Attempt, ReadBody, attempt, attempt_span, own_mcp_session, request_headers, retry_after_ms,
};
use classify::{Stopped, classify, classify_by_policy};

/// Lease length for a claim, in ms (`limits.lease_ms`).
pub fn lease_ms(app: &AppState) -> i64 {
    i64::try_from(app.settings().limits.lease_ms)
        .unwrap_or(i64::MAX)
        .max(1)
}

/// Attempts allowed in all for `op` on `route` (grows with each requeue).
pub fn attempt_budget(route: &Route, op: &Operation) -> i64 {
    i64::from(route.retry.max_attempts) * (1 + op.requeues)
}

/// Runs `op` (already claimed: EXECUTING under `claim`) in a background
/// task and answers the caller: with the final response, or with 202 when
/// the route's retry mode is `background` and a transient failure occurred,
/// or when `retry.max_wait_ms` passes first. The task goes on either way, so
/// a caller that hangs up never strands an operation.
pub async fn execute_for_caller(
    app: &AppState,
    route: &Route,
    op: Operation,
    claim: Claim,
) -> Answer {
    let (tx, rx) = oneshot::channel();
    let operation_id = op.operation_id.clone();
    spawn_execution(app, route, op, claim, Some(tx));
    match tokio::time::timeout(Duration::from_millis(route.retry.max_wait_ms), rx).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(_)) => Err(OpError::Internal(
            "the execution task ended without an answer".into(),
        )),
        Err(_) => Ok(accepted(
            &operation_id,
            "the provider has not answered within the route's wait bound",
        )),
    }
}

/// Starts `op`'s execution in a task of its own, in the caller's request
/// span and with its request id (it goes on after the caller stops
/// waiting), answering on `reply` when given. A function of its own, not a
/// step of the caller's future, so that the execution's future (8 KB) is
/// built and boxed here and the waiting future holds no room for it.
fn spawn_execution(
    app: &AppState,
    route: &Route,
    op: Operation,
    claim: Claim,
    reply: Option<oneshot::Sender<Answer>>,
) -> tokio::task::JoinHandle<Option<OpState>> {
    let request = crate::telemetry::request_context();
    // Boxed before it is wrapped and spawned: each wrapper and the spawn
    // would copy it whole.
    let execution = Box::pin(run(app.clone(), route.clone(), op, claim, reply));
    app.lifecycle
        .executions
        .spawn(crate::telemetry::with_request(request, execution).in_current_span())
}

/// Runs a claimed operation in a task of its own and waits for it at most
/// `wait`: the attempt finishes (and is recorded) even if the waiting
/// request goes away. Returns the recorded state if it ended in time.
pub async fn run_detached(
    app: &AppState,
    route: &Route,
    op: Operation,
    claim: Claim,
    wait: Duration,
) -> Option<OpState> {
    let task = spawn_execution(app, route, op, claim, None);
    tokio::time::timeout(wait, task)
        .await
        .ok()
        .and_then(Result::ok)
        .flatten()
}

/// 202 for an operation whose attempts go on in the background.
fn accepted(operation_id: &str, why: &str) -> Reply {
    let body = serde_json::json!({
        "operation_id": operation_id,
        "state": "EXECUTING",
        "detail": format!("{why}; attempts go on in the background with the same provider key. \
                           Re-send the same request (same Idempotency-Key) to get the result."),
    });
    Reply::json(StatusCode::ACCEPTED, &body)
        .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"))
}

/// Runs the attempts of a claimed operation to an outcome and records it.
/// `reply` receives the caller's answer (the first one, if background mode
/// sends an early 202). Returns the state recorded, or `None` if the lease
/// was lost to a newer claim (the write was fenced off).
pub async fn run(
    app: AppState,
    route: Route,
    op: Operation,
    claim: Claim,
    mut reply: Option<oneshot::Sender<Answer>>,
) -> Option<OpState> {
    let send = |reply: &mut Option<oneshot::Sender<Answer>>, r: Answer| {
        if let Some(tx) = reply.take() {
            let _ = tx.send(r);
        }
    };
    match run_inner(&app, &route, &op, &claim, &mut reply).await {
        Ok((state, resp)) => {
            send(&mut reply, resp);
            state
        }
        Err(e) => {
            tracing::error!(operation_id = %op.operation_id, error = %e, "execution failed");
            send(&mut reply, Err(e));
            None
        }
    }
}

/// A transient failure of one attempt, to be retried within budget with
/// the same provider key.
struct Transient {
    /// The provider's status, if it answered.
    status: Option<u16>,
    /// The attempt's outcome kind (`connect-failed`, `status-503`, …).
    kind: String,
    detail: String,
    /// The provider's `Retry-After`, in ms.
    retry_after: Option<u64>,
}

/// Whether `result` is transient: nothing was written (connect failed), a
/// 429 or 503, a classifier policy's `transient`, or an MCP server that no
/// longer knows the session (it refused the call before running it). A
/// policy's `permanent` wins over the status. `now_ms` (ms since the
/// epoch) is what a `Retry-After` date without the answer's `Date` is
/// counted from.
fn transient(
    result: &Attempt,
    policy_class: Option<FailureClass>,
    route: &Route,
    now_ms: i64,
) -> Option<Transient> {
    match result {
        Attempt::ConnectFailed(d) => Some(Transient {
            status: None,
            kind: "connect-failed".to_owned(),
            detail: d.clone(),
            retry_after: None,
        }),
        Attempt::Response { .. } if policy_class == Some(FailureClass::Permanent) => None,
        Attempt::Response { head, .. }
            if matches!(head.status.as_u16(), 429 | 503)
                || policy_class == Some(FailureClass::Transient)
                || (route.mcp.is_some() && head.status == StatusCode::NOT_FOUND) =>
        {
            Some(Transient {
                status: Some(head.status.as_u16()),
                kind: format!("status-{}", head.status.as_u16()),
                detail: format!("provider answered {}", head.status),
                retry_after: retry_after_ms(&head.headers, now_ms),
            })
        }
        _ => None,
    }
}

async fn run_inner(
    app: &AppState,
    route: &Route,
    op: &Operation,
    claim: &Claim,
    reply: &mut Option<oneshot::Sender<Answer>>,
) -> Result<(Option<OpState>, Answer), OpError> {
    let ledger = &app.ledger;
    let lease_ms = lease_ms(app);
    let uri = upstream_uri(route, &op.path, op.query.as_deref())?;
    let mut headers = request_headers(route, op, claim).await;
    let method: http::Method = op
        .method
        .parse()
        .map_err(|_| OpError::Internal("stored method".into()))?;
    let body = Bytes::from(op.request_body.clone());
    let budget = attempt_budget(route, op);

    let mut attempt_no = claim.attempt;
    let mut retry_no: u32 = 1;
    let mut last_status: Option<u16> = None;
    loop {
        if route.mcp.is_some()
            && retry_no > 1
            && last_status == Some(StatusCode::NOT_FOUND.as_u16())
        {
            own_mcp_session(route, op, &mut headers).await;
        }
        let span = attempt_span(route, op, claim, &method, &uri, attempt_no);
        let mut sent_headers = headers.clone();
        crate::telemetry::inject_attempt(&span, op.trace_context.as_deref(), &mut sent_headers);
        let req = build_request(
            method.clone(),
            uri.clone(),
            sent_headers,
            crate::forward::OutboundBody::from(body.clone()),
        );
        crate::failpoint::hit("before-send");
        // A claim that took long to land (a wait for a connection or a row
        // lock, a pause of this process) may hold little of its lease:
        // renew it under the fencing token before sending. Every retry
        // renews it too: the wait before it (or a pause of this process
        // during that wait) may have outlasted the lease, and another owner
        // may hold the operation now. If the renewal fails, nothing is sent.
        if (attempt_no != claim.attempt
            || claim.lease_expires_at - ledger.clock().now_ms() < lease_ms / 2)
            && !ledger
                .extend_lease(&op.tenant_id, &op.operation_id, claim.fence, lease_ms)
                .await?
        {
            return Ok((None, Err(fenced_off(&op.operation_id))));
        }
        let result = attempt(app, &route.client, req, route, op, claim.fence, lease_ms)
            .instrument(span.clone())
            .await;
        if let Attempt::Response { head, .. } = &result {
            span.record("http.response.status_code", head.status.as_u16());
        }

        // The tenant's classifier policies may override the gateway's rules
        // for a failed response.
        let policy_class = match &result {
            Attempt::Response { head, body } if !head.status.is_success() => {
                classify_by_policy(app, route, op, head, body).await
            }
            _ => None,
        };
        let transient = transient(&result, policy_class, route, ledger.clock().now_ms());
        last_status = transient.as_ref().and_then(|t| t.status);
        let delay = transient
            .as_ref()
            .filter(|_| attempt_no < budget)
            .map(|t| backoff_ms(route, retry_no, t.retry_after));
        if let (Some(t), Some(Some(delay))) = (&transient, delay) {
            span.record("effectgate.outcome", "transient");
            span.record("otel.status_code", "ERROR");
            if !note_retry(app, route, op, claim, t, lease_ms + delay as i64).await? {
                return Ok((None, Err(fenced_off(&op.operation_id))));
            }
            tracing::info!(operation_id = %op.operation_id, attempt = attempt_no, delay_ms = delay, detail = %t.detail, "transient failure; retrying");
            if route.retry.mode == RetryMode::Background
                && let Some(tx) = reply.take()
            {
                let _ = tx.send(Ok(accepted(
                    &op.operation_id,
                    &format!("attempt {attempt_no} failed ({})", t.kind),
                )));
            }
            tokio::time::sleep(Duration::from_millis(delay)).await;
            retry_no += 1;
            attempt_no += 1;
            continue;
        }
        let now = ledger.clock().now_ms();
        // A transient failure ends here: its budget is spent, or retries
        // were left but the provider asked for a longer wait than the
        // route honours.
        let stopped = transient.as_ref().map(|t| match (delay, t.retry_after) {
            (Some(None), Some(wait_ms)) => Stopped::RetryAfterTooLong { wait_ms },
            _ => Stopped::BudgetSpent,
        });
        let (mut outcome, answer) = classify(result, stopped, policy_class, route, op, now);
        span.record("effectgate.outcome", outcome.state.as_str());
        if outcome.state != OpState::Completed {
            span.record("otel.status_code", "ERROR");
        }
        outcome.request_id = crate::telemetry::request_id();
        return record(app, route, op, claim, outcome, attempt_no, answer).await;
    }
}

/// Records a transient failure and the lease for the wait before the next
/// attempt (`lease_ms`); `false` when the write was fenced off.
async fn note_retry(
    app: &AppState,
    route: &Route,
    op: &Operation,
    claim: &Claim,
    t: &Transient,
    lease_ms: i64,
) -> Result<bool, OpError> {
    let ok = app
        .ledger
        .note_retry(
            (&op.tenant_id, &op.operation_id),
            claim.fence,
            t.status,
            (&t.kind, &t.detail),
            lease_ms,
            crate::telemetry::request_id().as_deref(),
        )
        .await
        .map_err(|e| unrecorded(&op.operation_id, &e))?;
    if ok {
        crate::metrics::retry(&route.name);
    }
    Ok(ok)
}

/// Records the attempt's outcome under the fencing token and hands back the
/// caller's answer (a fenced-off write answers 409).
async fn record(
    app: &AppState,
    route: &Route,
    op: &Operation,
    claim: &Claim,
    outcome: Outcome,
    attempts: i64,
    answer: Answer,
) -> Result<(Option<OpState>, Answer), OpError> {
    crate::failpoint::hit("before-record");
    let mono = app.ledger.clock().monotonic_ms();
    let recorded = app
        .ledger
        .record_outcome(
            &op.tenant_id,
            &op.operation_id,
            claim.fence,
            OpState::Executing,
            &app.instance_id,
            &outcome,
        )
        .await
        .map_err(|e| unrecorded(&op.operation_id, &e))?;
    if !recorded {
        return Ok((None, Err(fenced_off(&op.operation_id))));
    }
    // UNKNOWN: the settle window opens on the monotonic clock too (see
    // `ledger::SettleWindows`). Ended: its window goes.
    let windows = app.ledger.settle_windows();
    match (outcome.state, outcome.settle_until) {
        (OpState::Unknown, Some(until)) => windows.open(
            &op.tenant_id,
            &op.operation_id,
            until,
            mono,
            route
                .read_back
                .as_ref()
                .map_or(0, |rb| rb.settle_delay_ms as i64),
        ),
        (state, _) if state.is_terminal() && outcome.dead_letter.is_none() => {
            windows.close(&op.tenant_id, &op.operation_id)
        }
        _ => {}
    }
    crate::failpoint::hit("after-record");
    let span = tracing::Span::current();
    span.record("effectgate.state", outcome.state.as_str());
    span.record("effectgate.fence", claim.fence);
    crate::metrics::recorded(&op.tenant_id, &route.name, outcome.state.as_str());
    // String values (not `Display`): the log's field formatter writes a
    // plain string directly.
    tracing::info!(
        tenant = op.tenant_id.as_str(),
        operation_id = op.operation_id.as_str(),
        route = route.name.as_str(),
        state = outcome.state.as_str(),
        attempts,
        outcome = outcome.attempt_outcome.as_deref().unwrap_or("-"),
        "operation recorded"
    );
    Ok((Some(outcome.state), answer))
}

/// The provider was called, but the ledger could not record what came
/// back (the database is unreachable or timed out): the outcome is unknown
/// to the caller, not "nothing happened". The operation stays EXECUTING
/// under this instance's lease; when the lease expires the reconciler
/// reads it back, so a retry with the same key gets the one result.
fn unrecorded(operation_id: &str, e: &crate::ledger::LedgerError) -> OpError {
    tracing::error!(operation_id, error = %e, "the provider was called but the outcome could not be recorded");
    OpError::OutcomeUnknown {
        operation_id: operation_id.to_owned(),
        detail: "the provider was called but the effect ledger could not record the outcome; \
                 it will be reconciled: retry with the same Idempotency-Key, never a new one"
            .into(),
        status: StatusCode::SERVICE_UNAVAILABLE,
        retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
    }
}

fn fenced_off(operation_id: &str) -> OpError {
    OpError::OutcomeUnknown {
        operation_id: operation_id.to_owned(),
        detail:
            "a newer claim took over this operation; its outcome will be recorded by that owner"
                .into(),
        status: StatusCode::CONFLICT,
        retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
    }
}

/// Full-jitter exponential backoff for retry number `n` (1 = first retry):
/// a random delay in `[0, min(max_delay_ms, base_delay_ms · 2^(n-1))]`, at
/// least the provider's `Retry-After`; `None` when that exceeds
/// `max_retry_after_ms`.
pub fn backoff_ms(route: &Route, n: u32, retry_after: Option<u64>) -> Option<u64> {
    let r = &route.retry;
    let jitter = crate::ops::backoff::delay_ms(
        r.base_delay_ms,
        r.max_delay_ms,
        n,
        crate::ops::backoff::Jitter::Full,
    );
    match retry_after {
        Some(ra) if ra > r.max_retry_after_ms => None,
        Some(ra) => Some(jitter.max(ra)),
        None => Some(jitter),
    }
}
