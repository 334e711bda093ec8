//! Compensation: undoing a COMPLETED operation with a compensating
//! operation of its own, built from the route's `[routes.compensation]`
//! template.
//!
//! ```text
//! operator ──POST …/operations/{id}/compensate──► policy `compensate` (or the default)
//!   allow            → reserve `<id>#compensation` (RESERVED) → claim → execute
//!   require approval → reserve it AWAITING_APPROVAL with an approval bound to
//!                      the exact compensating request; once approved → execute
//!   deny             → the policy's 4xx; nothing reserved or sent
//! `<id>#compensation` COMPLETED ──same transaction──► `<id>` COMPLETED → COMPENSATED
//! ```
//!
//! The compensation is an ordinary operation on the route
//! `<route>#compensation`: its own provider key (derived from the
//! original's, so every retry is the same compensation at the provider),
//! lease and fencing token, retries, UNKNOWN, read-back and dead letter,
//! all through the same code as any operation. Asking again returns the
//! same compensation; it is never made twice.

use std::time::Duration;

use http::{HeaderValue, StatusCode};
use serde_json::{Value, json};

use crate::config::{
    BodyEncoding, Compensation, Principal, Role, Route, compensated_id, compensation_id,
};
use crate::ledger::{
    CompensationReservation, NewApproval, NewCompensation, NewOperation, Operation,
    State as OpState,
};
use crate::ops::{OpError, effect_class, route_of};
use crate::policy::Verdict;
use crate::state::AppState;
use crate::template::{Vars, body_value, url_encode};

/// The compensating request rendered for one operation.
struct Rendered {
    method: String,
    path: String,
    query: Option<String>,
    content_type: Option<String>,
    body: Vec<u8>,
    headers: Vec<(String, String)>,
}

