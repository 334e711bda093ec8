//! Tenant policies as WebAssembly components.
//!
//! - [`bindings`]: the `effectgate:policy@0.2.0` world (`wit/policy.wit`;
//!   components of 0.1.0 load too, without `compensate`);
//! - [`compensate`]: the `compensate` decision and its defaults;
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
mod chain;
pub mod compensate;
pub mod disk_cache;
pub mod engine;
mod epoch;
mod failure;
mod guard;
mod host;
mod inspect;
mod no_wait;
pub mod scaffold;

use std::collections::HashMap;
use std::sync::Arc;

pub use bindings::{Decision, EffectClass as WitEffectClass, FailureClass, ReplayVerdict, Request};
pub use chain::{Verdict, evaluate_chain, evaluate_chain_async};
pub use engine::{BusyLimit, CompiledPolicy, LoadError, LoadOrigin, PolicyEngine, PolicyFailure};
pub use guard::Permit;

use crate::config::{EffectClass, PolicyLimitsSpec, Settings};

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
    /// Tenant → route name → policies in order (looked up by `&str`, no
    /// key built per call). Route `*` bindings are expanded into every
    /// route.
    by_route: HashMap<String, HashMap<String, Vec<BoundPolicy>>>,
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
        let mut by_route: HashMap<String, HashMap<String, Vec<BoundPolicy>>> = HashMap::new();
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
            let of_tenant = by_route.entry(tenant.clone()).or_default();
            for r in routes {
                of_tenant.entry(r).or_default().push(bound.clone());
            }
        }
        Ok(Self { by_route })
    }

    /// The policies of `tenant` on `route`, in order (empty if none).
    pub fn for_route(&self, tenant: &str, route: &str) -> &[BoundPolicy] {
        self.by_route
            .get(tenant)
            .and_then(|routes| routes.get(route))
            .map_or(&[], Vec::as_slice)
    }

    /// Content hashes of every module in the set.
    pub fn hashes(&self) -> Vec<[u8; 32]> {
        let mut v: Vec<[u8; 32]> = self
            .by_route
            .values()
            .flat_map(HashMap::values)
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
        match engine.guarded(tenant, None, &p.name, || {
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
        let v = match engine.guarded(tenant, None, &p.name, || {
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
