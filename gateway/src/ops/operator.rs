//! The operator's actions on operations: requeue a dead letter, resolve
//! an UNKNOWN operation by the operator's own read-back, and the views of
//! an operation and a dead letter they work from.

use serde::Deserialize;
use serde_json::json;

use crate::config::{Principal, Role};
use crate::ledger::{Operation, Outcome, State as OpState};
use crate::ops::{OpError, effect_class, route_of};
use crate::state::AppState;

pub use crate::ops::replay::replay_verdict_for;

/// Who may requeue a dead letter, resolve an UNKNOWN operation and decide
/// a quarantined inbox event: operators and admins of the tenant, on the
/// admin API and in the console alike.
pub const SETTLERS: &[Role] = &[Role::Operator, Role::Admin];

/// Refuses `principal` unless its role is one of [`SETTLERS`].
///
/// Errors: 403 `forbidden` naming the role and `action` (an approver or a
/// client).
pub fn may_settle(principal: &Principal, action: &'static str) -> Result<(), OpError> {
    if SETTLERS.contains(&principal.role) {
        return Ok(());
    }
    Err(OpError::Forbidden {
        role: principal.role.as_str(),
        action: action.into(),
    })
}

/// Checks the text an operator or approver gives with an action (`field`
/// names it: `body.reason`, `body.comment`) against
/// `limits.max_reason_chars`.
///
/// Errors: 400 `bad-request` naming `field` when it is longer (it used to
/// be cut, silently).
pub fn check_reason(app: &AppState, field: &str, text: Option<&str>) -> Result<(), OpError> {
    let max = app.settings().limits.max_reason_chars;
    match text {
        Some(t) if t.chars().count() > max => Err(OpError::BadRequest {
            field: field.to_owned(),
            message: format!(
                "{field} is {} characters; at most {max} (limits.max_reason_chars)",
                t.chars().count()
            ),
        }),
        _ => Ok(()),
    }
}

/// The body of `POST …/requeue`: a reason only. A resolution's fields
/// (`outcome`, `provider_reference`) are refused by name: a requeue runs
/// the operation again, whatever an operator meant to say about it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Requeue {
    /// Why, for the transition row.
    #[serde(default)]
    pub reason: Option<String>,
}

/// An operator's resolution of an UNKNOWN operation (the body of
/// `POST …/resolve`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resolution {
    /// Why, for the transition row.
    #[serde(default)]
    pub reason: Option<String>,
    /// `completed` (the effect exists) or `absent` (it does not).
    #[serde(default)]
    pub outcome: Option<String>,
    /// The provider's reference of the effect, for `completed`.
    #[serde(default)]
    pub provider_reference: Option<String>,
}

/// The operation's ledger row as people read it (the admin API's list of
/// operations, the CLI's `ledger show`, and the base of
/// [`operation_json`]): its columns without the stored bodies, with the
/// values of credential headers ([`crate::forward::is_credential`]) in
/// `request_headers` and `response_headers` shown as `[redacted]`.
///
/// Errors: 500 if the row can't be written as JSON.
pub fn operation_row(op: &Operation) -> Result<serde_json::Value, OpError> {
    let mut row = serde_json::to_value(op).map_err(|e| OpError::Internal(e.to_string()))?;
    row["request_headers"] = json!(crate::forward::redacted(op.request_headers.clone()));
    row["response_headers"] = json!(crate::forward::redacted(op.response_headers.clone()));
    Ok(row)
}

