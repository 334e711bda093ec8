//! The outbox: events written with the ledger changes they announce, and
//! their delivery.

use super::super::LedgerError;
use super::super::approval::{DeadEvent, OutboxEvent};
use super::super::dialect::{Conn, Dialect, LedgerRow, clean, sql};
use super::Store;

/// Queues an event of `event_type` for `tenant` at `now`, on `conn`
/// (inside the transaction of the change it announces).
pub(super) async fn insert_event<D: Dialect>(
    conn: &mut Conn<D>,
    tenant: &str,
    event_type: &str,
    payload: serde_json::Value,
    now: i64,
) -> Result<(), sqlx::Error> {
    let event_id = format!("evt_{}", hex::encode(rand::random::<[u8; 12]>()));
    insert_event_as::<D>(conn, &event_id, tenant, event_type, payload, now, None).await?;
    Ok(())
}

/// [`insert_event`] under a given `event_id` (stable: derived from what
/// it announces) and `ordering_key`: the events of one ordering key are
/// delivered one after another, in the order they were written. Returns
/// whether it was written (an event id already queued is not written
/// again).
pub(super) async fn insert_event_as<D: Dialect>(
    conn: &mut Conn<D>,
    event_id: &str,
    tenant: &str,
    event_type: &str,
    payload: serde_json::Value,
    now: i64,
    ordering_key: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let body = serde_json::json!({
        "event_id": event_id,
        "type": event_type,
        "tenant": tenant,
        "created_at": now,
        "data": payload,
    });
    let n = sql::<D>("INSERT INTO outbox (event_id, tenant_id, event_type, payload, created_at, next_attempt_at, ordering_key) \
         VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING")
        .bind(event_id)
        .bind(tenant)
        .bind(event_type)
        .bind(body.to_string())
        .bind(now)
        .bind(now)
        .bind(ordering_key)
        .execute(conn)
        .await?;
    Ok(n == 1)
}