/// Compensates operation `operation_id` of `tenant` as operator `p` with
/// `reason`, waiting at most `wait` for the compensation's first attempt.
/// Returns the status (200 compensated, 202 under way or awaiting an
/// approval) and a report: `{"operation_id", "state", "compensation":
/// {"operation_id", "state", "provider_key", "attempts", "approval_id",
/// "error"}}`.
///
/// Errors: 403 for roles other than operator; 404 for an unknown
/// operation; 409 for an operation that is not COMPLETED (naming its
/// state), a route without a compensation ("no compensation defined"), a
/// compensation that FAILED, or an operation that is itself a
/// compensation; 422 `compensation-unresolved` naming the template's
/// placeholder the stored request or response lacks (nothing sent); the
/// policy's 4xx for a deny; 503 when a policy fails.
pub async fn compensate_as(
    app: &AppState,
    p: &Principal,
    tenant: &str,
    operation_id: &str,
    reason: Option<String>,
    wait: Duration,
) -> Result<(StatusCode, Value), OpError> {
    if p.tenant != tenant {
        return Err(OpError::NotFound(format!("no operation {operation_id:?}")));
    }
    if p.role != Role::Operator {
        return Err(OpError::Forbidden {
            role: p.role.as_str(),
            action: "compensate operations".into(),
        });
    }
    crate::ops::operator::check_reason(app, "body.reason", reason.as_deref())?;
    let reason = reason
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "no reason given".into());
    let original = crate::ops::operator::load(app, tenant, operation_id).await?;
    if compensated_id(operation_id).is_some() {
        return Err(OpError::Conflict(format!(
            "operation {operation_id:?} is a compensation; a compensation is not compensated"
        )));
    }
    let child_id = compensation_id(operation_id);
    // Asking again: the same compensation, whatever the original's state now.
    if let Some(child) = app.ledger.get(tenant, &child_id).await? {
        return resume(app, &original, child, wait).await;
    }
    if original.state != OpState::Completed {
        return Err(OpError::Conflict(format!(
            "operation {operation_id:?} is {}; only a COMPLETED operation can be compensated",
            original.state
        )));
    }
    let route = route_of(&app.settings(), &original)?;
    let Some(comp) = route.compensation.clone() else {
        return Err(OpError::Conflict(format!(
            "no compensation defined for route {:?} ([routes.compensation])",
            route.name
        )));
    };
    let child_key = crate::idempotency::compensation_provider_key(
        &app.provider_key_secret,
        tenant,
        &child_id,
        &original.provider_key,
    );
    let reference = reference_of(&original, &comp);
    let rendered = render(
        &comp,
        &original,
        &child_id,
        &child_key,
        reference.as_deref(),
    )?;
    let fingerprint = crate::idempotency::fingerprint(
        &rendered.method,
        &comp.route.name,
        &rendered.path,
        rendered.query.as_deref(),
        rendered.content_type.as_deref(),
        &rendered.body,
    );
    let class = effect_class(&original, Some(&route));
    let ask = Ask {
        principal: p,
        reason: &reason,
        child_id: &child_id,
    };
    let (verdict, decisions) =
        decide(app, &route, &original, &ask, &rendered, &fingerprint, class).await;
    let approval = match verdict {
        Verdict::Allow { .. } => None,
        Verdict::RequireApproval { reasons, policy } => Some(NewApproval {
            id: format!("apr_{}", hex::encode(rand::random::<[u8; 12]>())),
            kind: "request".into(),
            policy: policy.0,
            policy_hash: policy.1,
            reason: reasons.join("; "),
            ttl_ms: i64::try_from(route.approval_ttl_ms).unwrap_or(i64::MAX),
        }),
        refused => {
            app.ledger
                .record_decisions(tenant, &child_id, &fingerprint, &decisions)
                .await?;
            return Err(crate::ops::admit::refusal(refused)
                .unwrap_or_else(|| OpError::Internal("a refusal without an error".into())));
        }
    };
    let mut headers = rendered.headers;
    if let Some(ct) = &rendered.content_type {
        headers.push(("content-type".into(), ct.clone()));
    }
    let new = NewOperation {
        tenant_id: tenant.to_owned(),
        operation_id: child_id.clone(),
        route: comp.route.name.clone(),
        method: rendered.method,
        path: rendered.path,
        query: rendered.query,
        fingerprint,
        provider_key: child_key,
        effect_class: Some(class.as_str().to_owned()),
        request_content_type: rendered.content_type,
        request_body: rendered.body,
        request_headers: headers,
        // The operator's request span: the compensation's attempts and
        // read-backs link to it.
        trace_context: crate::telemetry::traceparent_of(&tracing::Span::current()),
        principal: p.name.clone(),
        retention_ms: i64::try_from(route.key_retention_ms).unwrap_or(i64::MAX),
        awaiting_approval: approval.is_some(),
        decisions,
        approval,
    };
    let link = NewCompensation {
        operation_id: operation_id.to_owned(),
        requested_by: p.name.clone(),
        reason: reason.clone(),
        reference,
    };
    tracing::info!(tenant, operation_id, compensation = %child_id, by = %p.name, awaiting_approval = new.awaiting_approval, "compensation requested");
    match app.ledger.reserve_compensation(&new, &link).await? {
        CompensationReservation::Created(child) => {
            if child.state == OpState::Reserved {
                crate::failpoint::hit("after-reserve");
            }
            crate::metrics::compensation(&route.name, "requested");
            resume(app, &original, child, wait).await
        }
        CompensationReservation::Existing(child) => resume(app, &original, child, wait).await,
        CompensationReservation::EarlierIncarnation(old) => Err(OpError::Conflict(format!(
            "operation {operation_id:?} was used again after its retention, and the compensation \
             of its earlier use ({}) is {}{}: settle that one first (resolve or requeue it)",
            old.operation_id,
            old.state,
            if old.dead_letter {
                ", a dead letter"
            } else {
                ""
            }
        ))),
        CompensationReservation::NotCompleted(state) => Err(OpError::Conflict(format!(
            "operation {operation_id:?} is {}; only a COMPLETED operation can be compensated",
            state.map_or("gone".to_owned(), |s| s.to_string())
        ))),
    }
}

