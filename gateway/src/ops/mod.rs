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

/// A provider reference read from a provider's answer (a read-back, an
/// inbox event) as the ledger may keep it: `None` when it is longer than
/// `max_bytes` (`limits.max_provider_reference_bytes`) or holds U+0000.
/// The reference is indexed, and on PostgreSQL an entry much longer than
/// 2 KB fails the write, and with it the outcome it belongs to; dropped,
/// the outcome is kept without it, and a warning names `about` (the
/// operation, or the inbox event).
pub fn bounded_reference(
    reference: Option<String>,
    max_bytes: usize,
    about: &str,
) -> Option<String> {
    let r = reference?;
    if let Some(fault) = reference_fault(&r, max_bytes) {
        tracing::warn!(about, %fault, "a provider reference is not kept");
        return None;
    }
    Some(r)
}

/// What keeps `reference` out of the ledger, if anything: more than
/// `max_bytes` (`limits.max_provider_reference_bytes`), or a NUL (the
/// ledger stores none: each would be U+FFFD, three bytes, past the limit,
/// and two references would read as one). Shared by the operator's
/// resolution, which refuses such a reference, and [`bounded_reference`],
/// which drops it.
pub fn reference_fault(reference: &str, max_bytes: usize) -> Option<String> {
    if reference.len() > max_bytes {
        return Some(format!(
            "provider_reference is {} bytes; at most {max_bytes} (limits.max_provider_reference_bytes)",
            reference.len()
        ));
    }
    reference
        .contains('\0')
        .then(|| "provider_reference holds U+0000 (NUL), which the ledger does not store".into())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A reference up to the limit is kept; a longer one, or one holding
    /// NUL, is dropped.
    #[test]
    fn a_provider_reference_is_kept_only_within_the_limit() {
        let r = |s: &str| bounded_reference(Some(s.to_owned()), 4, "op");
        assert_eq!(r("ch_1").as_deref(), Some("ch_1"));
        assert_eq!(r("ch_12"), None);
        assert_eq!(r("c\0"), None);
        assert_eq!(bounded_reference(None, 4, "op"), None);
    }
}
