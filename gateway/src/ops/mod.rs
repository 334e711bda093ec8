//! The use cases of the gateway, free of HTTP framework types: admitting
//! an effectful call (identity, fingerprint, contract, policies), answering
//! one whose key is known, executing, reconciling through read-back,
//! replays, approvals and the operator's actions. Each returns a
//! [`Reply`] or an [`OpError`]; [`crate::http`] renders both.

pub mod admit;
pub mod answer;
pub mod approvals;
pub mod backoff;
pub mod compensate;
pub mod error;
pub mod execute;
pub mod inbox;
pub mod mcp;
pub mod operator;
pub mod read_back;
pub mod reconcile;
pub mod replay;
pub mod reply;

pub use error::OpError;
pub use reply::Reply;

use crate::config::{EffectClass, Route, Settings};
use crate::ledger::Operation;

/// What a use case answers a caller with: a reply, or an error the HTTP
/// surface renders as problem details.
pub type Answer = Result<Reply, OpError>;

/// The route an operation was made on, as configured now.
///
/// Errors: 409 `conflict` when no route of that name is configured any
/// more (a reload removed it).
pub fn route_of(settings: &Settings, op: &Operation) -> Result<Route, OpError> {
    settings
        .route_named(&op.route)
        .cloned()
        .ok_or_else(|| OpError::Conflict(format!("route {:?} is no longer configured", op.route)))
}

/// The effect class of `op`: the one stored with it at reservation, else
/// its route's, else `irreversible` (the most careful class) when the
/// route is gone.
pub fn effect_class(op: &Operation, route: Option<&Route>) -> EffectClass {
    op.effect_class
        .as_deref()
        .and_then(EffectClass::parse)
        .or(route.map(|r| r.effect_class))
        .unwrap_or(EffectClass::Irreversible)
}
