//! Approvals: creation, decisions, their use and expiry. The operation's
//! side of each goes through a command (`NoteApproval`, `RefuseApproval`,
//! `UseApproval`), in the approval's transaction.

use super::super::approval::{Approval, Decision, NewApproval, refused_response};
use super::super::command::{self, NoteApproval, OpRef, RefuseApproval, UseApproval};
use super::super::dialect::{Conn, Dialect, LedgerRow, clean, sql};
use super::super::{Claim, LedgerError, NewOperation, Operation};
use super::Store;
use super::outbox::insert_event;

const APPROVAL_COLUMNS: &str = "id, tenant_id, operation_id, kind, method, route, path, fingerprint, policy, policy_hash, \
     reason, requested_by, status, created_at, expires_at, decided_by, decided_at, comment, used_at, operation_version";

fn approval_from_row<R: LedgerRow>(r: &R) -> Result<Approval, sqlx::Error> {
    Ok(Approval {
        id: r.get("id")?,
        tenant_id: r.get("tenant_id")?,
        operation_id: r.get("operation_id")?,
        kind: r.get("kind")?,
        method: r.get("method")?,
        route: r.get("route")?,
        path: r.get("path")?,
        fingerprint: r.get("fingerprint")?,
        policy: r.get("policy")?,
        policy_hash: r.get("policy_hash")?,
        reason: r.get("reason")?,
        requested_by: r.get("requested_by")?,
        status: r.get("status")?,
        created_at: r.get("created_at")?,
        expires_at: r.get("expires_at")?,
        decided_by: r.get("decided_by")?,
        decided_at: r.get("decided_at")?,
        comment: r.get("comment")?,
        used_at: r.get("used_at")?,
        operation_version: r.get("operation_version")?,
    })
}