/// Takes the compensation on from where it is: runs a RESERVED one (or an
/// AWAITING_APPROVAL one whose approval was granted), waiting at most
/// `wait`, then reports.
async fn resume(
    app: &AppState,
    original: &Operation,
    child: Operation,
    wait: Duration,
) -> Result<(StatusCode, Value), OpError> {
    let expected_key = crate::idempotency::compensation_provider_key(
        &app.provider_key_secret,
        &original.tenant_id,
        &child.operation_id,
        &original.provider_key,
    );
    if child.provider_key != expected_key {
        return Err(OpError::Conflict(format!(
            "{:?} is the compensation of an earlier operation under the key {:?}, still kept until {}; \
             ask again after it expires",
            child.operation_id,
            original.operation_id,
            crate::times::rfc3339(child.expires_at).unwrap_or_default()
        )));
    }
    let settings = app.settings();
    let route = settings.route_named(&child.route).cloned().ok_or_else(|| {
        OpError::Conflict(format!(
            "no compensation defined for route {:?} any more",
            original.route
        ))
    })?;
    let lease = crate::ops::execute::lease_ms(app);
    let claim = match child.state {
        OpState::Reserved => {
            app.ledger
                .claim(
                    (&child.tenant_id, &child.operation_id),
                    OpState::Reserved,
                    child.version,
                    &app.instance_id,
                    lease,
                    "compensation: lease claimed for attempt",
                )
                .await?
        }
        OpState::AwaitingApproval => match app
            .ledger
            .approval_for(&child.tenant_id, &child.operation_id, "request")
            .await?
        {
            Some(a) if a.status == "approved" => {
                app.ledger
                    .use_approval(
                        &child.tenant_id,
                        &a.id,
                        &child.operation_id,
                        &child.fingerprint,
                        &app.instance_id,
                        lease,
                    )
                    .await?
            }
            _ => None,
        },
        _ => None,
    };
    if let Some(claim) = claim {
        let fresh = app
            .ledger
            .get(&child.tenant_id, &child.operation_id)
            .await?
            .unwrap_or(child.clone());
        crate::ops::execute::run_detached(app, &route, fresh, claim, wait).await;
    }
    report(
        app,
        &original.tenant_id,
        &original.operation_id,
        &child.operation_id,
    )
    .await
}

