// Approvals and the outbox (included once per SQL dialect).

const APPROVAL_COLUMNS: &str = "id, tenant_id, operation_id, kind, method, route, path, fingerprint, policy, policy_hash, \
     reason, requested_by, status, created_at, expires_at, decided_by, decided_at, comment, used_at, operation_version";

fn approval_from_row(r: &DbRow) -> Result<Approval, sqlx::Error> {
    Ok(Approval {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        operation_id: r.try_get("operation_id")?,
        kind: r.try_get("kind")?,
        method: r.try_get("method")?,
        route: r.try_get("route")?,
        path: r.try_get("path")?,
        fingerprint: r.try_get("fingerprint")?,
        policy: r.try_get("policy")?,
        policy_hash: r.try_get("policy_hash")?,
        reason: r.try_get("reason")?,
        requested_by: r.try_get("requested_by")?,
        status: r.try_get("status")?,
        created_at: r.try_get("created_at")?,
        expires_at: r.try_get("expires_at")?,
        decided_by: r.try_get("decided_by")?,
        decided_at: r.try_get("decided_at")?,
        comment: r.try_get("comment")?,
        used_at: r.try_get("used_at")?,
        operation_version: r.try_get("operation_version")?,
    })
}

pub(super) async fn insert_event(
    tx: &mut sqlx::Transaction<'_, Db>,
    tenant: &str,
    event_type: &str,
    payload: serde_json::Value,
    now: i64,
) -> Result<(), sqlx::Error> {
    let event_id = format!("evt_{}", hex::encode(rand::random::<[u8; 12]>()));
    let body = serde_json::json!({
        "event_id": event_id,
        "type": event_type,
        "tenant": tenant,
        "created_at": now,
        "data": payload,
    });
    sqlx::query(q("INSERT INTO outbox (event_id, tenant_id, event_type, payload, created_at, next_attempt_at) VALUES (?, ?, ?, ?, ?, ?)"))
    .bind(&event_id)
    .bind(tenant)
    .bind(event_type)
    .bind(body.to_string())
    .bind(now)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub(super) async fn insert_approval(
    tx: &mut sqlx::Transaction<'_, Db>,
    op: &super::NewOperation,
    a: &NewApproval,
    now: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(q(&format!("INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, NULL, NULL, NULL, NULL, NULL)")))
    .bind(&a.id)
    .bind(&op.tenant_id)
    .bind(&op.operation_id)
    .bind(&a.kind)
    .bind(&op.method)
    .bind(&op.route)
    .bind(&op.path)
    .bind(&op.fingerprint)
    .bind(&a.policy)
    .bind(&a.policy_hash)
    .bind(clean(&a.reason))
    .bind(&op.principal)
    .bind(now)
    .bind(now.saturating_add(a.ttl_ms))
    .execute(&mut **tx)
    .await?;
    let payload = serde_json::json!({
        "approval_id": a.id, "operation_id": op.operation_id, "method": op.method, "route": op.route,
        "path": op.path, "fingerprint": op.fingerprint, "policy": a.policy, "policy_hash": a.policy_hash,
        "reason": a.reason, "requested_by": op.principal, "expires_at": now.saturating_add(a.ttl_ms),
    });
    insert_event(tx, &op.tenant_id, "approval.created", payload, now).await
}

impl Store {
    pub(super) async fn approval(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Approval>, LedgerError> {
        let row = sqlx::query(q(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ? AND id = ?"
        )))
        .bind(tenant)
        .bind(id)
        .fetch_optional(&self.read)
        .await?;
        Ok(row.as_ref().map(approval_from_row).transpose()?)
    }

    pub(super) async fn approval_for(
        &self,
        tenant: &str,
        operation_id: &str,
        kind: &str,
    ) -> Result<Option<Approval>, LedgerError> {
        let row = sqlx::query(q(&format!("SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ? AND operation_id = ? AND kind = ? \
             ORDER BY created_at DESC, {ROW_ORDER} DESC LIMIT 1")))
        .bind(tenant)
        .bind(operation_id)
        .bind(kind)
        .fetch_optional(&self.write)
        .await?;
        Ok(row.as_ref().map(approval_from_row).transpose()?)
    }

    pub(super) async fn approvals(
        &self,
        tenant: &str,
        status: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Approval>, LedgerError> {
        let rows = sqlx::query(q(&format!("SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ?1 AND (?2 IS NULL OR status = ?2) \
             ORDER BY created_at LIMIT ?3")))
        .bind(tenant)
        .bind(status)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(approval_from_row)
            .collect::<Result<_, _>>()?)
    }

    pub(super) async fn create_replay_approval(
        &self,
        op: &super::Operation,
        a: &NewApproval,
        requested_by: &str,
    ) -> Result<(), LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let new = super::NewOperation {
            tenant_id: op.tenant_id.clone(),
            operation_id: op.operation_id.clone(),
            route: op.route.clone(),
            method: op.method.clone(),
            path: op.path.clone(),
            query: op.query.clone(),
            fingerprint: op.fingerprint.clone(),
            provider_key: op.provider_key.clone(),
            effect_class: op.effect_class.clone(),
            request_content_type: op.request_content_type.clone(),
            request_body: Vec::new(),
            request_headers: Vec::new(),
            principal: requested_by.to_owned(),
            retention_ms: 0,
            awaiting_approval: true,
            decisions: Vec::new(),
            approval: None,
        };

        insert_approval(&mut tx, &new, a, now).await?;
        sqlx::query(q("UPDATE approvals SET operation_version = ? WHERE id = ?"))
            .bind(op.version)
            .bind(&a.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn decide(
        &self,
        tenant: &str,
        id: &str,
        decision: Decision,
        by: &str,
        comment: Option<&str>,
    ) -> Result<Option<Approval>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let status = if decision == Decision::Approve {
            "approved"
        } else {
            "rejected"
        };

        let row = sqlx::query(q(&format!("UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, comment = ? \
             WHERE tenant_id = ? AND id = ? AND status = 'pending' AND expires_at > ? RETURNING {APPROVAL_COLUMNS}")))
        .bind(status)
        .bind(by)
        .bind(now)
        .bind(comment.map(clean))
        .bind(tenant)
        .bind(id)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let a = approval_from_row(&row)?;
        let note = comment.map(|c| format!(": {c}")).unwrap_or_default();
        if a.kind == "request" {
            if decision == Decision::Reject {
                let body = super::approval::refused_response(
                    "approval-rejected",
                    &format!("the approval was rejected by {by}{note}"),
                    &a.operation_id,
                    &a.id,
                );
                self.fail_awaiting(
                    &mut tx,
                    &a,
                    by,
                    &format!("approval {} rejected by {by}{note}", a.id),
                    body,
                    now,
                )
                .await?;
            } else {
                self.audit_awaiting(
                    &mut tx,
                    &a,
                    by,
                    &format!("approval {} approved by {by}{note}", a.id),
                    now,
                )
                .await?;
            }
        }
        let payload = serde_json::json!({
            "approval_id": a.id, "operation_id": a.operation_id, "fingerprint": a.fingerprint,
            "status": a.status, "decided_by": by, "comment": comment,
        });
        insert_event(&mut tx, tenant, &format!("approval.{status}"), payload, now).await?;
        tx.commit().await?;
        Ok(Some(a))
    }

    async fn audit_awaiting(
        &self,
        tx: &mut sqlx::Transaction<'_, Db>,
        a: &Approval,
        actor: &str,
        reason: &str,
        now: i64,
    ) -> Result<(), sqlx::Error> {
        let row = sqlx::query(q("UPDATE operations SET version = version + 1, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND state = 'AWAITING_APPROVAL' RETURNING version, fence"))
        .bind(now)
        .bind(&a.tenant_id)
        .bind(&a.operation_id)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(row) = row {
            let (v, f): (i64, i64) = (row.try_get("version")?, row.try_get("fence")?);
            insert_transition(
                tx,
                &a.tenant_id,
                &a.operation_id,
                Some(State::AwaitingApproval),
                State::AwaitingApproval,
                v,
                f,
                actor,
                reason,
                now,
            )
            .await?;
        }
        Ok(())
    }

    async fn fail_awaiting(
        &self,
        tx: &mut sqlx::Transaction<'_, Db>,
        a: &Approval,
        actor: &str,
        reason: &str,
        body: Vec<u8>,
        now: i64,
    ) -> Result<(), sqlx::Error> {
        let headers = r#"[["content-type","application/problem+json"]]"#;
        let row = sqlx::query(q("UPDATE operations SET state = 'FAILED', version = version + 1, response_status = 403, response_headers = ?, \
             response_body_bytes = ?, response_body = ?, error_kind = 'approval-refused', error_detail = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND state = 'AWAITING_APPROVAL' AND fingerprint = ? \
             RETURNING version, fence"))
        .bind(headers)
        .bind(body.len() as i64)
        .bind(&body)
        .bind(clean(reason))
        .bind(now)
        .bind(&a.tenant_id)
        .bind(&a.operation_id)
        .bind(&a.fingerprint)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(row) = row {
            let (v, f): (i64, i64) = (row.try_get("version")?, row.try_get("fence")?);
            insert_transition(
                tx,
                &a.tenant_id,
                &a.operation_id,
                Some(State::AwaitingApproval),
                State::Failed,
                v,
                f,
                actor,
                reason,
                now,
            )
            .await?;
        }
        Ok(())
    }

    pub(super) async fn use_approval(
        &self,
        tenant: &str,
        approval_id: &str,
        operation_id: &str,
        fingerprint: &str,
        owner: &str,
        lease_ms: i64,
    ) -> Result<Option<Claim>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let expires = now.saturating_add(lease_ms.max(0));

        let used = sqlx::query(q("UPDATE approvals SET status = 'used', used_at = ? WHERE tenant_id = ? AND id = ? AND operation_id = ? \
             AND fingerprint = ? AND status = 'approved' AND expires_at > ?"))
        .bind(now)
        .bind(tenant)
        .bind(approval_id)
        .bind(operation_id)
        .bind(fingerprint)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if used.rows_affected() != 1 {
            return Ok(None);
        }
        let row = sqlx::query(q("UPDATE operations SET state = 'EXECUTING', version = version + 1, fence = fence + 1, attempts = attempts + 1, \
             lease_owner = ?, lease_expires_at = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND fingerprint = ? AND state = 'AWAITING_APPROVAL' \
             RETURNING version, fence, attempts"))
        .bind(owner)
        .bind(expires)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(fingerprint)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let claim = claim_row(&row, expires)?;
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::AwaitingApproval),
            State::Executing,
            claim.version,
            claim.fence,
            owner,
            &format!("approval {approval_id} used: executing the approved request"),
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(claim))
    }

    pub(super) async fn use_replay_approval(
        &self,
        tenant: &str,
        approval_id: &str,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let r = sqlx::query(q("UPDATE approvals SET status = 'used', used_at = ? WHERE tenant_id = ? AND id = ? AND kind = 'replay' \
             AND status = 'approved'"))
        .bind(now)
        .bind(tenant)
        .bind(approval_id)
        .execute(&self.write)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    pub(super) async fn expire_approvals(&self, limit: u32) -> Result<usize, LedgerError> {
        let now = self.now().await?;
        let rows = sqlx::query(q(&format!("SELECT {APPROVAL_COLUMNS} FROM approvals WHERE status IN ('pending', 'approved') AND expires_at <= ? \
             ORDER BY expires_at LIMIT ?")))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        let mut n = 0;
        for r in rows {
            let a = approval_from_row(&r)?;
            let mut tx = self.write.begin().await?;
            // An approval granted but never used expires too: it can't
            // authorise anything after its expiry.
            let done = sqlx::query(q(
                "UPDATE approvals SET status = 'expired', decided_at = COALESCE(decided_at, ?) \
                 WHERE id = ? AND status IN ('pending', 'approved')",
            ))
            .bind(now)
            .bind(&a.id)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                if a.kind == "request" {
                    let body = super::approval::refused_response(
                        "approval-expired",
                        if a.status == "approved" {
                            "the approval expired before the approved request was sent again"
                        } else {
                            "the approval expired before anyone decided"
                        },
                        &a.operation_id,
                        &a.id,
                    );
                    self.fail_awaiting(
                        &mut tx,
                        &a,
                        "reconciler",
                        &format!("approval {} expired", a.id),
                        body,
                        now,
                    )
                    .await?;
                }
                let payload = serde_json::json!({"approval_id": a.id, "operation_id": a.operation_id, "status": "expired"});
                insert_event(&mut tx, &a.tenant_id, "approval.expired", payload, now).await?;
                n += 1;
            }
            tx.commit().await?;
        }
        Ok(n)
    }

    pub(super) async fn claim_events(
        &self,
        owner: &str,
        lease_ms: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        // Fair by tenant: every tenant's oldest due event before any
        // tenant's second, so one tenant's backlog (a receiver that is
        // down) never delays another's past one round. A window function
        // can't take row locks, so the candidates are picked unlocked and
        // the UPDATE checks the claim condition again on each row it locks:
        // two relays never claim one event.
        let rows = sqlx::query(q("UPDATE outbox SET lease_owner = ?1, lease_expires_at = ?2 WHERE event_id IN ( \
               SELECT event_id FROM ( \
                 SELECT event_id, created_at, \
                   ROW_NUMBER() OVER (PARTITION BY tenant_id ORDER BY created_at) AS rank_in_tenant \
                 FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at <= ?3 \
                 AND (lease_expires_at IS NULL OR lease_expires_at <= ?3)) due \
               ORDER BY rank_in_tenant, created_at LIMIT ?4) \
             AND delivered_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at <= ?3 \
             AND (lease_expires_at IS NULL OR lease_expires_at <= ?3) \
             RETURNING event_id, tenant_id, event_type, payload, attempts, created_at"))
        .bind(owner)
        .bind(now.saturating_add(lease_ms))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        rows.iter()
            .map(|r| {
                Ok(OutboxEvent {
                    event_id: r.try_get("event_id")?,
                    tenant_id: r.try_get("tenant_id")?,
                    event_type: r.try_get("event_type")?,
                    payload: r.try_get("payload")?,
                    attempts: r.try_get("attempts")?,
                    created_at: r.try_get("created_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn event_attempted(
        &self,
        event_id: &str,
        owner: &str,
        delivered: bool,
        error: Option<&str>,
        next_attempt_at: i64,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let r = sqlx::query(q("UPDATE outbox SET attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL, \
             delivered_at = CASE WHEN ? THEN ? ELSE NULL END, last_error = ?, next_attempt_at = ? \
             WHERE event_id = ? AND lease_owner = ? AND delivered_at IS NULL"))
        .bind(delivered)
        .bind(now)
        .bind(error.map(clean))
        .bind(next_attempt_at)
        .bind(event_id)
        .bind(owner)
        .execute(&self.write)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    pub(super) async fn events(
        &self,
        tenant: &str,
    ) -> Result<Vec<(String, String, Option<i64>, i64)>, LedgerError> {
        let rows = sqlx::query(q(&format!("SELECT event_id, event_type, delivered_at, attempts FROM outbox WHERE tenant_id = ? ORDER BY created_at, {ROW_ORDER}")))
        .bind(tenant)
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("event_id")?,
                    r.try_get("event_type")?,
                    r.try_get("delivered_at")?,
                    r.try_get("attempts")?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn event_given_up(
        &self,
        event_id: &str,
        owner: &str,
        error: &str,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let r = sqlx::query(q("UPDATE outbox SET attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL, \
             last_error = ?, dead_lettered_at = ? \
             WHERE event_id = ? AND lease_owner = ? AND delivered_at IS NULL"))
        .bind(clean(error))
        .bind(now)
        .bind(event_id)
        .bind(owner)
        .execute(&self.write)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    pub(super) async fn dead_events(
        &self,
        tenant: &str,
        limit: u32,
    ) -> Result<Vec<crate::ledger::DeadEvent>, LedgerError> {
        let rows = sqlx::query(q("SELECT event_id, event_type, attempts, last_error, created_at, dead_lettered_at FROM outbox \
             WHERE tenant_id = ? AND dead_lettered_at IS NOT NULL ORDER BY dead_lettered_at DESC LIMIT ?"))
        .bind(tenant)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(crate::ledger::DeadEvent {
                    event_id: r.try_get("event_id")?,
                    event_type: r.try_get("event_type")?,
                    attempts: r.try_get("attempts")?,
                    last_error: r.try_get("last_error")?,
                    created_at: r.try_get("created_at")?,
                    dead_lettered_at: r.try_get("dead_lettered_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub(super) async fn sweep_delivered_events(
        &self,
        retention_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        let mut tx = self.write.begin().await?;
        let now = self.now_in(&mut tx).await?;
        let n = sqlx::query(q("DELETE FROM outbox WHERE event_id IN (SELECT event_id FROM outbox \
             WHERE delivered_at IS NOT NULL AND delivered_at <= ? LIMIT ?)"))
        .bind(now.saturating_sub(retention_ms.max(0)))
        .bind(i64::from(batch))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(n)
    }

    pub(super) async fn pending_events(&self) -> Result<i64, LedgerError> {
        let row = sqlx::query(q(
            "SELECT COUNT(*) AS n FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL",
        ))
        .fetch_one(&self.read)
        .await?;
        Ok(row.try_get("n")?)
    }
}
