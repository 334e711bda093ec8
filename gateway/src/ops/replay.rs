//! Replay: an operator's deliberate re-run or re-serve of an operation,
//! governed by the tenant's replay verdict for its effect class.

use std::time::Duration;

use http::StatusCode;
use serde_json::json;

use crate::config::Role;
use crate::ledger::{NewApproval, Operation, State as OpState};
use crate::ops::OpError;
use crate::policy::{ReplayVerdict, Verdict, verdict_name};
use crate::state::AppState;

/// Runs the tenant's replay verdict for operation `operation_id` as
/// principal `p`. Returns the status and a JSON report with the verdict and
/// what happened.
///
/// Errors: 403 for roles other than operator (a client key can never
/// replay), 404 for an unknown operation, 409 for a deny verdict or an
/// operation with no outcome yet (RESERVED, AWAITING_APPROVAL,
/// EXECUTING: refused before any approval is asked).
pub async fn replay_as(
    app: &AppState,
    p: &crate::config::Principal,
    tenant: &str,
    operation_id: &str,
    force: bool,
    reason: Option<String>,
) -> Result<(StatusCode, serde_json::Value), OpError> {
    if p.tenant != tenant {
        return Err(OpError::NotFound(format!("no operation {operation_id:?}")));
    }
    if p.role != Role::Operator {
        return Err(OpError::Forbidden {
            role: p.role.as_str(),
            action: "replay operations".into(),
        });
    }
    crate::ops::operator::check_reason(app, "body.reason", reason.as_deref())?;
    let op = app
        .ledger
        .get(tenant, operation_id)
        .await?
        .ok_or_else(|| OpError::NotFound(format!("no operation {operation_id:?}")))?;
    refuse_in_flight(&op)?;
    let route = crate::ops::route_of(&app.settings(), &op)?;
    let class = crate::ops::effect_class(&op, Some(&route));
    let verdict = replay_verdict_for(app, &op, class).await;
    let reason = reason.unwrap_or_else(|| "no reason given".into());
    tracing::info!(tenant, operation_id, verdict = verdict_name(verdict), force, by = %p.name, "replay requested");
    let report = |status: StatusCode, outcome: &str, extra: serde_json::Value| {
        let mut v = json!({"operation_id": operation_id, "verdict": verdict_name(verdict), "outcome": outcome});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        Ok((status, v))
    };
    match verdict {
        ReplayVerdict::Deny => Err(OpError::Conflict(format!(
            "replay denied by the {} verdict for effect class {}",
            verdict_name(verdict),
            class.as_str()
        ))),
        ReplayVerdict::Manual => {
            let approval_id = replay_approval(app, p, &op, &route, class, &reason).await?;
            report(
                StatusCode::ACCEPTED,
                "approval-required",
                json!({"approval_id": approval_id}),
            )
        }
        ReplayVerdict::Revalidate => match revalidate(app, tenant, &route, &op).await {
            Verdict::Allow { .. } => {
                let (outcome, extra) = run_replay(
                    app,
                    &route,
                    op,
                    ReplayVerdict::SameOperationOnly,
                    false,
                    &p.name,
                )
                .await?;
                report(StatusCode::OK, &outcome, extra)
            }
            Verdict::Deny { reason, policy, .. } => Err(OpError::Conflict(format!(
                "revalidation denied the replay: policy {policy}: {reason}"
            ))),
            Verdict::RequireApproval { reasons, .. } => Err(OpError::Conflict(format!(
                "revalidation requires an approval: {}",
                reasons.join("; ")
            ))),
            Verdict::Failed { policy, failure } => Err(OpError::PolicyFailed {
                policy,
                detail: failure.to_string(),
            }),
        },
        ReplayVerdict::Allow | ReplayVerdict::SameOperationOnly => {
            let (outcome, extra) = run_replay(app, &route, op, verdict, force, &p.name).await?;
            report(StatusCode::OK, &outcome, extra)
        }
    }
}

/// A replay is asked of an operation with an outcome, or one the ledger
/// can reconcile (COMPLETED, FAILED, UNKNOWN, COMPENSATED); one still on
/// its way has nothing to replay yet, and is refused before any verdict,
/// so that no replay approval is asked that could never run.
///
/// Errors: 409 `operation-in-flight` (retry after 1 s) for RESERVED or
/// EXECUTING; 409 `conflict` naming the state for AWAITING_APPROVAL, which
/// waits on a human, not on time.
fn refuse_in_flight(op: &Operation) -> Result<(), OpError> {
    match op.state {
        OpState::Reserved | OpState::Executing => Err(OpError::InFlight {
            operation_id: op.operation_id.clone(),
            retry_after_s: 1,
        }),
        OpState::AwaitingApproval => Err(OpError::Conflict(format!(
            "operation {:?} is AWAITING_APPROVAL: it has not run, so there is nothing to replay; \
             decide its approval instead",
            op.operation_id
        ))),
        OpState::Completed | OpState::Failed | OpState::Unknown | OpState::Compensated => Ok(()),
    }
}