/// Inserts a pending approval `a` for `op` at `now`, with its
/// `approval.created` event.
pub(super) async fn insert_approval<D: Dialect>(
    conn: &mut Conn<D>,
    op: &NewOperation,
    a: &NewApproval,
    now: i64,
) -> Result<(), sqlx::Error> {
    sql::<D>(&format!("INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, NULL, NULL, NULL, NULL, NULL)"))
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
    .execute(&mut *conn)
    .await?;
    let payload = serde_json::json!({
        "approval_id": a.id, "operation_id": op.operation_id, "method": op.method, "route": op.route,
        "path": op.path, "fingerprint": op.fingerprint, "policy": a.policy, "policy_hash": a.policy_hash,
        "reason": a.reason, "requested_by": op.principal, "expires_at": now.saturating_add(a.ttl_ms),
    });
    insert_event::<D>(conn, &op.tenant_id, "approval.created", payload, now).await
}

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::approval`].
    pub(crate) async fn approval(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Approval>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let row = sql::<D>(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ? AND id = ?"
        ))
        .bind(tenant)
        .bind(id)
        .fetch_optional(&mut conn)
        .await?;
        Ok(row.as_ref().map(approval_from_row).transpose()?)
    }

    /// See [`crate::ledger::Ledger::approval_for`].
    pub(crate) async fn approval_for(
        &self,
        tenant: &str,
        operation_id: &str,
        kind: &str,
    ) -> Result<Option<Approval>, LedgerError> {
        let mut conn = self.writer.begin(0).await?;
        let row = sql::<D>(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ? AND operation_id = ? AND kind = ? \
             ORDER BY created_at DESC, {} DESC LIMIT 1",
            D::ROW_ORDER
        ))
        .bind(tenant)
        .bind(operation_id)
        .bind(kind)
        .fetch_optional(&mut conn)
        .await?;
        conn.commit().await?;
        Ok(row.as_ref().map(approval_from_row).transpose()?)
    }

    /// See [`crate::ledger::Ledger::approvals`].
    pub(crate) async fn approvals(
        &self,
        tenant: &str,
        status: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Approval>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant_id = ?1 AND (?2 IS NULL OR status = ?2) \
             ORDER BY created_at LIMIT ?3"
        ))
        .bind(tenant)
        .bind(status)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        Ok(rows
            .iter()
            .map(approval_from_row)
            .collect::<Result<_, _>>()?)
    }

    /// See [`crate::ledger::Ledger::create_replay_approval`].
    pub(crate) async fn create_replay_approval(
        &self,
        op: &Operation,
        a: &NewApproval,
        requested_by: &str,
    ) -> Result<(), LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let new = NewOperation {
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
            trace_context: op.trace_context.clone(),
            principal: requested_by.to_owned(),
            retention_ms: 0,
            awaiting_approval: true,
            decisions: Vec::new(),
            approval: None,
        };
        insert_approval::<D>(&mut tx, &new, a, now).await?;
        sql::<D>("UPDATE approvals SET operation_version = ? WHERE id = ?")
            .bind(op.version)
            .bind(&a.id)
            .execute(&mut tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// See [`crate::ledger::Ledger::decide`].
    pub(crate) async fn decide(
        &self,
        tenant: &str,
        id: &str,
        decision: Decision,
        by: &str,
        comment: Option<&str>,
    ) -> Result<Option<Approval>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let status = if decision == Decision::Approve {
            "approved"
        } else {
            "rejected"
        };
        let row = sql::<D>(&format!(
            "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, comment = ? \
             WHERE tenant_id = ? AND id = ? AND status = 'pending' AND expires_at > ? RETURNING {APPROVAL_COLUMNS}"
        ))
        .bind(status)
        .bind(by)
        .bind(now)
        .bind(comment.map(clean))
        .bind(tenant)
        .bind(id)
        .bind(now)
        .fetch_optional(&mut tx)
        .await?;
        let Some(row) = row else {
            tx.unchanged();
            return Ok(None);
        };
        let a = approval_from_row(&row)?;
        let note = comment.map(|c| format!(": {c}")).unwrap_or_default();
        let op = OpRef::new(&a.tenant_id, &a.operation_id);
        if a.kind == "request" {
            if decision == Decision::Reject {
                let body = refused_response(
                    "approval-rejected",
                    &format!("the approval was rejected by {by}{note}"),
                    &a.operation_id,
                    &a.id,
                );
                let reason = format!("approval {} rejected by {by}{note}", a.id);
                let cmd = RefuseApproval {
                    op,
                    fingerprint: &a.fingerprint,
                    actor: by,
                    reason: &reason,
                    body: &body,
                };
                if let Some(applied) = command::apply::<D, _>(&mut tx, &cmd, now).await? {
                    self.report_refused(&mut tx, op, applied.version, &reason, now)
                        .await?;
                }
            } else {
                let reason = format!("approval {} approved by {by}{note}", a.id);
                let cmd = NoteApproval {
                    op,
                    actor: by,
                    reason: &reason,
                };
                command::apply::<D, _>(&mut tx, &cmd, now).await?;
            }
        }
        let payload = serde_json::json!({
            "approval_id": a.id, "operation_id": a.operation_id, "fingerprint": a.fingerprint,
            "status": a.status, "decided_by": by, "comment": comment,
        });
        insert_event::<D>(&mut tx, tenant, &format!("approval.{status}"), payload, now).await?;
        tx.commit().await?;
        Ok(Some(a))
    }

    /// See [`crate::ledger::Ledger::use_approval`].
    pub(crate) async fn use_approval(
        &self,
        approval_id: &str,
        cmd: &UseApproval<'_>,
    ) -> Result<Option<Claim>, LedgerError> {
        let (mut tx, now) = self.begin_for(cmd).await?;
        let used = sql::<D>(
            "UPDATE approvals SET status = 'used', used_at = ? WHERE tenant_id = ? AND id = ? AND operation_id = ? \
             AND fingerprint = ? AND status = 'approved' AND expires_at > ?",
        )
        .bind(now)
        .bind(cmd.op.tenant)
        .bind(approval_id)
        .bind(cmd.op.operation_id)
        .bind(cmd.fingerprint)
        .bind(now)
        .execute(&mut tx)
        .await?;
        if used != 1 {
            tx.unchanged();
            return Ok(None);
        }
        let Some(applied) = command::apply::<D, _>(&mut tx, cmd, now).await? else {
            return Ok(None);
        };
        tx.commit().await?;
        Ok(Some(applied.claim(cmd.lease.expires_at(now))))
    }

    /// See [`crate::ledger::Ledger::use_replay_approval`].
    pub(crate) async fn use_replay_approval(
        &self,
        tenant: &str,
        approval_id: &str,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let mut conn = self.writer.begin(0).await?;
        let n = sql::<D>(
            "UPDATE approvals SET status = 'used', used_at = ? WHERE tenant_id = ? AND id = ? AND kind = 'replay' \
             AND status = 'approved'",
        )
        .bind(now)
        .bind(tenant)
        .bind(approval_id)
        .execute(&mut conn)
        .await?;
        conn.commit().await?;
        Ok(n == 1)
    }

    /// See [`crate::ledger::Ledger::expire_approvals`].
    pub(crate) async fn expire_approvals(&self, limit: u32) -> Result<usize, LedgerError> {
        let now = self.now().await?;
        let rows = {
            let mut conn = D::acquire(&self.read).await?;
            sql::<D>(&format!(
                "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE status IN ('pending', 'approved') AND expires_at <= ? \
                 ORDER BY expires_at LIMIT ?"
            ))
            .bind(now)
            .bind(i64::from(limit))
            .fetch_all(&mut conn)
            .await?
        };
        let mut n = 0;
        for r in rows {
            let a = approval_from_row(&r)?;
            if self.expire_approval(&a, now).await? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Expires one approval at `now`, with its `request` operation and an
    /// event, in one transaction. Returns whether it was still pending or
    /// approved.
    async fn expire_approval(&self, a: &Approval, now: i64) -> Result<bool, LedgerError> {
        let mut tx = self.writer.begin(0).await?;
        // An approval granted but never used expires too: it can't
        // authorise anything after its expiry.
        let done = sql::<D>(
            "UPDATE approvals SET status = 'expired', decided_at = COALESCE(decided_at, ?) \
             WHERE id = ? AND status IN ('pending', 'approved')",
        )
        .bind(now)
        .bind(&a.id)
        .execute(&mut tx)
        .await?;
        let expired = done == 1;
        if expired {
            if a.kind == "request" {
                let body = refused_response(
                    "approval-expired",
                    if a.status == "approved" {
                        "the approval expired before the approved request was sent again"
                    } else {
                        "the approval expired before anyone decided"
                    },
                    &a.operation_id,
                    &a.id,
                );
                let reason = format!("approval {} expired", a.id);
                let op = OpRef::new(&a.tenant_id, &a.operation_id);
                let cmd = RefuseApproval {
                    op,
                    fingerprint: &a.fingerprint,
                    actor: "reconciler",
                    reason: &reason,
                    body: &body,
                };
                if let Some(applied) = command::apply::<D, _>(&mut tx, &cmd, now).await? {
                    self.report_refused(&mut tx, op, applied.version, &reason, now)
                        .await?;
                }
            }
            let payload = serde_json::json!({"approval_id": a.id, "operation_id": a.operation_id, "status": "expired"});
            insert_event::<D>(&mut tx, &a.tenant_id, "approval.expired", payload, now).await?;
        }
        tx.commit().await?;
        Ok(expired)
    }

    /// Queues the operation event of a refused (rejected or expired)
    /// approval's operation, AWAITING_APPROVAL → FAILED at `version`
    /// (`operation.failed`), in the refusal's transaction.
    async fn report_refused(
        &self,
        conn: &mut Conn<D>,
        op: OpRef<'_>,
        version: i64,
        reason: &str,
        now: i64,
    ) -> Result<(), sqlx::Error> {
        let reported = super::events::Reported {
            op,
            from: Some(super::super::State::AwaitingApproval),
            to: super::super::State::Failed,
            version,
            dead_letter: false,
            reason,
            provider_reference: None,
        };
        let subs = self.subscriptions.load_full();
        super::events::report::<D>(conn, &subs, &reported, now).await
    }
}
