//! The inbox's reads and retention: listings, the gauges, a sequence's
//! last applied number, and the sweeps of old events and idle sequences.

use super::super::super::LedgerError;
use super::super::super::dialect::{Dialect, LedgerRow, sql};
use super::super::super::inbox::InboxEvent;
use super::super::Store;
use super::{INBOX_COLUMNS, inbox_from_row};

impl<D: Dialect> Store<D> {
    /// See [`crate::ledger::Ledger::inbox_events`].
    pub(crate) async fn inbox_events(
        &self,
        tenant: &str,
        source: Option<&str>,
        state: Option<&str>,
        limit: u32,
    ) -> Result<Vec<InboxEvent>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT {INBOX_COLUMNS} FROM inbox WHERE tenant_id = ?1 AND (?2 IS NULL OR source = ?2) \
             AND (?3 IS NULL OR state = ?3) ORDER BY received_at DESC, event_id DESC LIMIT ?4"
        ))
        .bind(tenant)
        .bind(source)
        .bind(state)
        .bind(i64::from(limit))
        .fetch_all(&mut conn)
        .await?;
        Ok(rows.iter().map(inbox_from_row).collect::<Result<_, _>>()?)
    }

    /// See [`crate::ledger::Ledger::inbox_for_operation`].
    pub(crate) async fn inbox_for_operation(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<InboxEvent>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(&format!(
            "SELECT {INBOX_COLUMNS} FROM inbox WHERE tenant_id = ? AND operation_id = ? ORDER BY received_at"
        ))
        .bind(tenant)
        .bind(operation_id)
        .fetch_all(&mut conn)
        .await?;
        Ok(rows.iter().map(inbox_from_row).collect::<Result<_, _>>()?)
    }

    /// See [`crate::ledger::Ledger::inbox_gauges`].
    pub(crate) async fn inbox_gauges(
        &self,
    ) -> Result<Vec<(String, String, i64, Option<i64>)>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let rows = sql::<D>(
            "SELECT source, state, COUNT(*) AS n, MIN(received_at) AS oldest FROM inbox \
             WHERE state IN ('held', 'quarantined') GROUP BY source, state",
        )
        .fetch_all(&mut conn)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.get("source")?,
                    r.get("state")?,
                    r.get("n")?,
                    r.get("oldest")?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// See [`crate::ledger::Ledger::sweep_inbox`].
    pub(crate) async fn sweep_inbox(
        &self,
        source: (&str, &str),
        window_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        // Held and quarantined events wait for their gap or an operator.
        self.sweep_older(
            "DELETE FROM inbox WHERE (tenant_id, source, event_id) IN (SELECT tenant_id, source, event_id FROM inbox \
             WHERE tenant_id = ? AND source = ? AND received_at <= ? AND state NOT IN ('held', 'quarantined') LIMIT ?)",
            source,
            window_ms,
            batch,
        )
        .await
    }

    /// See [`crate::ledger::Ledger::sweep_inbox_sequences`].
    pub(crate) async fn sweep_inbox_sequences(
        &self,
        source: (&str, &str),
        window_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        // A key with a held or quarantined event still orders it.
        self.sweep_older(
            "DELETE FROM inbox_sequences WHERE (tenant_id, source, sequence_key) IN \
             (SELECT s.tenant_id, s.source, s.sequence_key FROM inbox_sequences s \
             WHERE s.tenant_id = ? AND s.source = ? AND s.updated_at <= ? AND NOT EXISTS \
             (SELECT 1 FROM inbox i WHERE i.tenant_id = s.tenant_id AND i.source = s.source \
             AND i.sequence_key = s.sequence_key AND i.state IN ('held', 'quarantined')) LIMIT ?)",
            source,
            window_ms,
            batch,
        )
        .await
    }

    /// Runs one of the inbox's sweeps, `delete`: its parameters are the
    /// tenant, the source, the newest time swept (`window_ms` before the
    /// ledger's clock) and the batch size. Returns the rows deleted.
    async fn sweep_older(
        &self,
        delete: &'static str,
        (tenant, source): (&str, &str),
        window_ms: i64,
        batch: u32,
    ) -> Result<u64, LedgerError> {
        let (mut tx, now) = self.begin().await?;
        let n = sql::<D>(delete)
            .bind(tenant)
            .bind(source)
            .bind(now.saturating_sub(window_ms.max(0)))
            .bind(i64::from(batch))
            .execute(&mut tx)
            .await?;
        tx.commit().await?;
        Ok(n)
    }

    /// See [`crate::ledger::Ledger::inbox_sequence`].
    pub(crate) async fn inbox_sequence(
        &self,
        (tenant, source, key): (&str, &str, &str),
    ) -> Result<Option<i64>, LedgerError> {
        let mut conn = D::acquire(&self.read).await?;
        let row = sql::<D>(
            "SELECT last_applied FROM inbox_sequences WHERE tenant_id = ? AND source = ? AND sequence_key = ?",
        )
        .bind(tenant)
        .bind(source)
        .bind(key)
        .fetch_optional(&mut conn)
        .await?;
        Ok(row.map(|r| r.get("last_applied")).transpose()?)
    }
}
