//! Write effectgate policies in Rust.
//!
//! Implement [`Policy`] for a type and export it with [`export_policy!`]; build
//! with `cargo build --target wasm32-wasip2 --release` and the result is a
//! component for the `effectgate:policy@0.2.0` world (`wit/policy.wit`).
//!
//! ```ignore
//! use effectgate_policy_sdk::*;
//!
//! struct DenyDeletes;
//! impl Policy for DenyDeletes {
//!     fn config_schema() -> String { r#"{"type":"object"}"#.into() }
//!     fn evaluate(_config: &Value, req: &Request) -> Decision {
//!         if req.method == "DELETE" { deny(403, "deletes are not allowed") } else { allow() }
//!     }
//! }
//! export_policy!(DenyDeletes);
//! ```

extern crate self as effectgate_policy_sdk;

/// The raw bindings generated from `wit/policy.wit`. Policy authors don't
/// need them; [`export_policy!`] uses them.
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "policy",
        pub_export_macro: true,
        default_bindings_module: "effectgate_policy_sdk::bindings",
        runtime_path: "effectgate_policy_sdk::__wit_bindgen::rt",
    });
}

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;

pub use bindings::effectgate::policy::types::{
    Allow, Compensation, Decision, Deny, EffectClass, FailureClass, Header, Operation,
    OperationState, ReplayVerdict, Request, ResponseHead,
};
pub use serde_json::{self, Value, json};

/// A policy. Every method but [`Policy::config_schema`] has a default:
/// allow every request, classify failures as unknown (the gateway's own
/// rules apply), the replay defaults of [`default_replay`] and the
/// compensation defaults of [`default_compensate`].
pub trait Policy {
    /// The JSON Schema of this policy's per-tenant config.
    fn config_schema() -> String;

    /// Decides on a request. `config` is the tenant's config (validated
    /// against the schema by the gateway).
    fn evaluate(config: &Value, request: &Request) -> Decision {
        let _ = (config, request);
        allow()
    }

    /// Classifies a provider failure.
    fn classify_failure(config: &Value, head: &ResponseHead, body: &[u8]) -> FailureClass {
        let _ = (config, head, body);
        FailureClass::Unknown
    }

    /// Decides whether an operation may be replayed.
    fn replay(config: &Value, op: &Operation) -> ReplayVerdict {
        let _ = config;
        default_replay(op.effect_class)
    }

    /// Decides whether an operator may compensate (undo) a COMPLETED
    /// operation with the compensating request in `request`: allow, deny,
    /// or require an approval of that exact request.
    fn compensate(config: &Value, request: &Compensation) -> Decision {
        let _ = config;
        default_compensate(request.operation.effect_class)
    }
}

/// The gateway's compensation defaults: permission and irreversible
/// operations need an approval; payment, notification, derived and
/// analytics ones are allowed for operators.
pub fn default_compensate(class: EffectClass) -> Decision {
    match class {
        EffectClass::Permission | EffectClass::Irreversible => {
            require_approval("compensating this operation needs an approval")
        }
        _ => allow(),
    }
}

/// Allow the request unchanged.
pub fn allow() -> Decision {
    Decision::Allow(Allow {
        effect_class: None,
        add_headers: Vec::new(),
    })
}

/// Refuse with a 4xx `status` and a reason the caller sees.
pub fn deny(status: u16, reason: impl Into<String>) -> Decision {
    Decision::Deny(Deny {
        status,
        reason: reason.into(),
    })
}

/// Require a human approval of this exact request.
pub fn require_approval(reason: impl Into<String>) -> Decision {
    Decision::RequireApproval(reason.into())
}

