//! Chain semantics: a route's policies evaluated in order for one request
//! (the first deny wins, approvals add up, a failure fails closed unless
//! the route fails open), and the validation of a policy's output.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderName;

use super::*;
use crate::config::{EffectClass, Route};

/// The chain's verdict.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// Run it, with these changes.
    Allow {
        /// Effect class override.
        effect_class: Option<EffectClass>,
        /// Headers to add to the forwarded request.
        add_headers: Vec<(HeaderName, http::HeaderValue)>,
    },
    /// Refused (the first deny).
    Deny {
        /// 4xx status.
        status: u16,
        /// Reason.
        reason: String,
        /// Policy that denied.
        policy: String,
    },
    /// A human must approve first.
    RequireApproval {
        /// Reasons of every policy that asked.
        reasons: Vec<String>,
        /// First policy that asked (name and content hash).
        policy: (String, String),
    },
    /// A policy failed and the route fails closed.
    Failed {
        /// Policy that failed.
        policy: String,
        /// What happened.
        failure: PolicyFailure,
    },
}

/// Checks the parts of a decision every hook's output follows (those of
/// `evaluate` and `compensate`): a deny's status is 4xx, and a deny or
/// approval reason is at most `policy.max_reason_bytes`.
///
/// Errors: [`PolicyFailure::InvalidOutput`] naming the rule.
pub(super) fn validate_reasons(
    d: &Decision,
    limits: &PolicyLimitsSpec,
) -> Result<(), PolicyFailure> {
    let too_long = |what: &str, s: &str| {
        (s.len() > limits.max_reason_bytes).then(|| {
            PolicyFailure::InvalidOutput(format!(
                "{what} is {} bytes; the limit is {}",
                s.len(),
                limits.max_reason_bytes
            ))
        })
    };
    match d {
        Decision::Deny(deny) => {
            if !(400..=499).contains(&deny.status) {
                return Err(PolicyFailure::InvalidOutput(format!(
                    "deny status {} is not 4xx",
                    deny.status
                )));
            }
            if let Some(e) = too_long("the deny reason", &deny.reason) {
                return Err(e);
            }
        }
        Decision::RequireApproval(reason) => {
            if let Some(e) = too_long("the approval reason", reason) {
                return Err(e);
            }
        }
        Decision::Allow(_) => {}
    }
    Ok(())
}

/// Whether a policy may add a header of this name: not a hop-by-hop one,
/// nor one that names the connection or the gateway's caller (`Host`,
/// `Authorization`, `Forwarded`, `X-Forwarded-*`, `X-Real-IP`), describes
/// the content the ledger fingerprinted (any `Content-*`), or is the
/// gateway's own (`X-Request-Id`, the trace context, the idempotency
/// headers and the route's credentials).
fn may_add(name: &HeaderName, route: &Route) -> bool {
    let n = name.as_str();
    !(crate::forward::is_hop_by_hop(name, &[])
        || name == http::header::HOST
        || name == http::header::AUTHORIZATION
        || n.starts_with("content-")
        || name == http::header::EXPECT
        || name == http::header::FORWARDED
        || n.starts_with("x-forwarded-")
        || n == "x-real-ip"
        || n == "x-request-id"
        || n == crate::telemetry::TRACEPARENT
        || n == crate::telemetry::TRACESTATE
        || n == crate::idempotency::IDEMPOTENCY_KEY
        || route.inject_headers.iter().any(|(h, _)| h == name)
        || route.provider_idempotency_header.as_ref() == Some(name))
}

