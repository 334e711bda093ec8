//! Admitting an effectful call, after the HTTP surface has authenticated
//! the principal, matched the route and read the bounded body: the steps of
//! the effectful flow (docs/design.md "Request flow"), one function each:
//!
//! 1. [`refuse_ambiguous_json`]: a body that repeats a JSON key is refused;
//! 2. [`check_contract`]: the route's request contract (4b);
//! 3. [`known_operation`]: a key that already names an operation is
//!    answered from it (6, read pool; when nothing before the reservation
//!    needs it, only the replay cache is asked and the reservation finds
//!    the operation, [`Flow::reads_first`]);
//! 4. [`decide`]: the tenant's policies (5);
//! 5. [`reserve`]: the operation is reserved in the effect ledger (6);
//! 6. [`claim_and_execute`]: the lease is claimed and the provider called
//!    (7–9).

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::config::{EffectClass, Principal, Route};
use crate::forward::{caller_headers, to_pairs};
use crate::idempotency::provider_key;
use crate::ledger::DecisionRecord;
use crate::ledger::{NewApproval, NewOperation, Operation, Reservation, State as OpState};
use crate::ops::answer::{answer_existing, resume_awaiting};
use crate::ops::mcp::McpCall;
use crate::ops::{Answer, OpError};
use crate::policy::{Verdict, evaluate_chain_async, wit_class};
use crate::state::{AppState, Runtime};

/// The effectful flow of one call after identity and fingerprint.
pub struct Flow<'a> {
    /// The shared state.
    pub app: &'a AppState,
    /// The settings snapshot this request is served from.
    pub rt: &'a Runtime,
    /// The matched route (of `rt`).
    pub route: &'a Route,
    /// The authenticated principal.
    pub principal: &'a Principal,
    /// The caller's address (for `X-Forwarded-For`).
    pub peer: SocketAddr,
    /// The scheme the caller used (`http` or `https`).
    pub scheme: &'static str,
    /// The caller's method.
    pub method: &'a http::Method,
    /// The caller's headers.
    pub headers: &'a HeaderMap,
    /// The path below the route's prefix.
    pub rest: &'a str,
    /// The query, if any.
    pub query: Option<&'a str>,
    /// The MCP tool call this is, on an MCP route.
    pub mcp: Option<&'a McpCall>,
}

