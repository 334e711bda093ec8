//! Writes of the executor: reserve, claim, record an outcome, retry,
//! extend a lease; policy decisions and the attempts log.

use super::super::command::{
    self, AwaitApproval, ClaimLease, ExtendLease, Lease, NoteRetry, OpRef, RecordOutcome, Reserve,
};
use super::super::dialect::{Conn, Dialect, clean, sql};
use super::super::{
    Claim, DecisionRecord, LedgerError, NewOperation, Operation, Reservation, State,
};
use super::reads::fetch_op;
use super::{Store, TERMINAL};

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::reserve`] and
    /// [`crate::ledger::Ledger::reserve_and_claim`]: with `claim`, a
    /// created operation that awaits no approval is also claimed
    /// (RESERVED → EXECUTING) in the same transaction.
    pub(crate) async fn reserve(
        &self,
        new: &NewOperation,
        claim: Option<(Lease<'_>, &str)>,
    ) -> Result<(Reservation, Option<Claim>), LedgerError> {
        if D::GROUPS_WRITES
            && !new.awaiting_approval
            && let Some((lease, reason)) = claim
        {
            match self.reserve_grouped(new, lease, reason).await {
                super::grouped::Grouped::Done((now, applied)) => {
                    let claimed = applied.claim(lease.expires_at(now));
                    return Ok((Reservation::Created(as_reserved(new, now)), Some(claimed)));
                }
                super::grouped::Grouped::Failed(e) => return Err(e),
                super::grouped::Grouped::Alone => {}
            }
        }
        // The existing row can vanish between the insert that found it and
        // the read of it (the retention sweeper deleted it, expired): then
        // the key is free and the next try creates the operation.
        for _ in 0..3 {
            if let Some(r) = self.reserve_once(new, claim).await? {
                return Ok(r);
            }
        }
        Err(LedgerError::Db(sqlx::Error::RowNotFound))
    }

    async fn reserve_once(
        &self,
        new: &NewOperation,
        claim: Option<(Lease<'_>, &str)>,
    ) -> Result<Option<(Reservation, Option<Claim>)>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        tx.add_bytes(new.request_body.len());
        tx.inject(&new.operation_id);
        // The claim of a new operation rides in its reservation's
        // statement: one durable write before the provider is called, not
        // two, and one statement, not two.
        let claim = claim
            .filter(|_| !new.awaiting_approval)
            .map(|(lease, reason)| ClaimLease {
                op: OpRef::new(&new.tenant_id, &new.operation_id),
                from: State::Reserved,
                version: 1,
                lease,
                reason,
            });
        // The new row's version, fencing token and attempts come back with
        // the insert; the rest is `new` as inserted (no read of its own).
        let mut inserted = insert_new::<D>(&mut tx, new, claim.as_ref(), now).await?;
        let mut created = inserted.is_some();
        if !created {
            // The key is taken; by an operation whose retention ended, it is
            // free again (a new key, the usual case, costs no statement
            // for this).
            let expired = sql::<D>(
                "DELETE FROM operations WHERE tenant_id = ? AND operation_id = ? AND updated_at + retention_ms <= ? \
                 AND state IN (?, ?, ?) AND NOT dead_letter",
            )
            .bind(&new.tenant_id)
            .bind(&new.operation_id)
            .bind(now)
            .bind_states(&TERMINAL)
            .execute(&mut tx)
            .await?;
            if expired > 0 {
                tx.changes_terminal();
                forget_history::<D>(&mut tx, OpRef::new(&new.tenant_id, &new.operation_id)).await?;
                inserted = insert_new::<D>(&mut tx, new, claim.as_ref(), now).await?;
                created = inserted.is_some();
            }
        }
        if created {
            if new.awaiting_approval {
                let reason = new
                    .decisions
                    .iter()
                    .filter(|d| d.decision == "require-approval")
                    .map(|d| format!("{}: {}", d.policy, d.reason.as_deref().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join("; ");
                command::apply::<D, _>(&mut tx, &AwaitApproval { new, reason }, now).await?;
            }
            let op = OpRef::new(&new.tenant_id, &new.operation_id);
            insert_decisions::<D>(
                &mut tx,
                op,
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
        }
        let (op, claimed) = match inserted {
            // As inserted, returned as reserved (with a claim, the claim is
            // what changed): nothing since changed the row (an approval
            // wait did: read it).
            Some(applied) if !new.awaiting_approval => {
                let claimed = claim
                    .as_ref()
                    .map(|c| applied.claim(c.lease.expires_at(now)));
                (as_reserved(new, now), claimed)
            }
            _ => match fetch_op::<D>(&mut tx, &new.tenant_id, &new.operation_id).await? {
                Some(op) => (op, None),
                None => return Ok(None),
            },
        };
        tx.commit().await?;
        Ok(Some((
            if created {
                Reservation::Created(op)
            } else {
                Reservation::Existing(op)
            },
            claimed,
        )))
    }

    /// See [`crate::ledger::Ledger::claim`].
    pub(crate) async fn claim(&self, cmd: &ClaimLease<'_>) -> Result<Option<Claim>, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            return Ok(None);
        };
        tx.commit().await?;
        Ok(Some(applied.claim(cmd.lease.expires_at(now))))
    }

    /// See [`crate::ledger::Ledger::record_outcome`]; returns the
    /// operation as committed, or `None` when the fencing token was not
    /// current (nothing written).
    pub(crate) async fn record_outcome(
        &self,
        cmd: &RecordOutcome<'_>,
    ) -> Result<Option<Operation>, LedgerError> {
        if D::GROUPS_WRITES
            && cmd.outcome.attempt_outcome.is_some()
            && crate::config::compensated_id(cmd.op.operation_id).is_none()
        {
            command::check(cmd)?;
            match self.record_grouped(cmd).await {
                super::grouped::Grouped::Done(op) => return Ok(Some(op)),
                super::grouped::Grouped::Failed(e) => return Err(e),
                super::grouped::Grouped::Alone => {}
            }
        }
        let (mut tx, now) = self.begin_for(cmd).await?;
        tx.add_bytes(cmd.outcome.response_body.as_ref().map_or(0, Vec::len));
        if crate::config::compensated_id(cmd.op.operation_id).is_some() {
            // A compensation's COMPLETED makes its original COMPENSATED.
            tx.changes_terminal();
        }
        let subs = self.subscriptions.load_full();
        let Some((_, row)) = record_outcome_on::<D>(&mut tx, &subs, cmd, now).await? else {
            tx.unchanged();
            self.count_stale_fence();
            tracing::warn!(
                tenant = cmd.op.tenant,
                operation_id = cmd.op.operation_id,
                fence = cmd.fence,
                "write rejected: fencing token is not current"
            );
            return Ok(None);
        };
        let op = super::reads::op_from_row(&row)?;
        crate::failpoint::hit("before-outcome-commit");
        tx.commit().await?;
        Ok(Some(op))
    }

    /// See [`crate::ledger::Ledger::note_retry`]; `status` is the failed
    /// attempt's provider status, for the attempts log.
    pub(crate) async fn note_retry(
        &self,
        cmd: &NoteRetry<'_>,
        status: Option<u16>,
    ) -> Result<bool, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            tx.unchanged();
            self.count_stale_fence();
            return Ok(false);
        };
        let attempt = command::AttemptLog {
            fence: cmd.fence,
            status: status.map(i64::from),
            outcome: cmd.outcome,
            detail: Some(cmd.detail),
            at: now,
            request_id: cmd.request_id,
        };
        command::insert_attempt::<D>(&mut tx, cmd.op, applied.attempts - 1, &attempt).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// See [`crate::ledger::Ledger::extend_lease`].
    pub(crate) async fn extend_lease(&self, cmd: &ExtendLease<'_>) -> Result<bool, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let applied = command::apply::<D, _>(&mut tx, cmd, now).await?;
        tx.commit().await?;
        if applied.is_none() {
            self.count_stale_fence();
        }
        Ok(applied.is_some())
    }

    /// See [`crate::ledger::Ledger::record_decisions`].
    pub(crate) async fn record_decisions(
        &self,
        op: OpRef<'_>,
        fingerprint: &str,
        decisions: &[DecisionRecord],
    ) -> Result<(), LedgerError> {
        if decisions.is_empty() {
            return Ok(());
        }
        let (mut tx, now) = self.begin().await?;
        insert_decisions::<D>(
            &mut tx,
            op,
            fingerprint,
            decisions,
            DecisionsFor::Refusal,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Inserts `new` (RESERVED) or, with `claim`, `new` as claimed by it
/// (EXECUTING, [`command::reserve_claimed`]), on `conn` at `now`. Returns
/// the command's [`command::Applied`] (the row's version, fencing token
/// and attempts, read back by the insert's statement), or `None` when the
/// key is taken.
///
/// Errors: as [`command::apply`].
async fn insert_new<D: Dialect>(
    conn: &mut Conn<D>,
    new: &NewOperation,
    claim: Option<&ClaimLease<'_>>,
    now: i64,
) -> Result<Option<command::Applied>, LedgerError> {
    let reserve = Reserve { new };
    let columns = command::APPLIED_COLUMNS;
    let inserted = match claim {
        None => command::apply_returning::<D, _>(conn, &reserve, now, columns).await?,
        Some(claim) => command::reserve_claimed::<D>(conn, &reserve, claim, now, columns).await?,
    };
    Ok(inserted.map(|(applied, _)| applied))
}

/// The operation `new` as its reservation inserts it at `now`: RESERVED
/// at version 1, no attempt, no lease, no outcome. It is what a read of
/// the new row gives back ([`super::reads::op_from_row`]), built without
/// the read: the reservation's statement reads back only what
/// [`insert_new`] returns.
fn as_reserved(new: &NewOperation, now: i64) -> Operation {
    Operation {
        tenant_id: new.tenant_id.clone(),
        operation_id: new.operation_id.clone(),
        route: new.route.clone(),
        method: new.method.clone(),
        path: new.path.clone(),
        query: new.query.clone(),
        fingerprint: new.fingerprint.clone(),
        provider_key: new.provider_key.clone(),
        effect_class: new.effect_class.clone(),
        state: State::Reserved,
        version: 1,
        attempts: 0,
        lease_owner: None,
        lease_expires_at: None,
        fence: 0,
        request_content_type: new.request_content_type.clone(),
        request_body: new.request_body.clone(),
        principal: new.principal.clone(),
        response_status: None,
        response_headers: Vec::new(),
        response_body: None,
        response_body_bytes: None,
        response_body_omitted: false,
        error_kind: None,
        error_detail: None,
        created_at: now,
        updated_at: now,
        // Retention runs from the last change.
        expires_at: now.saturating_add(new.retention_ms),
        request_headers: new.request_headers.clone(),
        trace_context: new.trace_context.clone(),
        reconcile_attempts: 0,
        next_reconcile_at: None,
        dead_letter: false,
        dead_letter_reason: None,
        operator_check: None,
        provider_reference: None,
        requeues: 0,
        settle_until: None,
    }
}

/// Applies outcome `cmd` at `now` on `conn` (inside the caller's
/// transaction): the fenced compare-and-swap and its transition, the
/// attempts log row, a compensation's original made COMPENSATED with it,
/// and the operation event its tenant subscribes to (`subs`). Returns the
/// row after it (its version, fence and attempts, and the row of
/// [`super::reads::OP_COLUMNS`], read by the compare-and-swap itself), or
/// `None` when the fencing token is not current (then nothing was
/// written).
///
/// Errors: [`LedgerError::IllegalTransition`] before any write, or the
/// database's.
pub(super) async fn record_outcome_on<D: Dialect>(
    conn: &mut Conn<D>,
    subs: &super::Subscriptions,
    cmd: &RecordOutcome<'_>,
    now: i64,
) -> Result<Option<(command::Applied, D::Row)>, LedgerError> {
    let outcome = cmd.outcome;
    // The attempt's log row, numbered by the row's attempts after the
    // compare-and-swap, rides in its statement where the backend can.
    let applied = match &outcome.attempt_outcome {
        Some(attempt_outcome) => {
            let attempt = command::AttemptLog {
                outcome: attempt_outcome,
                ..super::grouped::attempt_log(cmd.fence, outcome, now)
            };
            command::apply_returning_with_attempt::<D, _>(
                &mut *conn,
                cmd,
                now,
                super::reads::OP_COLUMNS,
                &attempt,
            )
            .await?
        }
        None => {
            command::apply_returning::<D, _>(&mut *conn, cmd, now, super::reads::OP_COLUMNS).await?
        }
    };
    let Some((applied, row)) = applied else {
        return Ok(None);
    };
    if outcome.state == super::super::State::Completed {
        // A compensation's original becomes COMPENSATED with it.
        super::compensation::complete_original::<D>(&mut *conn, cmd.op, now).await?;
    }
    let reported = super::events::Reported {
        op: cmd.op,
        from: Some(cmd.from),
        to: outcome.state,
        version: applied.version,
        dead_letter: outcome.dead_letter.is_some(),
        reason: &outcome.reason,
        provider_reference: outcome.provider_reference.as_deref(),
    };
    super::events::report::<D>(&mut *conn, subs, &reported, now).await?;
    Ok(Some((applied, row)))
}

/// What a call's policy decisions are recorded with: the operation's
/// reservation, in the same transaction, or nothing, the call having been
/// refused before it was reserved (`unreserved`: the sweeper's
/// `policy_decisions_unreserved` index holds only those rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecisionsFor {
    /// The operation reserved in the same transaction.
    Reservation,
    /// A call refused before any operation was reserved for it.
    Refusal,
}

/// Appends one `policy_decisions` row per decision of `op`'s request
/// (`fingerprint`), recorded with `of`, at `at` (ms since epoch), on
/// `conn`.
pub(super) async fn insert_decisions<D: Dialect>(
    conn: &mut Conn<D>,
    op: OpRef<'_>,
    fingerprint: &str,
    decisions: &[DecisionRecord],
    of: DecisionsFor,
    at: i64,
) -> Result<(), sqlx::Error> {
    for d in decisions {
        sql::<D>(
            "INSERT INTO policy_decisions (tenant_id, operation_id, fingerprint, policy, content_hash, decision, reason, \
             duration_us, at, unreserved) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(op.tenant)
        .bind(op.operation_id)
        .bind(fingerprint)
        .bind(&d.policy)
        .bind(&d.content_hash)
        .bind(&d.decision)
        .bind(d.reason.as_deref().map(clean))
        .bind(d.duration_us)
        .bind(at)
        .bind(of == DecisionsFor::Refusal)
        .execute(conn)
        .await?;
    }
    Ok(())
}

/// Deletes what the ledger keeps about a forgotten operation besides its
/// row, once the row is deleted: transitions and attempts (unless the
/// row's deletion took them: [`Dialect::HISTORY_DELETED_WITH_ROW`]), policy
/// decisions, approvals and compensation links.
pub(super) async fn forget_history<D: Dialect>(
    conn: &mut Conn<D>,
    op: OpRef<'_>,
) -> Result<(), sqlx::Error> {
    let history: &[&str] = if D::HISTORY_DELETED_WITH_ROW {
        &[]
    } else {
        &[
            "DELETE FROM transitions WHERE tenant_id = ? AND operation_id = ?",
            "DELETE FROM attempts WHERE tenant_id = ? AND operation_id = ?",
        ]
    };
    for text in history.iter().chain(&[
        "DELETE FROM policy_decisions WHERE tenant_id = ? AND operation_id = ?",
        "DELETE FROM approvals WHERE tenant_id = ? AND operation_id = ?",
        "DELETE FROM compensations WHERE tenant_id = ? AND operation_id = ?",
    ]) {
        sql::<D>(text)
            .bind(op.tenant)
            .bind(op.operation_id)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}