/// The operation with its history, as the admin API shows it:
/// [`operation_row`] with the stored response body, transitions,
/// attempts, policy decisions, compensation and inbox events.
pub async fn operation_json(app: &AppState, op: &Operation) -> Result<serde_json::Value, OpError> {
    let transitions = app
        .ledger
        .transitions(&op.tenant_id, &op.operation_id)
        .await?;
    let attempts = app.ledger.attempts(&op.tenant_id, &op.operation_id).await?;
    let mut body = operation_row(op)?;
    body["response_body"] = json!(op.response_body.as_deref().map(String::from_utf8_lossy));
    body["transitions"] = json!(transitions);
    body["attempts_log"] = json!(attempts);
    body["policy_decisions"] = json!(
        app.ledger
            .decisions(&op.tenant_id, &op.operation_id)
            .await?
    );
    // Its compensation, when one was asked for (the link, with the
    // compensating operation's state now); or, for a compensation, what it undoes.
    if let Some(link) = app
        .ledger
        .compensation(&op.tenant_id, &op.operation_id)
        .await?
    {
        let child = app.ledger.get(&op.tenant_id, &link.compensation_id).await?;
        let mut v = json!(link);
        v["state"] = json!(child.map(|c| c.state));
        body["compensation"] = v;
    }
    if let Some(original) = crate::config::compensated_id(&op.operation_id) {
        body["compensates"] = json!(original);
    }
    // Provider webhooks that named it, and what each did.
    body["inbox_events"] = json!(
        app.ledger
            .inbox_for_operation(&op.tenant_id, &op.operation_id)
            .await?
    );
    crate::times::annotate(&mut body);
    Ok(body)
}

/// An operator's decision on a quarantined inbox event `(source,
/// event_id)` of the principal's tenant: `action` is `release` (delivered
/// with the gap flag) or `drop`. Returns the events it changed, in order
/// (held events behind it are released too). Logged with the principal;
/// the row keeps who and when.
///
/// Errors: 403 for a role not in [`SETTLERS`], 400 for another action,
/// 404 for an unknown source of this tenant or an unknown event, 409
/// naming the event's state when it is not quarantined.
pub async fn decide_inbox(
    app: &AppState,
    principal: &Principal,
    (source, event_id): (&str, &str),
    action: &str,
) -> Result<Vec<String>, OpError> {
    may_settle(principal, "release or drop inbox events")?;
    let act = match action {
        "release" => crate::ledger::QuarantineAction::Release,
        "drop" => crate::ledger::QuarantineAction::Drop,
        other => {
            return Err(OpError::BadRequest {
                field: "path:action".into(),
                // At most 64 characters of it: the value is the caller's.
                message: format!(
                    "unknown action {:?}; expected release or drop",
                    other.chars().take(64).collect::<String>()
                ),
            });
        }
    };
    let settings = app.settings();
    let deliver = match settings.inbox.get(source) {
        Some(s) if s.tenant == principal.tenant => s.deliver,
        _ => return Err(OpError::NotFound(format!("no inbox source {source:?}"))),
    };
    let changed = app
        .ledger
        .decide_quarantined(
            (&principal.tenant, source, event_id),
            act,
            deliver,
            &principal.name,
        )
        .await?;
    let changed = match changed {
        crate::ledger::QuarantineDecision::Decided(ids) => ids,
        crate::ledger::QuarantineDecision::NotQuarantined(state) => {
            return Err(OpError::Conflict(format!(
                "inbox event {event_id:?} of {source:?} is {state}, not quarantined"
            )));
        }
        crate::ledger::QuarantineDecision::Missing => {
            return Err(OpError::NotFound(format!(
                "no inbox event {event_id:?} of {source:?}"
            )));
        }
    };
    tracing::warn!(tenant = %principal.tenant, source, event_id, action, actor = %principal.name,
        changed = ?changed, "inbox: quarantined event decided by an operator");
    Ok(changed)
}

/// The operation `operation_id` of `tenant`.
///
/// Errors: 404 when there is none.
pub async fn load(app: &AppState, tenant: &str, operation_id: &str) -> Result<Operation, OpError> {
    app.ledger
        .get(tenant, operation_id)
        .await?
        .ok_or_else(|| OpError::NotFound(format!("no operation {operation_id:?}")))
}

/// The fields an operator needs to decide on a dead letter.
pub fn dead_letter_json(op: &Operation) -> serde_json::Value {
    json!({
        "operation_id": op.operation_id,
        "idempotency_key": op.operation_id,
        "provider_key": op.provider_key,
        "route": op.route,
        "effect_class": op.effect_class,
        "attempts": op.attempts,
        "read_backs": op.reconcile_attempts,
        "last_error": { "kind": op.error_kind, "detail": op.error_detail, "status": op.response_status },
        "reason": op.dead_letter_reason,
        "operator_check": op.operator_check,
        "since": op.updated_at,
    })
}