impl Flow<'_> {
    /// Runs the steps for a call identified by `key` with fingerprint
    /// `fp`, whose body is `body` (of type `content_type`).
    ///
    /// Errors: every refusal of a step, as its [`OpError`].
    pub async fn run(
        self,
        body: Bytes,
        content_type: Option<String>,
        key: String,
        fp: String,
    ) -> Answer {
        crate::telemetry::note_operation_id(&key);
        if crate::config::compensated_id(&key).is_some() {
            // Those ids are the gateway's own compensating operations.
            return Err(OpError::IdempotencyKeyInvalid(format!(
                "keys ending in {:?} are reserved for compensations",
                crate::config::COMPENSATION_SUFFIX
            )));
        }
        refuse_ambiguous_json(&body)?;
        check_contract(self.route, &body)?;
        let read = self.reads_first();
        if let Some(op) = known_operation(self.app, &self.principal.tenant, &key, &fp, read).await?
        {
            return answer_existing(self.app, self.route, op, &fp).await;
        }
        // The call's bytes count against the quota until its reservation
        // is written (or has failed).
        let hold = check_quota(self.app, self.rt, &self.principal.tenant, body.len()).await?;
        let admission = self.decide(&body, &key, &fp).await?;
        let reserved = self
            .reserve(admission, body, content_type, key, &fp)
            .await?;
        drop(hold);
        let op = match reserved {
            Reserved::Op(op) => *op,
            Reserved::Claimed(op, claim) => {
                crate::metrics::request(&self.route.name, "forwarded");
                return crate::ops::execute::execute_for_caller(self.app, self.route, *op, claim)
                    .await;
            }
            Reserved::Answered(a) => return a,
        };
        claim_and_execute(self.app, self.route, op).await
    }

    /// Whether the ledger is read for the key before the reservation: when
    /// something runs before it that a duplicate must not set off or be
    /// refused by (the tenant's policies on this route, its
    /// `max_stored_bytes` quota, the route's `tenant_scoped_field` stamp).
    /// Otherwise the reservation itself finds an operation the key names
    /// (`INSERT … ON CONFLICT DO NOTHING`, then the row) and the same
    /// answer is given from it, with one ledger read less for a new key.
    fn reads_first(&self) -> bool {
        let tenant = &self.principal.tenant;
        self.route.tenant_scoped_field.is_some()
            || self
                .rt
                .tenant_limits
                .get(tenant)
                .is_some_and(|l| l.max_stored_bytes.is_some())
            || !self
                .rt
                .policies
                .for_route(tenant, &self.route.name)
                .is_empty()
    }

    /// Step 5: the tenant's policies on this route. Refusals are recorded
    /// (with the decisions) and returned as errors.
    async fn decide(&self, body: &[u8], key: &str, fp: &str) -> Result<Admission, OpError> {
        let (app, route, principal) = (self.app, self.route, self.principal);
        let mut admission = Admission {
            effect_class: self
                .mcp
                .and_then(|c| c.effect_class)
                .unwrap_or(route.effect_class),
            forwarded: caller_headers(route, self.headers, Some(self.peer), self.scheme),
            approval: None,
            decisions: Vec::new(),
        };
        let policies = self.rt.policies.for_route(&principal.tenant, &route.name);
        if policies.is_empty() {
            return Ok(admission);
        }
        let request = match self.mcp {
            Some(call) => {
                crate::ops::mcp::call_policy_request(call, principal, route, self.headers, body)
            }
            None => policy_request(
                principal,
                route,
                &PolicyView {
                    method: self.method.as_str(),
                    path: self.rest,
                    query: self.query,
                    headers: self.headers,
                    body,
                    operation_id: key,
                    fingerprint: fp,
                    existing: None,
                },
            ),
        };
        let (verdict, records) = evaluate_chain_async(
            app.engine.clone(),
            policies,
            route,
            &principal.tenant,
            request,
        )
        .await;
        admission.decisions = records;
        match verdict {
            Verdict::Allow {
                effect_class,
                add_headers,
            } => {
                if let Some(c) = effect_class {
                    admission.effect_class = c;
                }
                // A policy's header replaces the caller's of that name: a
                // caller can't pre-empt what a policy pins.
                for (n, _) in &add_headers {
                    admission.forwarded.remove(n);
                }
                for (n, v) in add_headers {
                    admission.forwarded.append(n, v);
                }
            }
            Verdict::RequireApproval { reasons, policy } => {
                admission.approval = Some(NewApproval {
                    id: format!("apr_{}", hex::encode(rand::random::<[u8; 12]>())),
                    kind: "request".into(),
                    policy: policy.0,
                    policy_hash: policy.1,
                    reason: reasons.join("; "),
                    ttl_ms: i64::try_from(route.approval_ttl_ms).unwrap_or(i64::MAX),
                });
            }
            refused => {
                app.ledger
                    .record_decisions(&principal.tenant, key, fp, &admission.decisions)
                    .await?;
                crate::metrics::request(&route.name, "rejected");
                return Err(refusal(refused).unwrap_or_else(|| {
                    OpError::Internal("a policy verdict without a refusal".into())
                }));
            }
        }
        Ok(admission)
    }

    /// Step 6: reserves the operation (the tenant stamped into the body
    /// where the route's read-back checks it) and, when it needs no
    /// approval, claims its lease in the same ledger commit. A request
    /// that needs an approval, or whose key was taken meanwhile, is
    /// answered here.
    async fn reserve(
        &self,
        admission: Admission,
        body: Bytes,
        content_type: Option<String>,
        key: String,
        fp: &str,
    ) -> Result<Reserved, OpError> {
        let (app, route, principal) = (self.app, self.route, self.principal);
        // After the fingerprint: the caller's own bytes identify the request.
        let body = match &route.tenant_scoped_field {
            None => body,
            Some(ptr) => Bytes::from(
                crate::forward::stamp_tenant(
                    content_type.as_deref(),
                    &body,
                    ptr,
                    &principal.tenant,
                )
                .map_err(|m| OpError::ContractViolation {
                    errors: vec![(ptr.clone(), m)],
                })?,
            ),
        };
        let new = NewOperation {
            tenant_id: principal.tenant.clone(),
            provider_key: provider_key(
                &app.provider_key_secret,
                &principal.tenant,
                &key,
                &crate::idempotency::new_incarnation(),
                app.ledger.clock().now_ms(),
            ),
            operation_id: key,
            route: route.name.clone(),
            method: self.method.to_string(),
            path: self.rest.to_owned(),
            query: self.query.map(str::to_owned),
            fingerprint: fp.to_owned(),
            effect_class: Some(admission.effect_class.as_str().to_owned()),
            request_content_type: content_type,
            request_body: body.to_vec(),
            request_headers: to_pairs(&admission.forwarded),
            trace_context: crate::telemetry::traceparent_of(&tracing::Span::current()).or_else(
                || {
                    self.headers
                        .get(crate::telemetry::TRACEPARENT)
                        .and_then(|v| v.to_str().ok())
                        .filter(|v| crate::telemetry::parse_traceparent(v).is_some())
                        .map(str::to_owned)
                },
            ),
            principal: principal.name.clone(),
            retention_ms: i64::try_from(route.key_retention_ms).unwrap_or(i64::MAX),
            awaiting_approval: admission.approval.is_some(),
            decisions: admission.decisions,
            approval: admission.approval,
        };
        let reserved = if new.awaiting_approval {
            (app.ledger.reserve(&new).await?, None)
        } else {
            app.ledger
                .reserve_and_claim(
                    &new,
                    &app.instance_id,
                    crate::ops::execute::lease_ms(app),
                    "lease claimed for attempt",
                )
                .await?
        };
        Ok(match reserved {
            (Reservation::Created(op), _) if op.state == OpState::AwaitingApproval => {
                // `resume_awaiting` counts it, under the answer it gives.
                Reserved::Answered(Box::pin(resume_awaiting(app, route, op)).await)
            }
            (Reservation::Created(op), Some(claim)) => {
                crate::failpoint::hit("after-claim");
                Reserved::Claimed(Box::new(op), claim)
            }
            (Reservation::Created(op), None) => Reserved::Op(Box::new(op)),
            (Reservation::Existing(op), _)
                if op.state == OpState::Reserved && op.fingerprint == fp =>
            {
                Reserved::Op(Box::new(op))
            }
            (Reservation::Existing(op), _) => {
                // Boxed, as in `answer_existing` itself: a rare answer's
                // future is not held room for by every reservation's.
                Reserved::Answered(Box::pin(answer_existing(app, route, op, fp)).await)
            }
        })
    }
}

