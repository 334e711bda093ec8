//! Reconciliation: resolving operations whose outcome is unknown through
//! provider read-back, never by inventing a new attempt blindly.
//!
//! The reconciler scans the ledger every `reconcile.interval_ms` for:
//! - UNKNOWN operations that are due: it takes a reconciliation lease (new
//!   fencing token) and reads back. Found → COMPLETED, storing the
//!   provider's reference and what the read-back returned. Absent, and the
//!   settle delay has passed → a new attempt of the **same** operation with
//!   the **same** provider key, within the retry budget (past it → dead
//!   letter). Absent within the settle delay → stays UNKNOWN and is read
//!   back again, at growing intervals, until the delay ends. The delay
//!   must have passed on the ledger's clock and on the monotonic one
//!   (`ledger::SettleWindows`), so a step of the wall clock (or of the
//!   database clock) never shortens it.
//!   Read-back error → stays UNKNOWN with exponential backoff; past
//!   `reconcile.max_read_backs` → dead letter.
//! - EXECUTING operations whose lease expired (the owner died or stalled):
//!   → UNKNOWN with a new fencing token, then as above.
//! - RESERVED operations untouched for `reconcile.reserved_grace_ms`
//!   (nothing was sent; the caller went away): executed.
//!
//! Routes without `read_back` can't be reconciled automatically: their
//! UNKNOWN operations wait for an operator (`POST …/resolve`).
//!
//! A duplicate request for an UNKNOWN operation calls [`reconcile_op`]
//! at once instead of waiting for the scan.

use std::time::Duration;

use http::StatusCode;
use serde_json::Value;

use crate::config::{ReadBack, Route};
use crate::ledger::{DeadLetter, LedgerError, Operation, Outcome, SettleVerdict, State};
use crate::ops::OpError;
use crate::ops::execute;
use crate::state::AppState;
use tracing::Instrument;

pub use crate::ops::read_back::{ReadBackResult, read_back};

/// What one reconciliation step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Read-back found the effect: COMPLETED.
    Found,
    /// Absent: a new attempt ran and ended in this state (None: fenced off).
    Retried(Option<State>),
    /// Absent, but within the settle delay: still UNKNOWN.
    Settling,
    /// Read-back failed: still UNKNOWN, backing off.
    ReadBackError,
    /// Moved to the terminal route.
    DeadLettered,
    /// A stale RESERVED operation was executed, ending in this state.
    ExecutedReserved(Option<State>),
    /// A new attempt or an abandoned reservation's execution was started
    /// in the background (the reconciler's own scans: [`Execution::Detach`]).
    ExecutionStarted,
    /// Someone else holds the operation, or it changed meanwhile.
    Busy,
    /// Nothing to do (terminal, awaiting approval, or the route has no read-back).
    Skipped(&'static str),
}

/// How a step runs the executions it starts (an abandoned reservation, a
/// new attempt after an "absent" read-back).
#[derive(Clone, Copy)]
pub enum Execution<'a> {
    /// In the step: it returns once the attempt is recorded.
    Await,
    /// In a task of `tracker`: the step returns [`Step::ExecutionStarted`]
    /// at once, so a slow provider never holds up the reconciler's scan.
    Detach(&'a tokio_util::task::TaskTracker),
}

/// One reconciliation step for `op` (as last read), awaiting any execution
/// it starts. Every write is a compare-and-swap: if another instance got
/// there first, the step is [`Step::Busy`].
pub async fn reconcile_op(app: &AppState, op: Operation) -> Result<Step, LedgerError> {
    reconcile_with(app, op, Execution::Await).await
}

/// [`reconcile_op`], running executions as `exec` says, in a span
/// `reconcile` of its own (a child of the current request span, if any)
/// linked to the trace of the request that created the operation.
pub async fn reconcile_with(
    app: &AppState,
    op: Operation,
    exec: Execution<'_>,
) -> Result<Step, LedgerError> {
    let span = tracing::debug_span!(
        "reconcile",
        otel.name = "reconcile",
        effectgate.tenant = op.tenant_id.as_str(),
        effectgate.operation_id = op.operation_id.as_str(),
        effectgate.route = op.route.as_str(),
        effectgate.state = op.state.as_str(),
        effectgate.fence = op.fence,
        effectgate.step = tracing::field::Empty,
    );
    crate::telemetry::link_to(&span, op.trace_context.as_deref());
    let step = reconcile_steps(app, op, exec)
        .instrument(span.clone())
        .await;
    if let Ok(s) = &step {
        span.record("effectgate.step", format!("{s:?}").as_str());
    }
    step
}

