//! Operation events: written to the outbox in the transaction of the
//! transition they report, for the tenants subscribed to them.

use std::collections::{BTreeSet, HashMap};

use super::super::State;
use super::super::command::OpRef;
use super::super::dialect::{Conn, Dialect};
use super::outbox::insert_event_as;

/// Event types a tenant receives, by tenant (only tenants with a webhook).
pub type Subscriptions = HashMap<String, BTreeSet<String>>;

/// The operation event a transition `from → to` reports, if any:
/// `operation.unknown` (entering UNKNOWN from another state),
/// `operation.dead_lettered` (onto the terminal route),
/// `operation.reconciled` (UNKNOWN → COMPLETED or FAILED),
/// `operation.completed` / `operation.failed` (any other entry into
/// COMPLETED or FAILED: a refused or expired approval is
/// `operation.failed`). A dead letter requeued to UNKNOWN is
/// `operation.unknown`; one requeued to RESERVED reports nothing until it
/// ends again.
pub fn event_type(from: Option<State>, to: State, dead_letter: bool) -> Option<&'static str> {
    match (from, to) {
        (_, State::Failed) if dead_letter => Some("operation.dead_lettered"),
        (Some(State::Unknown), State::Unknown) => None,
        (_, State::Unknown) => Some("operation.unknown"),
        (Some(State::Unknown), State::Completed | State::Failed) => Some("operation.reconciled"),
        (Some(State::Completed), State::Completed) => None,
        (_, State::Completed) => Some("operation.completed"),
        (_, State::Failed) => Some("operation.failed"),
        _ => None,
    }
}

/// One transition to report.
pub(super) struct Reported<'a> {
    pub op: OpRef<'a>,
    pub from: Option<State>,
    pub to: State,
    pub version: i64,
    pub dead_letter: bool,
    pub reason: &'a str,
    pub provider_reference: Option<&'a str>,
}

/// Queues the operation event of `t` on `conn` (inside the transaction of
/// the transition) when its tenant subscribes to that type. The event id
/// is derived from the operation and its version, so it is stable.
pub(super) async fn report<D: Dialect>(
    conn: &mut Conn<D>,
    subs: &Subscriptions,
    t: &Reported<'_>,
    now: i64,
) -> Result<(), sqlx::Error> {
    let Some(ty) = event_type(t.from, t.to, t.dead_letter) else {
        return Ok(());
    };
    if !subs.get(t.op.tenant).is_some_and(|s| s.contains(ty)) {
        return Ok(());
    }
    let id = {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [t.op.tenant, t.op.operation_id, &t.version.to_string(), ty] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        format!("evt_{}", &hex::encode(h.finalize())[..32])
    };
    let payload = serde_json::json!({
        "operation_id": t.op.operation_id,
        "from_state": t.from,
        "to_state": t.to,
        "version": t.version,
        "reason": t.reason,
        "dead_letter": t.dead_letter,
        "provider_reference": t.provider_reference,
    });
    insert_event_as::<D>(conn, &id, t.op.tenant, ty, payload, now, None).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use State::*;

    #[test]
    fn each_transition_reports_its_event() {
        assert_eq!(
            event_type(Some(Executing), Unknown, false),
            Some("operation.unknown")
        );
        assert_eq!(event_type(Some(Unknown), Unknown, false), None);
        assert_eq!(
            event_type(Some(Unknown), Completed, false),
            Some("operation.reconciled")
        );
        assert_eq!(
            event_type(Some(Unknown), Failed, true),
            Some("operation.dead_lettered")
        );
        assert_eq!(
            event_type(Some(Executing), Failed, true),
            Some("operation.dead_lettered")
        );
        assert_eq!(
            event_type(Some(Executing), Completed, false),
            Some("operation.completed")
        );
        assert_eq!(
            event_type(Some(Executing), Failed, false),
            Some("operation.failed")
        );
        assert_eq!(event_type(Some(Completed), Completed, false), None);
        assert_eq!(event_type(Some(Reserved), Executing, false), None);
        // A refused or expired approval; a requeued dead letter.
        assert_eq!(
            event_type(Some(AwaitingApproval), Failed, false),
            Some("operation.failed")
        );
        assert_eq!(
            event_type(Some(Failed), Unknown, false),
            Some("operation.unknown")
        );
        assert_eq!(event_type(Some(Failed), Reserved, false), None);
    }
}