/// What the policies decided for a call that may run.
struct Admission {
    effect_class: EffectClass,
    /// The headers to forward (and store with the operation).
    forwarded: HeaderMap,
    /// Set when a policy requires an approval first.
    approval: Option<NewApproval>,
    decisions: Vec<DecisionRecord>,
}

/// The result of [`Flow::reserve`].
enum Reserved {
    /// A RESERVED operation to claim and run.
    Op(Box<Operation>),
    /// A new operation (as reserved) whose lease the reservation claimed:
    /// to run.
    Claimed(Box<Operation>, crate::ledger::Claim),
    /// The caller's answer, already decided.
    Answered(Answer),
}

/// Step 1: a JSON body that repeats a key reads differently to different
/// parsers: it is refused rather than fingerprinted, approved or forwarded
/// as something the provider may read otherwise. Whatever its
/// `Content-Type` says: a policy or a provider may parse it as JSON anyway.
///
/// Errors: 400 naming `body` (RFC 7493 §2.3).
pub fn refuse_ambiguous_json(body: &[u8]) -> Result<(), OpError> {
    if crate::idempotency::has_duplicate_keys(body) {
        return Err(OpError::BadRequest {
            field: "body".into(),
            message: "a JSON object in the body repeats a key (RFC 7493 §2.3)".into(),
        });
    }
    Ok(())
}

