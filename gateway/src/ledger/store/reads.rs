//! Reads of the effect ledger, the reconciler's scan and the retention
//! sweep.

use super::super::dialect::{Conn, Dialect, LedgerRow, sql};
use super::super::{
    Attempt, LedgerError, Operation, State, TenantCounts, Transition, UnknownState,
};
use super::{Store, TERMINAL};
use crate::ledger::postgres::PgDialect;

/// The columns [`op_from_row`] reads.
pub(super) const OP_COLUMNS: &str = "tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
     effect_class, state, version, attempts, lease_owner, lease_expires_at, fence, request_content_type, \
     request_body, principal, response_status, response_headers, response_body, response_body_bytes, \
     response_body_omitted, error_kind, error_detail, created_at, updated_at, expires_at, request_headers, \
     reconcile_attempts, next_reconcile_at, dead_letter, dead_letter_reason, operator_check, provider_reference, \
     requeues, settle_until, retention_ms, trace_context";

/// The condition of the partial index `operations_terminal_by_change`,
/// word for word as SQLite's migrations (0014, and 0015 that rebuilds the
/// table) spell it: a query names it
/// so for the index to be usable at all (neither planner proves a bound
/// `state IN (?, ?, ?)` implies it). The states are compared one by one,
/// joined by OR: SQLite evaluates an IN list of more than two values
/// through a temporary b-tree, and it checks the index's condition on
/// every write of a row. PostgreSQL's index (its migration 0001) says
/// `state IN (...)`, which its planner proves this condition implies.
/// Built from [`State::as_str`].
pub(super) fn terminal_rows() -> &'static str {
    static TEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let states: Vec<String> = TERMINAL
            .iter()
            .map(|s| format!("state = '{}'", s.as_str()))
            .collect();
        format!("({}) AND NOT dead_letter", states.join(" OR "))
    });
    &TEXT
}

/// The retention sweep's scan: marks (`scan_owner = ?1`) up to `?4`
/// terminal operations, not dead letters, that changed last at or before
/// `?2` (now less the shortest retention, ms since epoch) and whose own
/// retention ended by `?3` (now), oldest first, reading only the partial
/// index of such rows ([`Dialect::TERMINAL_BY_CHANGE`]).
pub(super) fn sweep_mark<D: Dialect>() -> String {
    format!(
        "UPDATE operations SET scan_owner = ? WHERE (tenant_id, operation_id) IN ( \
         SELECT tenant_id, operation_id FROM operations{} \
         WHERE {} AND updated_at <= ? AND updated_at + retention_ms <= ? \
         ORDER BY updated_at LIMIT ?{})",
        D::TERMINAL_BY_CHANGE,
        terminal_rows(),
        D::SKIP_LOCKED
    )
}

/// The reconciler's scan: marks (`scan_owner = ?4`, until `?5`, ms
/// since epoch) up to `?3` operations still in flight whose turn has
/// come at `?1` (now): UNKNOWN ones due for read-back, EXECUTING ones
/// whose lease lapsed, RESERVED ones unchanged since `?2` (now less the
/// grace for a reservation), oldest change first. The states are in the
/// text, not bound, so that PostgreSQL's planner can prove the scan reads
/// only rows of its partial index `operations_unsettled` (migration 0008),
/// whatever the plan: through `operations_by_state`, a bitmap scan visited
/// every dead index entry a completed operation leaves behind until a
/// vacuum. SQLite keeps no dead versions and reads `operations_by_state`.
pub(super) fn due_scan<D: Dialect>() -> String {
    format!(
        "UPDATE operations SET scan_owner = ?4, scan_expires_at = ?5 \
         WHERE (tenant_id, operation_id) IN (SELECT tenant_id, operation_id FROM operations WHERE \
         ((state = '{}' AND next_reconcile_at IS NOT NULL AND next_reconcile_at <= ?1 \
             AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)) \
         OR (state = '{}' AND lease_expires_at <= ?1) \
         OR (state = '{}' AND updated_at <= ?2)) \
         AND (scan_expires_at IS NULL OR scan_expires_at <= ?1) \
         ORDER BY updated_at LIMIT ?3{}) \
         RETURNING {OP_COLUMNS}",
        State::Unknown.as_str(),
        State::Executing.as_str(),
        State::Reserved.as_str(),
        D::SKIP_LOCKED
    )
}