/// Checks a policy's decision against the output rules (RFC-style 4xx
/// statuses, sizes, and headers a policy may never set).
fn validate(
    d: Decision,
    route: &Route,
    limits: &PolicyLimitsSpec,
) -> Result<Decision, PolicyFailure> {
    validate_reasons(&d, limits)?;
    match &d {
        Decision::Deny(_) | Decision::RequireApproval(_) => {}
        Decision::Allow(allow) => {
            if allow.add_headers.len() > limits.max_add_headers {
                return Err(PolicyFailure::InvalidOutput(format!(
                    "{} headers added; the limit is {}",
                    allow.add_headers.len(),
                    limits.max_add_headers
                )));
            }
            for h in &allow.add_headers {
                // Name and value together, as a header field's size.
                let size = h.name.len() + h.value.len();
                if size > limits.max_header_bytes {
                    return Err(PolicyFailure::InvalidOutput(format!(
                        "a header of {size} bytes (name and value) was added; policy.max_header_bytes is {}",
                        limits.max_header_bytes
                    )));
                }
                let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
                    PolicyFailure::InvalidOutput(format!(
                        "{} is not a header name",
                        super::failure::shown(&format!("{:?}", h.name), 64)
                    ))
                })?;
                if !may_add(&name, route) {
                    return Err(PolicyFailure::InvalidOutput(format!(
                        "a policy may not set the {name} header"
                    )));
                }
                // Visible ASCII, spaces and tabs (RFC 9110 §5.5; obs-text
                // is not sent).
                let visible = h
                    .value
                    .bytes()
                    .all(|b| b == b'\t' || (0x20..0x7f).contains(&b));
                if !visible || http::HeaderValue::from_str(&h.value).is_err() {
                    return Err(PolicyFailure::InvalidOutput(format!(
                        "the value of header {name} holds a character other than visible ASCII, a space or a tab"
                    )));
                }
            }
        }
    }
    Ok(d)
}

/// Runs the chain of `policies` on `request`. Returns the verdict and one
/// record per policy that ran (or failed). Each call passes its policy's
/// circuit breaker ([`PolicyEngine::guarded`]); the caller holds the
/// tenant's permit ([`evaluate_chain_async`] takes it).
pub fn evaluate_chain(
    engine: &PolicyEngine,
    policies: &[BoundPolicy],
    route: &Route,
    tenant: &str,
    request: &Request,
) -> (Verdict, Vec<DecisionRecord>) {
    let mut records = Vec::with_capacity(policies.len());
    let mut effect_class = None;
    let mut add_headers = Vec::new();
    let mut approvals: Vec<(String, String, String)> = Vec::new();
    for p in policies {
        let span = tracing::debug_span!(
            "policy",
            otel.name = format!("policy {}", p.name),
            effectgate.tenant = tenant,
            effectgate.policy = p.name.as_str(),
            effectgate.policy_hash = p.compiled.hash_hex.as_str(),
            effectgate.decision = tracing::field::Empty,
            effectgate.duration_us = tracing::field::Empty,
        );
        let _entered = span.enter();
        let started = Instant::now();
        let label = format!("{tenant}/{}", p.name);
        let out = engine.guarded(tenant, Some(&request.principal), &p.name, || {
            engine
                .call(&p.compiled, &label, |inst, store| {
                    inst.call_evaluate(store, &p.config, request)
                })
                .and_then(|d| {
                    validate(d, route, engine.limits()).inspect_err(|_| {
                        // The call itself was counted; a refused output is a
                        // failure of its own kind.
                        crate::metrics::policy_failure("invalid-output");
                    })
                })
        });
        let elapsed = started.elapsed();
        crate::metrics::policy_time(&p.name, elapsed);
        let duration_us = elapsed.as_micros() as i64;
        span.record("effectgate.duration_us", duration_us);
        let rec = |decision: &str, reason: Option<String>| {
            span.record("effectgate.decision", decision);
            DecisionRecord {
                policy: p.name.clone(),
                content_hash: p.compiled.hash_hex.clone(),
                decision: decision.to_owned(),
                reason,
                duration_us,
            }
        };
        match out {
            Ok(Decision::Allow(a)) => {
                records.push(rec("allow", None));
                if let Some(c) = a.effect_class {
                    effect_class = Some(from_wit_class(c));
                }
                for h in a.add_headers {
                    if let (Ok(n), Ok(v)) = (
                        HeaderName::from_bytes(h.name.as_bytes()),
                        http::HeaderValue::from_str(&h.value),
                    ) {
                        add_headers.push((n, v));
                    }
                }
            }
            Ok(Decision::Deny(d)) => {
                records.push(rec("deny", Some(d.reason.clone())));
                return (
                    Verdict::Deny {
                        status: d.status,
                        reason: d.reason,
                        policy: p.name.clone(),
                    },
                    records,
                );
            }
            Ok(Decision::RequireApproval(reason)) => {
                records.push(rec("require-approval", Some(reason.clone())));
                approvals.push((p.name.clone(), p.compiled.hash_hex.clone(), reason));
            }
            Err(failure) => {
                tracing::warn!(
                    tenant,
                    route = %route.name,
                    policy = %p.name,
                    kind = failure.kind(),
                    fail_open = route.policy_fail_open,
                    error = %failure,
                    "policy call failed"
                );
                if route.policy_fail_open {
                    records.push(rec("failed-open", Some(failure.to_string())));
                } else {
                    records.push(rec("failed-closed", Some(failure.to_string())));
                    return (
                        Verdict::Failed {
                            policy: p.name.clone(),
                            failure,
                        },
                        records,
                    );
                }
            }
        }
    }
    if let Some((name, hash, _)) = approvals.first() {
        let policy = (name.clone(), hash.clone());
        return (
            Verdict::RequireApproval {
                reasons: approvals.into_iter().map(|a| a.2).collect(),
                policy,
            },
            records,
        );
    }
    (
        Verdict::Allow {
            effect_class,
            add_headers,
        },
        records,
    )
}

