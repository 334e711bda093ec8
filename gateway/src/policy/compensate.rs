//! The `compensate` decision: may an operator undo a COMPLETED operation
//! directly, or does it need an approval? The tenant's policies on the
//! operation's route decide with their `compensate` export (world 0.2.0);
//! a policy without it (built for 0.1.0) gives the default for the effect
//! class, as does a route without policies:
//!
//! | effect class | default |
//! |---|---|
//! | payment, notification, derived, analytics | allow (for operators) |
//! | permission, irreversible | require an approval |
//!
//! Chain semantics as for `evaluate`: the first deny wins; an approval is
//! required if any policy requires it; a policy that fails fails the
//! request closed (an operator action never fails open).

use std::sync::Arc;
use std::time::Instant;

use super::bindings::{Compensation, Decision};
use super::{BoundPolicy, DecisionRecord, PolicyEngine, Verdict};
use crate::config::EffectClass;

/// The default `compensate` decision for an effect class (see the module
/// docs).
pub fn default_compensate(class: EffectClass) -> Verdict {
    match class {
        EffectClass::Permission | EffectClass::Irreversible => Verdict::RequireApproval {
            reasons: vec![format!(
                "compensating a {} operation needs an approval by default",
                class.as_str()
            )],
            policy: ("compensate-default".into(), String::new()),
        },
        _ => Verdict::Allow {
            effect_class: None,
            add_headers: Vec::new(),
        },
    }
}

/// Runs the `compensate` chain of `policies` for `request` on the
/// blocking pool, with one of the tenant's permits. Returns the verdict and
/// the decisions to record with the compensation.
pub async fn compensate_verdict_async(
    engine: Arc<PolicyEngine>,
    policies: &[BoundPolicy],
    tenant: &str,
    class: EffectClass,
    request: Compensation,
) -> (Verdict, Vec<DecisionRecord>) {
    if policies.is_empty() {
        return (default_compensate(class), Vec::new());
    }
    let permit = match engine.permit(tenant).await {
        Ok(p) => p,
        Err(failure) => {
            let p = &policies[0];
            crate::metrics::policy_failure(failure.kind());
            tracing::warn!(tenant, policy = %p.name, hook = "compensate", kind = failure.kind(), error = %failure, "policy not run; failing closed");
            let record = DecisionRecord {
                policy: p.name.clone(),
                content_hash: p.compiled.hash_hex.clone(),
                decision: "failed-closed".into(),
                reason: Some(failure.to_string()),
                duration_us: 0,
            };
            return (
                Verdict::Failed {
                    policy: p.name.clone(),
                    failure,
                },
                vec![record],
            );
        }
    };
    let (p, t) = (policies.to_vec(), tenant.to_owned());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        compensate_verdict(&engine, &p, &t, class, &request)
    })
    .await
    .unwrap_or_else(|e| {
        (
            Verdict::Failed {
                policy: "compensate".into(),
                failure: super::PolicyFailure::Trap(format!("the policy task failed: {e}")),
            },
            Vec::new(),
        )
    })
}

/// The `compensate` chain, on this thread (see the module docs).
pub fn compensate_verdict(
    engine: &PolicyEngine,
    policies: &[BoundPolicy],
    tenant: &str,
    class: EffectClass,
    request: &Compensation,
) -> (Verdict, Vec<DecisionRecord>) {
    let mut records = Vec::new();
    let mut approval: Option<((String, String), Vec<String>)> = None;
    for p in policies {
        let label = format!("{tenant}/{}", p.name);
        let started = Instant::now();
        let out = engine.guarded(tenant, None, &p.name, || {
            engine.call_compensate(&p.compiled, &label, &p.config, request)
        });
        let duration_us = started.elapsed().as_micros() as i64;
        let mut record = |decision: &str, reason: Option<String>| {
            records.push(DecisionRecord {
                policy: p.name.clone(),
                content_hash: p.compiled.hash_hex.clone(),
                decision: decision.into(),
                reason,
                duration_us,
            })
        };
        // A module without the export (world 0.1.0) has the default's say.
        // A verdict follows the reasons' rules of `evaluate` (a 4xx deny;
        // sizes).
        let checked = out.and_then(|d| match d {
            Some(d) => super::chain::validate_reasons(&d, engine.limits()).map(|()| Some(d)),
            None => Ok(None),
        });
        let decision = match checked {
            Ok(Some(d)) => d,
            Ok(None) => match default_compensate(class) {
                Verdict::RequireApproval { reasons, .. } => {
                    Decision::RequireApproval(reasons.join("; "))
                }
                _ => Decision::Allow(super::bindings::Allow {
                    effect_class: None,
                    add_headers: Vec::new(),
                }),
            },
            Err(failure) => {
                tracing::warn!(tenant, policy = %p.name, error = %failure, "compensate() failed; failing closed");
                record("failed-closed", Some(failure.to_string()));
                return (
                    Verdict::Failed {
                        policy: p.name.clone(),
                        failure,
                    },
                    records,
                );
            }
        };
        match decision {
            Decision::Allow(_) => record("allow", None),
            Decision::Deny(d) => {
                record("deny", Some(d.reason.clone()));
                return (
                    Verdict::Deny {
                        status: d.status,
                        reason: d.reason,
                        policy: p.name.clone(),
                    },
                    records,
                );
            }
            Decision::RequireApproval(reason) => {
                record("require-approval", Some(reason.clone()));
                let entry = approval.get_or_insert_with(|| {
                    ((p.name.clone(), p.compiled.hash_hex.clone()), Vec::new())
                });
                entry.1.push(format!("{}: {reason}", p.name));
            }
        }
    }
    let verdict = match approval {
        Some((policy, reasons)) => Verdict::RequireApproval { reasons, policy },
        None => Verdict::Allow {
            effect_class: None,
            add_headers: Vec::new(),
        },
    };
    (verdict, records)
}