/// The retention sweep's first statement: deletes up to `?2` decisions of
/// calls refused before reservation (`unreserved`, read through the
/// partial index `policy_decisions_unreserved`) recorded at or before `?1`
/// (ms since epoch) whose key names no operation.
pub(super) const SWEEP_UNRESERVED_DECISIONS: &str = "DELETE FROM policy_decisions WHERE seq IN (\
     SELECT d.seq FROM policy_decisions d WHERE d.unreserved AND d.at <= ? \
     AND NOT EXISTS (SELECT 1 FROM operations o \
     WHERE o.tenant_id = d.tenant_id AND o.operation_id = d.operation_id) LIMIT ?)";

/// UNKNOWN operations per tenant (`?`: UNKNOWN), with the oldest last
/// change: read from `operations_by_state` alone.
pub(super) const COUNT_UNKNOWN: &str = "SELECT tenant_id, COUNT(*) AS n, MIN(updated_at) AS oldest \
     FROM operations WHERE state = ? GROUP BY tenant_id";

/// Dead letters per tenant, with the oldest last change: read from the
/// partial index `operations_dead_letters` alone.
pub(super) const COUNT_DEAD_LETTERS: &str = "SELECT tenant_id, COUNT(*) AS n, MIN(updated_at) AS oldest \
     FROM operations WHERE dead_letter GROUP BY tenant_id";

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::ping`].
    pub(crate) async fn ping(&self) -> Result<(), LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        sql::<D>("SELECT 1").execute(&mut conn).await?;
        Ok(())
    }

    /// See [`crate::ledger::Ledger::provider_key_secret`].
    pub(crate) async fn provider_key_secret(&self) -> Result<Vec<u8>, LedgerError> {
        let fresh: [u8; 32] = rand::random();
        let mut conn = self.writer.begin(0).await?;
        sql::<D>("INSERT INTO meta (name, value) VALUES ('provider_key_secret', ?) ON CONFLICT (name) DO NOTHING")
            .bind(fresh.as_slice())
            .execute(&mut conn)
            .await?;
        let row = sql::<D>("SELECT value FROM meta WHERE name = 'provider_key_secret'")
            .fetch_one(&mut conn)
            .await?;
        conn.commit().await?;
        Ok(row.get("value")?)
    }

    /// See [`crate::ledger::Ledger::get`].
    pub(crate) async fn get(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        let mut conn = D::acquire_point(&self.point).await?;
        Ok(fetch_op::<D>(&mut conn, tenant, operation_id).await?)
    }

    /// The version and last change (ms since epoch) of an operation, if it
    /// exists (the replay cache's check).
    pub(crate) async fn version_of(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<(i64, i64)>, LedgerError> {
        let mut conn = D::acquire_point(&self.point).await?;
        let row = sql::<D>(
            "SELECT version, updated_at FROM operations WHERE tenant_id = ? AND operation_id = ?",
        )
        .bind(tenant)
        .bind(operation_id)
        .fetch_optional(&mut conn)
        .await?;
        row.map(|r| Ok((r.get("version")?, r.get("updated_at")?)))
            .transpose()
            .map_err(|e: sqlx::Error| e.into())
    }

    /// See [`crate::ledger::Ledger::attempts`].
    pub(crate) async fn attempts(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT attempt, fence, status, outcome, detail, at, request_id FROM attempts \
             WHERE {} ORDER BY attempt",
            D::HISTORY_OF
        ))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Attempt {
                    attempt: r.get("attempt")?,
                    fence: r.get("fence")?,
                    status: r.get("status")?,
                    outcome: r.get("outcome")?,
                    detail: r.get("detail")?,
                    request_id: r.get("request_id")?,
                    at: r.get("at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::decisions`].
    pub(crate) async fn decisions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<serde_json::Value>, LedgerError> {
        // Only this operation's: a refusal recorded under the same key
        // before the operation existed (a denied call, an earlier
        // operation's) is not part of its history.
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>("SELECT policy, content_hash, decision, reason, duration_us, fingerprint, at FROM policy_decisions d \
             WHERE d.tenant_id = ? AND d.operation_id = ? \
             AND d.at >= COALESCE((SELECT o.created_at FROM operations o \
                 WHERE o.tenant_id = d.tenant_id AND o.operation_id = d.operation_id), 0) \
             ORDER BY d.seq")
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(serde_json::json!({
                    "policy": r.get::<String>("policy")?,
                    "content_hash": r.get::<String>("content_hash")?,
                    "decision": r.get::<String>("decision")?,
                    "reason": r.get::<Option<String>>("reason")?,
                    "duration_us": r.get::<i64>("duration_us")?,
                    "fingerprint": r.get::<String>("fingerprint")?,
                    "at": r.get::<i64>("at")?,
                }))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::transitions`].
    pub(crate) async fn transitions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Transition>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT seq, from_state, to_state, version, fence, actor, reason, at FROM transitions \
             WHERE {} ORDER BY seq",
            D::HISTORY_OF
        ))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                let from: Option<String> = r.get("from_state")?;
                let to: String = r.get("to_state")?;
                Ok(Transition {
                    seq: r.get("seq")?,
                    from_state: from.and_then(|s| s.parse().ok()),
                    to_state: parse_state(&to)?,
                    version: r.get("version")?,
                    fence: r.get("fence")?,
                    actor: r.get("actor")?,
                    reason: r.get("reason")?,
                    at: r.get("at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::due_for_reconciliation`].
    pub(crate) async fn due_for_reconciliation(
        &self,
        owner: &str,
        reserved_grace_ms: i64,
        scan_ms: i64,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let rows = sql::<D>(&due_scan::<D>())
            .bind(now)
            .bind(now.saturating_sub(reserved_grace_ms))
            .bind(i64::from(limit))
            .bind(owner)
            .bind(now.saturating_add(scan_ms.max(0)))
            .fetch_all(&mut tx)
            .await?;
        tx.commit().await?;
        let mut ops = rows
            .iter()
            .map(op_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        ops.sort_by_key(|o| o.updated_at);
        Ok(ops)
    }

    /// See [`crate::ledger::Ledger::release_scan`].
    pub(crate) async fn release_scan(&self, owner: &str) -> Result<u64, LedgerError> {
        let mut conn = self.writer.begin(0).await?;
        let n = sql::<D>(
            "UPDATE operations SET scan_owner = NULL, scan_expires_at = NULL WHERE scan_owner = ?",
        )
        .bind(owner)
        .execute(&mut conn)
        .await?;
        conn.commit().await?;
        Ok(n)
    }

    /// See [`crate::ledger::Ledger::sweep_expired`].
    pub(crate) async fn sweep_expired(
        &self,
        batch: u32,
        min_retention_ms: i64,
    ) -> Result<u64, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        // Decisions recorded for calls refused before reservation have no
        // operation; they go after the shortest key retention.
        sql::<D>(SWEEP_UNRESERVED_DECISIONS)
            .bind(now.saturating_sub(min_retention_ms.max(0)))
            .bind(i64::from(batch))
            .execute(&mut tx)
            .await?;
        // Mark the batch (rows another sweeper or a reservation holds are
        // skipped), delete the marked rows' history, then the rows (on
        // SQLite their transitions and attempts go with them): a fixed
        // number of statements per batch, in one transaction, whatever its
        // size.
        let token = format!("sweep:{}", hex::encode(rand::random::<[u8; 8]>()));
        let marked = sql::<D>(&sweep_mark::<D>())
            .bind(&token)
            .bind(now.saturating_sub(min_retention_ms.max(0)))
            .bind(now)
            .bind(i64::from(batch))
            .execute(&mut tx)
            .await?;
        if marked == 0 {
            tx.commit().await?;
            return Ok(0);
        }
        // Expired COMPLETED and FAILED rows are deleted.
        tx.changes_terminal();
        let history: &[&str] = if D::HISTORY_DELETED_WITH_ROW {
            &[]
        } else {
            &["transitions", "attempts"]
        };
        for table in history
            .iter()
            .chain(&["policy_decisions", "approvals", "compensations"])
        {
            sql::<D>(&format!(
                "DELETE FROM {table} WHERE (tenant_id, operation_id) IN \
                 (SELECT tenant_id, operation_id FROM operations WHERE scan_owner = ?)"
            ))
            .bind(&token)
            .execute(&mut tx)
            .await?;
        }
        let deleted = sql::<D>("DELETE FROM operations WHERE scan_owner = ?")
            .bind(&token)
            .execute(&mut tx)
            .await?;
        tx.commit().await?;
        Ok(deleted)
    }

    /// See [`crate::ledger::Ledger::dead_letters`].
    pub(crate) async fn dead_letters(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!("SELECT {OP_COLUMNS} FROM operations WHERE dead_letter AND (?1 IS NULL OR tenant_id = ?1) \
             ORDER BY updated_at LIMIT ?2"))
        .bind(tenant)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::tenant_counts`]. Two reads, each of
    /// an index that holds just the rows it counts (UNKNOWN ones in
    /// `operations_by_state`, dead letters in the partial
    /// `operations_dead_letters`), not a pass over every operation.
    pub(crate) async fn tenant_counts(&self) -> Result<Vec<TenantCounts>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let unknown = sql::<D>(COUNT_UNKNOWN)
            .bind(State::Unknown)
            .fetch_all(&mut conn)
            .await?;
        let dead = sql::<D>(COUNT_DEAD_LETTERS).fetch_all(&mut conn).await?;
        let mut by_tenant = std::collections::BTreeMap::<String, TenantCounts>::new();
        for (rows, is_dead) in [(unknown, false), (dead, true)] {
            for r in &rows {
                let tenant: String = r.get("tenant_id")?;
                let (n, oldest): (i64, Option<i64>) = (r.get("n")?, r.get("oldest")?);
                let c = by_tenant
                    .entry(tenant.clone())
                    .or_insert_with(|| TenantCounts {
                        tenant,
                        unknown: 0,
                        dead_letters: 0,
                        oldest_dead_letter_at: None,
                        oldest_unknown_at: None,
                    });
                if is_dead {
                    (c.dead_letters, c.oldest_dead_letter_at) = (n, oldest);
                } else {
                    (c.unknown, c.oldest_unknown_at) = (n, oldest);
                }
            }
        }
        Ok(by_tenant.into_values().collect())
    }

    /// See [`crate::ledger::Ledger::stored_bytes`].
    pub(crate) async fn stored_bytes(&self, tenant: &str) -> Result<i64, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let row = sql::<D>(
            "SELECT COALESCE(SUM(LENGTH(request_body) + COALESCE(LENGTH(response_body), 0)), 0) AS n \
             FROM operations WHERE tenant_id = ?",
        )
        .bind(tenant)
        .fetch_one(&mut conn)
        .await?;
        Ok(row.get("n")?)
    }

    /// See [`crate::ledger::Ledger::list`].
    pub(crate) async fn list(
        &self,
        tenant: Option<&str>,
        state: Option<State>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!("SELECT {OP_COLUMNS} FROM operations WHERE (?1 IS NULL OR tenant_id = ?1) AND (?2 IS NULL OR state = ?2) \
             ORDER BY updated_at DESC, operation_id LIMIT ?3"))
        .bind(tenant)
        .bind(state)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }
}

/// One operation, on `conn`.
pub(super) async fn fetch_op<D: Dialect>(
    conn: &mut Conn<D>,
    tenant: &str,
    operation_id: &str,
) -> Result<Option<Operation>, sqlx::Error> {
    let row = sql::<D>(&format!(
        "SELECT {OP_COLUMNS} FROM operations WHERE tenant_id = ? AND operation_id = ?"
    ))
    .bind(tenant)
    .bind(operation_id)
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(op_from_row).transpose()
}

/// A stored state name as a [`State`] (a decode error if unknown).
fn parse_state(name: &str) -> Result<State, sqlx::Error> {
    name.parse()
        .map_err(|e: UnknownState| sqlx::Error::Decode(e.into()))
}

/// An operation from a row of [`OP_COLUMNS`].
pub(super) fn op_from_row<R: LedgerRow>(r: &R) -> Result<Operation, sqlx::Error> {
    let headers: Option<String> = r.get("response_headers")?;
    Ok(Operation {
        tenant_id: r.get("tenant_id")?,
        operation_id: r.get("operation_id")?,
        route: r.get("route")?,
        method: r.get("method")?,
        path: r.get("path")?,
        query: r.get("query")?,
        fingerprint: r.get("fingerprint")?,
        provider_key: r.get("provider_key")?,
        effect_class: r.get("effect_class")?,
        state: parse_state(&r.get::<String>("state")?)?,
        version: r.get("version")?,
        attempts: r.get("attempts")?,
        lease_owner: r.get("lease_owner")?,
        lease_expires_at: r.get("lease_expires_at")?,
        fence: r.get("fence")?,
        request_content_type: r.get("request_content_type")?,
        request_body: r.get("request_body")?,
        principal: r.get("principal")?,
        response_status: r.get("response_status")?,
        response_headers: headers
            .and_then(|h| serde_json::from_str(&h).ok())
            .unwrap_or_default(),
        response_body: r.get("response_body")?,
        response_body_bytes: r.get("response_body_bytes")?,
        response_body_omitted: r.get("response_body_omitted")?,
        error_kind: r.get("error_kind")?,
        error_detail: r.get("error_detail")?,
        created_at: r.get("created_at")?,
        updated_at: r.get("updated_at")?,
        // Retention runs from the last change of a terminal operation.
        expires_at: r
            .get::<i64>("updated_at")?
            .saturating_add(r.get::<i64>("retention_ms")?),
        request_headers: serde_json::from_str(&r.get::<String>("request_headers")?)
            .unwrap_or_default(),
        trace_context: r.get("trace_context")?,
        reconcile_attempts: r.get("reconcile_attempts")?,
        next_reconcile_at: r.get("next_reconcile_at")?,
        dead_letter: r.get("dead_letter")?,
        dead_letter_reason: r.get("dead_letter_reason")?,
        operator_check: r.get("operator_check")?,
        provider_reference: r.get("provider_reference")?,
        requeues: r.get("requeues")?,
        settle_until: r.get("settle_until")?,
    })
}

/// Rows changed in a never-analyzed table past which the gateway gives it
/// its first statistics ([`Store::first_statistics`]).
pub(in crate::ledger) const FIRST_STATISTICS_AFTER_ROWS: i64 = 1_000;

/// The tables whose lookups by key a plan without statistics gets wrong.
const ANALYZED: &str = "'operations', 'transitions', 'attempts'";

impl Store<PgDialect> {
    /// Gives each of the ledger's busiest tables its first statistics
    /// (`ANALYZE (SKIP_LOCKED)`) once it has [`FIRST_STATISTICS_AFTER_ROWS`]
    /// changed rows and was never analyzed, by hand or by autovacuum.
    /// Without statistics PostgreSQL prices every index of a small table
    /// alike, and a prepared compare-and-swap (`WHERE tenant_id = $ AND
    /// operation_id = $ AND state = $`) was seen to run a cached generic
    /// plan that reads `operations_by_state` (every row of the state,
    /// dead versions included) instead of the primary key: throughput fell
    /// by half within a minute of a fresh ledger, until autovacuum's first
    /// analyze (its naptime is a minute). Analyzing invalidates the cached
    /// plans. Later statistics are autovacuum's. Only tables the
    /// gateway's role may analyze (it owns them, or a role that does) are
    /// tried; one that fails (a statement timeout on a large table whose
    /// statistics were reset) is reported and the others are still tried.
    /// Returns the tables that have statistics now.
    ///
    /// Errors: the database's.
    pub(in crate::ledger) async fn first_statistics(&self) -> Result<Vec<String>, LedgerError> {
        let mut conn = PgDialect::acquire(&self.read).await?;
        let due: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT s.relname::text FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
             WHERE s.schemaname = current_schema() AND s.relname IN ({ANALYZED}) \
             AND s.last_analyze IS NULL AND s.last_autoanalyze IS NULL AND s.n_mod_since_analyze >= $1 \
             AND pg_has_role(c.relowner, 'USAGE') ORDER BY s.relname"
        )))
        .bind(FIRST_STATISTICS_AFTER_ROWS)
        .fetch_all(&mut *conn)
        .await?;
        if due.is_empty() {
            return Ok(due);
        }
        for table in &due {
            // The names come from the list above, not from the database.
            let Some(table) = ["attempts", "operations", "transitions"]
                .into_iter()
                .find(|t| t == table)
            else {
                continue;
            };
            if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(format!(
                "ANALYZE (SKIP_LOCKED) {table}"
            )))
            .execute(&mut *conn)
            .await
            {
                tracing::warn!(table, error = %e, "a ledger table's first statistics failed");
            }
        }
        // Skipped ones (another instance or autovacuum held the table) are
        // tried again next time.
        let analyzed: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT relname::text FROM pg_stat_user_tables \
             WHERE schemaname = current_schema() AND relname IN ({ANALYZED}) \
             AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL) ORDER BY relname"
        )))
        .fetch_all(&mut *conn)
        .await?;
        Ok(due.into_iter().filter(|t| analyzed.contains(t)).collect())
    }
}
