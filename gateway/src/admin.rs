//! The admin listener: health, readiness, metrics and the ledger's operator API.
//!
//! | route | roles |
//! |---|---|
//! | `GET /healthz` | none (liveness) |
//! | `GET /readyz` | none (the ledger answers) |
//! | `GET /metrics` | none (Prometheus text format) |
//! | `GET /admin/tenants/{t}/operations/{id}` | admin, operator, approver of `t` |
//! | `GET /admin/tenants/{t}/operations?state=S&limit=N` | admin, operator, approver of `t` |
//! | `GET /admin/tenants/{t}/dead-letters?limit=N` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/operations/{id}/requeue` | admin, operator of `t` |
//! | `POST /admin/tenants/{t}/operations/{id}/resolve` | admin, operator of `t` |
//! | `POST /admin/reload` | any tenant's admin |
//!
//! A key of another tenant gets 404, never 403: it must not learn whether
//! the tenant or operation exists. Every operator action is recorded as a
//! ledger transition with the principal as actor.

use std::collections::HashMap;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::json;

use crate::app::AppState;
use crate::config::Role;
use crate::error::ApiError;
use crate::ledger::{Operation, Outcome, State as OpState};

const READERS: &[Role] = &[Role::Admin, Role::Operator, Role::Approver];
const OPERATORS: &[Role] = &[Role::Admin, Role::Operator];

/// The admin router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/admin/tenants/{tenant}/operations", get(list_operations))
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}",
            get(get_operation),
        )
        .route("/admin/tenants/{tenant}/dead-letters", get(dead_letters))
        .route(
            "/admin/tenants/{tenant}/events/dead-letters",
            get(dead_events),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/requeue",
            post(requeue),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/resolve",
            post(resolve),
        )
        .route("/admin/reload", post(reload))
        .route(
            "/admin/tenants/{tenant}/approvals",
            get(crate::approvals::list),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}",
            get(crate::approvals::get),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}/approve",
            post(crate::approvals::approve),
        )
        .route(
            "/admin/tenants/{tenant}/approvals/{id}/reject",
            post(crate::approvals::reject),
        )
        .route(
            "/admin/tenants/{tenant}/operations/{operation_id}/replay",
            post(crate::replay::replay),
        )
        .merge(crate::console::routes())
        .fallback(|| async { ApiError::NotFound("no such admin endpoint".into()) })
        .method_not_allowed_fallback(|| async {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this admin endpoint",
            )
        })
        .layer(axum::middleware::map_response(as_problem))
        .with_state(state)
}

/// Turns the framework's plain-text rejections (a malformed path segment,
/// an oversized body, a bad form) into RFC 9457 problem+json, so every
/// admin error has the same shape. Console pages (HTML) pass unchanged.
async fn as_problem(resp: Response) -> Response {
    let status = resp.status();
    let ct = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if status.as_u16() < 400
        || ct.starts_with(crate::error::PROBLEM_JSON)
        || ct.starts_with("text/html")
    {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let detail = match axum::body::to_bytes(body, 64 * 1024).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).into_owned(),
        _ => status.canonical_reason().unwrap_or("error").to_owned(),
    };
    let problem = json!({
        "type": "urn:effectgate:problem:bad-request",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut r = (parts.status, problem.to_string()).into_response();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(crate::error::PROBLEM_JSON),
    );
    r
}

async fn readyz(State(app): State<AppState>) -> Response {
    match app.ledger.ping().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(e) => ApiError::LedgerUnavailable(e.to_string()).into_response(),
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    let settings = app.settings();
    if let Ok(counts) = app.ledger.tenant_counts().await {
        let now = app.ledger.clock().now_ms();
        let mut seen = std::collections::BTreeSet::new();
        for (tenant, unknown, dead, oldest) in counts {
            let label = if settings.tenants.contains(&tenant) {
                tenant
            } else {
                "_other".to_owned()
            };
            let age = oldest.map_or(0.0, |t| (now - t).max(0) as f64 / 1000.0);
            crate::metrics::tenant_gauges(&label, unknown, dead, age);
            seen.insert(label);
        }
        for t in settings.tenants.iter().filter(|t| !seen.contains(*t)) {
            crate::metrics::tenant_gauges(t, 0, 0, 0.0);
        }
    }
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::handle().render(),
    )
        .into_response()
}