async fn reconcile_steps(
    app: &AppState,
    op: Operation,
    exec: Execution<'_>,
) -> Result<Step, LedgerError> {
    let settings = app.settings();
    let Some(route) = settings.route_named(&op.route) else {
        // Off the schedule, so it can't hold up the scan; an operator decides.
        if op.state == State::Unknown {
            app.ledger
                .unschedule(&op.tenant_id, &op.operation_id, op.version)
                .await?;
        }
        return Ok(Step::Skipped(
            "the operation's route is no longer configured",
        ));
    };
    let op = match take_up(app, route, op, exec).await? {
        Ok(op) => op,
        Err(step) => return Ok(step),
    };
    let Some(rb) = &route.read_back else {
        app.ledger
            .unschedule(&op.tenant_id, &op.operation_id, op.version)
            .await?;
        return Ok(Step::Skipped(
            "the route has no read-back; an operator resolves it",
        ));
    };
    let Some(lease) = app
        .ledger
        .lease_for_reconcile(
            &op.tenant_id,
            &op.operation_id,
            op.version,
            &app.instance_id,
            settings.reconcile.lease_ms as i64,
            "reconciliation: read-back",
        )
        .await?
    else {
        return Ok(Step::Busy);
    };
    // A compensation's read-back may name the original's reference.
    let reference = match crate::config::compensated_id(&op.operation_id) {
        Some(original) => app
            .ledger
            .compensation(&op.tenant_id, original)
            .await?
            .and_then(|l| l.reference),
        None => None,
    };
    // "Absent" counts from when the read-back was sent: an answer that
    // arrives (or is looked at, after a pause of this process) past the
    // settle delay may still describe the provider before it.
    let clock = app.ledger.clock();
    let (sent_at, sent_mono) = (clock.now_ms(), clock.monotonic_ms());
    let result = read_back(route, rb, &op, reference.as_deref()).await;
    log_read_back(&op, &result);
    let step = ReadBackStep {
        app,
        route,
        rb,
        cfg: &settings.reconcile,
        exec,
        now: clock.now_ms(),
        fence: lease.fence,
        op,
    };
    match result {
        ReadBackResult::Found { matched, reference } => step.found(&matched, reference).await,
        ReadBackResult::Absent => match settle_left(&step, sent_at, sent_mono) {
            Some(left_ms) => step.settling(left_ms).await,
            None => step.absent().await,
        },
        ReadBackResult::Error(detail) => step.failed(detail).await,
    }
}

/// Whether an "absent" read-back sent at `sent_at` (ledger ms) and
/// `sent_mono` (monotonic ms) falls within the settle window: on the
/// ledger's clock (`settle_until`) or on the monotonic one (see
/// `ledger::SettleWindows`). `Some(ms)`: within it, ending that many ms
/// from now on the monotonic clock (0 when only the ledger's clock says
/// so); `None`: "absent" is trusted. An operation without `settle_until`
/// had no ambiguous attempt: nothing to wait for.
fn settle_left(step: &ReadBackStep<'_>, sent_at: i64, sent_mono: i64) -> Option<i64> {
    let until = step.op.settle_until?;
    let verdict = step.app.ledger.settle_windows().judge(
        (&step.op.tenant_id, &step.op.operation_id),
        until,
        sent_mono,
        step.app.ledger.clock().monotonic_ms(),
        step.rb.settle_delay_ms as i64,
    );
    match verdict {
        SettleVerdict::Settling { left_ms } => Some(left_ms),
        SettleVerdict::Passed if sent_at < until => Some(0),
        SettleVerdict::Passed => None,
    }
}