/// Step 2 (4b): the route's request contract, before the ledger; a
/// violation is never retried.
///
/// Errors: 422 `contract-violation` with up to 16 JSON pointers.
pub fn check_contract(route: &Route, body: &[u8]) -> Result<(), OpError> {
    let Some(schema) = &route.request_schema else {
        return Ok(());
    };
    let errors: Vec<(String, String)> = match serde_json::from_slice::<serde_json::Value>(body) {
        Err(e) => vec![("".into(), format!("the body is not JSON: {e}"))],
        Ok(v) => schema
            .iter_errors(&v)
            .take(16)
            .map(|e| (e.instance_path().to_string(), e.to_string()))
            .collect(),
    };
    if errors.is_empty() {
        return Ok(());
    }
    crate::metrics::request(&route.name, "rejected");
    Err(OpError::ContractViolation { errors })
}

/// Step 3: the operation `key` already names, when the duplicate is to be
/// answered from it: a finished one (replayed), one with another
/// fingerprint (refused before any policy runs, so nothing of the refused
/// request is recorded against it) or one awaiting approval (its approval
/// answers). Read from the read pool: COMPLETED and FAILED never change
/// back, and it keeps replays off the single writer. Without
/// `read_ledger`, only a COMPLETED or FAILED operation with fingerprint
/// `fp` in the replay cache is found (checked against the ledger's version
/// as a cached replay always is), and nothing is read for a key not
/// cached: the reservation finds the rest.
///
/// Errors: the ledger can't be read.
pub async fn known_operation(
    app: &AppState,
    tenant: &str,
    key: &str,
    fp: &str,
    read_ledger: bool,
) -> Result<Option<Operation>, OpError> {
    let found = if read_ledger {
        app.ledger.get_for_duplicate(tenant, key, fp).await?
    } else {
        app.ledger.cached_for_duplicate(tenant, key, fp).await?
    };
    Ok(found.filter(|op| {
        op.expires_at > app.ledger.clock().now_ms()
            && (op.state.is_terminal()
                || op.fingerprint != fp
                || op.state == OpState::AwaitingApproval)
    }))
}

/// Step 3b: a tenant with `tenants[].max_stored_bytes` may reserve a new
/// operation only while its operations' bodies, and those of its calls
/// checked but not yet reserved on this instance
/// ([`crate::state::QuotaHolds`]), leave room for this one. A duplicate of
/// an existing operation is answered before this check. The returned hold
/// (none without a quota) counts this call's bytes until it is dropped,
/// once the reservation is written.
///
/// Errors: 507 `tenant-quota-exceeded`, whose `stored_bytes` is the
/// ledger's total plus the bytes held (counted in
/// `effectgate_tenant_limited_total{limit="stored-bytes"}`); the ledger
/// can't be read.
pub async fn check_quota<'a>(
    app: &'a AppState,
    rt: &Runtime,
    tenant: &str,
    body_bytes: usize,
) -> Result<Option<crate::state::QuotaHold<'a>>, OpError> {
    let Some(limit) = rt
        .tenant_limits
        .get(tenant)
        .and_then(|l| l.max_stored_bytes)
    else {
        return Ok(None);
    };
    let stored = app.ledger.stored_bytes(tenant).await?;
    crate::metrics::tenant_stored_bytes(tenant, stored);
    let stored = u64::try_from(stored).unwrap_or(0);
    let body_bytes = body_bytes as u64;
    match app.quota_holds.hold(tenant, stored, body_bytes, limit) {
        Ok(hold) => Ok(Some(hold)),
        Err(held) => {
            crate::metrics::tenant_limited(tenant, "stored-bytes");
            Err(OpError::QuotaExceeded {
                limit_bytes: limit,
                stored_bytes: stored.saturating_add(held),
                body_bytes,
            })
        }
    }
}