/// The replay defaults of docs/design.md: derived and analytics → allow;
/// notification and payment → same operation only; permission →
/// revalidate; irreversible → manual.
pub fn default_replay(class: EffectClass) -> ReplayVerdict {
    match class {
        EffectClass::Derived | EffectClass::Analytics => ReplayVerdict::Allow,
        EffectClass::Notification | EffectClass::Payment => ReplayVerdict::SameOperationOnly,
        EffectClass::Permission => ReplayVerdict::Revalidate,
        EffectClass::Irreversible => ReplayVerdict::Manual,
    }
}

/// The request body parsed as JSON, if it is JSON.
pub fn json_body(request: &Request) -> Option<Value> {
    serde_json::from_slice(&request.body).ok()
}

/// Effect class by its lower-case name (`"payment"`).
pub fn effect_class_named(name: &str) -> Option<EffectClass> {
    Some(match name {
        "derived" => EffectClass::Derived,
        "analytics" => EffectClass::Analytics,
        "notification" => EffectClass::Notification,
        "payment" => EffectClass::Payment,
        "permission" => EffectClass::Permission,
        "irreversible" => EffectClass::Irreversible,
        _ => return None,
    })
}

/// Replay verdict by its name (`"same-operation-only"`).
pub fn replay_verdict_named(name: &str) -> Option<ReplayVerdict> {
    Some(match name {
        "allow" => ReplayVerdict::Allow,
        "same-operation-only" => ReplayVerdict::SameOperationOnly,
        "revalidate" => ReplayVerdict::Revalidate,
        "manual" => ReplayVerdict::Manual,
        "deny" => ReplayVerdict::Deny,
        _ => return None,
    })
}

/// Structured logging into the gateway's log.
pub mod log {
    use super::bindings::effectgate::policy::log::{Level, log};

    fn emit(level: Level, message: &str, fields: &[(&str, &str)]) {
        let fields: Vec<(String, String)> = fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        log(level, message, &fields);
    }
    /// Debug.
    pub fn debug(message: &str, fields: &[(&str, &str)]) {
        emit(Level::Debug, message, fields)
    }
    /// Info.
    pub fn info(message: &str, fields: &[(&str, &str)]) {
        emit(Level::Info, message, fields)
    }
    /// Warning.
    pub fn warn(message: &str, fields: &[(&str, &str)]) {
        emit(Level::Warn, message, fields)
    }
    /// Error.
    pub fn error(message: &str, fields: &[(&str, &str)]) {
        emit(Level::Error, message, fields)
    }
}

/// Milliseconds since the Unix epoch, from the gateway.
pub fn now_ms() -> u64 {
    bindings::effectgate::policy::clock::now_ms()
}

#[doc(hidden)]
pub fn __config(config: &str) -> Value {
    serde_json::from_str(config).unwrap_or(Value::Null)
}

/// Exports a [`Policy`] implementation as the component's exports.
#[macro_export]
macro_rules! export_policy {
    ($ty:ty) => {
        struct __EffectgatePolicyExport;
        impl $crate::bindings::Guest for __EffectgatePolicyExport {
            fn config_schema() -> ::std::string::String {
                <$ty as $crate::Policy>::config_schema()
            }
            fn evaluate(config: ::std::string::String, request: $crate::Request) -> $crate::Decision {
                <$ty as $crate::Policy>::evaluate(&$crate::__config(&config), &request)
            }
            fn classify_failure(
                config: ::std::string::String,
                head: $crate::ResponseHead,
                body: ::std::vec::Vec<u8>,
            ) -> $crate::FailureClass {
                <$ty as $crate::Policy>::classify_failure(&$crate::__config(&config), &head, &body)
            }
            fn replay(config: ::std::string::String, op: $crate::Operation) -> $crate::ReplayVerdict {
                <$ty as $crate::Policy>::replay(&$crate::__config(&config), &op)
            }
            fn compensate(config: ::std::string::String, request: $crate::Compensation) -> $crate::Decision {
                <$ty as $crate::Policy>::compensate(&$crate::__config(&config), &request)
            }
        }
        $crate::bindings::export!(__EffectgatePolicyExport with_types_in $crate::bindings);
    };
}