/// Brings `op` to UNKNOWN for a read-back: an abandoned reservation is
/// executed instead (`Err` with its step), an EXECUTING one whose lease ran
/// out is expired to UNKNOWN, an UNKNOWN one is taken as it is.
async fn take_up(
    app: &AppState,
    route: &Route,
    op: Operation,
    exec: Execution<'_>,
) -> Result<Result<Operation, Step>, LedgerError> {
    let ledger = &app.ledger;
    let owner: &str = &app.instance_id;
    match op.state {
        State::Reserved => {
            let Some(claim) = ledger
                .claim(
                    (&op.tenant_id, &op.operation_id),
                    State::Reserved,
                    op.version,
                    owner,
                    execute::lease_ms(app),
                    "reconciler: executing an abandoned reservation",
                )
                .await?
            else {
                return Ok(Err(Step::Busy));
            };
            crate::metrics::reconciliation("reserved-executed");
            Ok(Err(run(
                app,
                route,
                op,
                claim,
                exec,
                Step::ExecutedReserved,
            )
            .await))
        }
        State::Executing => {
            if op
                .lease_expires_at
                .is_some_and(|t| t > ledger.clock().now_ms())
            {
                return Ok(Err(Step::Busy));
            }
            let settle = route.read_back.as_ref().map(|rb| rb.settle_delay_ms as i64);
            if !ledger
                .expire_lease(&op.tenant_id, &op.operation_id, op.version, settle, owner)
                .await?
            {
                return Ok(Err(Step::Busy));
            }
            crate::metrics::reconciliation("lease-expired");
            Ok(match ledger.get(&op.tenant_id, &op.operation_id).await? {
                Some(op) => {
                    // The window opens now on the monotonic clock too: a
                    // lease that expired early (a forward step) can't
                    // shorten it.
                    if let (Some(until), Some(settle)) = (op.settle_until, settle) {
                        ledger.settle_windows().open(
                            &op.tenant_id,
                            &op.operation_id,
                            until,
                            ledger.clock().monotonic_ms(),
                            settle,
                        );
                    }
                    Ok(op)
                }
                None => Err(Step::Busy),
            })
        }
        State::Unknown => Ok(Ok(op)),
        _ => Ok(Err(Step::Skipped("not in a state reconciliation resolves"))),
    }
}

/// Runs a claimed operation as `exec` says: awaited (`step` of the state it
/// ended in) or in a task of the tracker ([`Step::ExecutionStarted`]).
async fn run(
    app: &AppState,
    route: &Route,
    op: Operation,
    claim: crate::ledger::Claim,
    exec: Execution<'_>,
    step: fn(Option<State>) -> Step,
) -> Step {
    let task = execute::run(app.clone(), route.clone(), op, claim, None);
    match exec {
        Execution::Await => step(task.await),
        Execution::Detach(tracker) => {
            tracker.spawn(task.in_current_span());
            Step::ExecutionStarted
        }
    }
}

/// Logs a read-back's decision and the provider's reference only: a found
/// value is the provider's data (possibly personal), never logged.
fn log_read_back(op: &Operation, result: &ReadBackResult) {
    let (decision, reference) = match result {
        ReadBackResult::Found { reference, .. } => ("found", reference.as_deref()),
        ReadBackResult::Absent => ("absent", None),
        ReadBackResult::Error(_) => ("error", None),
    };
    tracing::info!(
        tenant = %op.tenant_id, operation_id = %op.operation_id, decision,
        reference = reference.unwrap_or("-"),
        error = if let ReadBackResult::Error(e) = result { e.as_str() } else { "-" },
        "read-back"
    );
}

/// What a read-back decided, applied under the reconciliation lease.
struct ReadBackStep<'a> {
    app: &'a AppState,
    route: &'a Route,
    rb: &'a ReadBack,
    cfg: &'a crate::config::ReconcileSpec,
    exec: Execution<'a>,
    now: i64,
    fence: i64,
    op: Operation,
}