/// Step 6 (7–9): claims the lease on a RESERVED operation and runs it,
/// answering with its outcome.
///
/// Errors: 409 `operation-in-flight` when another request claimed it first.
pub async fn claim_and_execute(app: &AppState, route: &Route, op: Operation) -> Answer {
    let lease = crate::ops::execute::lease_ms(app);
    let Some(claim) = app
        .ledger
        .claim(
            (&op.tenant_id, &op.operation_id),
            op.state,
            op.version,
            &app.instance_id,
            lease,
            "lease claimed for attempt",
        )
        .await?
    else {
        crate::metrics::request(&route.name, "in-flight");
        return Err(OpError::InFlight {
            operation_id: op.operation_id.clone(),
            retry_after_s: 1,
        });
    };
    crate::metrics::request(&route.name, "forwarded");
    crate::ops::execute::execute_for_caller(app, route, op, claim).await
}

/// The error a refusing verdict answers with: `Deny` is `policy-denied`
/// with the policy's status, `Failed` is `policy-failed`, and
/// `RequireApproval` where no approval is possible (a call outside the
/// ledger) is `policy-denied` 403. `Allow` refuses nothing (`None`).
pub fn refusal(verdict: Verdict) -> Option<OpError> {
    match verdict {
        Verdict::Allow { .. } => None,
        Verdict::Deny {
            status,
            reason,
            policy,
        } => Some(OpError::PolicyDenied {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN),
            policy,
            reason,
        }),
        Verdict::RequireApproval { policy, .. } => Some(OpError::PolicyDenied {
            status: StatusCode::FORBIDDEN,
            policy: policy.0,
            reason: "approval is only possible for effectful calls".into(),
        }),
        Verdict::Failed { policy, failure } => Some(OpError::PolicyFailed {
            policy,
            detail: failure.to_string(),
        }),
    }
}

/// What of a request a policy is shown.
#[derive(Debug, Clone, Copy)]
pub struct PolicyView<'a> {
    /// Method.
    pub method: &'a str,
    /// Path below the route's prefix.
    pub path: &'a str,
    /// Query, if any.
    pub query: Option<&'a str>,
    /// The caller's headers.
    pub headers: &'a HeaderMap,
    /// The body (empty for calls outside the ledger).
    pub body: &'a [u8],
    /// Operation id (empty outside the ledger).
    pub operation_id: &'a str,
    /// Fingerprint (empty outside the ledger).
    pub fingerprint: &'a str,
    /// The operation's state, when a policy revalidates an existing one.
    pub existing: Option<OpState>,
}

/// The request as a policy sees it (the gateway's credential and
/// hop-by-hop headers removed).
pub fn policy_request(
    principal: &Principal,
    route: &Route,
    view: &PolicyView<'_>,
) -> crate::policy::Request {
    use crate::policy::bindings::{Header, OperationState};
    // The scheme the caller used isn't known here; policies see no
    // `X-Forwarded-Proto` rather than a guess.
    let mut visible = caller_headers(route, view.headers, None, "http");
    visible.remove("x-forwarded-proto");
    crate::policy::Request {
        tenant: principal.tenant.clone(),
        principal: principal.name.clone(),
        route: route.name.clone(),
        effect_class: wit_class(route.effect_class),
        method: view.method.to_owned(),
        path: view.path.to_owned(),
        query: view.query.map(str::to_owned),
        headers: visible
            .iter()
            .filter_map(|(n, v)| {
                Some(Header {
                    name: n.as_str().to_owned(),
                    value: v.to_str().ok()?.to_owned(),
                })
            })
            .collect(),
        body: view.body.to_vec(),
        operation_id: view.operation_id.to_owned(),
        fingerprint: view.fingerprint.to_owned(),
        existing_state: view.existing.map(|s| match s {
            OpState::Reserved => OperationState::Reserved,
            OpState::AwaitingApproval => OperationState::AwaitingApproval,
            OpState::Executing => OperationState::Executing,
            OpState::Completed => OperationState::Completed,
            OpState::Failed => OperationState::Failed,
            OpState::Unknown => OperationState::Unknown,
            OpState::Compensated => OperationState::Compensated,
        }),
    }
}
