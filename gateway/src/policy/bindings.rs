//! Host bindings for the `effectgate:policy` world (`wit/policy.wit`).

wasmtime::component::bindgen!({
    path: "../wit",
    world: "policy",
});

pub use self::effectgate::policy::types::{Allow, Deny, EffectClass, Header, OperationState};

/// The world's package and version, as policies must target it.
pub const WORLD: &str = "effectgate:policy@0.1.0";

/// The world's WIT text (`wit/policy.wit`), as this gateway was built with
/// it: `effectgate policy wit` prints it and `effectgate policy new`
/// writes it into new policy projects.
pub const WIT: &str = include_str!("../../../wit/policy.wit");