/// Requeues a dead letter with the same operation id and provider key.
/// Only effect classes whose replay default is allow or
/// same-operation-only may be requeued (409 otherwise). With a read-back,
/// the operation goes back to UNKNOWN so the provider is read first; without
/// one it is executed again at once.
///
/// Returns the operation as [`operation_json`] shows it, after waiting at
/// most `reconcile.duplicate_wait_ms` for the new attempt or read-back.
///
/// Errors: 403 for a role not in [`SETTLERS`]; 404 for an unknown
/// operation; 409 when it isn't a dead letter,
/// its route is gone, its replay verdict doesn't allow a requeue, or it
/// changed meanwhile.
pub async fn requeue(
    app: &AppState,
    principal: &Principal,
    operation_id: &str,
    reason: Option<&str>,
) -> Result<serde_json::Value, OpError> {
    may_settle(principal, "requeue operations")?;
    check_reason(app, "body.reason", reason)?;
    let tenant = principal.tenant.as_str();
    let op = load(app, tenant, operation_id).await?;
    if !op.dead_letter {
        return Err(OpError::Conflict(format!(
            "operation {operation_id:?} is {} and not a dead letter",
            op.state
        )));
    }
    let route = route_of(&app.settings(), &op)?;
    let class = effect_class(&op, Some(&route));
    let verdict = replay_verdict_for(app, &op, class).await;
    if !matches!(
        verdict,
        crate::policy::ReplayVerdict::Allow | crate::policy::ReplayVerdict::SameOperationOnly
    ) {
        return Err(OpError::Conflict(format!(
            "the replay verdict for effect class {} is {}, not allow or same-operation-only; requeue needs an approval",
            class.as_str(),
            crate::policy::verdict_name(verdict)
        )));
    }
    let target = if route.read_back.is_some() {
        OpState::Unknown
    } else {
        OpState::Reserved
    };
    let reason = format!(
        "requeued by {}: {}",
        principal.role.as_str(),
        reason.unwrap_or("no reason given")
    );
    let Some(version) = app
        .ledger
        .requeue(
            tenant,
            operation_id,
            op.version,
            target,
            &principal.name,
            &reason,
        )
        .await?
    else {
        return Err(OpError::Conflict(
            "the operation changed meanwhile; reload and retry".into(),
        ));
    };
    // Run it now (read back first when the route can), in a task of its
    // own so it finishes even if this request gives up waiting.
    let task = if target == OpState::Reserved {
        let lease = crate::ops::execute::lease_ms(app);
        match app
            .ledger
            .claim(
                (tenant, operation_id),
                OpState::Reserved,
                version,
                &app.instance_id,
                lease,
                "requeued: new attempt",
            )
            .await?
        {
            Some(claim) => {
                let op = load(app, tenant, operation_id).await?;
                let app2 = app.clone();
                Some(app.lifecycle.executions.spawn(async move {
                    crate::ops::execute::run(app2, route, op, claim, None).await;
                }))
            }
            None => None,
        }
    } else {
        let op = load(app, tenant, operation_id).await?;
        let app2 = app.clone();
        Some(app.lifecycle.executions.spawn(async move {
            let _ = crate::ops::reconcile::reconcile_op(&app2, op).await;
        }))
    };
    if let Some(task) = task {
        let _ = tokio::time::timeout(
            std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms),
            task,
        )
        .await;
    }
    let op = load(app, tenant, operation_id).await?;
    operation_json(app, &op).await
}