fn event_from_row<R: LedgerRow>(r: &R) -> Result<OutboxEvent, sqlx::Error> {
    Ok(OutboxEvent {
        event_id: r.get("event_id")?,
        tenant_id: r.get("tenant_id")?,
        event_type: r.get("event_type")?,
        payload: r.get("payload")?,
        attempts: r.get("attempts")?,
        created_at: r.get("created_at")?,
    })
}

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::claim_events`].
    pub(crate) async fn claim_events(
        &self,
        owner: &str,
        lease_ms: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        // Fair by tenant: every tenant's oldest due event before any
        // tenant's second, so one tenant's backlog (a receiver that is
        // down) never delays another's past one round. A window function
        // can't take row locks, so the candidates are picked unlocked and
        // the UPDATE checks the claim condition again on each row it locks:
        // two relays never claim one event. An event with an ordering
        // key waits while an earlier one of its key is undelivered (and
        // not dead-lettered), so they reach the receiver in order.
        let rows = sql::<D>(&format!("UPDATE outbox SET lease_owner = ?1, lease_expires_at = ?2 WHERE event_id IN ( \
               SELECT event_id FROM ( \
                 SELECT event_id, created_at, \
                   ROW_NUMBER() OVER (PARTITION BY tenant_id ORDER BY created_at) AS rank_in_tenant \
                 FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at <= ?3 \
                 AND (lease_expires_at IS NULL OR lease_expires_at <= ?3) \
                 AND (ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM outbox earlier \
                   WHERE earlier.ordering_key = outbox.ordering_key AND earlier.delivered_at IS NULL \
                   AND earlier.dead_lettered_at IS NULL AND earlier.{order} < outbox.{order}))) due \
               ORDER BY rank_in_tenant, created_at LIMIT ?4) \
             AND delivered_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at <= ?3 \
             AND (lease_expires_at IS NULL OR lease_expires_at <= ?3) \
             RETURNING event_id, tenant_id, event_type, payload, attempts, created_at", order = D::ROW_ORDER))
        .bind(owner)
        .bind(now.saturating_add(lease_ms))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&mut tx)
        .await?;
        tx.commit().await?;
        rows.iter()
            .map(event_from_row)
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::event_attempted`].
    pub(crate) async fn event_attempted(
        &self,
        event_id: &str,
        owner: &str,
        delivered: bool,
        error: Option<&str>,
        next_attempt_at: i64,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let mut conn = self.writer.begin(0).await?;
        let n = sql::<D>("UPDATE outbox SET attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL, \
             delivered_at = CASE WHEN ? THEN ? ELSE NULL END, last_error = ?, next_attempt_at = ? \
             WHERE event_id = ? AND lease_owner = ? AND delivered_at IS NULL")
        .bind(delivered)
        .bind(now)
        .bind(error.map(clean))
        .bind(next_attempt_at)
        .bind(event_id)
        .bind(owner)
        .execute(&mut conn)
        .await?;
        conn.commit().await?;
        Ok(n == 1)
    }

    /// See [`crate::ledger::Ledger::events`].
    pub(crate) async fn events(
        &self,
        tenant: &str,
    ) -> Result<Vec<(String, String, Option<i64>, i64)>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT event_id, event_type, delivered_at, attempts FROM outbox WHERE tenant_id = ? ORDER BY created_at, {}",
            D::ROW_ORDER
        ))
        .bind(tenant)
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.get("event_id")?,
                    r.get("event_type")?,
                    r.get("delivered_at")?,
                    r.get("attempts")?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::event_given_up`].
    pub(crate) async fn event_given_up(
        &self,
        event_id: &str,
        owner: &str,
        error: &str,
    ) -> Result<bool, LedgerError> {
        let now = self.now().await?;
        let mut conn = self.writer.begin(0).await?;
        let n = sql::<D>(
            "UPDATE outbox SET attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL, \
             last_error = ?, dead_lettered_at = ? \
             WHERE event_id = ? AND lease_owner = ? AND delivered_at IS NULL",
        )
        .bind(clean(error))
        .bind(now)
        .bind(event_id)
        .bind(owner)
        .execute(&mut conn)
        .await?;
        conn.commit().await?;
        Ok(n == 1)
    }

    /// See [`crate::ledger::Ledger::dead_events`].
    pub(crate) async fn dead_events(
        &self,
        tenant: &str,
        limit: u32,
    ) -> Result<Vec<DeadEvent>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>("SELECT event_id, event_type, attempts, last_error, created_at, dead_lettered_at FROM outbox \
             WHERE tenant_id = ? AND dead_lettered_at IS NOT NULL ORDER BY dead_lettered_at DESC LIMIT ?")
        .bind(tenant)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(DeadEvent {
                    event_id: r.get("event_id")?,
                    event_type: r.get("event_type")?,
                    attempts: r.get("attempts")?,
                    last_error: r.get("last_error")?,
                    created_at: r.get("created_at")?,
                    dead_lettered_at: r.get("dead_lettered_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::sweep_delivered_events`].
    pub(crate) async fn sweep_delivered_events(
        &self,
        retention_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let n = sql::<D>(
            "DELETE FROM outbox WHERE event_id IN (SELECT event_id FROM outbox \
             WHERE delivered_at IS NOT NULL AND delivered_at <= ? LIMIT ?)",
        )
        .bind(now.saturating_sub(retention_ms.max(0)))
        .bind(i64::from(batch))
        .execute(&mut tx)
        .await?;
        tx.commit().await?;
        Ok(n)
    }

    /// See [`crate::ledger::Ledger::oldest_pending_event_at`].
    pub(crate) async fn oldest_pending_event_at(&self) -> Result<Option<i64>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let row = sql::<D>(
            "SELECT MIN(created_at) AS at FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL",
        )
        .fetch_one(&mut conn)
        .await?;
        Ok(row.get("at")?)
    }

    /// See [`crate::ledger::Ledger::pending_events`].
    pub(crate) async fn pending_events(&self) -> Result<i64, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let row = sql::<D>(
            "SELECT COUNT(*) AS n FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL",
        )
        .fetch_one(&mut conn)
        .await?;
        Ok(row.get("n")?)
    }
}