/// The id of the operation's pending replay approval: the one that waits
/// (one per operation), or a new one asked by `p`.
async fn replay_approval(
    app: &AppState,
    p: &crate::config::Principal,
    op: &Operation,
    route: &crate::config::Route,
    class: crate::config::EffectClass,
    reason: &str,
) -> Result<String, OpError> {
    if let Some(pending) = app
        .ledger
        .approval_for(&op.tenant_id, &op.operation_id, "replay")
        .await?
        && pending.status == "pending"
    {
        return Ok(pending.id);
    }
    let a = NewApproval {
        id: format!("apr_{}", hex::encode(rand::random::<[u8; 12]>())),
        kind: "replay".into(),
        policy: "replay".into(),
        policy_hash: String::new(),
        reason: format!(
            "{} asked to replay ({reason}); the effect class {} needs a human",
            p.name,
            class.as_str()
        ),
        ttl_ms: i64::try_from(route.approval_ttl_ms).unwrap_or(i64::MAX),
    };
    app.ledger.create_replay_approval(op, &a, &p.name).await?;
    Ok(a.id)
}

/// The stored request evaluated again by the route's current policies, as
/// its original principal.
async fn revalidate(
    app: &AppState,
    tenant: &str,
    route: &crate::config::Route,
    op: &Operation,
) -> Verdict {
    let rt = app.settings();
    let policies = rt.policies.for_route(tenant, &route.name);
    let principal = crate::config::Principal {
        tenant: tenant.into(),
        name: op.principal.clone(),
        role: Role::Client,
    };
    let headers = crate::forward::from_pairs(&op.request_headers);
    let request = crate::ops::admit::policy_request(
        &principal,
        route,
        &crate::ops::admit::PolicyView {
            method: &op.method,
            path: &op.path,
            query: op.query.as_deref(),
            headers: &headers,
            body: &op.request_body,
            operation_id: &op.operation_id,
            fingerprint: &op.fingerprint,
            existing: Some(op.state),
        },
    );
    crate::policy::evaluate_chain_async(app.engine.clone(), policies, route, tenant, request)
        .await
        .0
}

/// Carries out a permitted replay of the **same** operation (same id, same
/// provider key). COMPLETED: the stored result stands and the provider is
/// not called, unless the verdict is `allow` and `force` is set (audited).
/// FAILED on the terminal route: requeued. UNKNOWN: reconciled (read-back
/// first). Anything in flight: 409.
pub(crate) async fn run_replay(
    app: &AppState,
    route: &crate::config::Route,
    op: Operation,
    verdict: ReplayVerdict,
    force: bool,
    actor: &str,
) -> Result<(String, serde_json::Value), OpError> {
    match op.state {
        OpState::Completed if force && verdict == ReplayVerdict::Allow => {
            let state = forced_replay(app, route, &op, actor).await?;
            Ok((
                "re-executed (forced)".into(),
                json!({"state": state, "provider_called": true}),
            ))
        }
        OpState::Completed | OpState::Compensated => Ok((
            "stored result stands".into(),
            json!({"state": op.state, "provider_called": false}),
        )),
        OpState::Failed if op.dead_letter => {
            let target = if route.read_back.is_some() {
                OpState::Unknown
            } else {
                OpState::Reserved
            };
            let v = app
                .ledger
                .requeue(
                    &op.tenant_id,
                    &op.operation_id,
                    op.version,
                    target,
                    actor,
                    "replayed by operator",
                )
                .await?
                .ok_or_else(|| OpError::Conflict("the operation changed meanwhile".into()))?;
            let lease = crate::ops::execute::lease_ms(app);
            if target == OpState::Reserved {
                if let Some(claim) = app
                    .ledger
                    .claim(
                        (&op.tenant_id, &op.operation_id),
                        OpState::Reserved,
                        v,
                        &app.instance_id,
                        lease,
                        "replay: new attempt",
                    )
                    .await?
                {
                    let fresh = app
                        .ledger
                        .get(&op.tenant_id, &op.operation_id)
                        .await?
                        .unwrap_or(op.clone());
                    crate::ops::execute::run_detached(app, route, fresh, claim, wait(app)).await;
                }
            } else if let Some(fresh) = app.ledger.get(&op.tenant_id, &op.operation_id).await? {
                reconcile_detached(app, fresh).await;
            }
            let now = app.ledger.get(&op.tenant_id, &op.operation_id).await?;
            Ok((
                "requeued".into(),
                json!({"state": now.map(|o| o.state), "provider_called": true}),
            ))
        }
        OpState::Failed => Ok((
            "stored failure stands".into(),
            json!({"state": op.state, "provider_called": false}),
        )),
        OpState::Unknown => {
            let step = reconcile_detached(app, op.clone()).await;
            let now = app.ledger.get(&op.tenant_id, &op.operation_id).await?;
            Ok((
                "reconciled".into(),
                json!({"state": now.map(|o| o.state), "step": format!("{step:?}")}),
            ))
        }
        _ => Err(OpError::InFlight {
            operation_id: op.operation_id.clone(),
            retry_after_s: 1,
        }),
    }
}

