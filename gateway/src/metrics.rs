//! Prometheus metrics (`GET /metrics` on the admin listener).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `effectgate_requests_total` | counter | `route`, `outcome` (`forwarded`, `replayed`, `fingerprint-mismatch`, `in-flight`, `outcome-unknown`, `rejected`, `awaiting-approval`) |
//! | `effectgate_replays_total` | counter | `route` (duplicates suppressed) |
//! | `effectgate_fingerprint_mismatches_total` | counter | `route` |
//! | `effectgate_in_flight_conflicts_total` | counter | `route` |
//! | `effectgate_operations_recorded_total` | counter | `tenant`, `route`, `state` |
//! | `effectgate_retries_total` | counter | `route` |
//! | `effectgate_reconciliations_total` | counter | `outcome` (`found`, `absent-retried`, `absent-settling`, `read-back-error`, `dead-lettered`, `lease-expired`, `reserved-executed`) |
//! | `effectgate_stale_fence_rejections_total` | counter | — |
//! | `effectgate_unknown_operations` | gauge | `tenant` |
//! | `effectgate_dead_letters` | gauge | `tenant` |
//! | `effectgate_dead_letter_oldest_age_seconds` | gauge | `tenant` |
//! | `effectgate_upstream_latency_seconds` | histogram (summary) | `route` |
//! | `effectgate_policy_evaluation_seconds` | histogram (summary) | — |
//! | `effectgate_mcp_tool_calls_total` | counter | `route`, `outcome` (`ok`, `tool-error`, `jsonrpc-error`): the tool-level outcome, not the HTTP status |
//! | `effectgate_policy_failures_total` | counter | `kind` (`timeout`, `out-of-fuel`, `out-of-memory`, `trap`, `invalid-output`, `instantiate`, `host-panic`, and for policies that did not run `pool-exhausted`, `busy`, `circuit-open`) |
//! | `effectgate_policy_breaker_trips_total` | counter | `tenant`, `policy` (a policy's circuit opened) |
//! | `effectgate_policy_call_seconds` | histogram | `policy` (a module name from the config) |
//! | `effectgate_read_back_latency_seconds` | histogram | `route` |
//! | `effectgate_reconciliation_drift_total` | counter | — (operations the ledger had as UNKNOWN that a read-back found at the provider) |
//! | `effectgate_reconciliation_drift` | gauge | — (of those, found in the last scan) |
//! | `effectgate_unknown_oldest_age_seconds` | gauge | `tenant` (the UNKNOWN operation unresolved longest) |
//! | `effectgate_outbox_lag_seconds` | gauge | — (age of the oldest event not yet delivered) |
//! | `effectgate_outbox_pending_events` | gauge | — |
//! | `effectgate_ledger_up` | gauge | — (1 when the ledger answered the scrape's ping) |
//! | `effectgate_connections_closed_total` | counter | `listener`, `reason` |
//! | `effectgate_tenant_limited_total` | counter | `tenant`, `limit` |
//! | `effectgate_tenant_stored_bytes` | gauge | `tenant` |
//! | `effectgate_retention_swept_total` | counter | — |
//! | `effectgate_ledger_batch_size` | histogram | — (ledger writes per group commit; buckets [`BATCH_SIZE_BUCKETS`]) |
//! | `effectgate_ledger_commit_seconds` | histogram | — (time of one group commit) |
//! | `effectgate_ledger_batch_failures_total` | counter | — (group commits that failed) |
//! | `effectgate_inbox_received_total` | counter | `source`, `outcome` (`accepted`, `duplicate`, `stale`, `held`) |
//! | `effectgate_inbox_rejected_total` | counter | `source`, `check` (see [`INBOX_CHECKS`]) |
//! | `effectgate_inbox_gaps_total` | counter | `source`, `outcome` (`delivered`, `quarantined`) |
//! | `effectgate_inbox_resolutions_total` | counter | `source`, `outcome` (`completed`, `read-back`, `ignored`) |
//! | `effectgate_inbox_held_events` | gauge | `source` |
//! | `effectgate_inbox_quarantined_events` | gauge | `source` |
//! | `effectgate_inbox_quarantine_oldest_age_seconds` | gauge | `source` |
//! | `effectgate_inbox_delivery_lag_seconds` | histogram | `source` (receipt to the tenant's 2xx) |
//!
//! Histograms have the buckets of [`LATENCY_BUCKETS`] (seconds). Every
//! family exists from start-up ([`register_all`]): at 0 for every label set
//! the config defines (routes × outcomes, tenants, policies), so alert
//! rules and dashboards see 0, not "no data".
//!
//! Cardinality: `route` takes only configured route names and `tenant` only
//! configured tenant ids, so the series count is bounded by the config. A
//! tenant outside the configured set (which the proxy can't produce) is
//! reported as `_other`.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Histogram buckets, in seconds: 0.5 ms to 30 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Outcomes of `effectgate_requests_total`.
pub const REQUEST_OUTCOMES: &[&str] = &[
    "forwarded",
    "replayed",
    "fingerprint-mismatch",
    "in-flight",
    "outcome-unknown",
    "rejected",
    "awaiting-approval",
];

