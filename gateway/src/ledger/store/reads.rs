// Reads of the effect ledger (included once per SQL dialect).

const OP_COLUMNS: &str = "tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
     effect_class, state, version, attempts, lease_owner, lease_expires_at, fence, request_content_type, \
     request_body, principal, response_status, response_headers, response_body, response_body_bytes, \
     response_body_omitted, error_kind, error_detail, created_at, updated_at, expires_at, request_headers, \
     reconcile_attempts, next_reconcile_at, dead_letter, dead_letter_reason, operator_check, provider_reference, \
     requeues, settle_until, retention_ms";

impl Store {
    pub(super) fn count_stale_fence(&self) {
        self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
        crate::metrics::stale_fence();
    }

    pub(super) async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query(q("SELECT 1")).execute(&self.read).await?;
        Ok(())
    }

    pub(super) async fn provider_key_secret(&self) -> Result<Vec<u8>, LedgerError> {
        let fresh: [u8; 32] = rand::random();
        sqlx::query(q("INSERT INTO meta (name, value) VALUES ('provider_key_secret', ?) ON CONFLICT (name) DO NOTHING"))
            .bind(fresh.as_slice())
            .execute(&self.write)
            .await?;
        let row = sqlx::query(q(
            "SELECT value FROM meta WHERE name = 'provider_key_secret'",
        ))
        .fetch_one(&self.write)
        .await?;
        Ok(row.try_get("value")?)
    }

    pub(super) async fn get(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        let mut conn = self.read.acquire().await?;
        Ok(fetch_op(&mut *conn, tenant, operation_id).await?)
    }

    pub(super) async fn attempts(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let rows = sqlx::query(q(
            "SELECT attempt, fence, status, outcome, detail, at FROM attempts \
             WHERE tenant_id = ? AND operation_id = ? ORDER BY attempt",
        ))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Attempt {
                    attempt: r.try_get("attempt")?,
                    fence: r.try_get("fence")?,
                    status: r.try_get("status")?,
                    outcome: r.try_get("outcome")?,
                    detail: r.try_get("detail")?,
                    at: r.try_get("at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn decisions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<serde_json::Value>, LedgerError> {
        // Only this operation's: a refusal recorded under the same key
        // before the operation existed (a denied call, an earlier
        // operation's) is not part of its history.
        let rows = sqlx::query(q("SELECT policy, content_hash, decision, reason, duration_us, fingerprint, at FROM policy_decisions d \
             WHERE d.tenant_id = ? AND d.operation_id = ? \
             AND d.at >= COALESCE((SELECT o.created_at FROM operations o \
                 WHERE o.tenant_id = d.tenant_id AND o.operation_id = d.operation_id), 0) \
             ORDER BY d.seq"))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(serde_json::json!({
                    "policy": r.try_get::<String, _>("policy")?,
                    "content_hash": r.try_get::<String, _>("content_hash")?,
                    "decision": r.try_get::<String, _>("decision")?,
                    "reason": r.try_get::<Option<String>, _>("reason")?,
                    "duration_us": r.try_get::<i64, _>("duration_us")?,
                    "fingerprint": r.try_get::<String, _>("fingerprint")?,
                    "at": r.try_get::<i64, _>("at")?,
                }))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn transitions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Transition>, LedgerError> {
        let rows = sqlx::query(q(
            "SELECT seq, from_state, to_state, version, fence, actor, reason, at FROM transitions \
             WHERE tenant_id = ? AND operation_id = ? ORDER BY seq",
        ))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                let from: Option<String> = r.try_get("from_state")?;
                let to: String = r.try_get("to_state")?;
                Ok(Transition {
                    seq: r.try_get("seq")?,
                    from_state: from.and_then(|s| s.parse().ok()),
                    to_state: to
                        .parse()
                        .map_err(|e: super::UnknownState| sqlx::Error::Decode(e.into()))?,
                    version: r.try_get("version")?,
                    fence: r.try_get("fence")?,
                    actor: r.try_get("actor")?,
                    reason: r.try_get("reason")?,
                    at: r.try_get("at")?,
                })
            })
            .collect()
    }

    pub(super) async fn due_for_reconciliation(
        &self,
        owner: &str,
        reserved_grace_ms: i64,
        scan_ms: i64,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let rows = sqlx::query(q(&format!(
            "UPDATE operations SET scan_owner = ?4, scan_expires_at = ?5 \
             WHERE (tenant_id, operation_id) IN (SELECT tenant_id, operation_id FROM operations WHERE \
             ((state = 'UNKNOWN' AND next_reconcile_at IS NOT NULL AND next_reconcile_at <= ?1 \
                 AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)) \
             OR (state = 'EXECUTING' AND lease_expires_at <= ?1) \
             OR (state = 'RESERVED' AND updated_at <= ?2)) \
             AND (scan_expires_at IS NULL OR scan_expires_at <= ?1) \
             ORDER BY updated_at LIMIT ?3{SKIP_LOCKED}) \
             RETURNING {OP_COLUMNS}"
        )))
        .bind(now)
        .bind(now.saturating_sub(reserved_grace_ms))
        .bind(i64::from(limit))
        .bind(owner)
        .bind(now.saturating_add(scan_ms.max(0)))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut ops = rows
            .iter()
            .map(op_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        ops.sort_by_key(|o| o.updated_at);
        Ok(ops)
    }

    pub(super) async fn release_scan(&self, owner: &str) -> Result<u64, LedgerError> {
        let r = sqlx::query(q(
            "UPDATE operations SET scan_owner = NULL, scan_expires_at = NULL WHERE scan_owner = ?",
        ))
        .bind(owner)
        .execute(&self.write)
        .await?;
        Ok(r.rows_affected())
    }

    pub(super) async fn sweep_expired(
        &self,
        batch: u32,
        min_retention_ms: i64,
    ) -> Result<u64, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        // Decisions recorded for calls refused before reservation have no
        // operation; they go after the shortest key retention.
        sqlx::query(q(
            "DELETE FROM policy_decisions WHERE seq IN (SELECT d.seq FROM policy_decisions d \
             WHERE d.at <= ? AND NOT EXISTS (SELECT 1 FROM operations o \
             WHERE o.tenant_id = d.tenant_id AND o.operation_id = d.operation_id) LIMIT ?)",
        ))
        .bind(now.saturating_sub(min_retention_ms.max(0)))
        .bind(i64::from(batch))
        .execute(&mut *tx)
        .await?;
        // Mark the batch (rows another sweeper or a reservation holds are
        // skipped), delete the marked rows' history, then the rows: six
        // statements per batch, in one transaction, whatever its size.
        let token = format!("sweep:{}", hex::encode(rand::random::<[u8; 8]>()));
        let marked = sqlx::query(q(&format!(
            "UPDATE operations SET scan_owner = ? WHERE (tenant_id, operation_id) IN ( \
             SELECT tenant_id, operation_id FROM operations \
             WHERE state IN ('COMPLETED', 'FAILED', 'COMPENSATED') AND NOT dead_letter \
             AND updated_at <= ? AND updated_at + retention_ms <= ? \
             ORDER BY updated_at LIMIT ?{SKIP_LOCKED})"
        )))
        .bind(&token)
        .bind(now.saturating_sub(min_retention_ms.max(0)))
        .bind(now)
        .bind(i64::from(batch))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if marked == 0 {
            tx.commit().await?;
            return Ok(0);
        }
        for table in ["transitions", "attempts", "policy_decisions", "approvals"] {
            sqlx::query(q(&format!(
                "DELETE FROM {table} WHERE (tenant_id, operation_id) IN \
                 (SELECT tenant_id, operation_id FROM operations WHERE scan_owner = ?)"
            )))
            .bind(&token)
            .execute(&mut *tx)
            .await?;
        }
        let deleted = sqlx::query(q("DELETE FROM operations WHERE scan_owner = ?"))
            .bind(&token)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }

    pub(super) async fn dead_letters(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let rows = sqlx::query(q(&format!("SELECT {OP_COLUMNS} FROM operations WHERE dead_letter AND (?1 IS NULL OR tenant_id = ?1) \
             ORDER BY updated_at LIMIT ?2")))
        .bind(tenant)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }

    pub(super) async fn tenant_counts(
        &self,
    ) -> Result<Vec<(String, i64, i64, Option<i64>)>, LedgerError> {
        let rows = sqlx::query(q("SELECT tenant_id, COUNT(*) FILTER (WHERE state = 'UNKNOWN') AS unknown, COUNT(*) FILTER (WHERE dead_letter) AS dead, \
             MIN(CASE WHEN dead_letter THEN updated_at END) AS oldest \
             FROM operations WHERE state = 'UNKNOWN' OR dead_letter GROUP BY tenant_id"))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("tenant_id")?,
                    r.try_get("unknown")?,
                    r.try_get("dead")?,
                    r.try_get("oldest")?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn list(
        &self,
        tenant: Option<&str>,
        state: Option<State>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let rows = sqlx::query(q(&format!("SELECT {OP_COLUMNS} FROM operations WHERE (?1 IS NULL OR tenant_id = ?1) AND (?2 IS NULL OR state = ?2) \
             ORDER BY updated_at DESC, operation_id LIMIT ?3")))
        .bind(tenant)
        .bind(state.map(State::as_str))
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }
}

pub(super) async fn fetch_op<'e, E>(
    ex: E,
    tenant: &str,
    operation_id: &str,
) -> Result<Option<Operation>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let row = sqlx::query(q(&format!(
        "SELECT {OP_COLUMNS} FROM operations WHERE tenant_id = ? AND operation_id = ?"
    )))
    .bind(tenant)
    .bind(operation_id)
    .fetch_optional(ex)
    .await?;
    row.as_ref().map(op_from_row).transpose()
}