/// The answer for a compensation as it is now.
async fn report(
    app: &AppState,
    tenant: &str,
    operation_id: &str,
    child_id: &str,
) -> Result<(StatusCode, Value), OpError> {
    let original = crate::ops::operator::load(app, tenant, operation_id).await?;
    let child = crate::ops::operator::load(app, tenant, child_id).await?;
    let approval = if child.state == OpState::AwaitingApproval {
        app.ledger.approval_for(tenant, child_id, "request").await?
    } else {
        None
    };
    if child.state == OpState::Failed {
        return Err(OpError::Conflict(format!(
            "the compensation {child_id:?} is FAILED{} ({}); operation {operation_id:?} stays {}",
            if child.dead_letter {
                " (dead letter)"
            } else {
                ""
            },
            child
                .error_detail
                .as_deref()
                .or(child.error_kind.as_deref())
                .unwrap_or("no detail"),
            original.state
        )));
    }
    let status = if child.state == OpState::Completed {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    let mut v = json!({
        "operation_id": operation_id,
        "state": original.state,
        "compensation": {
            "operation_id": child_id,
            "state": child.state,
            "provider_key": child.provider_key,
            "attempts": child.attempts,
            "approval_id": approval.as_ref().map(|a| &a.id),
            "approval_status": approval.as_ref().map(|a| &a.status),
            "error": child.error_detail,
        },
    });
    if status == StatusCode::ACCEPTED {
        v["detail"] = json!(match child.state {
            OpState::AwaitingApproval =>
                "the compensation awaits an approval; nothing has been sent. Once approved it runs.",
            _ =>
                "the compensation is under way; ask again (it is the same compensation) or watch the operation",
        });
    }
    crate::times::annotate(&mut v);
    Ok((status, v))
}

/// The original's provider reference: the one recorded (by a read-back or
/// an operator), else the value at the compensation's `reference_pointer`
/// in its stored response.
fn reference_of(op: &Operation, comp: &Compensation) -> Option<String> {
    if let Some(r) = op.provider_reference.clone().filter(|r| !r.is_empty()) {
        return Some(r);
    }
    let ptr = comp.reference_pointer.as_ref()?;
    match stored_response(op, comp.tool.is_some()).pointer(ptr)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The original's stored response body as JSON (decoded if it was stored
/// compressed); `Null` when none was kept. On an MCP route, the tool's
/// result: its `structuredContent`, or the JSON of its first text content
/// (as a read-back tool's answer is read).
fn stored_response(op: &Operation, mcp: bool) -> Value {
    let v = stored_json(op);
    if !mcp {
        return v;
    }
    let result = &v["result"];
    match result.get("structuredContent") {
        Some(s) if !s.is_null() => s.clone(),
        _ => result["content"][0]["text"]
            .as_str()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or(Value::Null),
    }
}

/// The stored response body parsed as JSON (decoded first if stored
/// compressed), or `Null`.
fn stored_json(op: &Operation) -> Value {
    let Some(body) = &op.response_body else {
        return Value::Null;
    };
    let header = |name: &str| {
        op.response_headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    let decoded = match header("content-encoding") {
        Some(c) => match crate::encoding::decode(c, body, 16 << 20) {
            Ok(b) => b,
            Err(_) => return Value::Null,
        },
        None => body.clone(),
    };
    serde_json::from_slice(&decoded).unwrap_or(Value::Null)
}

/// Renders the compensating request for `op` strictly: a placeholder the
/// stored request or response lacks refuses it (nothing is sent).
fn render(
    comp: &Compensation,
    op: &Operation,
    child_id: &str,
    child_key: &str,
    reference: Option<&str>,
) -> Result<Rendered, OpError> {
    let body = body_value(op.request_content_type.as_deref(), &op.request_body);
    let response = stored_response(op, comp.tool.is_some());
    let vars = Vars {
        operation_id: child_id,
        provider_key: child_key,
        body: &body,
        tenant: &op.tenant_id,
        reference,
        response: &response,
    };
    let unresolved = |e: crate::template::Unresolved| OpError::CompensationUnresolved {
        placeholder: e.placeholder.clone(),
        detail: e.to_string(),
    };
    if comp.needs_reference() && reference.is_none() {
        return Err(OpError::CompensationUnresolved {
            placeholder: "reference".into(),
            detail: format!(
                "reference: no provider reference is recorded for operation {:?}, and its stored response has none{}",
                op.operation_id,
                comp.reference_pointer
                    .as_ref()
                    .map(|p| format!(" at {p:?}"))
                    .unwrap_or_default()
            ),
        });
    }
    let (path, query) = match &comp.path {
        Some(t) => {
            let rendered = t.render_strict(&vars, url_encode).map_err(unresolved)?;
            match rendered.split_once('?') {
                Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
                None => (rendered, None),
            }
        }
        None => (op.path.clone(), None),
    };
    let mut headers = Vec::new();
    for (name, t) in &comp.headers {
        let value = t
            .render_strict(&vars, |s| s.to_owned())
            .map_err(unresolved)?;
        if HeaderValue::from_str(&value).is_err() {
            return Err(OpError::CompensationUnresolved {
                placeholder: format!("header:{name}"),
                detail: format!(
                    "the header {name} renders to a value that is not a valid header value"
                ),
            });
        }
        headers.push((name.as_str().to_owned(), value));
    }
    let (content_type, body) = match (&comp.tool, &comp.body) {
        (Some(tool), _) => {
            let arguments = match &comp.arguments {
                Some(a) => a.render(&vars).map_err(unresolved)?,
                None => json!({}),
            };
            headers.push((
                "accept".into(),
                "application/json, text/event-stream".into(),
            ));
            headers.push((
                "mcp-protocol-version".into(),
                crate::mcp::protocol::PROTOCOL_VERSION.into(),
            ));
            let msg = json!({"jsonrpc": "2.0", "id": child_id, "method": "tools/call",
                "params": {"name": tool, "arguments": arguments,
                           "_meta": {"effectgate/operation-id": child_id}}});
            (
                Some("application/json".to_owned()),
                msg.to_string().into_bytes(),
            )
        }
        (None, Some(b)) => {
            let v = b.render(&vars).map_err(unresolved)?;
            let bytes = match comp.encoding {
                BodyEncoding::Json => crate::template::render_json(&v),
                BodyEncoding::Form => crate::template::render_form(&v),
            };
            (Some(comp.encoding.content_type().to_owned()), bytes)
        }
        (None, None) => (None, Vec::new()),
    };
    Ok(Rendered {
        method: comp.method.to_string(),
        path,
        query,
        content_type,
        body,
        headers,
    })
}

/// Who asks for a compensation, why, and its id.
struct Ask<'a> {
    principal: &'a Principal,
    reason: &'a str,
    child_id: &'a str,
}

/// The tenant's `compensate` decision for this compensation (policies on
/// the original's route, or the default for its effect class).
async fn decide(
    app: &AppState,
    route: &Route,
    original: &Operation,
    ask: &Ask<'_>,
    rendered: &Rendered,
    fingerprint: &str,
    class: crate::config::EffectClass,
) -> (Verdict, Vec<crate::ledger::DecisionRecord>) {
    let rt = app.settings();
    let policies = rt.policies.for_route(&original.tenant_id, &route.name);
    let request = crate::policy::bindings::Compensation {
        operation: crate::ops::replay::wit_operation(original, class),
        principal: ask.principal.name.clone(),
        reason: ask.reason.to_owned(),
        compensation_id: ask.child_id.to_owned(),
        method: rendered.method.clone(),
        path: rendered.path.clone(),
        query: rendered.query.clone(),
        body: rendered.body.clone(),
        fingerprint: fingerprint.to_owned(),
    };
    crate::policy::compensate::compensate_verdict_async(
        app.engine.clone(),
        policies,
        &original.tenant_id,
        class,
        request,
    )
    .await
}
