//! The reconciler loop: every `reconcile.interval_ms` it expires
//! approvals past their time, takes the due operations (UNKNOWN ones, and
//! EXECUTING or RESERVED ones whose lease or grace ran out), runs a
//! [`reconcile_op`] step for each in [`fair_order`], then runs the
//! retention [`sweep`] (and, on PostgreSQL, gives a fresh ledger's tables
//! their first planner statistics).

use std::time::Duration;

use futures_util::StreamExt;

use crate::ledger::{LedgerError, Operation};
use crate::ops::reconcile::{Execution, Step, reconcile_with};
use crate::state::AppState;
use crate::workers::sweeper::sweep;

/// Orders a scan's operations fairly between tenants: every tenant's
/// oldest first, then every tenant's second, and so on (oldest first within
/// a rank). Steps start in this order, 8 at a time, so one tenant's backlog
/// of slow operations can't hold another tenant's behind it in the scan.
pub fn fair_order(mut ops: Vec<Operation>) -> Vec<Operation> {
    ops.sort_by_key(|o| o.updated_at);
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut ranked: Vec<(usize, Operation)> = ops
        .into_iter()
        .map(|o| {
            let rank = seen.entry(o.tenant_id.clone()).or_insert(0);
            *rank += 1;
            (*rank, o)
        })
        .collect();
    ranked.sort_by_key(|(rank, o)| (*rank, o.updated_at));
    ranked.into_iter().map(|(_, o)| o).collect()
}

/// Runs one scan to the end: handles every due operation (up to
/// `reconcile.batch`), 8 at a time, in [`fair_order`], awaiting the
/// executions it starts. Returns what each step did.
///
/// Errors: the ledger could not be read.
pub async fn tick(app: &AppState) -> Result<Vec<(String, String, Step)>, LedgerError> {
    scan(app, Execution::Await).await
}

/// One scan as the reconciler loop runs it: executions it starts
/// (abandoned reservations, new attempts after an "absent" read-back) go
/// on in tasks of `tracker` ([`Step::ExecutionStarted`]), so one tenant's
/// slow provider can't hold another tenant's read-back behind it.
///
/// Errors: the ledger could not be read.
pub async fn scan(
    app: &AppState,
    exec: Execution<'_>,
) -> Result<Vec<(String, String, Step)>, LedgerError> {
    crate::metrics::drift_scan();
    // First, so that no failure later in the scan holds it back.
    match app.ledger.first_statistics().await {
        Ok(tables) if !tables.is_empty() => {
            tracing::info!(
                ?tables,
                "ledger tables given their first planner statistics"
            );
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "ledger statistics could not be gathered"),
    }
    let settings = app.settings();
    let cfg = &settings.reconcile;
    // Approvals past their expiry can never authorise anything: expire them.
    let expired = app.ledger.expire_approvals(cfg.batch).await?;
    if expired > 0 {
        tracing::info!(expired, "approvals expired");
    }
    // Rows this scan picked are claimed for it (FOR UPDATE SKIP LOCKED on
    // PostgreSQL), so the instances' scans never hand out the same one.
    let due = app
        .ledger
        .due_for_reconciliation(
            &app.instance_id,
            cfg.reserved_grace_ms as i64,
            cfg.lease_ms as i64,
            cfg.batch,
        )
        .await?;
    let claimed = !due.is_empty();
    let steps = futures_util::stream::iter(fair_order(due))
        .map(|op| async move {
            let (t, id) = (op.tenant_id.clone(), op.operation_id.clone());
            match reconcile_with(app, op, exec).await {
                Ok(step) => Some((t, id, step)),
                Err(e) => {
                    tracing::warn!(tenant = %t, operation_id = %id, error = %e, "reconciliation step failed");
                    None
                }
            }
        })
        .buffer_unordered(8)
        .filter_map(|x| async move { x })
        .collect()
        .await;
    if claimed {
        app.ledger.release_scan(&app.instance_id).await?;
    }
    sweep(app, cfg.sweep_batch, cfg.sweep_max_batches).await?;
    Ok(steps)
}

/// Runs the reconciler until `shutdown` turns true, then waits for the
/// executions it started (each bounded by its route's response timeout
/// and retry budget, under its lease).
pub async fn run(app: AppState, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    // Executions run in the gateway's tracker: shutdown awaits them within
    // its drain deadline.
    let executions = app.lifecycle.executions.clone();
    loop {
        if let Err(e) = scan(&app, Execution::Detach(&executions)).await {
            tracing::warn!(error = %e, "reconciler scan failed");
        }
        // Read each time, so a reload's new interval applies.
        let period = Duration::from_millis(app.settings().reconcile.interval_ms);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = shutdown.wait_for(|s| *s) => break,
        }
    }
}