impl ReadBackStep<'_> {
    /// Records `o` under the lease; `false` when another owner got there first.
    async fn record(&self, o: Outcome) -> Result<bool, LedgerError> {
        self.app
            .ledger
            .record_outcome(
                &self.op.tenant_id,
                &self.op.operation_id,
                self.fence,
                State::Unknown,
                &self.app.instance_id,
                &o,
            )
            .await
    }

    /// `o` recorded, then `step` (with its metric), or Busy when fenced off.
    async fn finish(
        &self,
        o: Outcome,
        step: Step,
        metric: &'static str,
    ) -> Result<Step, LedgerError> {
        let ends = o.state.is_terminal() && o.dead_letter.is_none();
        if !self.record(o).await? {
            return Ok(Step::Busy);
        }
        if ends {
            self.app
                .ledger
                .settle_windows()
                .close(&self.op.tenant_id, &self.op.operation_id);
        }
        crate::metrics::reconciliation(metric);
        Ok(step)
    }

    /// The provider has the effect: COMPLETED with what was found.
    async fn found(&self, matched: &Value, reference: Option<String>) -> Result<Step, LedgerError> {
        let body = if self.route.mcp.is_some() {
            crate::ops::mcp::reconciled_result(matched)
        } else {
            serde_json::to_vec(matched).unwrap_or_default()
        };
        let mut o = Outcome::new(State::Completed, "read-back: the provider has the effect");
        o.response_status = Some(200);
        o.response_headers = vec![("content-type".into(), "application/json".into())];
        o.response_body_bytes = Some(body.len() as i64);
        o.response_body = Some(body);
        o.provider_reference = super::bounded_reference(
            reference,
            self.app.settings().limits.max_provider_reference_bytes,
            &self.op.operation_id,
        );
        o.count_read_back = true;
        let step = self.finish(o, Step::Found, "found").await?;
        if matches!(step, Step::Found) && self.op.state == State::Unknown {
            crate::metrics::drift_found();
        }
        Ok(step)
    }

    /// Absent, but within the settle delay: look again while the
    /// provider's search catches up, waiting as long again as since the
    /// last attempt (doubling, between the backoff bounds), never past the
    /// end of the window: the later of `settle_until` and `mono_left_ms`
    /// from now (what is left of it on the monotonic clock). A "found"
    /// meanwhile is trusted at once.
    async fn settling(&self, mono_left_ms: i64) -> Result<Step, LedgerError> {
        let (op, cfg, now) = (&self.op, self.cfg, self.now);
        let mut o = Outcome::new(
            State::Unknown,
            "read-back: absent, but within the settle delay",
        );
        o.keep_response = true;
        o.error_kind = op.error_kind.clone();
        o.error_detail = op.error_detail.clone();
        let settle_until = op
            .settle_until
            .unwrap_or(now)
            .max(now.saturating_add(mono_left_ms));
        let since_attempt = settle_until
            .saturating_sub(self.rb.settle_delay_ms as i64)
            .max(0);
        let waited = now.saturating_sub(since_attempt).max(0) as u64;
        let wait = waited.clamp(
            cfg.backoff_base_ms,
            cfg.backoff_max_ms.max(cfg.backoff_base_ms),
        );
        o.next_reconcile_at = Some(now.saturating_add(wait as i64).min(settle_until));
        self.finish(o, Step::Settling, "absent-settling").await
    }

    /// Absent past the settle delay: a new attempt with the same provider
    /// key, or a dead letter when the retry budget is spent.
    async fn absent(self) -> Result<Step, LedgerError> {
        let op = &self.op;
        if op.attempts >= execute::attempt_budget(self.route, op) {
            let mut o = Outcome::new(
                State::Failed,
                "read-back: absent, and the retry budget is spent",
            );
            o.keep_response = true;
            o.error_kind = Some("retries-exhausted".into());
            o.error_detail = op.error_detail.clone();
            o.count_read_back = true;
            o.dead_letter = Some(DeadLetter {
                reason: "retries-exhausted".into(),
                operator_check: format!(
                    "{} attempts were made; the last read-back found no effect for provider key {}. \
                     Confirm at the provider that none exists, then requeue.",
                    op.attempts, op.provider_key
                ),
            });
            return self.finish(o, Step::DeadLettered, "dead-lettered").await;
        }
        let Some(claim) = self
            .app
            .ledger
            .reattempt(
                &op.tenant_id,
                &op.operation_id,
                self.fence,
                &self.app.instance_id,
                execute::lease_ms(self.app),
                "read-back: absent; new attempt, same provider key",
            )
            .await?
        else {
            return Ok(Step::Busy);
        };
        crate::metrics::reconciliation("absent-retried");
        Ok(run(
            self.app,
            self.route,
            self.op,
            claim,
            self.exec,
            Step::Retried,
        )
        .await)
    }

    /// The read-back itself failed: UNKNOWN again after a backoff, or a
    /// dead letter past `reconcile.max_read_backs`.
    async fn failed(&self, detail: String) -> Result<Step, LedgerError> {
        let (op, cfg) = (&self.op, self.cfg);
        let n = op.reconcile_attempts + 1;
        let mut o = Outcome::new(State::Unknown, format!("read-back failed: {detail}"));
        o.keep_response = true;
        o.error_kind = Some("read-back-error".into());
        o.error_detail = Some(detail.clone());
        o.count_read_back = true;
        if n >= i64::from(cfg.max_read_backs) {
            o.state = State::Failed;
            o.reason = format!("reconciliation out of bounds after {n} failed read-backs");
            o.dead_letter = Some(DeadLetter {
                reason: "reconciliation-out-of-bounds".into(),
                operator_check: format!(
                    "The effect MAY exist: {n} read-backs failed (last: {detail}). Search the provider for \
                     provider key {} (operation {}) before requeueing; if it exists, resolve as completed.",
                    op.provider_key, op.operation_id
                ),
            });
            return self.finish(o, Step::DeadLettered, "dead-lettered").await;
        }
        let delay = crate::ops::backoff::delay_ms(
            cfg.backoff_base_ms,
            cfg.backoff_max_ms,
            u32::try_from(n).unwrap_or(u32::MAX),
            crate::ops::backoff::Jitter::Equal,
        );
        o.next_reconcile_at = Some(self.now.saturating_add(delay as i64));
        self.finish(o, Step::ReadBackError, "read-back-error").await
    }
}