/// Resolves an UNKNOWN operation by an operator's own read-back:
/// `{"outcome": "completed", "provider_reference": "…", "reason": "…"}`
/// (the effect exists) or `{"outcome": "absent", …}` (it does not: a new
/// attempt with the same provider key runs now).
///
/// Returns the operation as [`operation_json`] shows it.
///
/// Errors: 403 for a role not in [`SETTLERS`]; 400 naming `body.outcome`
/// for a missing or unknown outcome; 404
/// for an unknown operation; 409 when the operation isn't UNKNOWN (or a
/// dead letter out of reconciliation bounds), is being reconciled, changed
/// meanwhile, its replay verdict forbids a new attempt, or (`absent`) its
/// route is no longer configured: checked before anything is written.
pub async fn resolve(
    app: &AppState,
    principal: &Principal,
    operation_id: &str,
    action: &Resolution,
) -> Result<serde_json::Value, OpError> {
    may_settle(principal, "resolve operations")?;
    check_reason(app, "body.reason", action.reason.as_deref())?;
    let max = app.settings().limits.max_provider_reference_bytes;
    if let Some(fault) = action
        .provider_reference
        .as_deref()
        .and_then(|r| super::reference_fault(r, max))
    {
        return Err(OpError::BadRequest {
            field: "body.provider_reference".into(),
            message: fault,
        });
    }
    let tenant = principal.tenant.as_str();
    let outcome = action
        .outcome
        .as_deref()
        .ok_or_else(|| OpError::BadRequest {
            field: "body.outcome".into(),
            message: "outcome is required: \"completed\" or \"absent\"".into(),
        })?;
    if !matches!(outcome, "completed" | "absent") {
        return Err(OpError::BadRequest {
            field: "body.outcome".into(),
            message: format!("unknown outcome {outcome:?}: expected \"completed\" or \"absent\""),
        });
    }
    let mut op = load(app, tenant, operation_id).await?;
    if op.dead_letter && op.dead_letter_reason.as_deref() != Some("reconciliation-out-of-bounds") {
        return Err(OpError::Conflict(format!(
            "dead letter {operation_id:?} ({}) did not lose track of an effect; use requeue or replay",
            op.dead_letter_reason.as_deref().unwrap_or("unknown reason")
        )));
    }
    if outcome == "absent" {
        // "Absent" means a new attempt: it passes the replay verdict like
        // any other re-execution (manual or deny classes need an approval).
        let class = effect_class(&op, app.settings().route_named(&op.route));
        let verdict = replay_verdict_for(app, &op, class).await;
        if !matches!(
            verdict,
            crate::policy::ReplayVerdict::Allow | crate::policy::ReplayVerdict::SameOperationOnly
        ) {
            return Err(OpError::Conflict(format!(
                "resolving as absent runs the operation again; the replay verdict for {} is {}: use POST …/replay",
                class.as_str(),
                crate::policy::verdict_name(verdict)
            )));
        }
    }
    // A new attempt needs the operation's route: checked before anything
    // is written (a dead letter taken up, the lease), so that a refusal
    // leaves nothing behind to block the next resolution.
    let route = match outcome {
        "absent" => Some(route_of(&app.settings(), &op)?),
        _ => None,
    };
    if op.dead_letter && op.state == OpState::Failed {
        // A dead letter whose effect may exist (reconciliation out of
        // bounds) is resolved like an UNKNOWN operation: back to UNKNOWN
        // first (recorded), then the operator's verdict.
        app.ledger
            .requeue(
                tenant,
                operation_id,
                op.version,
                OpState::Unknown,
                &principal.name,
                "taken up for operator resolution",
            )
            .await?
            .ok_or_else(|| OpError::Conflict("the operation changed meanwhile".into()))?;
        app.ledger
            .unschedule(
                tenant,
                operation_id,
                load(app, tenant, operation_id).await?.version,
            )
            .await?;
        op = load(app, tenant, operation_id).await?;
    }
    if op.state != OpState::Unknown {
        return Err(OpError::Conflict(format!(
            "operation {operation_id:?} is {}, not UNKNOWN or a dead letter",
            op.state
        )));
    }
    let reason = action
        .reason
        .clone()
        .unwrap_or_else(|| "no reason given".into());
    let Some(lease) = app
        .ledger
        .lease_for_reconcile(
            tenant,
            operation_id,
            op.version,
            &principal.name,
            app.settings().reconcile.lease_ms as i64,
            "operator resolution",
        )
        .await?
    else {
        return Err(OpError::Conflict(
            "the operation is being reconciled right now; retry shortly".into(),
        ));
    };
    let ctx = (principal, operation_id, lease.fence);
    match route {
        None => resolve_completed(app, ctx, action, &reason).await?,
        Some(route) => resolve_absent(app, ctx, &route, &reason).await?,
    }
    let op = load(app, tenant, operation_id).await?;
    operation_json(app, &op).await
}

