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

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

use super::{Attempt, Claim, Clock, LedgerError, NewOperation, Operation, Outcome, Reservation, State, Transition};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// The effect ledger on SQLite. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    write: SqlitePool,
    read: SqlitePool,
    clock: Arc<dyn Clock>,
    stale_fence_rejections: Arc<AtomicU64>,
}

const OP_COLUMNS: &str = "tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
     effect_class, state, version, attempts, lease_owner, lease_expires_at, fence, request_content_type, \
     request_body, principal, response_status, response_headers, response_body, response_body_bytes, \
     response_body_omitted, error_kind, error_detail, created_at, updated_at, expires_at";

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
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_millis(busy_timeout_ms));
        let write = SqlitePoolOptions::new().max_connections(1).connect_with(opts.clone()).await?;
        MIGRATOR.run(&write).await?;
        let read = SqlitePoolOptions::new().max_connections(max_read_connections).connect_with(opts).await?;
        Ok(Self { write, read, clock, stale_fence_rejections: Arc::new(AtomicU64::new(0)) })
    }

    /// Applies the embedded migrations only (`effectgate migrate`).
    pub async fn migrate(path: &Path) -> Result<(), LedgerError> {
        Self::open(path, 1, 5_000, Arc::new(super::SystemClock)).await.map(|_| ())
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
        let row = sqlx::query("SELECT value FROM meta WHERE name = 'provider_key_secret'").fetch_one(&self.write).await?;
        Ok(row.try_get("value")?)
    }

    /// Reserves an operation: `INSERT … ON CONFLICT DO NOTHING`, plus the
    /// first transition (`∅ → RESERVED`). If the key exists, returns the
    /// existing row unchanged. A terminal operation past its key retention
    /// is deleted first, so its key starts fresh (draft §2.3).
    pub async fn reserve(&self, new: &NewOperation) -> Result<Reservation, LedgerError> {
        let now = self.clock.now_ms();
        let mut tx = self.write.begin().await?;
        let expired = sqlx::query(
            "DELETE FROM operations WHERE tenant_id = ? AND operation_id = ? AND expires_at <= ? \
             AND state IN ('COMPLETED', 'FAILED', 'COMPENSATED')",
        )
        .bind(&new.tenant_id)
        .bind(&new.operation_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if expired.rows_affected() > 0 {
            for sql in [
                "DELETE FROM transitions WHERE tenant_id = ? AND operation_id = ?",
                "DELETE FROM attempts WHERE tenant_id = ? AND operation_id = ?",
            ] {
                sqlx::query(sql).bind(&new.tenant_id).bind(&new.operation_id).execute(&mut *tx).await?;
            }
        }
        let inserted = sqlx::query(
            "INSERT INTO operations (tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, \
             effect_class, state, version, attempts, fence, request_content_type, request_body, principal, \
             created_at, updated_at, expires_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'RESERVED', 1, 0, 0, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (tenant_id, operation_id) DO NOTHING",
        )
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
        .execute(&mut *tx)
        .await?;
        let created = inserted.rows_affected() == 1;
        if created {
            insert_transition(&mut tx, &new.tenant_id, &new.operation_id, None, State::Reserved, 1, 0, &new.principal, "reserved", now)
                .await?;
        }
        let op = fetch_op(&mut *tx, &new.tenant_id, &new.operation_id).await?.ok_or(sqlx::Error::RowNotFound)?;
        tx.commit().await?;
        Ok(if created { Reservation::Created(op) } else { Reservation::Existing(op) })
    }

    /// Claims the lease on an operation and moves it `from → EXECUTING`, if
    /// its row is still at `expected_version` in state `from`. Allowed
    /// `from` states: RESERVED, AWAITING_APPROVAL (after approval), UNKNOWN
    /// (after an absent read-back) and EXECUTING whose lease has expired.
    /// The fencing token and the attempt count are incremented.
    ///
    /// Returns `None` when the compare-and-swap lost: someone else changed
    /// the row first, or the lease is still live.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] for any other `from`.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim(
        &self,
        tenant: &str,
        operation_id: &str,
        from: State,
        expected_version: i64,
        owner: &str,
        lease_ms: i64,
        reason: &str,
    ) -> Result<Option<Claim>, LedgerError> {
        if !from.can_transition_to(State::Executing) {
            return Err(LedgerError::IllegalTransition { from, to: State::Executing });
        }
        let now = self.clock.now_ms();
        let expires = now.saturating_add(lease_ms.max(0));
        let mut tx = self.write.begin().await?;
        let row = sqlx::query(
            "UPDATE operations SET state = 'EXECUTING', version = version + 1, fence = fence + 1, \
             attempts = attempts + 1, lease_owner = ?, lease_expires_at = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND version = ? AND state = ? \
             AND (state <> 'EXECUTING' OR lease_expires_at IS NULL OR lease_expires_at <= ?) \
             RETURNING version, fence, attempts",
        )
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
        let claim = Claim {
            version: row.try_get("version")?,
            fence: row.try_get("fence")?,
            attempt: row.try_get("attempts")?,
            lease_expires_at: expires,
        };
        insert_transition(&mut tx, tenant, operation_id, Some(from), State::Executing, claim.version, claim.fence, owner, reason, now)
            .await?;
        tx.commit().await?;
        Ok(Some(claim))
    }

    /// Records the outcome of an attempt under fencing token `fence`:
    /// `UPDATE … WHERE fence = ? AND state = 'EXECUTING'`. The lease is
    /// released.
    ///
    /// Returns `false` (and counts a stale-fence rejection) when the token
    /// is no longer current: a newer claim owns the operation, and this
    /// write must not land.
    ///
    /// Errors: [`LedgerError::IllegalTransition`] unless `outcome.state` is
    /// COMPLETED, FAILED or UNKNOWN.
    pub async fn record_outcome(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        actor: &str,
        outcome: &Outcome,
    ) -> Result<bool, LedgerError> {
        if !State::Executing.can_transition_to(outcome.state) || outcome.state == State::Executing {
            return Err(LedgerError::IllegalTransition { from: State::Executing, to: outcome.state });
        }
        let now = self.clock.now_ms();
        let headers = serde_json::to_string(&outcome.response_headers).unwrap_or_else(|_| "[]".into());
        let mut tx = self.write.begin().await?;
        let row = sqlx::query(
            "UPDATE operations SET state = ?, version = version + 1, lease_owner = NULL, lease_expires_at = NULL, \
             response_status = ?, response_headers = ?, response_body = ?, response_body_bytes = ?, \
             response_body_omitted = ?, error_kind = ?, error_detail = ?, updated_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'EXECUTING' \
             RETURNING version, attempts",
        )
        .bind(outcome.state.as_str())
        .bind(outcome.response_status.map(i64::from))
        .bind(headers)
        .bind(&outcome.response_body)
        .bind(outcome.response_body_bytes)
        .bind(outcome.response_body_omitted)
        .bind(&outcome.error_kind)
        .bind(&outcome.error_detail)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(tenant, operation_id, fence, "write rejected: fencing token is not current");
            return Ok(false);
        };
        let version: i64 = row.try_get("version")?;
        let attempt: i64 = row.try_get("attempts")?;
        insert_attempt(
            &mut tx,
            tenant,
            operation_id,
            attempt,
            fence,
            outcome.response_status.map(i64::from),
            &outcome.attempt_outcome,
            outcome.error_detail.as_deref(),
            now,
        )
        .await?;
        insert_transition(
            &mut tx,
            tenant,
            operation_id,
            Some(State::Executing),
            outcome.state,
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

    /// Logs a failed attempt that will be retried, under `fence`, and starts
    /// the next one: bumps `attempts`, records the error, and extends the
    /// lease to now + `lease_ms`. Returns `false` (counted) if the token is
    /// no longer current; the caller must then stop.
    #[allow(clippy::too_many_arguments)]
    pub async fn note_retry(
        &self,
        tenant: &str,
        operation_id: &str,
        fence: i64,
        status: Option<u16>,
        outcome: &str,
        detail: &str,
        lease_ms: i64,
    ) -> Result<bool, LedgerError> {
        let now = self.clock.now_ms();
        let mut tx = self.write.begin().await?;
        let row = sqlx::query(
            "UPDATE operations SET attempts = attempts + 1, lease_expires_at = ?, error_kind = ?, error_detail = ?, \
             updated_at = ? WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'EXECUTING' \
             RETURNING attempts",
        )
        .bind(now.saturating_add(lease_ms))
        .bind(outcome)
        .bind(detail)
        .bind(now)
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        };
        let next: i64 = row.try_get("attempts")?;
        insert_attempt(&mut tx, tenant, operation_id, next - 1, fence, status.map(i64::from), outcome, Some(detail), now)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The attempts log of one operation, oldest first.
    pub async fn attempts(&self, tenant: &str, operation_id: &str) -> Result<Vec<Attempt>, LedgerError> {
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

    /// Extends the lease held under `fence` to now + `lease_ms`. Returns
    /// `false` if the token is no longer current.
    pub async fn extend_lease(&self, tenant: &str, operation_id: &str, fence: i64, lease_ms: i64) -> Result<bool, LedgerError> {
        let now = self.clock.now_ms();
        let r = sqlx::query(
            "UPDATE operations SET lease_expires_at = ? \
             WHERE tenant_id = ? AND operation_id = ? AND fence = ? AND state = 'EXECUTING'",
        )
        .bind(now.saturating_add(lease_ms))
        .bind(tenant)
        .bind(operation_id)
        .bind(fence)
        .execute(&self.write)
        .await?;
        if r.rows_affected() == 0 {
            self.stale_fence_rejections.fetch_add(1, Ordering::Relaxed);
        }
        Ok(r.rows_affected() == 1)
    }

    /// Reads one operation of `tenant`. Another tenant's operation is `None`.
    pub async fn get(&self, tenant: &str, operation_id: &str) -> Result<Option<Operation>, LedgerError> {
        let mut conn = self.read.acquire().await?;
        Ok(fetch_op(&mut *conn, tenant, operation_id).await?)
    }

    /// The transition history of one operation, oldest first.
    pub async fn transitions(&self, tenant: &str, operation_id: &str) -> Result<Vec<Transition>, LedgerError> {
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
                    to_state: to.parse().map_err(|e: super::UnknownState| sqlx::Error::Decode(e.into()))?,
                    version: r.try_get("version")?,
                    fence: r.try_get("fence")?,
                    actor: r.try_get("actor")?,
                    reason: r.try_get("reason")?,
                    at: r.try_get("at")?,
                })
            })
            .collect()
    }

    /// Lists operations, newest change first, optionally filtered by tenant
    /// and state, at most `limit` rows.
    pub async fn list(&self, tenant: Option<&str>, state: Option<State>, limit: u32) -> Result<Vec<Operation>, LedgerError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE (?1 IS NULL OR tenant_id = ?1) AND (?2 IS NULL OR state = ?2) \
             ORDER BY updated_at DESC, operation_id LIMIT ?3"
        )))
        .bind(tenant)
        .bind(state.map(State::as_str))
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        rows.iter().map(op_from_row).collect::<Result<_, _>>().map_err(Into::into)
    }
}

