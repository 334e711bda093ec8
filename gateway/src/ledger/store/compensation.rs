//! Compensations: the compensating operation's reservation (with the
//! original's audit row and the link, in one transaction) and the
//! original's COMPLETED → COMPENSATED, in the transaction that records the
//! compensation COMPLETED.

use super::super::command::{
    self, AwaitApproval, CompleteCompensation, NoteCompensation, OpRef, ReserveCompensation,
};
use super::super::compensation::{CompensationLink, CompensationReservation, NewCompensation};
use super::super::dialect::{Conn, Dialect, LedgerRow, clean, sql};
use super::super::{LedgerError, NewOperation};
use super::reads::fetch_op;
use super::writes::{DecisionsFor, forget_history, insert_decisions};
use super::{Store, TERMINAL};
use crate::config::compensated_id;

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::reserve_compensation`].
    pub(crate) async fn reserve_compensation(
        &self,
        new: &NewOperation,
        link: &NewCompensation,
    ) -> Result<CompensationReservation, LedgerError> {
        // As for any reservation, the existing row can vanish between the
        // insert that found it and the read of it (swept, expired).
        for _ in 0..3 {
            if let Some(r) = self.reserve_compensation_once(new, link).await? {
                return Ok(r);
            }
        }
        Err(LedgerError::Db(sqlx::Error::RowNotFound))
    }

    async fn reserve_compensation_once(
        &self,
        new: &NewOperation,
        link: &NewCompensation,
    ) -> Result<Option<CompensationReservation>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        // The original (COMPLETED) gets the compensation's audit row.
        tx.changes_terminal();
        let child = OpRef::new(&new.tenant_id, &new.operation_id);
        // A finished compensation is forgotten when its retention ended, or
        // when it compensated an earlier incarnation of the original (the
        // original's key was reused after its own retention, which can end
        // first: a compensation that FAILED is updated after it). Else a
        // request for the new effect would get the old compensation back.
        let expired = sql::<D>(
            "DELETE FROM operations WHERE tenant_id = ? AND operation_id = ? \
             AND (updated_at + retention_ms <= ? OR created_at < (SELECT o.created_at FROM operations o \
             WHERE o.tenant_id = ? AND o.operation_id = ?)) \
             AND state IN (?, ?, ?) AND NOT dead_letter",
        )
        .bind(child.tenant)
        .bind(child.operation_id)
        .bind(now)
        .bind(child.tenant)
        .bind(&link.operation_id)
        .bind_states(&TERMINAL)
        .execute(&mut tx)
        .await?;
        if expired > 0 {
            forget_history::<D>(&mut tx, child).await?;
        }
        let reserve = ReserveCompensation {
            new,
            reason: format!(
                "compensation of operation {} requested by {}: {}",
                link.operation_id, link.requested_by, link.reason
            ),
        };
        let created = command::apply::<D, _>(&mut tx, &reserve, now)
            .await?
            .is_some();
        if created {
            let original = OpRef::new(&new.tenant_id, &link.operation_id);
            let note = format!(
                "compensation requested by {} ({}): compensating operation {}",
                link.requested_by, link.reason, new.operation_id
            );
            let noted = NoteCompensation {
                op: original,
                actor: &link.requested_by,
                reason: &note,
            };
            if command::apply::<D, _>(&mut tx, &noted, now)
                .await?
                .is_none()
            {
                let state = fetch_op::<D>(&mut tx, original.tenant, original.operation_id)
                    .await?
                    .map(|o| o.state);
                // Dropped without commit: nothing of this call is written.
                return Ok(Some(CompensationReservation::NotCompleted(state)));
            }
            if new.awaiting_approval {
                let reason = new
                    .approval
                    .as_ref()
                    .map(|a| format!("{}: {}", a.policy, a.reason))
                    .unwrap_or_default();
                command::apply::<D, _>(&mut tx, &AwaitApproval { new, reason }, now).await?;
            }
            insert_decisions::<D>(
                &mut tx,
                child,
                &new.fingerprint,
                &new.decisions,
                DecisionsFor::Reservation,
                now,
            )
            .await?;
            if new.awaiting_approval
                && let Some(a) = &new.approval
            {
                super::approvals::insert_approval::<D>(&mut tx, new, a, now).await?;
            }
            // An earlier incarnation's link (its key reused after its
            // retention) is replaced.
            sql::<D>(
                "INSERT INTO compensations (tenant_id, operation_id, compensation_id, requested_by, reason, reference, created_at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant_id, operation_id) DO UPDATE SET \
                 compensation_id = excluded.compensation_id, requested_by = excluded.requested_by, \
                 reason = excluded.reason, reference = excluded.reference, created_at = excluded.created_at",
            )
            .bind(&new.tenant_id)
            .bind(&link.operation_id)
            .bind(&new.operation_id)
            .bind(clean(&link.requested_by))
            .bind(clean(&link.reason))
            .bind(link.reference.as_deref().map(clean))
            .bind(now)
            .execute(&mut tx)
            .await?;
        }
        let Some(op) = fetch_op::<D>(&mut tx, child.tenant, child.operation_id).await? else {
            return Ok(None);
        };
        if !created
            && let Some(original) = fetch_op::<D>(&mut tx, child.tenant, &link.operation_id).await?
            && op.created_at < original.created_at
        {
            // Dropped without commit: nothing of this call is written.
            return Ok(Some(CompensationReservation::EarlierIncarnation(op)));
        }
        tx.commit().await?;
        Ok(Some(if created {
            CompensationReservation::Created(op)
        } else {
            CompensationReservation::Existing(op)
        }))
    }

    /// See [`crate::ledger::Ledger::compensation`].
    pub(crate) async fn compensation(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<CompensationLink>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        Ok(fetch_link::<D>(&mut conn, tenant, operation_id).await?)
    }
}

async fn fetch_link<D: Dialect>(
    conn: &mut Conn<D>,
    tenant: &str,
    operation_id: &str,
) -> Result<Option<CompensationLink>, sqlx::Error> {
    let row = sql::<D>(
        "SELECT operation_id, compensation_id, requested_by, reason, reference, created_at \
         FROM compensations WHERE tenant_id = ? AND operation_id = ?",
    )
    .bind(tenant)
    .bind(operation_id)
    .fetch_optional(conn)
    .await?;
    row.map(|r| {
        Ok(CompensationLink {
            operation_id: r.get("operation_id")?,
            compensation_id: r.get("compensation_id")?,
            requested_by: r.get("requested_by")?,
            reason: r.get("reason")?,
            reference: r.get("reference")?,
            created_at: r.get("created_at")?,
        })
    })
    .transpose()
}

/// In the transaction that records operation `op` COMPLETED: when `op` is
/// a compensation, its original moves COMPLETED → COMPENSATED, with a
/// transition naming the compensation, the operator and the reason.
/// Nothing for other operations (or an original no longer COMPLETED).
pub(super) async fn complete_original<D: Dialect>(
    conn: &mut Conn<D>,
    op: OpRef<'_>,
    now: i64,
) -> Result<(), LedgerError> {
    let Some(original) = compensated_id(op.operation_id) else {
        return Ok(());
    };
    let Some(link) = fetch_link::<D>(&mut *conn, op.tenant, original).await? else {
        return Ok(());
    };
    if link.compensation_id != op.operation_id {
        return Ok(());
    }
    let cmd = CompleteCompensation {
        op: OpRef::new(op.tenant, original),
        actor: &link.requested_by,
        reason: format!(
            "compensated by operation {} (requested by {}: {})",
            op.operation_id, link.requested_by, link.reason
        ),
    };
    command::apply::<D, _>(conn, &cmd, now).await?;
    Ok(())
}
