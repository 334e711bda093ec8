//! The SQLite effect ledger.
//!
//! Writes go through a pool of one connection (SQLite serialises writers;
//! one connection avoids `SQLITE_BUSY` on transaction upgrade), reads
//! through a separate pool. The file runs in WAL mode with
//! `synchronous = FULL`, so a committed transition survives a crash of the
//! process or the machine.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row, SqlitePool};

use super::{Attempt, Clock, LedgerError, Operation, State, Transition};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// The effect ledger on SQLite. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    pub(super) write: SqlitePool,
    pub(super) read: SqlitePool,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) stale_fence_rejections: Arc<AtomicU64>,
}

pub(super) const OP_COLUMNS: &str = "tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
     effect_class, state, version, attempts, lease_owner, lease_expires_at, fence, request_content_type, \
     request_body, principal, response_status, response_headers, response_body, response_body_bytes, \
     response_body_omitted, error_kind, error_detail, created_at, updated_at, expires_at, request_headers, \
     reconcile_attempts, next_reconcile_at, dead_letter, dead_letter_reason, operator_check, provider_reference, \
     requeues, settle_until, retention_ms";

impl Ledger {
    /// Opens (creating if missing) the SQLite file at `path` and applies the
    /// embedded migrations (`migrations/sqlite`).
    ///
    /// `max_read_connections` sizes the read pool; `busy_timeout_ms` is how
    /// long a statement waits for a lock held by another process.
    ///
    /// Errors: the file can't be opened or a migration fails.
    pub async fn open(
        path: &Path,
        max_read_connections: u32,
        busy_timeout_ms: u64,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let storage = crate::config::StorageSpec {
            path: path.to_path_buf(),
            max_read_connections,
            busy_timeout_ms,
            synchronous: crate::config::Synchronous::Full,
        };
        Self::open_storage(&storage, clock).await
    }

