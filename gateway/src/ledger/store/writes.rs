impl Store {
    pub(super) async fn reserve(&self, new: &NewOperation) -> Result<Reservation, LedgerError> {
        // The existing row can vanish between the insert that found it and
        // the read of it (the retention sweeper deleted it, expired): then
        // the key is free and the next try creates the operation.
        for _ in 0..3 {
            if let Some(r) = self.reserve_once(new).await? {
                return Ok(r);
            }
        }
        Err(LedgerError::Db(sqlx::Error::RowNotFound))
    }

    async fn reserve_once(&self, new: &NewOperation) -> Result<Option<Reservation>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        let expired = sqlx::query(q("DELETE FROM operations WHERE tenant_id = ? AND operation_id = ? AND updated_at + retention_ms <= ? \
             AND state IN ('COMPLETED', 'FAILED', 'COMPENSATED') AND NOT dead_letter"))
        .bind(&new.tenant_id)
        .bind(&new.operation_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if expired.rows_affected() > 0 {
            forget_history(&mut tx, &new.tenant_id, &new.operation_id).await?;
        }
        let inserted = sqlx::query(q("INSERT INTO operations (tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
             effect_class, state, version, attempts, fence, request_content_type, request_body, principal, \
             created_at, updated_at, expires_at, request_headers, retention_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'RESERVED', 1, 0, 0, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (tenant_id, operation_id) DO NOTHING"))
        .bind(&new.tenant_id)
        .bind(&new.operation_id)
        .bind(&new.route)
        .bind(&new.method)
        .bind(&new.path)
        .bind(&new.query)
        .bind(&new.fingerprint)
        .bind(&new.provider_key)
        .bind(&new.effect_class)
        .bind(&new.request_content_type)
        .bind(&new.request_body)
        .bind(&new.principal)
        .bind(now)
        .bind(now)
        .bind(now.saturating_add(new.retention_ms))
        .bind(serde_json::to_string(&new.request_headers).unwrap_or_else(|_| "[]".into()))
        .bind(new.retention_ms)
        .execute(&mut *tx)
        .await?;
        let created = inserted.rows_affected() == 1;
        if created {
            insert_transition(
                &mut tx,
                &new.tenant_id,
                &new.operation_id,
                None,
                State::Reserved,
                1,
                0,
                &new.principal,
                "reserved",
                now,
            )
            .await?;
            if new.awaiting_approval {
                sqlx::query(q("UPDATE operations SET state = 'AWAITING_APPROVAL', version = 2 WHERE tenant_id = ? AND operation_id = ?"))
                .bind(&new.tenant_id)
                .bind(&new.operation_id)
                .execute(&mut *tx)
                .await?;
                let reason = new
                    .decisions
                    .iter()
                    .filter(|d| d.decision == "require-approval")
                    .map(|d| format!("{}: {}", d.policy, d.reason.as_deref().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join("; ");
                insert_transition(
                    &mut tx,
                    &new.tenant_id,
                    &new.operation_id,
                    Some(State::Reserved),
                    State::AwaitingApproval,
                    2,
                    0,
                    &new.principal,
                    &format!("approval required: {reason}"),
                    now,
                )
                .await?;
            }
            insert_decisions(
                &mut tx,
                &new.tenant_id,
                &new.operation_id,
                &new.fingerprint,
                &new.decisions,
                now,
            )
            .await?;
            if new.awaiting_approval
                && let Some(a) = &new.approval
            {
                insert_approval(&mut tx, new, a, now).await?;
            }
        }
        let Some(op) = fetch_op(&mut *tx, &new.tenant_id, &new.operation_id).await? else {
            return Ok(None);
        };
        tx.commit().await?;
        Ok(Some(if created {
            Reservation::Created(op)
        } else {
            Reservation::Existing(op)
        }))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn claim(
        &self,
        tenant: &str,
        operation_id: &str,
        from: State,
        expected_version: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        if !from.can_transition_to(State::Executing) || from == State::Failed {
            return Err(LedgerError::IllegalTransition {
                from,
                to: State::Executing,
            });
        }
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let expires = now.saturating_add(lease_ms.max(0));

        let row = sqlx::query(q("UPDATE operations SET state = 'EXECUTING', version = version + 1, fence = fence + 1, \
             attempts = attempts + 1, lease_owner = ?, lease_expires_at = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = ? \
             AND (state NOT IN ('EXECUTING', 'UNKNOWN') OR lease_expires_at IS NULL OR lease_expires_at <= ?) \
             RETURNING version, fence, attempts"))
        .bind(owner)
        .bind(expires)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(expected_version)
        .bind(from.as_str())
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let claim = claim_row(&row, expires)?;
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(from),
            State::Executing,
            claim.version,
            claim.fence,
            owner,
            reason,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(claim))
    }

    pub(super) async fn record_outcome(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        from: State,
        actor: &str,
        outcome: &Outcome,
    ) -> Result<bool, LedgerError> {
        let to = outcome.state;
        if !matches!(from, State::Executing | State::Unknown)
            || !matches!(to, State::Completed | State::Failed | State::Unknown)
            || !from.can_transition_to(to)
        {
            return Err(LedgerError::IllegalTransition { from, to });
        }
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let headers =
            serde_json::to_string(&outcome.response_headers).unwrap_or_else(|_| "[]".into());
        let (dl, dl_reason, dl_check) = match &outcome.dead_letter {
            Some(d) => (
                true,
                Some(d.reason.as_str()),
                Some(d.operator_check.as_str()),
            ),
            None => (false, None, None),
        };

        let row = sqlx::query(q("UPDATE operations SET state = ?1, version = version + 1, lease_owner = NULL, lease_expires_at = NULL, \
             response_status = CASE WHEN ?2 THEN response_status ELSE ?3 END, \
             response_headers = CASE WHEN ?2 THEN response_headers ELSE ?4 END, \
             response_body = CASE WHEN ?2 THEN response_body ELSE ?5 END, \
             response_body_bytes = CASE WHEN ?2 THEN response_body_bytes ELSE ?6 END, \
             response_body_omitted = CASE WHEN ?2 THEN response_body_omitted ELSE ?7 END, \
             error_kind = ?8, error_detail = ?9, updated_at = ?10, \
             reconcile_attempts = reconcile_attempts + ?11, next_reconcile_at = ?12, \
             dead_letter = ?13, dead_letter_reason = ?14, operator_check = ?15, \
             provider_reference = COALESCE(?16, provider_reference), \
             settle_until = COALESCE(?21, settle_until) \
             WHERE tenant_id = ?17 AND operation_id = ?18 AND fence = ?19 AND state = ?20 \
             RETURNING version, attempts"))
        .bind(to.as_str())
        .bind(outcome.keep_response)
        .bind(outcome.response_status.map(i64::from))
        .bind(headers)
        .bind(&outcome.response_body)
        .bind(outcome.response_body_bytes)
        .bind(outcome.response_body_omitted)
        .bind(outcome.error_kind.as_deref().map(clean))
        .bind(outcome.error_detail.as_deref().map(clean))
        .bind(now)
        .bind(i64::from(outcome.count_read_back))
        .bind(outcome.next_reconcile_at)
        .bind(dl)
        .bind(dl_reason.map(clean))
        .bind(dl_check.map(clean))
        .bind(outcome.provider_reference.as_deref().map(clean))
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .bind(from.as_str())
        .bind(outcome.settle_until)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            self.count_stale_fence();
            tracing::warn!(
                tenant,
                operation_id,
                fence,
                "write rejected: fencing token is not current"
            );
            return Ok(false);
        };
        let version: i64 = row.try_get("version")?;
        let attempt: i64 = row.try_get("attempts")?;
        if let Some(attempt_outcome) = &outcome.attempt_outcome {
            insert_attempt(
                &mut tx,
                tenant,
                operation_id,
                attempt,
                fence,
                outcome.response_status.map(i64::from),
                attempt_outcome,
                outcome.error_detail.as_deref(),
                now,
            )
            .await?;
        }
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(from),
            to,
            version,
            fence,
            actor,
            &outcome.reason,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn note_retry(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        status: Option<u16>,
        outcome: &str,
        detail: &str,
        lease_ms: i64,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        let row = sqlx::query(q("UPDATE operations SET attempts = attempts + 1, lease_expires_at = ?, error_kind = ?, error_detail = ?, \
             updated_at = ? WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'EXECUTING' \
             RETURNING attempts"))
        .bind(now.saturating_add(lease_ms))
        .bind(clean(outcome))
        .bind(clean(detail))
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            self.count_stale_fence();
            return Ok(false);
        };
        let next: i64 = row.try_get("attempts")?;
        insert_attempt(
            &mut tx,
            tenant,
            operation_id,
            next - 1,
            fence,
            status.map(i64::from),
            outcome,
            Some(detail),
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn extend_lease(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let r = sqlx::query(q("UPDATE operations SET lease_expires_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'EXECUTING'"))
        .bind(now.saturating_add(lease_ms))
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        if r.rows_affected() == 0 {
            self.count_stale_fence();
        }
        Ok(r.rows_affected() == 1)
    }
}

/// The claim an `UPDATE … RETURNING version, fence, attempts` took.
pub(super) fn claim_row(row: &DbRow, expires: i64) -> Result<Claim, sqlx::Error> {
    Ok(Claim {
        version: row.try_get("version")?,
        fence: row.try_get("fence")?,
        attempt: row.try_get("attempts")?,
        lease_expires_at: expires,
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn insert_transition(
    tx: &mut sqlx::Transaction<'_, Db>,
    tenant: &str,
    operation_id: &str,
    from: Option<State>,
    to: State,
    version: i64,
    fence: i64,
    actor: &str,
    reason: &str,
    at: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(q("INSERT INTO transitions (tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"))
    .bind(tenant)
    .bind(operation_id)
    .bind(from.map(State::as_str))
    .bind(to.as_str())
    .bind(version)
    .bind(fence)
    .bind(clean(actor))
    .bind(clean(reason))
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn insert_decisions(
    tx: &mut sqlx::Transaction<'_, Db>,
    tenant: &str,
    operation_id: &str,
    fingerprint: &str,
    decisions: &[super::DecisionRecord],
    at: i64,
) -> Result<(), sqlx::Error> {
    for d in decisions {
        sqlx::query(q("INSERT INTO policy_decisions (tenant_id, operation_id, fingerprint, policy, content_hash, decision, reason, \
             duration_us, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"))
        .bind(tenant)
        .bind(operation_id)
        .bind(fingerprint)
        .bind(&d.policy)
        .bind(&d.content_hash)
        .bind(&d.decision)
        .bind(d.reason.as_deref().map(clean))
        .bind(d.duration_us)
        .bind(at)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

impl Store {
    pub(super) async fn record_decisions(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
        decisions: &[super::DecisionRecord],
    ) -> Result<(), LedgerError> {
        if decisions.is_empty() {
            return Ok(());
        }
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        insert_decisions(&mut tx, tenant, operation_id, fingerprint, decisions, now).await?;
        tx.commit().await?;
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
async fn insert_attempt(
    tx: &mut sqlx::Transaction<'_, Db>,
    tenant: &str,
    operation_id: &str,
    attempt: i64,
    fence: i64,
    status: Option<i64>,
    outcome: &str,
    detail: Option<&str>,
    at: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(q("INSERT INTO attempts (tenant_id, operation_id, attempt, fence, status, outcome, detail, at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"))
    .bind(tenant)
    .bind(operation_id)
    .bind(attempt)
    .bind(fence)
    .bind(status)
    .bind(clean(outcome))
    .bind(detail.map(clean))
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Deletes what the ledger keeps about a forgotten operation besides its
/// row: transitions, attempts, policy decisions and approvals.
async fn forget_history(
    tx: &mut sqlx::Transaction<'_, Db>,
    tenant: &str,
    operation_id: &str,
) -> Result<(), sqlx::Error> {
    for sql in [
        "DELETE FROM transitions WHERE tenant_id = ? AND operation_id = ?",
        "DELETE FROM attempts WHERE tenant_id = ? AND operation_id = ?",
        "DELETE FROM policy_decisions WHERE tenant_id = ? AND operation_id = ?",
        "DELETE FROM approvals WHERE tenant_id = ? AND operation_id = ?",
    ] {
        sqlx::query(q(sql))
            .bind(tenant)
            .bind(operation_id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}
