//! Resolving operations from inbox events: finding the operation an
//! event names, and applying the source's rule to it inside the event's
//! transaction.

use super::super::super::command::{
    self, Lease, LeaseForReconcile, OpRef, ReadBackNow, RecordOutcome,
};
use super::super::super::dialect::{Conn, Dialect, sql};
use super::super::super::inbox::{Naming, Resolution, Resolved, Resolving, Says};
use super::super::super::{LedgerError, Operation, State};

/// The operation of `tenant` that `naming` finds, on `conn`. Only this
/// tenant's operations are searched: another tenant's provider key or
/// reference finds nothing.
async fn find_named<D: Dialect>(
    conn: &mut Conn<D>,
    tenant: &str,
    naming: &Naming<'_>,
    max_candidates: u32,
) -> Result<Option<Operation>, sqlx::Error> {
    let cols = super::super::reads::OP_COLUMNS;
    let rows = match naming {
        Naming::ProviderKey(k) => {
            sql::<D>(&format!(
                "SELECT {cols} FROM operations WHERE tenant_id = ? AND provider_key = ? LIMIT 1"
            ))
            .bind(tenant)
            .bind(k.as_str())
            .fetch_all(&mut *conn)
            .await?
        }
        Naming::Reference(r) => sql::<D>(&format!(
            "SELECT {cols} FROM operations WHERE tenant_id = ? AND provider_reference = ? LIMIT 1"
        ))
        .bind(tenant)
        .bind(r.as_str())
        .fetch_all(&mut *conn)
        .await?,
        Naming::Match { route, .. } => {
            sql::<D>(&format!(
                "SELECT {cols} FROM operations WHERE tenant_id = ? AND state = ? AND route = ? \
             ORDER BY updated_at DESC, operation_id LIMIT ?"
            ))
            .bind(tenant)
            .bind(State::Unknown)
            .bind(*route)
            .bind(i64::from(max_candidates))
            .fetch_all(&mut *conn)
            .await?
        }
    };
    for row in &rows {
        let op = super::super::reads::op_from_row(row)?;
        match naming {
            Naming::Match { accepts, .. } if !accepts(&op) => continue,
            _ => return Ok(Some(op)),
        }
    }
    Ok(None)
}

/// Applies the first rule of `r` that names an operation of `tenant`, on
/// `conn` (inside the event's transaction): a success for an UNKNOWN
/// operation takes a reconciliation lease (new fencing token) and records
/// the rule's outcome under it, the fenced write of a read-back "found"
/// (with its operation event); a failure moves its next read-back to now;
/// an operation in another state is left as it is. Returns what it did,
/// or `None` when no rule names an operation.
pub(super) async fn resolve_on<D: Dialect>(
    conn: &mut Conn<D>,
    subs: &super::super::Subscriptions,
    tenant: &str,
    r: &Resolving<'_>,
    now: i64,
) -> Result<Option<Resolution>, LedgerError> {
    for rule in &r.rules {
        let Some(op) = find_named::<D>(&mut *conn, tenant, &rule.naming, r.max_candidates).await?
        else {
            continue;
        };
        let ty = r.event_type;
        let opref = OpRef::new(&op.tenant_id, &op.operation_id);
        let (resolved, note) = if op.state != State::Unknown {
            let why = format!("the operation is {}", op.state);
            (Resolved::Ignored(why.clone()), format!("ignored: {why}"))
        } else {
            match &rule.says {
                Says::Failed => {
                    let cmd = ReadBackNow {
                        op: opref,
                        version: op.version,
                    };
                    if command::apply::<D, _>(&mut *conn, &cmd, now)
                        .await?
                        .is_some()
                    {
                        (
                            Resolved::ReadBack,
                            format!("read-back: {ty} says it failed; read back now"),
                        )
                    } else {
                        let why = "the operation moved on".to_owned();
                        (Resolved::Ignored(why.clone()), format!("ignored: {why}"))
                    }
                }
                Says::Succeeded(outcome) => {
                    let lease = LeaseForReconcile {
                        op: opref,
                        version: op.version,
                        lease: Lease {
                            owner: r.lease_owner,
                            ms: r.lease_ms,
                        },
                        reason: r.lease_reason,
                    };
                    let claimed = command::apply::<D, _>(&mut *conn, &lease, now).await?;
                    let recorded = match claimed {
                        None => None,
                        Some(c) => {
                            let cmd = RecordOutcome {
                                op: opref,
                                from: State::Unknown,
                                fence: c.fence,
                                actor: r.actor,
                                outcome: outcome.as_ref(),
                            };
                            super::super::writes::record_outcome_on::<D>(
                                &mut *conn, subs, &cmd, now,
                            )
                            .await?
                        }
                    };
                    if recorded.is_some() {
                        (Resolved::Completed, format!("completed: {ty}"))
                    } else {
                        let why = "another owner holds the operation".to_owned();
                        (Resolved::Ignored(why.clone()), format!("ignored: {why}"))
                    }
                }
            }
        };
        return Ok(Some(Resolution {
            operation_id: op.operation_id.clone(),
            resolved,
            note,
        }));
    }
    Ok(None)
}