/// [`evaluate_chain`] on the blocking pool: a policy call blocks its
/// thread (up to its deadline, and the WASI streams it may write to block
/// on the runtime), so it never runs on an async worker. The chain first
/// takes one of the tenant's permits ([`PolicyEngine::permit`]), held
/// until it ends; without one within `policy.permit_wait_ms` no policy
/// runs and the call fails as `busy`. A panic in the host while running a
/// policy counts as a policy failure.
pub async fn evaluate_chain_async(
    engine: Arc<PolicyEngine>,
    policies: &[BoundPolicy],
    route: &Route,
    tenant: &str,
    request: Request,
) -> (Verdict, Vec<DecisionRecord>) {
    if policies.is_empty() {
        return (
            Verdict::Allow {
                effect_class: None,
                add_headers: Vec::new(),
            },
            Vec::new(),
        );
    }
    let permit = match engine.permit(tenant).await {
        Ok(p) => p,
        Err(failure) => {
            let kind = failure.kind();
            let (verdict, records) = not_run(policies, route, tenant, failure);
            for _ in &records {
                crate::metrics::policy_failure(kind);
            }
            return (verdict, records);
        }
    };
    let (p, r, t) = (policies.to_vec(), route.clone(), tenant.to_owned());
    // The blocking thread continues the caller's span and request (its
    // log lines name the request).
    let parent = tracing::Span::current();
    let request_context = crate::telemetry::request_context();
    let run = move || {
        let _entered = parent.enter();
        let _permit = permit;
        crate::telemetry::in_request(request_context, || {
            evaluate_chain(&engine, &p, &r, &t, &request)
        })
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(v) => v,
        Err(e) => {
            crate::metrics::policy_call(std::time::Duration::ZERO, Some("host-panic"));
            tracing::error!(tenant, route = %route.name, error = %e, "a policy call panicked in the host");
            not_run(
                policies,
                route,
                tenant,
                PolicyFailure::Trap(format!("the host failed running the policy: {e}")),
            )
        }
    }
}

/// The verdict of a chain none of whose policies ran (no permit, or the
/// host failed): closed, naming the first policy and recording its
/// failure, or on a `policy_fail_open` route the call goes on with a
/// `failed-open` record for every policy. Each is logged at WARN.
fn not_run(
    policies: &[BoundPolicy],
    route: &Route,
    tenant: &str,
    failure: PolicyFailure,
) -> (Verdict, Vec<DecisionRecord>) {
    let record = |p: &BoundPolicy, decision: &str| {
        tracing::warn!(
            tenant,
            route = %route.name,
            policy = %p.name,
            kind = failure.kind(),
            fail_open = route.policy_fail_open,
            error = %failure,
            "policy not run"
        );
        DecisionRecord {
            policy: p.name.clone(),
            content_hash: p.compiled.hash_hex.clone(),
            decision: decision.to_owned(),
            reason: Some(failure.to_string()),
            duration_us: 0,
        }
    };
    if route.policy_fail_open {
        let records = policies.iter().map(|p| record(p, "failed-open")).collect();
        return (
            Verdict::Allow {
                effect_class: None,
                add_headers: Vec::new(),
            },
            records,
        );
    }
    let first = &policies[0];
    let records = vec![record(first, "failed-closed")];
    (
        Verdict::Failed {
            policy: first.name.clone(),
            failure,
        },
        records,
    )
}
