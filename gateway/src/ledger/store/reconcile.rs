impl Store {
    pub(super) async fn expire_lease(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        settle_ms: Option<i64>,
        actor: &str,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        let row = sqlx::query(q("UPDATE operations SET state = 'UNKNOWN', version = version + 1, fence = fence + 1, lease_owner = NULL, \
             lease_expires_at = NULL, error_kind = 'lease-expired', \
             error_detail = 'the lease of the executing owner expired before it recorded an outcome', \
             next_reconcile_at = ?, settle_until = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = 'EXECUTING' \
             AND lease_expires_at <= ? RETURNING version, fence"))
        .bind(settle_ms.map(|_| now))
        .bind(now.saturating_add(settle_ms.unwrap_or(0)))
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(version)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(false) };
        let (v, f): (i64, i64) = (row.try_get("version")?, row.try_get("fence")?);
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::Executing),
            State::Unknown,
            v,
            f,
            actor,
            "lease expired",
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn lease_for_reconcile(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let expires = now.saturating_add(lease_ms.max(0));

        let row = sqlx::query(q("UPDATE operations SET version = version + 1, fence = fence + 1, lease_owner = ?, lease_expires_at = ?, \
             updated_at = updated_at \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = 'UNKNOWN' \
             AND (lease_expires_at IS NULL OR lease_expires_at <= ?) RETURNING version, fence, attempts"))
        .bind(owner)
        .bind(expires)
        .bind(tenant)
        .bind(operation_id)
        .bind(version)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let claim = claim_row(&row, expires)?;
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::Unknown),
            State::Unknown,
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

    pub(super) async fn reattempt(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let expires = now.saturating_add(lease_ms.max(0));

        let row = sqlx::query(q(
            "UPDATE operations SET state = 'EXECUTING', version = version + 1, fence = fence + 1, \
             attempts = attempts + 1, lease_owner = ?, lease_expires_at = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'UNKNOWN' \
             RETURNING version, fence, attempts",
        ))
        .bind(owner)
        .bind(expires)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            self.count_stale_fence();
            return Ok(None);
        };
        let claim = claim_row(&row, expires)?;
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::Unknown),
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

    pub(super) async fn unschedule(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
    ) -> Result<bool, LedgerError> {
        let r = sqlx::query(q("UPDATE operations SET next_reconcile_at = NULL \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = 'UNKNOWN'"))
        .bind(tenant)
        .bind(operation_id)
        .bind(version)
        .execute(&self.write)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    pub(super) async fn audit(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        state: State,
        actor: &str,
        reason: &str,
    ) -> Result<bool, LedgerError> {
        if !state.can_transition_to(state) {
            return Err(LedgerError::IllegalTransition {
                from: state,
                to: state,
            });
        }
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        let row = sqlx::query(q("UPDATE operations SET version = version + 1, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = ? RETURNING version, fence"))
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(version)
        .bind(state.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(false) };
        let (v, f): (i64, i64) = (row.try_get("version")?, row.try_get("fence")?);
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(state),
            state,
            v,
            f,
            actor,
            reason,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn requeue(
        &self,
        tenant: &str,
        operation_id: &str,
        version: i64,
        to: State,
        actor: &str,
        reason: &str,
    ) -> Result<Option<i64>, LedgerError> {
        if !matches!(to, State::Unknown | State::Reserved) {
            return Err(LedgerError::IllegalTransition {
                from: State::Failed,
                to,
            });
        }
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;

        let row = sqlx::query(q("UPDATE operations SET state = ?, version = version + 1, dead_letter = FALSE, requeues = requeues + 1, \
             reconcile_attempts = 0, next_reconcile_at = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = 'FAILED' AND dead_letter \
             RETURNING version, fence"))
        .bind(to.as_str())
        .bind(now)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(version)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let (v, f): (i64, i64) = (row.try_get("version")?, row.try_get("fence")?);
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::Failed),
            to,
            v,
            f,
            actor,
            reason,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(v))
    }
}