/// The operation with its history, as the admin API and the CLI show it.
pub async fn operation_json(app: &AppState, op: &Operation) -> Result<serde_json::Value, ApiError> {
    let transitions = app
        .ledger
        .transitions(&op.tenant_id, &op.operation_id)
        .await?;
    let attempts = app.ledger.attempts(&op.tenant_id, &op.operation_id).await?;
    let mut body = serde_json::to_value(op).map_err(|e| ApiError::Internal(e.to_string()))?;
    body["response_body"] = json!(op.response_body.as_deref().map(String::from_utf8_lossy));
    body["transitions"] = json!(transitions);
    body["attempts_log"] = json!(attempts);
    body["policy_decisions"] = json!(
        app.ledger
            .decisions(&op.tenant_id, &op.operation_id)
            .await?
    );
    crate::times::annotate(&mut body);
    Ok(body)
}

async fn load(app: &AppState, tenant: &str, operation_id: &str) -> Result<Operation, ApiError> {
    app.ledger
        .get(tenant, operation_id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no operation {operation_id:?}")))
}

async fn get_operation(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let op = load(&app, &tenant, &operation_id).await?;
    Ok((StatusCode::OK, axum::Json(operation_json(&app, &op).await?)).into_response())
}

fn limit_param(
    app: &AppState,
    q: &HashMap<String, String>,
    allowed: &[&str],
) -> Result<u32, ApiError> {
    for k in q.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(ApiError::BadRequest {
                field: format!("query:{k}"),
                message: format!("unknown query parameter {k:?}"),
            });
        }
    }
    let max = app.settings().limits.max_list_limit;
    match q.get("limit") {
        None => Ok(100.min(max)),
        Some(l) => l
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| ApiError::BadRequest {
                field: "query:limit".into(),
                message: format!("limit must be an integer in 1..={max}"),
            }),
    }
}

async fn list_operations(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, READERS)?;
    let limit = limit_param(&app, &q, &["state", "limit"])?;
    let state = match q.get("state") {
        None => None,
        Some(s) => Some(s.parse::<OpState>().map_err(|e| ApiError::BadRequest {
            field: "query:state".into(),
            message: e.to_string(),
        })?),
    };
    let ops = app.ledger.list(Some(&tenant), state, limit).await?;
    let mut body = json!({ "operations": ops });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

async fn dead_letters(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let limit = limit_param(&app, &q, &["limit"])?;
    let ops = app.ledger.dead_letters(Some(&tenant), limit).await?;
    let items: Vec<_> = ops.iter().map(dead_letter_json).collect();
    let mut body = json!({ "dead_letters": items });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
}

/// `GET /admin/tenants/{t}/events/dead-letters`: the tenant's webhook
/// events whose delivery gave up (retry budget spent), newest first:
/// `{"dead_events": [{event_id, event_type, attempts, last_error,
/// created_at, dead_lettered_at, …_rfc3339}]}`. Roles: operator, admin.
async fn dead_events(
    State(app): State<AppState>,
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let limit = limit_param(&app, &q, &["limit"])?;
    let events = app.ledger.dead_events(&tenant, limit).await?;
    let mut body = json!({ "dead_events": events });
    crate::times::annotate(&mut body);
    Ok(axum::Json(body).into_response())
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionBody {
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    outcome: Option<String>,
    #[serde(default)]
    provider_reference: Option<String>,
}

fn parse_action(body: &[u8]) -> Result<ActionBody, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(ActionBody {
            reason: None,
            outcome: None,
            provider_reference: None,
        });
    }
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
        field: "body".into(),
        message: format!("invalid JSON body: {e}"),
    })
}