fn wait(app: &AppState) -> Duration {
    Duration::from_millis(app.settings().reconcile.duplicate_wait_ms)
}

/// Reconciles `op` in a task of its own, waiting at most
/// `reconcile.duplicate_wait_ms`; a new attempt it starts runs to its end
/// even if this request gives up.
async fn reconcile_detached(app: &AppState, op: Operation) -> Option<crate::ops::reconcile::Step> {
    let app2 = app.clone();
    let task = app
        .lifecycle
        .executions
        .spawn(async move { crate::ops::reconcile::reconcile_op(&app2, op).await });
    match tokio::time::timeout(wait(app), task).await {
        Ok(Ok(Ok(step))) => Some(step),
        _ => None,
    }
}

/// Re-sends a COMPLETED operation's stored request with the same provider
/// key, on an operator's explicit `force` under an `allow` verdict. The
/// state stays COMPLETED; the attempt and a COMPLETED → COMPLETED transition
/// naming the operator are recorded.
async fn forced_replay(
    app: &AppState,
    route: &crate::config::Route,
    op: &Operation,
    actor: &str,
) -> Result<OpState, OpError> {
    // The audit record is written first, as a compare-and-swap on the
    // version: of two concurrent forced replays only one calls the
    // provider, and no call goes unrecorded.
    if !app
        .ledger
        .audit(
            &op.tenant_id,
            &op.operation_id,
            op.version,
            OpState::Completed,
            actor,
            &format!("forced replay by {actor} (audited): sending the stored request again"),
        )
        .await?
    {
        return Err(OpError::Conflict(
            "the operation changed meanwhile; reload and retry".into(),
        ));
    }
    let mut headers = crate::forward::from_pairs(&op.request_headers);
    crate::forward::add_route_headers(route, &mut headers, Some(&op.provider_key));
    headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(op.request_body.len()),
    );
    let uri = crate::forward::upstream_uri(route, &op.path, op.query.as_deref())?;
    let method: http::Method = op
        .method
        .parse()
        .map_err(|_| OpError::Internal("stored method".into()))?;
    let req = crate::forward::build_request(
        method,
        uri,
        headers,
        crate::forward::OutboundBody::from(op.request_body.clone()),
    );
    let status = match tokio::time::timeout(
        Duration::from_millis(route.response_timeout_ms),
        route.client.request(req),
    )
    .await
    {
        Ok(Ok(r)) => r.status().as_u16().to_string(),
        Ok(Err(e)) => format!("error: {e}"),
        Err(_) => "timeout".into(),
    };
    // The provider was called: a ledger failure from here on must not read
    // as "nothing happened".
    let after_call = |e: crate::ledger::LedgerError| OpError::OutcomeUnknown {
        operation_id: op.operation_id.clone(),
        detail: format!(
            "the forced replay reached the provider (it answered {status}) but the ledger could not record the answer ({e}); the audit record of the attempt is in the ledger"
        ),
        status: http::StatusCode::SERVICE_UNAVAILABLE,
        retry_after_s: crate::ops::error::UNKNOWN_RETRY_AFTER_S,
    };
    let current = app
        .ledger
        .get(&op.tenant_id, &op.operation_id)
        .await
        .map_err(after_call)?
        .map_or(op.version + 1, |o| o.version);
    app.ledger
        .audit(
            &op.tenant_id,
            &op.operation_id,
            current,
            OpState::Completed,
            actor,
            &format!("forced replay by {actor} (audited): provider answered {status}"),
        )
        .await
        .map_err(after_call)?;
    Ok(OpState::Completed)
}

/// The tenant's replay verdict for `op` (policies on its route, or the
/// defaults of docs/design.md).
pub async fn replay_verdict_for(
    app: &AppState,
    op: &Operation,
    class: crate::config::EffectClass,
) -> crate::policy::ReplayVerdict {
    let rt = app.settings();
    let policies = rt.policies.for_route(&op.tenant_id, &op.route);
    let wit = wit_operation(op, class);
    crate::policy::replay_verdict_async(app.engine.clone(), policies, &op.tenant_id, wit).await
}

/// `op` as the policy world's `operation` record, with effect class `class`.
pub(crate) fn wit_operation(
    op: &Operation,
    class: crate::config::EffectClass,
) -> crate::policy::bindings::Operation {
    use crate::policy::bindings::{Operation as WitOp, OperationState as S};
    WitOp {
        tenant: op.tenant_id.clone(),
        operation_id: op.operation_id.clone(),
        route: op.route.clone(),
        effect_class: crate::policy::wit_class(class),
        state: match op.state {
            OpState::Reserved => S::Reserved,
            OpState::AwaitingApproval => S::AwaitingApproval,
            OpState::Executing => S::Executing,
            OpState::Completed => S::Completed,
            OpState::Failed => S::Failed,
            OpState::Unknown => S::Unknown,
            OpState::Compensated => S::Compensated,
        },
        attempts: u32::try_from(op.attempts).unwrap_or(u32::MAX),
        fingerprint: op.fingerprint.clone(),
    }
}
