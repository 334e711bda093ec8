//! Answers for a request whose key already names an operation (docs/design.md
//! step 6): replays of finished operations, 409s while one is in flight,
//! reconciliation of UNKNOWN ones, and the approval flow.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

use crate::config::Route;
use crate::idempotency::IDEMPOTENT_REPLAYED;
use crate::ledger::{Operation, State as OpState};
use crate::ops::reply::ReplyBody;
use crate::ops::{Answer, OpError, Reply};
use crate::state::AppState;

/// Answers a request whose key already names an operation (docs/design.md step 6).
pub(crate) async fn answer_existing(
    app: &AppState,
    route: &Route,
    op: Operation,
    fp: &str,
) -> Answer {
    let key = op.operation_id.clone();
    if op.fingerprint != fp {
        crate::metrics::request(&route.name, "fingerprint-mismatch");
        return Err(OpError::FingerprintMismatch { key });
    }
    let now = app.ledger.clock().now_ms();
    match op.state {
        OpState::Completed | OpState::Failed | OpState::Compensated => {
            replay_or_dead_letter(route, &op)
        }
        OpState::Executing if op.lease_expires_at.is_some_and(|t| t > now) => {
            crate::metrics::request(&route.name, "in-flight");
            let left_ms = op.lease_expires_at.unwrap_or(now) - now;
            Err(OpError::InFlight {
                operation_id: key,
                retry_after_s: (left_ms as u64).div_ceil(1000).max(1),
            })
        }
        OpState::Reserved => {
            crate::metrics::request(&route.name, "in-flight");
            Err(OpError::InFlight {
                operation_id: key,
                retry_after_s: 1,
            })
        }
        OpState::Executing | OpState::Unknown => {
            // The rarer answers are boxed: their futures (a read-back, an
            // approval's resumption) are kilobytes that every new call's
            // future would otherwise hold room for.
            match Box::pin(crate::ops::reconcile::for_duplicate(app, op)).await {
                Ok(resolved) => replay_or_dead_letter(route, &resolved),
                Err(e) => {
                    crate::metrics::request(&route.name, "outcome-unknown");
                    Err(e)
                }
            }
        }
        OpState::AwaitingApproval => Box::pin(resume_awaiting(app, route, op)).await,
    }
}

/// The stored answer of a terminal operation, or 409 for a dead letter
/// (an operator decides; the caller is not served a failure as final).
pub(crate) fn replay_or_dead_letter(route: &Route, op: &Operation) -> Answer {
    if op.dead_letter {
        crate::metrics::request(&route.name, "rejected");
        return Err(OpError::DeadLettered {
            operation_id: op.operation_id.clone(),
            reason: op.dead_letter_reason.clone().unwrap_or_default(),
        });
    }
    crate::metrics::request(&route.name, "replayed");
    Ok(replay(op))
}

/// Replays a terminal operation's stored response with
/// `Idempotent-Replayed: true`, without calling the provider. An
/// operation that never got an answer (the provider was unreachable) is
/// replayed as its 502 problem.
pub fn replay(op: &Operation) -> Reply {
    let mut resp = match op
        .response_status
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
    {
        Some(status) => {
            let body = op
                .response_body
                .clone()
                .map(Bytes::from)
                .unwrap_or_default();
            let mut r = Reply::new(status, body);
            for (name, value) in &op.response_headers {
                if let (Ok(n), Some(v)) = (
                    header::HeaderName::from_bytes(name.as_bytes()),
                    crate::forward::text_value(value),
                ) {
                    r.headers.append(n, v);
                }
            }
            if op.response_body_omitted {
                // The size is the provider's `Content-Length`; a body sent
                // without one (chunked) was never counted whole.
                let v = match op.response_body_bytes {
                    Some(n) => format!("omitted; size={n}"),
                    None => "omitted".to_owned(),
                };
                if let Ok(v) = HeaderValue::from_str(&v) {
                    r.headers.insert("effectgate-stored-body", v);
                }
                r.headers.remove(header::CONTENT_TYPE);
            }
            r
        }
        None => {
            let e = OpError::ProviderUnreachable(
                op.error_detail
                    .clone()
                    .unwrap_or_else(|| "the provider could not be reached".into()),
            );
            Reply {
                status: StatusCode::BAD_GATEWAY,
                headers: Default::default(),
                body: ReplyBody::Problem(Box::new(e)),
                stored_replay: false,
            }
        }
    };
    resp.headers
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if op.state == OpState::Compensated {
        // The effect was undone since: say so, and by which operation.
        resp.headers
            .insert(COMPENSATED, HeaderValue::from_static("true"));
        if let Ok(v) = HeaderValue::from_str(&crate::config::compensation_id(&op.operation_id)) {
            resp.headers.insert(COMPENSATION_ID, v);
        }
    }
    resp.stored_replay = true;
    resp
}

