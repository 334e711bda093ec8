//! Host bindings for the `effectgate:policy` world (`wit/policy.wit`).
//!
//! The host binds world `policy-core`, the exports every policy has had
//! since 0.1.0, so components of either version load; the `compensate`
//! export of 0.2.0 is looked up per component and called when it is there
//! ([`crate::policy::PolicyEngine::call_compensate`]).

wasmtime::component::bindgen!({
    path: "../wit",
    world: "policy-core",
});

pub use self::effectgate::policy::types::{
    Allow, Compensation, Deny, EffectClass, Header, OperationState,
};

/// The host's view of a policy instance (the `policy-core` exports).
pub type Policy = PolicyCore;
/// A policy's pre-instantiated component.
pub type PolicyPre<T> = PolicyCorePre<T>;

/// The world's package and version, as policies target it.
pub const WORLD: &str = "effectgate:policy@0.2.0";

/// Earlier versions of the world whose components this gateway still
/// loads (without the exports added since).
pub const EARLIER_WORLDS: &[&str] = &["effectgate:policy@0.1.0"];

/// The world's WIT text (`wit/policy.wit`), as this gateway was built with
/// it: `effectgate policy wit` prints it and `effectgate policy new`
/// writes it into new policy projects.
pub const WIT: &str = include_str!("../../../wit/policy.wit");