/// Outcomes of `effectgate_reconciliations_total`.
pub const RECONCILIATION_OUTCOMES: &[&str] = &[
    "found",
    "absent-retried",
    "absent-settling",
    "read-back-error",
    "dead-lettered",
    "lease-expired",
    "reserved-executed",
];

/// Kinds of `effectgate_policy_failures_total`.
pub const POLICY_FAILURE_KINDS: &[&str] = &[
    "timeout",
    "out-of-fuel",
    "out-of-memory",
    "trap",
    "invalid-output",
    "instantiate",
    "host-panic",
    "pool-exhausted",
    "busy",
    "circuit-open",
];

/// Checks an inbox request can fail (`effectgate_inbox_rejected_total`).
pub const INBOX_CHECKS: &[&str] = &[
    "signature-missing",
    "signature-malformed",
    "signature-mismatch",
    "timestamp-outside-tolerance",
    "body-too-large",
    "body-unreadable",
    "body-timeout",
    "body-not-json",
    "event-id-missing",
    "sequence-missing",
    "text-invalid",
];

/// What [`register_all`] needs of the configuration: the label values it
/// defines.
#[derive(Debug, Default)]
pub struct Labels<'a> {
    /// Route names, with whether the route is an MCP route.
    pub routes: Vec<(&'a str, bool)>,
    /// Tenant ids.
    pub tenants: Vec<&'a str>,
    /// Policy module names bound by some tenant, with the tenant.
    pub policies: Vec<(&'a str, &'a str)>,
    /// Tenants with a stored-bytes quota.
    pub quota_tenants: Vec<&'a str>,
    /// Inbox source names.
    pub inbox_sources: Vec<&'a str>,
}