/// Requeues a dead letter with the same operation id and provider key.
/// Only effect classes whose replay default is allow or
/// same-operation-only may be requeued (409 otherwise). With a read-back,
/// the operation goes back to UNKNOWN so the provider is read first; without
/// one it is executed again at once.
async fn requeue(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let principal = app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let action = parse_action(&body)?;
    let op = load(&app, &tenant, &operation_id).await?;
    if !op.dead_letter {
        return Err(ApiError::Conflict(format!(
            "operation {operation_id:?} is {} and not a dead letter",
            op.state
        )));
    }
    let route = app
        .settings()
        .routes
        .iter()
        .find(|r| r.name == op.route)
        .ok_or_else(|| ApiError::Conflict(format!("route {:?} is no longer configured", op.route)))?
        .clone();
    let class = op
        .effect_class
        .as_deref()
        .and_then(|c| serde_json::from_value::<crate::config::EffectClass>(json!(c)).ok())
        .unwrap_or(route.effect_class);
    let verdict = replay_verdict_for(&app, &op, class).await;
    if !matches!(
        verdict,
        crate::policy::ReplayVerdict::Allow | crate::policy::ReplayVerdict::SameOperationOnly
    ) {
        return Err(ApiError::Conflict(format!(
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
        "requeued by operator: {}",
        action.reason.as_deref().unwrap_or("no reason given")
    );
    let Some(version) = app
        .ledger
        .requeue(
            &tenant,
            &operation_id,
            op.version,
            target,
            &principal.name,
            &reason,
        )
        .await?
    else {
        return Err(ApiError::Conflict(
            "the operation changed meanwhile; reload and retry".into(),
        ));
    };
    // Run it now (read back first when the route can), in a task of its
    // own so it finishes even if this request gives up waiting.
    let task = if target == OpState::Reserved {
        let lease = crate::execute::lease_ms(&app);
        match app
            .ledger
            .claim(
                &tenant,
                &operation_id,
                OpState::Reserved,
                version,
                &app.instance_id,
                lease,
                "requeued: new attempt",
            )
            .await?
        {
            Some(claim) => {
                let op = load(&app, &tenant, &operation_id).await?;
                let app2 = app.clone();
                Some(tokio::spawn(async move {
                    crate::execute::run(app2, route, op, claim, None).await;
                }))
            }
            None => None,
        }
    } else {
        let op = load(&app, &tenant, &operation_id).await?;
        let app2 = app.clone();
        Some(tokio::spawn(async move {
            let _ = crate::reconcile::reconcile_op(&app2, op).await;
        }))
    };
    if let Some(task) = task {
        let _ = tokio::time::timeout(
            std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms),
            task,
        )
        .await;
    }
    let op = load(&app, &tenant, &operation_id).await?;
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(operation_json(&app, &op).await?),
    )
        .into_response())
}

/// The tenant's replay verdict for `op` (policies on its route, or the
/// DESIGN.md defaults).
pub async fn replay_verdict_for(
    app: &AppState,
    op: &Operation,
    class: crate::config::EffectClass,
) -> crate::policy::ReplayVerdict {
    use crate::policy::bindings::{Operation as WitOp, OperationState as S};
    let rt = app.settings();
    let policies = rt.policies.for_route(&op.tenant_id, &op.route);
    let wit = WitOp {
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
    };
    crate::policy::replay_verdict_async(app.engine.clone(), policies, &op.tenant_id, wit).await
}

/// Reloads the configuration and policies (admin role of any tenant):
/// compiled in the background, swapped atomically; on error the old set
/// stays and the answer says why (422).
async fn reload(State(app): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let p = app.authenticate(&headers)?;
    if p.role != Role::Admin {
        return Err(ApiError::Forbidden {
            role: p.role.as_str(),
            action: "reload the configuration",
        });
    }
    match app.reload(None).await {
        Ok(summary) => Ok(axum::Json(json!({"status": "reloaded", "summary": summary})).into_response()),
        Err(e) => Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            [(http::header::CONTENT_TYPE, crate::error::PROBLEM_JSON)],
            json!({"type": "urn:effectgate:problem:reload-refused", "title": "Unprocessable Entity", "status": 422,
                   "detail": format!("the reload was refused and the old configuration stays: {e}")})
            .to_string(),
        )
            .into_response()),
    }
}