    /// [`Ledger::open`] with every `[storage]` setting, including the
    /// `synchronous` mode.
    pub async fn open_storage(
        storage: &crate::config::StorageSpec,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LedgerError> {
        let (path, max_read_connections) = (&storage.path, storage.max_read_connections);
        let synchronous = match storage.synchronous {
            crate::config::Synchronous::Full => SqliteSynchronous::Full,
            crate::config::Synchronous::Normal => SqliteSynchronous::Normal,
        };
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_millis(storage.busy_timeout_ms));
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts.clone())
            .await?;
        MIGRATOR.run(&write).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(max_read_connections)
            .connect_with(opts)
            .await?;
        Ok(Self {
            write,
            read,
            clock,
            stale_fence_rejections: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Applies the embedded migrations only (`effectgate migrate`).
    pub async fn migrate(path: &Path) -> Result<(), LedgerError> {
        Self::open(path, 1, 5_000, Arc::new(super::SystemClock))
            .await
            .map(|_| ())
    }

    /// The clock the ledger stamps rows with.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Writes rejected because they carried a fencing token that was no
    /// longer current, since start.
    pub fn stale_fence_rejections(&self) -> u64 {
        self.stale_fence_rejections.load(Ordering::Relaxed)
    }

    pub(super) fn count_stale_fence(&self) {
        self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
        crate::metrics::stale_fence();
    }

    /// Checks that the database answers (readiness).
    pub async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query("SELECT 1").execute(&self.read).await?;
        Ok(())
    }

    /// Returns the gateway's provider-key secret, creating a random 32-byte
    /// one on first use. Stored in the ledger so provider keys stay the same
    /// across restarts.
    pub async fn provider_key_secret(&self) -> Result<Vec<u8>, LedgerError> {
        let fresh: [u8; 32] = rand::random();
        sqlx::query("INSERT INTO meta (name, value) VALUES ('provider_key_secret', ?) ON CONFLICT (name) DO NOTHING")
            .bind(fresh.as_slice())
            .execute(&self.write)
            .await?;
        let row = sqlx::query("SELECT value FROM meta WHERE name = 'provider_key_secret'")
            .fetch_one(&self.write)
            .await?;
        Ok(row.try_get("value")?)
    }

    /// Reads one operation of `tenant`. Another tenant's operation is `None`.
    pub async fn get(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        let mut conn = self.read.acquire().await?;
        Ok(fetch_op(&mut *conn, tenant, operation_id).await?)
    }

    /// The attempts log of one operation, oldest first.
    pub async fn attempts(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let rows = sqlx::query(
            "SELECT attempt, fence, status, outcome, detail, at FROM attempts \
             WHERE tenant_id = ? AND operation_id = ? ORDER BY attempt",
        )
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

    /// Policy decisions recorded for an operation id, oldest first, as JSON
    /// objects (policy, content_hash, decision, reason, duration_us,
    /// fingerprint, at).
    pub async fn decisions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<serde_json::Value>, LedgerError> {
        let rows = sqlx::query(
            "SELECT policy, content_hash, decision, reason, duration_us, fingerprint, at FROM policy_decisions \
             WHERE tenant_id = ? AND operation_id = ? ORDER BY seq",
        )
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

    /// The transition history of one operation, oldest first.
    pub async fn transitions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Transition>, LedgerError> {
        let rows = sqlx::query(
            "SELECT seq, from_state, to_state, version, fence, actor, reason, at FROM transitions \
             WHERE tenant_id = ? AND operation_id = ? ORDER BY seq",
        )
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

    /// Operations the reconciler should look at now, oldest change first, at
    /// most `limit`: UNKNOWN ones that are due (a NULL `next_reconcile_at`
    /// means "operator only": the route has no read-back) and not leased, EXECUTING
    /// ones whose lease expired, and RESERVED ones untouched for
    /// `reserved_grace_ms`.
    pub async fn due_for_reconciliation(
        &self,
        reserved_grace_ms: i64,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let now = self.clock.now_ms();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE \
             (state = 'UNKNOWN' AND next_reconcile_at IS NOT NULL AND next_reconcile_at <= ?1 \
                 AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)) \
             OR (state = 'EXECUTING' AND lease_expires_at <= ?1) \
             OR (state = 'RESERVED' AND updated_at <= ?2) \
             ORDER BY updated_at LIMIT ?3"
        )))
        .bind(now)
        .bind(now.saturating_sub(reserved_grace_ms))
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }

    /// Dead letters of `tenant`, oldest first, at most `limit`.
    pub async fn dead_letters(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE dead_letter = 1 AND (?1 IS NULL OR tenant_id = ?1) \
             ORDER BY updated_at LIMIT ?2"
        )))
        .bind(tenant)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(op_from_row)
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }

    /// Per-tenant counts: (tenant, UNKNOWN operations, dead letters, oldest
    /// dead letter's last change in ms since epoch).
    pub async fn tenant_counts(&self) -> Result<Vec<(String, i64, i64, Option<i64>)>, LedgerError> {
        let rows = sqlx::query(
            "SELECT tenant_id, SUM(state = 'UNKNOWN') AS unknown, SUM(dead_letter = 1) AS dead, \
             MIN(CASE WHEN dead_letter = 1 THEN updated_at END) AS oldest \
             FROM operations WHERE state = 'UNKNOWN' OR dead_letter = 1 GROUP BY tenant_id",
        )
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

    /// Lists operations, newest change first, optionally filtered by tenant
    /// and state, at most `limit` rows.
    pub async fn list(
        &self,
        tenant: Option<&str>,
        state: Option<State>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE (?1 IS NULL OR tenant_id = ?1) AND (?2 IS NULL OR state = ?2) \
             ORDER BY updated_at DESC, operation_id LIMIT ?3"
        )))
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
    E: sqlx::Executor<'e, Database = sqlx::Sqlite>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {OP_COLUMNS} FROM operations WHERE tenant_id = ? AND operation_id = ?"
    )))
    .bind(tenant)
    .bind(operation_id)
    .fetch_optional(ex)
    .await?;
    row.as_ref().map(op_from_row).transpose()
}

pub(super) fn op_from_row(r: &SqliteRow) -> Result<Operation, sqlx::Error> {
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
