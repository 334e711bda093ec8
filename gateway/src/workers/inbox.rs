//! The inbox's periodic work, run with every outbox relay pass: gaps whose
//! reorder window ended are closed (the next event delivered with the gap
//! flag, or quarantined, per source), events past their source's
//! dedupe window are swept, and so are the ordering rows (the last
//! applied sequence of a key) of keys idle past the source's
//! `sequence_window_ms`.

use std::collections::BTreeSet;

use crate::config::OnGap;
use crate::state::AppState;
use crate::workers::WorkerError;

/// Most held events looked at per pass.
const HELD_BATCH: u32 = 100;
/// Most rows one sweep statement deletes.
const SWEEP_BATCH: u32 = 500;

/// One pass: closes every due gap and sweeps each source once. Returns
/// the events whose gap it closed (delivered or quarantined).
///
/// Errors: the ledger failed.
pub async fn tick(app: &AppState) -> Result<Vec<String>, WorkerError> {
    let settings = app.settings();
    if settings.inbox.is_empty() {
        return Ok(Vec::new());
    }
    let mut closed = Vec::new();
    let mut keys = BTreeSet::new();
    for ev in app.ledger.held_due(HELD_BATCH).await? {
        if let Some(k) = ev.sequence_key.clone() {
            keys.insert((ev.tenant_id.clone(), ev.source.clone(), k));
        }
    }
    for (tenant, source, key) in keys {
        // A source removed by a reload: its held events wait (deliver).
        let (quarantine, deliver) = settings.inbox.get(&source).map_or((false, false), |s| {
            (s.on_gap == OnGap::Quarantine, s.deliver)
        });
        let done = app
            .ledger
            .close_gap((&tenant, &source, &key), quarantine, deliver)
            .await?;
        if let Some(first) = done.first() {
            crate::metrics::inbox_gap(
                &source,
                if quarantine {
                    "quarantined"
                } else {
                    "delivered"
                },
            );
            tracing::warn!(tenant = %tenant, source = %source, sequence_key = %key, event_id = %first,
                quarantined = quarantine, "inbox: a sequence gap did not fill within the reorder window");
        }
        closed.extend(done);
    }
    for src in settings.inbox.values() {
        let window = i64::try_from(src.dedupe_window_ms).unwrap_or(i64::MAX);
        app.ledger
            .sweep_inbox((&src.tenant, &src.name), window, SWEEP_BATCH)
            .await?;
        let window = i64::try_from(src.sequence_window_ms).unwrap_or(i64::MAX);
        app.ledger
            .sweep_inbox_sequences((&src.tenant, &src.name), window, SWEEP_BATCH)
            .await?;
    }
    Ok(closed)
}