/// Records an operator's "the effect exists": COMPLETED, with a stored
/// answer naming the provider's reference.
async fn resolve_completed(
    app: &AppState,
    (principal, operation_id, fence): (&Principal, &str, i64),
    action: &Resolution,
    reason: &str,
) -> Result<(), OpError> {
    let mut o = Outcome::new(
        OpState::Completed,
        format!(
            "resolved by {}: the effect exists ({reason})",
            principal.role.as_str()
        ),
    );
    let body = json!({"operation_id": operation_id, "state": "COMPLETED", "provider_reference": action.provider_reference,
                       "detail": format!("resolved by an {}", principal.role.as_str())});
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    o.response_status = Some(200);
    o.response_headers = vec![("content-type".into(), "application/json".into())];
    o.response_body_bytes = Some(bytes.len() as i64);
    o.response_body = Some(bytes);
    o.provider_reference = action.provider_reference.clone();
    let recorded = app
        .ledger
        .record_outcome(
            &principal.tenant,
            operation_id,
            fence,
            OpState::Unknown,
            &principal.name,
            &o,
        )
        .await?;
    if !recorded {
        return Err(OpError::Conflict("the operation changed meanwhile".into()));
    }
    Ok(())
}

/// Acts on an operator's "the effect does not exist": a new attempt with
/// the same provider key, waited for at most `reconcile.duplicate_wait_ms`.
async fn resolve_absent(
    app: &AppState,
    (principal, operation_id, fence): (&Principal, &str, i64),
    route: &crate::config::Route,
    reason: &str,
) -> Result<(), OpError> {
    let tenant = principal.tenant.as_str();
    let lease_ms = crate::ops::execute::lease_ms(app);
    let Some(claim) = app
        .ledger
        .reattempt(
            tenant,
            operation_id,
            fence,
            &principal.name,
            lease_ms,
            &format!(
                "resolved by {}: absent ({reason}); new attempt",
                principal.role.as_str()
            ),
        )
        .await?
    else {
        return Err(OpError::Conflict("the operation changed meanwhile".into()));
    };
    let op = load(app, tenant, operation_id).await?;
    let wait = std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
    crate::ops::execute::run_detached(app, route, op, claim, wait).await;
    Ok(())
}

/// Steps this gateway's ledger clock by `ms` (negative: back), a fault for
/// the chaos soak (`POST /admin/clock/step`, only in builds with the
/// `failpoints` feature). Leases, expiries, settle windows on the
/// ledger's clock and new timestamps jump; the monotonic clock does not
/// move (see [`crate::ledger::SettleWindows`]). The step lives in memory:
/// a restart starts at the system clock again. Answers `{"stepped_ms",
/// "now_ms"}` (the ledger's clock after the step).
///
/// Errors: 409 `conflict` on PostgreSQL, where the ledger's clock is the
/// database clock (shared by every instance), not this gateway's.
#[cfg(feature = "failpoints")]
pub async fn step_clock(app: &AppState, ms: i64) -> Result<serde_json::Value, OpError> {
    if app.ledger.backend_name() != "sqlite" {
        return Err(OpError::Conflict(format!(
            "the ledger is on {}: its clock is the database clock, shared by every instance, \
             and this gateway has none of its own to step",
            app.ledger.backend_name()
        )));
    }
    app.ledger.shift_clock(ms).await?;
    tracing::warn!(stepped_ms = ms, "ledger clock stepped (failure injection)");
    Ok(json!({ "stepped_ms": ms, "now_ms": app.ledger.clock().now_ms() }))
}