/// Registers every family at 0 for every label set `labels` defines (and
/// the label-less ones), with its help text. Called at start and on
/// reload (new routes and tenants appear at 0; series of removed ones stay
/// until restart).
pub fn register_all(labels: &Labels<'_>) {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "effectgate_requests_total",
        "Requests by route and outcome."
    );
    describe_counter!(
        "effectgate_replays_total",
        "Duplicates answered from the ledger."
    );
    describe_counter!(
        "effectgate_fingerprint_mismatches_total",
        "Reused idempotency keys with other arguments (422)."
    );
    describe_counter!(
        "effectgate_in_flight_conflicts_total",
        "Duplicates of an operation still executing (409)."
    );
    describe_counter!(
        "effectgate_operations_recorded_total",
        "Attempt outcomes recorded, by state."
    );
    describe_counter!(
        "effectgate_retries_total",
        "Transient failures retried with the same provider key."
    );
    describe_counter!(
        "effectgate_reconciliations_total",
        "Reconciliation steps by outcome."
    );
    describe_counter!(
        "effectgate_stale_fence_rejections_total",
        "Writes refused for a stale fencing token."
    );
    describe_counter!(
        "effectgate_retention_swept_total",
        "Operations deleted by the retention sweeper."
    );
    describe_counter!(
        "effectgate_mcp_tool_calls_total",
        "MCP tool calls by tool-level outcome."
    );
    describe_counter!(
        "effectgate_policy_failures_total",
        "Policy calls that failed or did not run, by kind."
    );
    describe_counter!(
        "effectgate_policy_breaker_trips_total",
        "Policy circuits opened."
    );
    describe_counter!(
        "effectgate_reconciliation_drift_total",
        "UNKNOWN operations a read-back found at the provider."
    );
    describe_counter!(
        "effectgate_connections_closed_total",
        "Connections closed or refused by a listener's limits."
    );
    describe_counter!(
        "effectgate_tenant_limited_total",
        "Calls refused by a tenant limit."
    );
    describe_gauge!("effectgate_unknown_operations", "Operations in UNKNOWN.");
    describe_gauge!(
        "effectgate_unknown_oldest_age_seconds",
        "Age of the UNKNOWN operation unresolved longest."
    );
    describe_gauge!(
        "effectgate_dead_letters",
        "Operations on the terminal route."
    );
    describe_gauge!(
        "effectgate_dead_letter_oldest_age_seconds",
        "Age of the oldest dead letter."
    );
    describe_gauge!(
        "effectgate_reconciliation_drift",
        "UNKNOWN operations found at the provider in the last scan."
    );
    describe_gauge!(
        "effectgate_outbox_lag_seconds",
        "Age of the oldest outbox event not yet delivered."
    );
    describe_gauge!(
        "effectgate_outbox_pending_events",
        "Outbox events not yet delivered."
    );
    describe_gauge!(
        "effectgate_ledger_up",
        "1 when the ledger answered the last scrape's ping."
    );
    describe_gauge!(
        "effectgate_tenant_stored_bytes",
        "Body bytes a tenant's operations hold."
    );
    describe_histogram!(
        "effectgate_upstream_latency_seconds",
        metrics::Unit::Seconds,
        "Provider response time."
    );
    describe_histogram!(
        "effectgate_policy_evaluation_seconds",
        metrics::Unit::Seconds,
        "Policy call time, all policies."
    );
    describe_histogram!(
        "effectgate_policy_call_seconds",
        metrics::Unit::Seconds,
        "Policy call time by policy."
    );
    describe_histogram!(
        "effectgate_ledger_batch_size",
        "Ledger writes per group commit."
    );
    describe_histogram!(
        "effectgate_ledger_commit_seconds",
        metrics::Unit::Seconds,
        "Time of one group commit (COMMIT to durable)."
    );
    describe_counter!(
        "effectgate_ledger_batch_failures_total",
        "Group commits that failed (every write in them got ledger-unavailable)."
    );
    describe_histogram!(
        "effectgate_read_back_latency_seconds",
        metrics::Unit::Seconds,
        "Read-back response time."
    );

    for &(route, mcp) in &labels.routes {
        for &outcome in REQUEST_OUTCOMES {
            counter!("effectgate_requests_total", "route" => route.to_owned(), "outcome" => outcome)
                .absolute(0);
        }
        for name in [
            "effectgate_replays_total",
            "effectgate_fingerprint_mismatches_total",
            "effectgate_in_flight_conflicts_total",
            "effectgate_retries_total",
        ] {
            counter!(name, "route" => route.to_owned()).absolute(0);
        }
        let _ = histogram!("effectgate_upstream_latency_seconds", "route" => route.to_owned());
        let _ = histogram!("effectgate_read_back_latency_seconds", "route" => route.to_owned());
        counter!("effectgate_compensations_total", "route" => route.to_owned(), "outcome" => "requested")
            .absolute(0);
        if mcp {
            for outcome in ["ok", "tool-error", "jsonrpc-error"] {
                counter!("effectgate_mcp_tool_calls_total", "route" => route.to_owned(), "outcome" => outcome)
                    .absolute(0);
            }
        }
        for &tenant in &labels.tenants {
            for state in ["COMPLETED", "FAILED", "UNKNOWN"] {
                counter!("effectgate_operations_recorded_total", "tenant" => tenant.to_owned(), "route" => route.to_owned(), "state" => state)
                    .absolute(0);
            }
        }
    }
    for &tenant in &labels.tenants {
        for name in [
            "effectgate_unknown_operations",
            "effectgate_unknown_oldest_age_seconds",
            "effectgate_dead_letters",
            "effectgate_dead_letter_oldest_age_seconds",
        ] {
            // Gauges are set by each scrape; created here at 0.
            let _ = gauge!(name, "tenant" => tenant.to_owned());
        }
        for limit in ["rate", "in-flight", "stored-bytes"] {
            counter!("effectgate_tenant_limited_total", "tenant" => tenant.to_owned(), "limit" => limit)
                .absolute(0);
        }
    }
    for &(tenant, policy) in &labels.policies {
        counter!("effectgate_policy_breaker_trips_total", "tenant" => tenant.to_owned(), "policy" => policy.to_owned())
            .absolute(0);
        let _ = histogram!("effectgate_policy_call_seconds", "policy" => policy.to_owned());
    }
    for &tenant in &labels.quota_tenants {
        let _ = gauge!("effectgate_tenant_stored_bytes", "tenant" => tenant.to_owned());
    }
    for &outcome in RECONCILIATION_OUTCOMES {
        counter!("effectgate_reconciliations_total", "outcome" => outcome).absolute(0);
    }
    for &kind in POLICY_FAILURE_KINDS {
        counter!("effectgate_policy_failures_total", "kind" => kind).absolute(0);
    }
    for listener in ["proxy", "admin"] {
        for reason in ["header-timeout", "no-request-head", "idle", "busy"] {
            counter!("effectgate_connections_closed_total", "listener" => listener, "reason" => reason)
                .absolute(0);
        }
    }
    counter!("effectgate_stale_fence_rejections_total").absolute(0);
    counter!("effectgate_retention_swept_total").absolute(0);
    counter!("effectgate_reconciliation_drift_total").absolute(0);
    let _ = gauge!("effectgate_reconciliation_drift");
    let _ = gauge!("effectgate_outbox_lag_seconds");
    let _ = gauge!("effectgate_outbox_pending_events");
    let _ = gauge!("effectgate_ledger_up");
    let _ = histogram!("effectgate_policy_evaluation_seconds");
    let _ = histogram!("effectgate_ledger_batch_size");
    let _ = histogram!("effectgate_ledger_commit_seconds");
    counter!("effectgate_ledger_batch_failures_total").absolute(0);
    register_inbox(&labels.inbox_sources);
}

