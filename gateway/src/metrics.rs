//! Prometheus metrics (`GET /metrics` on the admin listener).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `effectgate_requests_total` | counter | `route`, `outcome` (`forwarded`, `replayed`, `fingerprint-mismatch`, `in-flight`, `outcome-unknown`, `rejected`, `recorded-completed`, `recorded-failed`, `recorded-unknown`) |
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

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
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

/// Sets the per-tenant gauges (called on each scrape).
pub fn tenant_gauges(tenant: &str, unknown: i64, dead_letters: i64, oldest_age_s: f64) {
    gauge!("effectgate_unknown_operations", "tenant" => tenant.to_owned()).set(unknown as f64);
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
