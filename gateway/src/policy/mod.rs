//! Tenant policies as WebAssembly components.
//!
//! - [`bindings`]: the `effectgate:policy@0.1.0` world (`wit/policy.wit`);
//! - [`engine`]: the wasmtime host (compile once, `InstancePre` cached by
//!   content hash, a fresh `Store` per call with memory, epoch-deadline and
//!   optional fuel limits);
//! - [`disk_cache`]: compiled modules kept on disk (`policy.cache_dir`);
//! - `guard`: per-tenant permits and a circuit breaker per tenant and
//!   policy, which every call passes before it runs;
//! - [`scaffold`]: `effectgate policy new` and `effectgate policy wit`;
//! - [`PolicySet`]: each tenant's ordered policies per route, with their
//!   configs validated against the policies' `config-schema()`;
//! - [`cases`]: `effectgate policy test`.
//!
//! Chain semantics: the first deny wins; approval is required if any policy
//! requires it; allows merge (the last effect class given wins, added
//! headers accumulate).
//!
//! A policy that fails, or that can't run (no permit free, its circuit
//! open, the pool full), fails the call closed, or on a `policy_fail_open`
//! route lets it through; either way it is logged, counted in
//! `effectgate_policy_failures_total{kind}` and recorded as a
//! `failed-closed` / `failed-open` decision.

pub mod bindings;
pub mod cases;
pub mod disk_cache;
pub mod engine;
mod guard;
mod inspect;
pub mod scaffold;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use http::HeaderName;

pub use bindings::{Decision, EffectClass as WitEffectClass, FailureClass, ReplayVerdict, Request};
pub use engine::{BusyLimit, CompiledPolicy, LoadError, LoadOrigin, PolicyEngine, PolicyFailure};
pub use guard::Permit;

use crate::config::{EffectClass, PolicyLimitsSpec, Route, Settings};

/// A policy bound to a tenant's route.
#[derive(Debug, Clone)]
pub struct BoundPolicy {
    /// Policy name: the module's file stem.
    pub name: String,
    /// The compiled module.
    pub compiled: Arc<CompiledPolicy>,
    /// The tenant's config, as JSON text.
    pub config: String,
}

/// Every tenant's policies, per route. Immutable; a reload builds a new one.
#[derive(Debug, Default)]
pub struct PolicySet {
    /// (tenant, route name) → policies in order. Route `*` bindings are
    /// expanded into every route.
    by_route: HashMap<(String, String), Vec<BoundPolicy>>,
}

/// A load-time error naming the tenant, the policy and the JSON pointer.
#[derive(Debug, thiserror::Error)]
#[error("tenant {tenant:?}, policy {policy:?}: {message}")]
pub struct BindError {
    /// Tenant id.
    pub tenant: String,
    /// Policy module path.
    pub policy: String,
    /// What is wrong (for invalid configs, with the JSON pointer).
    pub message: String,
}