#[allow(clippy::too_many_arguments)]
async fn insert_transition(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
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
    sqlx::query(
        "INSERT INTO transitions (tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(tenant)
    .bind(operation_id)
    .bind(from.map(State::as_str))
    .bind(to.as_str())
    .bind(version)
    .bind(fence)
    .bind(actor)
    .bind(reason)
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn insert_attempt(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant: &str,
    operation_id: &str,
    attempt: i64,
    fence: i64,
    status: Option<i64>,
    outcome: &str,
    detail: Option<&str>,
    at: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO attempts (tenant_id, operation_id, attempt, fence, status, outcome, detail, at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
    )
    .bind(tenant)
    .bind(operation_id)
    .bind(attempt)
    .bind(fence)
    .bind(status)
    .bind(outcome)
    .bind(detail)
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn fetch_op<'e, E>(ex: E, tenant: &str, operation_id: &str) -> Result<Option<Operation>, sqlx::Error>
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

fn op_from_row(r: &SqliteRow) -> Result<Operation, sqlx::Error> {
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
        state: state.parse().map_err(|e: super::UnknownState| sqlx::Error::Decode(e.into()))?,
        version: r.try_get("version")?,
        attempts: r.try_get("attempts")?,
        lease_owner: r.try_get("lease_owner")?,
        lease_expires_at: r.try_get("lease_expires_at")?,
        fence: r.try_get("fence")?,
        request_content_type: r.try_get("request_content_type")?,
        request_body: r.try_get("request_body")?,
        principal: r.try_get("principal")?,
        response_status: r.try_get("response_status")?,
        response_headers: headers.and_then(|h| serde_json::from_str(&h).ok()).unwrap_or_default(),
        response_body: r.try_get("response_body")?,
        response_body_bytes: r.try_get("response_body_bytes")?,
        response_body_omitted: r.try_get("response_body_omitted")?,
        error_kind: r.try_get("error_kind")?,
        error_detail: r.try_get("error_detail")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
        expires_at: r.try_get("expires_at")?,
    })
}