/// Seconds a duplicate is told to wait (`Retry-After`, RFC 9110 §10.2.3):
/// the whole seconds until the next read-back is due (`next_ms`, the
/// ledger clock's ms since the epoch), at least 1; without one in the
/// future, [`crate::ops::error::UNKNOWN_RETRY_AFTER_S`].
fn retry_after_s(next_ms: Option<i64>, now_ms: i64) -> u64 {
    match next_ms.filter(|t| *t > now_ms) {
        Some(t) => u64::try_from(t - now_ms).unwrap_or(0).div_ceil(1000).max(1),
        None => crate::ops::error::UNKNOWN_RETRY_AFTER_S,
    }
}

/// Answers a duplicate request for an operation that is UNKNOWN (or whose
/// lease expired): reconciles it now, waiting at most
/// `reconcile.duplicate_wait_ms`, then replays the result if it resolved.
///
/// Errors: 409 `operation-outcome-unknown` when it is still unresolved.
pub async fn for_duplicate(app: &AppState, op: Operation) -> Result<Operation, OpError> {
    let wait = Duration::from_millis(app.settings().reconcile.duplicate_wait_ms);
    let (tenant, id) = (op.tenant_id.clone(), op.operation_id.clone());
    let deadline = tokio::time::Instant::now() + wait;
    let mut current = op;
    loop {
        // A read-back that ran (this caller's, or another's while this one
        // waited) set when the next one is due: after a failed read-back,
        // or one that found nothing within the settle delay. Until then a
        // duplicate doesn't get to hammer the provider's read-back API, nor
        // spend the read-back budget; concurrent duplicates share the one
        // read-back that ran.
        let now = app.ledger.clock().now_ms();
        if current.state == State::Unknown
            && let Some(due) = current.next_reconcile_at.filter(|t| *t > now)
        {
            return Err(OpError::OutcomeUnknown {
                operation_id: id,
                detail: format!(
                    "the outcome is unknown; the last read-back did not settle it, and the next is due at {}",
                    crate::times::human(due, now)
                ),
                status: StatusCode::CONFLICT,
                retry_after_s: retry_after_s(current.next_reconcile_at, now),
            });
        }
        // In a task of its own: if this caller stops waiting, a new attempt
        // the reconciliation started still runs to its end.
        let task = {
            let (app, op) = (app.clone(), current.clone());
            let tracker = app.lifecycle.executions.clone();
            tracker.spawn(async move { reconcile_op(&app, op).await })
        };
        let step = match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(r)) => r?,
            Ok(Err(e)) => {
                return Err(OpError::Internal(format!(
                    "reconciliation task failed: {e}"
                )));
            }
            Err(_) => Step::Busy,
        };
        current = app
            .ledger
            .get(&tenant, &id)
            .await?
            .ok_or_else(|| OpError::NotFound(format!("no operation {id:?}")))?;
        if current.state.is_terminal() {
            return Ok(current);
        }
        let next = retry_after_s(current.next_reconcile_at, app.ledger.clock().now_ms());
        let unresolved = |detail: String| OpError::OutcomeUnknown {
            operation_id: id.clone(),
            detail,
            status: StatusCode::CONFLICT,
            retry_after_s: next,
        };
        match step {
            Step::Skipped(why) => {
                return Err(unresolved(format!("the outcome is unknown and {why}")));
            }
            Step::Settling => {
                return Err(unresolved("the provider does not show the effect yet; the read-back settle delay has not passed".into()));
            }
            Step::ReadBackError => {
                return Err(unresolved(
                    "the read-back failed; reconciliation retries with backoff".into(),
                ));
            }
            _ => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(unresolved(
                "reconciliation is in progress; retry later".into(),
            ));
        }
        // Another owner holds it: look again shortly.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