impl PolicySet {
    /// Compiles (or reuses) every bound module and validates each tenant's
    /// config against the module's `config-schema()` with the jsonschema crate.
    ///
    /// Errors: the first module that can't be loaded or config that doesn't
    /// validate, naming tenant, policy and the JSON pointer of the failure.
    pub fn build(engine: &PolicyEngine, settings: &Settings) -> Result<Self, BindError> {
        let mut by_route: HashMap<(String, String), Vec<BoundPolicy>> = HashMap::new();
        for (tenant, b) in &settings.policy_bindings {
            let policy = b.module.display().to_string();
            let err = |message: String| BindError {
                tenant: tenant.clone(),
                policy: policy.clone(),
                message,
            };
            let compiled = engine.load(&b.module).map_err(|e| err(e.to_string()))?;
            let schema: serde_json::Value = serde_json::from_str(&compiled.config_schema)
                .map_err(|e| err(format!("config-schema() is not JSON: {e}")))?;
            let validator = jsonschema::validator_for(&schema)
                .map_err(|e| err(format!("config-schema() is not a valid JSON Schema: {e}")))?;
            if let Some(first) = validator.iter_errors(&b.config).next() {
                let pointer = first.instance_path().to_string();
                let pointer = if pointer.is_empty() {
                    "/".to_owned()
                } else {
                    pointer
                };
                return Err(err(format!("config is invalid at {pointer}: {first}")));
            }
            let name = b
                .module
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| policy.clone());
            let bound = BoundPolicy {
                name,
                compiled,
                config: b.config.to_string(),
            };
            let routes: Vec<String> = if b.route == "*" {
                settings.routes.iter().map(|r| r.name.clone()).collect()
            } else {
                vec![b.route.clone()]
            };
            for r in routes {
                by_route
                    .entry((tenant.clone(), r))
                    .or_default()
                    .push(bound.clone());
            }
        }
        Ok(Self { by_route })
    }

    /// The policies of `tenant` on `route`, in order (empty if none).
    pub fn for_route(&self, tenant: &str, route: &str) -> &[BoundPolicy] {
        self.by_route
            .get(&(tenant.to_owned(), route.to_owned()))
            .map_or(&[], Vec::as_slice)
    }

    /// Content hashes of every module in the set.
    pub fn hashes(&self) -> Vec<[u8; 32]> {
        let mut v: Vec<[u8; 32]> = self
            .by_route
            .values()
            .flatten()
            .map(|p| p.compiled.hash)
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// One policy's decision, as recorded with the operation (defined by the
/// ledger, which stores it).
pub use crate::ledger::DecisionRecord;

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

/// Converts a gateway effect class to the WIT one.
pub fn wit_class(c: EffectClass) -> WitEffectClass {
    match c {
        EffectClass::Derived => WitEffectClass::Derived,
        EffectClass::Analytics => WitEffectClass::Analytics,
        EffectClass::Notification => WitEffectClass::Notification,
        EffectClass::Payment => WitEffectClass::Payment,
        EffectClass::Permission => WitEffectClass::Permission,
        EffectClass::Irreversible => WitEffectClass::Irreversible,
    }
}

fn from_wit_class(c: WitEffectClass) -> EffectClass {
    match c {
        WitEffectClass::Derived => EffectClass::Derived,
        WitEffectClass::Analytics => EffectClass::Analytics,
        WitEffectClass::Notification => EffectClass::Notification,
        WitEffectClass::Payment => EffectClass::Payment,
        WitEffectClass::Permission => EffectClass::Permission,
        WitEffectClass::Irreversible => EffectClass::Irreversible,
    }
}

/// Checks a policy's decision against the output rules (RFC-style 4xx
/// statuses, sizes, and headers a policy may never set).
fn validate(
    d: Decision,
    route: &Route,
    limits: &PolicyLimitsSpec,
) -> Result<Decision, PolicyFailure> {
    let too_long = |what: &str, s: &str| {
        (s.len() > limits.max_reason_bytes).then(|| {
            PolicyFailure::InvalidOutput(format!(
                "{what} is {} bytes; the limit is {}",
                s.len(),
                limits.max_reason_bytes
            ))
        })
    };
    match &d {
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
        Decision::Allow(allow) => {
            if allow.add_headers.len() > limits.max_add_headers {
                return Err(PolicyFailure::InvalidOutput(format!(
                    "{} headers added; the limit is {}",
                    allow.add_headers.len(),
                    limits.max_add_headers
                )));
            }
            for h in &allow.add_headers {
                let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
                    PolicyFailure::InvalidOutput(format!("{:?} is not a header name", h.name))
                })?;
                let forbidden = crate::forward::is_hop_by_hop(&name, &[])
                    || name == http::header::HOST
                    || name == http::header::AUTHORIZATION
                    || name == http::header::CONTENT_LENGTH
                    || name == http::header::CONTENT_TYPE
                    || name == http::header::EXPECT
                    || name == http::header::FORWARDED
                    || name.as_str().starts_with("x-forwarded-")
                    || name.as_str() == "x-real-ip"
                    || name.as_str() == crate::idempotency::IDEMPOTENCY_KEY
                    || route.inject_headers.iter().any(|(n, _)| *n == name)
                    || route.provider_idempotency_header.as_ref() == Some(&name);
                if forbidden {
                    return Err(PolicyFailure::InvalidOutput(format!(
                        "a policy may not set the {name} header"
                    )));
                }
                if h.value.len() > limits.max_header_bytes
                    || http::HeaderValue::from_str(&h.value).is_err()
                {
                    return Err(PolicyFailure::InvalidOutput(format!(
                        "invalid or oversized value for header {name}"
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
        let started = Instant::now();
        let label = format!("{tenant}/{}", p.name);
        let out = engine.guarded(tenant, &p.name, || {
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
        let duration_us = started.elapsed().as_micros() as i64;
        let rec = |decision: &str, reason: Option<String>| DecisionRecord {
            policy: p.name.clone(),
            content_hash: p.compiled.hash_hex.clone(),
            decision: decision.to_owned(),
            reason,
            duration_us,
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
    let run = move || {
        let _permit = permit;
        evaluate_chain(&engine, &p, &r, &t, &request)
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

/// [`classify_failure`] on the blocking pool, with one of the tenant's
/// permits (see [`evaluate_chain_async`]); without a permit, or when the
/// host fails, the answer is `unknown` (the gateway's own classification).
pub async fn classify_failure_async(
    engine: Arc<PolicyEngine>,
    policies: &[BoundPolicy],
    tenant: &str,
    head: bindings::ResponseHead,
    body: bytes::Bytes,
) -> FailureClass {
    if policies.is_empty() {
        return FailureClass::Unknown;
    }
    let Some(permit) = hook_permit(&engine, policies, tenant, "classify-failure").await else {
        return FailureClass::Unknown;
    };
    let (p, t) = (policies.to_vec(), tenant.to_owned());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        classify_failure(&engine, &p, &t, &head, &body)
    })
    .await
    .unwrap_or(FailureClass::Unknown)
}

/// [`replay_verdict`] on the blocking pool, with one of the tenant's
/// permits (see [`evaluate_chain_async`]); without a permit, or when the
/// host fails, the effect class's default applies.
pub async fn replay_verdict_async(
    engine: Arc<PolicyEngine>,
    policies: &[BoundPolicy],
    tenant: &str,
    op: bindings::Operation,
) -> ReplayVerdict {
    let default = default_replay(from_wit_class(op.effect_class));
    if policies.is_empty() {
        return default;
    }
    let Some(permit) = hook_permit(&engine, policies, tenant, "replay").await else {
        return default;
    };
    let (p, t) = (policies.to_vec(), tenant.to_owned());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        replay_verdict(&engine, &p, &t, &op)
    })
    .await
    .unwrap_or(default)
}

/// A permit for a `classify-failure` or `replay` chain; `None` (logged
/// and counted for each policy) when none was free in time.
async fn hook_permit(
    engine: &PolicyEngine,
    policies: &[BoundPolicy],
    tenant: &str,
    hook: &str,
) -> Option<Permit> {
    match engine.permit(tenant).await {
        Ok(p) => Some(p),
        Err(failure) => {
            for p in policies {
                crate::metrics::policy_failure(failure.kind());
                tracing::warn!(tenant, policy = %p.name, hook, kind = failure.kind(), error = %failure, "policy not run; using the default");
            }
            None
        }
    }
}

/// Asks the chain how to treat a provider failure: the first answer that
/// is not `unknown` wins; failures of the policy count as `unknown`.
pub fn classify_failure(
    engine: &PolicyEngine,
    policies: &[BoundPolicy],
    tenant: &str,
    head: &bindings::ResponseHead,
    body: &[u8],
) -> FailureClass {
    for p in policies {
        let label = format!("{tenant}/{}", p.name);
        match engine.guarded(tenant, &p.name, || {
            engine.call(&p.compiled, &label, |inst, store| {
                inst.call_classify_failure(store, &p.config, head, body)
            })
        }) {
            Ok(FailureClass::Unknown) => {}
            Ok(c) => return c,
            Err(e) => {
                tracing::warn!(tenant, policy = %p.name, error = %e, "classify-failure failed; ignoring")
            }
        }
    }
    FailureClass::Unknown
}

/// The chain's replay verdict: the most restrictive answer wins (deny >
/// manual > revalidate > same-operation-only > allow). Without policies, or
/// when a policy fails, the docs/design.md default for the effect class applies.
pub fn replay_verdict(
    engine: &PolicyEngine,
    policies: &[BoundPolicy],
    tenant: &str,
    op: &bindings::Operation,
) -> ReplayVerdict {
    let rank = |v: &ReplayVerdict| match v {
        ReplayVerdict::Allow => 0,
        ReplayVerdict::SameOperationOnly => 1,
        ReplayVerdict::Revalidate => 2,
        ReplayVerdict::Manual => 3,
        ReplayVerdict::Deny => 4,
    };
    let default = default_replay(from_wit_class(op.effect_class));
    let mut verdict: Option<ReplayVerdict> = None;
    for p in policies {
        let label = format!("{tenant}/{}", p.name);
        let v = match engine.guarded(tenant, &p.name, || {
            engine.call(&p.compiled, &label, |inst, store| {
                inst.call_replay(store, &p.config, op)
            })
        }) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(tenant, policy = %p.name, error = %e, "replay() failed; using the default");
                default
            }
        };
        verdict = Some(match verdict {
            Some(cur) if rank(&cur) >= rank(&v) => cur,
            _ => v,
        });
    }
    verdict.unwrap_or(default)
}

/// docs/design.md's replay defaults by effect class.
pub fn default_replay(c: EffectClass) -> ReplayVerdict {
    match c {
        EffectClass::Derived | EffectClass::Analytics => ReplayVerdict::Allow,
        EffectClass::Notification | EffectClass::Payment => ReplayVerdict::SameOperationOnly,
        EffectClass::Permission => ReplayVerdict::Revalidate,
        EffectClass::Irreversible => ReplayVerdict::Manual,
    }
}

/// Name of a replay verdict (`same-operation-only`).
pub fn verdict_name(v: ReplayVerdict) -> &'static str {
    match v {
        ReplayVerdict::Allow => "allow",
        ReplayVerdict::SameOperationOnly => "same-operation-only",
        ReplayVerdict::Revalidate => "revalidate",
        ReplayVerdict::Manual => "manual",
        ReplayVerdict::Deny => "deny",
    }
}
