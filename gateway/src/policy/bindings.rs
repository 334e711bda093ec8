//! Host bindings for the `effectgate:policy` world (`wit/policy.wit`).

wasmtime::component::bindgen!({
    path: "../wit",
    world: "policy",
});

pub use self::effectgate::policy::types::{Allow, Deny, EffectClass, Header, OperationState};

/// The world's package and version, as policies must target it.
pub const WORLD: &str = "effectgate:policy@0.1.0";