/// Buckets of `effectgate_ledger_batch_size` (writes per commit).
pub const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// A group commit of `size` ledger writes took `d`.
pub fn ledger_batch(size: usize, d: Duration) {
    histogram!("effectgate_ledger_batch_size").record(size as f64);
    histogram!("effectgate_ledger_commit_seconds").record(d.as_secs_f64());
}

/// A group commit failed.
pub fn ledger_batch_failed() {
    counter!("effectgate_ledger_batch_failures_total").increment(1);
}

fn register_inbox(sources: &[&str]) {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "effectgate_inbox_received_total",
        "Verified webhook events by what receiving them did."
    );
    describe_counter!(
        "effectgate_inbox_rejected_total",
        "Webhook requests refused (400/413), by the check that failed; never stored."
    );
    describe_counter!(
        "effectgate_inbox_gaps_total",
        "Sequence gaps that did not fill within the reorder window."
    );
    describe_counter!(
        "effectgate_inbox_resolutions_total",
        "What webhook events did to the UNKNOWN operations they named."
    );
    describe_gauge!("effectgate_inbox_held_events", "Events held for a gap.");
    describe_gauge!(
        "effectgate_inbox_quarantined_events",
        "Events quarantined for an operator."
    );
    describe_gauge!(
        "effectgate_inbox_quarantine_oldest_age_seconds",
        "Age of the oldest quarantined event."
    );
    describe_histogram!(
        "effectgate_inbox_delivery_lag_seconds",
        metrics::Unit::Seconds,
        "From an event's receipt to the tenant's 2xx for its delivery."
    );
    for &source in sources {
        for outcome in ["accepted", "duplicate", "stale", "held"] {
            counter!("effectgate_inbox_received_total", "source" => source.to_owned(), "outcome" => outcome)
                .absolute(0);
        }
        for &check in INBOX_CHECKS {
            counter!("effectgate_inbox_rejected_total", "source" => source.to_owned(), "check" => check)
                .absolute(0);
        }
        for outcome in ["delivered", "quarantined"] {
            counter!("effectgate_inbox_gaps_total", "source" => source.to_owned(), "outcome" => outcome)
                .absolute(0);
        }
        for outcome in ["completed", "read-back", "ignored"] {
            counter!("effectgate_inbox_resolutions_total", "source" => source.to_owned(), "outcome" => outcome)
                .absolute(0);
        }
        for name in [
            "effectgate_inbox_held_events",
            "effectgate_inbox_quarantined_events",
            "effectgate_inbox_quarantine_oldest_age_seconds",
        ] {
            let _ = gauge!(name, "source" => source.to_owned());
        }
        let _ = histogram!("effectgate_inbox_delivery_lag_seconds", "source" => source.to_owned());
    }
}

