//! The retention sweeper: removes terminal operations whose idempotency
//! key retention has passed. Run after each reconciler scan.

use crate::ledger::LedgerError;
use crate::state::AppState;

/// The retention sweeper: deletes terminal operations past their key
/// retention, `batch` at a time, until a batch comes back short or
/// `max_batches` ran. Returns how many it deleted.
///
/// Errors: the ledger failed (what was deleted so far stays deleted).
pub async fn sweep(app: &AppState, batch: u32, max_batches: u32) -> Result<u64, LedgerError> {
    // Every route keeps keys at least an hour (`key_retention_hours` ≥ 1).
    let min_retention = app
        .settings()
        .routes
        .iter()
        .map(|r| r.key_retention_ms)
        .min()
        .unwrap_or(3_600_000)
        .min(i64::MAX as u64) as i64;
    let mut total = 0;
    for _ in 0..max_batches {
        let n = app
            .ledger
            .sweep_expired(batch.max(1), min_retention)
            .await?;
        total += n;
        crate::metrics::swept(n);
        if n < u64::from(batch.max(1)) {
            break;
        }
    }
    if total > 0 {
        tracing::info!(deleted = total, "retention sweeper");
    }
    Ok(total)
}