/// Response header on a replay of a COMPENSATED operation: `true`.
pub const COMPENSATED: &str = "effectgate-compensated";
/// Response header on a replay of a COMPENSATED operation: the id of the
/// compensating operation that undid it (`<id>#compensation`).
pub const COMPENSATION_ID: &str = "effectgate-compensation-id";

/// Answers a request for an operation AWAITING_APPROVAL: 202 while its
/// approval is pending; once approved, this (identical) request spends the
/// approval and executes, exactly once; a refused approval has already
/// failed the operation, which is replayed. Each answer counts in
/// `effectgate_requests_total` under its outcome, as a first call's does:
/// `awaiting-approval` (202), `forwarded` (the approved call executes),
/// `in-flight` (409), or the replay's.
pub(crate) async fn resume_awaiting(app: &AppState, route: &Route, op: Operation) -> Answer {
    let approval = app
        .ledger
        .approval_for(&op.tenant_id, &op.operation_id, "request")
        .await?;
    let awaiting = |op: &Operation, a: Option<&crate::ledger::Approval>| {
        crate::metrics::request(&route.name, "awaiting-approval");
        Ok(awaiting_approval_reply(op, a))
    };
    let in_flight = |operation_id: String| {
        crate::metrics::request(&route.name, "in-flight");
        Err(OpError::InFlight {
            operation_id,
            retry_after_s: 1,
        })
    };
    let Some(a) = approval else {
        return awaiting(&op, None);
    };
    match a.status.as_str() {
        "approved" => {
            let lease = crate::ops::execute::lease_ms(app);
            match app
                .ledger
                .use_approval(
                    &op.tenant_id,
                    &a.id,
                    &op.operation_id,
                    &op.fingerprint,
                    &app.instance_id,
                    lease,
                )
                .await?
            {
                Some(claim) => {
                    let op = app
                        .ledger
                        .get(&op.tenant_id, &op.operation_id)
                        .await?
                        .unwrap_or(op);
                    crate::metrics::request(&route.name, "forwarded");
                    crate::ops::execute::execute_for_caller(app, route, op, claim).await
                }
                None => in_flight(op.operation_id),
            }
        }
        "rejected" | "expired" => match app.ledger.get(&op.tenant_id, &op.operation_id).await? {
            Some(now) if now.state.is_terminal() => replay_or_dead_letter(route, &now),
            _ => awaiting(&op, Some(&a)),
        },
        "used" => in_flight(op.operation_id),
        _ => awaiting(&op, Some(&a)),
    }
}

/// 202 for an operation waiting on a human decision, with
/// `Location: /approvals/{id}` to poll.
pub(crate) fn awaiting_approval_reply(
    op: &Operation,
    approval: Option<&crate::ledger::Approval>,
) -> Reply {
    let body = serde_json::json!({
        "operation_id": op.operation_id,
        "state": op.state,
        "approval_id": approval.map(|a| &a.id),
        "approval_status": approval.map(|a| &a.status),
        "reason": approval.map(|a| &a.reason),
        "detail": "the operation awaits approval; nothing has been sent to the provider. Poll the Location, \
                   then re-send this same request once it is approved.",
    });
    let mut r = Reply::json(StatusCode::ACCEPTED, &body);
    if let Some(a) = approval
        && let Ok(v) = HeaderValue::from_str(&format!("/approvals/{}", a.id))
    {
        r.headers.insert(header::LOCATION, v);
    }
    r
}