/// A verified event from `source` was received with `outcome`.
pub fn inbox_received(source: &str, outcome: &'static str) {
    counter!("effectgate_inbox_received_total", "source" => source.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// A request to `source` failed `check` (one of [`INBOX_CHECKS`]).
pub fn inbox_rejected(source: &str, check: &'static str) {
    counter!("effectgate_inbox_rejected_total", "source" => source.to_owned(), "check" => check)
        .increment(1);
}

/// A gap of `source` did not fill: its next event was `outcome`.
pub fn inbox_gap(source: &str, outcome: &'static str) {
    counter!("effectgate_inbox_gaps_total", "source" => source.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// An event of `source` named an operation, and did `outcome` to it.
pub fn inbox_resolution(source: &str, outcome: &'static str) {
    counter!("effectgate_inbox_resolutions_total", "source" => source.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// An event of `source` was delivered `lag` after its receipt.
pub fn inbox_delivered(source: &str, lag: Duration) {
    histogram!("effectgate_inbox_delivery_lag_seconds", "source" => source.to_owned())
        .record(lag.as_secs_f64());
}

/// Scrape-time inbox gauges of `source`: held and quarantined events, and
/// the oldest quarantined one's age (s).
pub fn inbox_gauges(source: &str, held: i64, quarantined: i64, oldest_quarantined_s: f64) {
    gauge!("effectgate_inbox_held_events", "source" => source.to_owned()).set(held as f64);
    gauge!("effectgate_inbox_quarantined_events", "source" => source.to_owned())
        .set(quarantined as f64);
    gauge!("effectgate_inbox_quarantine_oldest_age_seconds", "source" => source.to_owned())
        .set(oldest_quarantined_s);
}

/// A policy named `policy` (a module name from the config) ran for `d`.
pub fn policy_time(policy: &str, d: Duration) {
    histogram!("effectgate_policy_call_seconds", "policy" => policy.to_owned())
        .record(d.as_secs_f64());
}

/// A read-back on `route` took `d` (until its answer or its error).
pub fn read_back_latency(route: &str, d: Duration) {
    histogram!("effectgate_read_back_latency_seconds", "route" => route.to_owned())
        .record(d.as_secs_f64());
}

static DRIFT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A read-back found at the provider an operation the ledger had as UNKNOWN.
pub fn drift_found() {
    counter!("effectgate_reconciliation_drift_total").increment(1);
    DRIFT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// A reconciler scan starts: `effectgate_reconciliation_drift` becomes
/// what the previous scan found (its executions may still have been
/// running when it ended).
pub fn drift_scan() {
    let n = DRIFT.swap(0, std::sync::atomic::Ordering::Relaxed);
    gauge!("effectgate_reconciliation_drift").set(n as f64);
}

/// Scrape-time gauges of the outbox and the ledger.
pub fn scrape_gauges(ledger_up: bool, outbox_pending: i64, outbox_lag_s: f64) {
    gauge!("effectgate_ledger_up").set(if ledger_up { 1.0 } else { 0.0 });
    gauge!("effectgate_outbox_pending_events").set(outbox_pending as f64);
    gauge!("effectgate_outbox_lag_seconds").set(outbox_lag_s);
}

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("the bucket list is not empty")
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full(
                        "effectgate_ledger_batch_size".into(),
                    ),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("the bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (e.g. an embedding
            // application's); then this handle renders only our metrics'
            // absence, which is the embedder's choice.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// A request on `route` ended with `outcome`.
pub fn request(route: &str, outcome: &'static str) {
    counter!("effectgate_requests_total", "route" => route.to_owned(), "outcome" => outcome)
        .increment(1);
    match outcome {
        "replayed" => {
            counter!("effectgate_replays_total", "route" => route.to_owned()).increment(1)
        }
        "fingerprint-mismatch" => {
            counter!("effectgate_fingerprint_mismatches_total", "route" => route.to_owned())
                .increment(1)
        }
        "in-flight" => {
            counter!("effectgate_in_flight_conflicts_total", "route" => route.to_owned())
                .increment(1)
        }
        _ => {}
    }
}

/// An attempt's outcome was recorded.
/// `state` is the ledger state's name (`COMPLETED`, …).
pub fn recorded(tenant: &str, route: &str, state: &'static str) {
    counter!("effectgate_operations_recorded_total", "tenant" => tenant.to_owned(), "route" => route.to_owned(), "state" => state)
        .increment(1);
}

/// A transient failure is retried.
pub fn retry(route: &str) {
    counter!("effectgate_retries_total", "route" => route.to_owned()).increment(1);
}

/// A compensation of an operation on `route` was `requested`.
pub fn compensation(route: &str, outcome: &'static str) {
    counter!("effectgate_compensations_total", "route" => route.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// A reconciliation step ended with `outcome`.
pub fn reconciliation(outcome: &'static str) {
    counter!("effectgate_reconciliations_total", "outcome" => outcome).increment(1);
}

/// A write carrying a stale fencing token was rejected.
pub fn stale_fence() {
    counter!("effectgate_stale_fence_rejections_total").increment(1);
}

/// Operations the retention sweeper deleted.
pub fn swept(n: u64) {
    counter!("effectgate_retention_swept_total").increment(n);
}

/// Time from sending to the end of the provider's response.
pub fn upstream_latency(route: &str, d: Duration) {
    histogram!("effectgate_upstream_latency_seconds", "route" => route.to_owned())
        .record(d.as_secs_f64());
}

/// A policy call took `d`; `failure` is its failure kind, if it failed.
pub fn policy_call(d: Duration, failure: Option<&'static str>) {
    histogram!("effectgate_policy_evaluation_seconds").record(d.as_secs_f64());
    if let Some(kind) = failure {
        counter!("effectgate_policy_failures_total", "kind" => kind).increment(1);
    }
}

/// A policy failed after its call returned (`kind`: `invalid-output`), or
/// did not run (`busy`, `circuit-open`).
pub fn policy_failure(kind: &'static str) {
    counter!("effectgate_policy_failures_total", "kind" => kind).increment(1);
}

/// The circuit breaker of `tenant`'s `policy` opened (`policy` is a module
/// name from the config).
pub fn policy_breaker_trip(tenant: &str, policy: &str) {
    counter!("effectgate_policy_breaker_trips_total", "tenant" => tenant.to_owned(), "policy" => policy.to_owned())
        .increment(1);
}

/// An MCP tool call ended with `outcome` (`ok`, `tool-error`, `jsonrpc-error`).
pub fn mcp_tool_call(route: &str, outcome: &'static str) {
    counter!("effectgate_mcp_tool_calls_total", "route" => route.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Sets the per-tenant gauges (called on each scrape): UNKNOWN count and
/// the oldest one's age, dead letters and the oldest one's age (seconds).
pub fn tenant_gauges(
    tenant: &str,
    (unknown, unknown_age_s): (i64, f64),
    dead_letters: i64,
    oldest_age_s: f64,
) {
    gauge!("effectgate_unknown_operations", "tenant" => tenant.to_owned()).set(unknown as f64);
    gauge!("effectgate_unknown_oldest_age_seconds", "tenant" => tenant.to_owned())
        .set(unknown_age_s);
    gauge!("effectgate_dead_letters", "tenant" => tenant.to_owned()).set(dead_letters as f64);
    gauge!("effectgate_dead_letter_oldest_age_seconds", "tenant" => tenant.to_owned())
        .set(oldest_age_s);
}

/// A connection was closed or refused by a listener's limits; `reason`:
/// `header-timeout`, `no-request-head` / `idle` (closed to make room at
/// the connection cap), `busy` (refused: every connection was busy).
pub fn connection_refused(listener: &'static str, reason: &'static str) {
    counter!("effectgate_connections_closed_total", "listener" => listener, "reason" => reason)
        .increment(1);
}

/// Bytes of bodies `tenant`'s operations hold in the ledger, as last
/// measured (tenants with `max_stored_bytes`).
pub fn tenant_stored_bytes(tenant: &str, bytes: i64) {
    gauge!("effectgate_tenant_stored_bytes", "tenant" => tenant.to_owned()).set(bytes as f64);
}

/// A call of `tenant` was refused by a limit (`rate`, `in-flight`, `stored-bytes`).
pub fn tenant_limited(tenant: &str, limit: &'static str) {
    counter!("effectgate_tenant_limited_total", "tenant" => tenant.to_owned(), "limit" => limit)
        .increment(1);
}