pub(super) fn op_from_row(r: &DbRow) -> Result<Operation, sqlx::Error> {
    let state: String = r.try_get("state")?;
    let headers: Option<String> = r.try_get("response_headers")?;
    Ok(Operation {
        tenant_id: r.try_get("tenant_id")?,
        operation_id: r.try_get("operation_id")?,
        route: r.try_get("route")?,
        method: r.try_get("method")?,
        path: r.try_get("path")?,
        query: r.try_get("query")?,
        fingerprint: r.try_get("fingerprint")?,
        provider_key: r.try_get("provider_key")?,
        effect_class: r.try_get("effect_class")?,
        state: state
            .parse()
            .map_err(|e: super::UnknownState| sqlx::Error::Decode(e.into()))?,
        version: r.try_get("version")?,
        attempts: r.try_get("attempts")?,
        lease_owner: r.try_get("lease_owner")?,
        lease_expires_at: r.try_get("lease_expires_at")?,
        fence: r.try_get("fence")?,
        request_content_type: r.try_get("request_content_type")?,
        request_body: r.try_get("request_body")?,
        principal: r.try_get("principal")?,
        response_status: r.try_get("response_status")?,
        response_headers: headers
            .and_then(|h| serde_json::from_str(&h).ok())
            .unwrap_or_default(),
        response_body: r.try_get("response_body")?,
        response_body_bytes: r.try_get("response_body_bytes")?,
        response_body_omitted: r.try_get("response_body_omitted")?,
        error_kind: r.try_get("error_kind")?,
        error_detail: r.try_get("error_detail")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
        // Retention runs from the last change of a terminal operation.
        expires_at: r
            .try_get::<i64, _>("updated_at")?
            .saturating_add(r.try_get::<i64, _>("retention_ms")?),
        request_headers: serde_json::from_str(&r.try_get::<String, _>("request_headers")?)
            .unwrap_or_default(),
        reconcile_attempts: r.try_get("reconcile_attempts")?,
        next_reconcile_at: r.try_get("next_reconcile_at")?,
        dead_letter: r.try_get("dead_letter")?,
        dead_letter_reason: r.try_get("dead_letter_reason")?,
        operator_check: r.try_get("operator_check")?,
        provider_reference: r.try_get("provider_reference")?,
        requeues: r.try_get("requeues")?,
        settle_until: r.try_get("settle_until")?,
    })
}