/// Resolves an UNKNOWN operation by an operator's own read-back:
/// `{"outcome": "completed", "provider_reference": "…", "reason": "…"}`
/// (the effect exists) or `{"outcome": "absent", …}` (it does not: a new
/// attempt with the same provider key runs now).
async fn resolve(
    State(app): State<AppState>,
    Path((tenant, operation_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let principal = app.authorize_admin(&headers, &tenant, OPERATORS)?;
    let action = parse_action(&body)?;
    let outcome = action
        .outcome
        .as_deref()
        .ok_or_else(|| ApiError::BadRequest {
            field: "body.outcome".into(),
            message: "outcome is required: \"completed\" or \"absent\"".into(),
        })?;
    if !matches!(outcome, "completed" | "absent") {
        return Err(ApiError::BadRequest {
            field: "body.outcome".into(),
            message: format!("unknown outcome {outcome:?}: expected \"completed\" or \"absent\""),
        });
    }
    let mut op = load(&app, &tenant, &operation_id).await?;
    if op.dead_letter && op.dead_letter_reason.as_deref() != Some("reconciliation-out-of-bounds") {
        return Err(ApiError::Conflict(format!(
            "dead letter {operation_id:?} ({}) did not lose track of an effect; use requeue or replay",
            op.dead_letter_reason.as_deref().unwrap_or("unknown reason")
        )));
    }
    if outcome == "absent" {
        // "Absent" means a new attempt: it passes the replay verdict like
        // any other re-execution (manual or deny classes need an approval).
        let class = op
            .effect_class
            .as_deref()
            .and_then(|c| serde_json::from_value::<crate::config::EffectClass>(json!(c)).ok())
            .unwrap_or(crate::config::EffectClass::Irreversible);
        let verdict = replay_verdict_for(&app, &op, class).await;
        if !matches!(
            verdict,
            crate::policy::ReplayVerdict::Allow | crate::policy::ReplayVerdict::SameOperationOnly
        ) {
            return Err(ApiError::Conflict(format!(
                "resolving as absent runs the operation again; the replay verdict for {} is {}: use POST …/replay",
                class.as_str(),
                crate::policy::verdict_name(verdict)
            )));
        }
    }
    if op.dead_letter && op.state == OpState::Failed {
        // A dead letter whose effect may exist (reconciliation out of
        // bounds) is resolved like an UNKNOWN operation: back to UNKNOWN
        // first (recorded), then the operator's verdict.
        app.ledger
            .requeue(
                &tenant,
                &operation_id,
                op.version,
                OpState::Unknown,
                &principal.name,
                "taken up for operator resolution",
            )
            .await?
            .ok_or_else(|| ApiError::Conflict("the operation changed meanwhile".into()))?;
        app.ledger
            .unschedule(
                &tenant,
                &operation_id,
                load(&app, &tenant, &operation_id).await?.version,
            )
            .await?;
        op = load(&app, &tenant, &operation_id).await?;
    }
    if op.state != OpState::Unknown {
        return Err(ApiError::Conflict(format!(
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
            &tenant,
            &operation_id,
            op.version,
            &principal.name,
            app.settings().reconcile.lease_ms as i64,
            "operator resolution",
        )
        .await?
    else {
        return Err(ApiError::Conflict(
            "the operation is being reconciled right now; retry shortly".into(),
        ));
    };
    match outcome {
        "completed" => {
            let mut o = Outcome::new(
                OpState::Completed,
                format!("resolved by operator: the effect exists ({reason})"),
            );
            let body = json!({"operation_id": operation_id, "state": "COMPLETED", "provider_reference": action.provider_reference,
                               "detail": "resolved by an operator"});
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            o.response_status = Some(200);
            o.response_headers = vec![("content-type".into(), "application/json".into())];
            o.response_body_bytes = Some(bytes.len() as i64);
            o.response_body = Some(bytes);
            o.provider_reference = action.provider_reference.clone();
            if !app
                .ledger
                .record_outcome(
                    &tenant,
                    &operation_id,
                    lease.fence,
                    OpState::Unknown,
                    &principal.name,
                    &o,
                )
                .await?
            {
                return Err(ApiError::Conflict("the operation changed meanwhile".into()));
            }
        }
        "absent" => {
            let route = app
                .settings()
                .routes
                .iter()
                .find(|r| r.name == op.route)
                .ok_or_else(|| {
                    ApiError::Conflict(format!("route {:?} is no longer configured", op.route))
                })?
                .clone();
            let lease_ms = crate::execute::lease_ms(&app);
            let Some(claim) = app
                .ledger
                .reattempt(
                    &tenant,
                    &operation_id,
                    lease.fence,
                    &principal.name,
                    lease_ms,
                    &format!("resolved by operator: absent ({reason}); new attempt"),
                )
                .await?
            else {
                return Err(ApiError::Conflict("the operation changed meanwhile".into()));
            };
            let op = load(&app, &tenant, &operation_id).await?;
            let wait = std::time::Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
            crate::execute::run_detached(&app, &route, op, claim, wait).await;
        }
        _ => unreachable!("outcome validated above"),
    }
    let op = load(&app, &tenant, &operation_id).await?;
    Ok(axum::Json(operation_json(&app, &op).await?).into_response())
}
