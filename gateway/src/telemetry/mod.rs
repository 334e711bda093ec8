//! Logs and traces: the `tracing` subscriber (human text or one JSON object
//! a line), OpenTelemetry trace export over OTLP/HTTP (protobuf), and W3C
//! Trace Context (`traceparent`, `tracestate`) in and out.
//!
//! Export is on when an endpoint is set, in `[telemetry] endpoint` or in
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (the variable wins); without one no
//! OpenTelemetry layer is installed and no span is built at all (every
//! layer that is installed declines them), so a request pays nothing for
//! them. Spans of the gateway's own steps (policy calls, ledger commands,
//! provider attempts, read-backs, webhook deliveries) are at DEBUG level,
//! the request's span at INFO; only the export layer takes spans.
//!
//! Log lines are events only. A line written while a request is served
//! carries that request's id, trace id and operation id from its
//! [`RequestContext`] (a task-local the HTTP layer sets, which the
//! executions a request spawns carry on), not from a span: formatting a
//! span's fields for the log, on every request whether or not it logs a
//! line, cost about a tenth of a pass-through call.
//!
//! Span and attribute names follow the OpenTelemetry HTTP semantic
//! conventions (`http.request.method`, `http.response.status_code`,
//! `url.path`, `server.address`, …) with `effectgate.*` attributes for the
//! tenant, route, operation id, state and fencing token. Bodies and
//! credentials never go into spans.

mod log_fields;
mod request;

pub use log_fields::LogFields;
use request::JsonWithRequest;
pub use request::{
    RequestContext, WithRequest, in_request, note_operation_id, request_context, request_id,
    with_request,
};

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags, TraceState, TracerProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// W3C Trace Context header names (<https://www.w3.org/TR/trace-context/>).
pub const TRACEPARENT: &str = "traceparent";
/// See [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable text (the default).
    #[default]
    Text,
    /// One JSON object a line (tracing-subscriber's `json` format), with the
    /// fields of the enclosing spans (request id, trace id, operation id).
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!(
                "log format {other:?}: expected \"text\" or \"json\""
            )),
        }
    }
}

/// Trace export settings, resolved from `[telemetry]` and the standard
/// `OTEL_*` variables when the config loads.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    /// OTLP/HTTP traces URL (`…/v1/traces`), or `None`: export off.
    pub traces_endpoint: Option<String>,
    /// `service.name` of the exported resource. Default `effectgate`.
    pub service_name: String,
    /// Share of new traces sampled, 0.0–1.0 (a caller's sampled flag is
    /// followed: parent-based). Default 1.0.
    pub sampling_ratio: f64,
    /// Extra headers on every export request (e.g. a collector's API key).
    pub headers: Vec<(String, String)>,
    /// Timeout of one export request, ms. Default 10000.
    pub export_timeout_ms: u64,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            traces_endpoint: None,
            service_name: "effectgate".into(),
            sampling_ratio: 1.0,
            headers: Vec::new(),
            export_timeout_ms: 10_000,
        }
    }
}

/// Appends the OTLP/HTTP traces path to a base endpoint
/// (`http://collector:4318` → `http://collector:4318/v1/traces`), as the
/// OTLP exporter specification does for `OTEL_EXPORTER_OTLP_ENDPOINT`.
pub fn traces_url(base: &str) -> String {
    let base = base.trim();
    if base.ends_with("/v1/traces") {
        return base.to_owned();
    }
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// What [`init`] installed; [`Telemetry::shutdown`] flushes the spans
/// still queued for export.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every span ended so far (blocks until the export requests
    /// are answered or time out; call it off the async workers).
    pub fn flush(&self) {
        if let Some(p) = &self.provider
            && let Err(e) = p.force_flush()
        {
            eprintln!("telemetry: flushing spans failed: {e}");
        }
    }

    /// Exports what is queued and stops the exporter (bounded by the
    /// export timeout). Call it before the runtime stops.
    pub fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            eprintln!("telemetry: flushing spans failed: {e}");
        }
    }
}

/// Installs the process-wide subscriber: the log layer (filtered by
/// `RUST_LOG`, default `effectgate=info,warn`) in `format`, and, when
/// `settings` names an endpoint, the OpenTelemetry layer exporting over
/// OTLP/HTTP from a background thread. Must run inside the Tokio runtime
/// (export requests are sent on it).
///
/// Errors: the exporter can't be built (a bad endpoint URL or header).
/// Installing a second subscriber in one process is not an error: the
/// first one stays (tests start several gateways in one process).
pub fn init(format: LogFormat, settings: &TelemetrySettings) -> anyhow::Result<Telemetry> {
    init_with(format, settings, "effectgate=info,warn")
}

/// [`init`] with another log filter when `RUST_LOG` is unset (for an
/// embedding program that wants fewer lines).
///
/// Errors: as [`init`].
pub fn init_with(
    format: LogFormat,
    settings: &TelemetrySettings,
    default_filter: &str,
) -> anyhow::Result<Telemetry> {
    let (dispatch, provider) = dispatch(format, settings, default_filter)?;
    if provider.is_some() {
        EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let _ = dispatch.try_init();
    Ok(Telemetry { provider })
}

/// The subscriber [`init_with`] installs, and its exporter when `settings`
/// names an endpoint.
///
/// Errors: as [`init`].
fn dispatch(
    format: LogFormat,
    settings: &TelemetrySettings,
    default_filter: &str,
) -> anyhow::Result<(tracing::Dispatch, Option<SdkTracerProvider>)> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // The log layer takes events only: the request's ids come from its
    // [`RequestContext`].
    // (The hint keeps the subscriber's most verbose level the filter's, so
    // that disabled `log` records and events stay skipped early: without
    // one, `and` has none.)
    let events = tracing_subscriber::filter::filter_fn(|m| m.is_event())
        .with_max_level_hint(tracing_subscriber::filter::LevelFilter::TRACE);
    let filter = Fresh(filter.and(events));
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .fmt_fields(LogFields)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(false)
            .with_span_list(false)
            .map_event_format(|json| JsonWithRequest { json })
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let (otel, provider) = match &settings.traces_endpoint {
        None => (None, None),
        Some(endpoint) => {
            let provider = tracer_provider(endpoint, settings)?;
            let tracer = provider.tracer("effectgate");
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_location(false)
                .with_threads(false)
                // A `target` attribute (the Rust module) on every span is
                // no semantic convention and costs every span a field.
                .with_target(false)
                // Per poll of a request's future these would start the
                // OpenTelemetry span, attach its context and read the clock
                // twice; nothing here reads `Context::current()`, and the
                // span's start and end times are kept either way.
                .with_context_activation(false)
                .with_tracked_inactivity(false)
                .with_filter(Fresh(
                    tracing_subscriber::filter::Targets::new()
                        .with_target("effectgate", tracing::Level::DEBUG),
                ));
            (Some(layer), Some(provider))
        }
    };
    // Without export the subscriber is the log layer alone: an absent layer
    // (`Option::None`) still declares an interest in every callsite, so
    // with one in the stack every span would be built in the registry, and
    // entered and closed, for no layer that wants it.
    let registry = tracing_subscriber::registry().with(fmt);
    let dispatch = match otel {
        Some(otel) => tracing::Dispatch::new(registry.with(otel)),
        None => tracing::Dispatch::new(registry),
    };
    Ok((dispatch, provider))
}

/// A per-layer filter that decides each span and event right before it is
/// recorded: `F`'s decisions, with a callsite that `F` always wants
/// reported as wanted "sometimes" (one that `F` never wants stays "never",
/// and costs nothing).
///
/// `tracing-subscriber` 0.3 carries a per-layer filter's decision from
/// `enabled` to `on_event` / `on_new_span` in a thread-local. A callsite
/// whose interest is cached as "always" skips `enabled`, and its event then
/// reads whatever the last `enabled` call on that thread left there. After
/// a check that no event followed (sqlx asks whether a level is enabled
/// before it logs a server notice, and that notice is off under the
/// default filter), the next event on the thread was dropped from the log:
/// on a PostgreSQL ledger that was already migrated, `effectgate serving`
/// never appeared (tokio-rs/tracing#2519). The cost is one pass of `F`
/// for each span or event it wants.
struct Fresh<F>(F);

impl<S, F: tracing_subscriber::layer::Filter<S>> tracing_subscriber::layer::Filter<S> for Fresh<F> {
    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        let interest = self.0.callsite_enabled(meta);
        if interest.is_always() {
            tracing::subscriber::Interest::sometimes()
        } else {
            interest
        }
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<tracing_subscriber::filter::LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_new_span(attrs, id, cx);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_record(id, values, cx);
    }

    fn on_enter(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_enter(id, cx);
    }

    fn on_exit(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_exit(id, cx);
    }

    fn on_close(&self, id: tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_close(id, cx);
    }
}

fn tracer_provider(
    endpoint: &str,
    settings: &TelemetrySettings,
) -> anyhow::Result<SdkTracerProvider> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let client = ExportClient::new(Duration::from_millis(settings.export_timeout_ms))?;
    let headers: HashMap<String, String> = settings.headers.iter().cloned().collect();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_millis(settings.export_timeout_ms))
        .with_headers(headers)
        .with_http_client(client)
        .build()
        .map_err(|e| anyhow::anyhow!("telemetry.endpoint: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sampling_ratio,
        ))))
        .with_resource(resource)
        .build())
}

/// The exporter's HTTP client: the gateway's own rustls client (system
/// roots, `HTTPS_PROXY`/`NO_PROXY` honoured), driven on the Tokio runtime
/// the gateway runs on (the batch exporter calls it from its own thread).
#[derive(Debug)]
struct ExportClient {
    client: crate::egress::HttpClient,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl ExportClient {
    fn new(timeout: Duration) -> anyhow::Result<Self> {
        let files = crate::tls::ClientTlsFiles::default();
        let tls = crate::tls::client_config(&files, true)
            .map_err(|e| anyhow::anyhow!("telemetry: TLS: {}", e.message))?;
        let client = crate::egress::build_client(crate::egress::ClientOptions {
            connect_timeout_ms: timeout.as_millis().try_into().unwrap_or(u64::MAX),
            idle_timeout_ms: crate::egress::DEFAULT_IDLE_TIMEOUT_MS,
            tls,
            server_name: None,
            proxy: crate::egress::Proxy::Environment,
        });
        Ok(Self {
            client,
            runtime: tokio::runtime::Handle::try_current()
                .map_err(|e| anyhow::anyhow!("telemetry: {e}"))?,
            timeout,
        })
    }
}

/// The most of an OTLP collector's answer to an export that is read,
/// bytes (1 MiB; the answer is a short status message): a larger one
/// fails the export.
const EXPORT_ANSWER_MAX_BYTES: usize = 1 << 20;

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for ExportClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        use http_body_util::BodyExt;
        let (parts, body) = request.into_parts();
        let request = http::Request::from_parts(parts, crate::egress::OutboundBody::from(body));
        let (client, timeout) = (self.client.clone(), self.timeout);
        // The export must not be traced itself (a span per export would
        // feed the next export).
        let task = self.runtime.spawn(
            async move {
                tokio::time::timeout(timeout, async move {
                    let response = client.request(request).await?;
                    let (parts, body) = response.into_parts();
                    let body = http_body_util::Limited::new(body, EXPORT_ANSWER_MAX_BYTES)
                        .collect()
                        .await?
                        .to_bytes();
                    Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(parts, body))
                })
                .await
                .map_err(|_| -> opentelemetry_http::HttpError { "export timed out".into() })?
            }
            .with_subscriber(tracing::subscriber::NoSubscriber::default()),
        );
        task.await
            .map_err(|e| -> opentelemetry_http::HttpError { e.to_string().into() })?
    }
}

use tracing::instrument::WithSubscriber;

/// The W3C Trace Context a request arrived with, as an OpenTelemetry
/// context (empty when the headers carry none or an invalid one).
pub fn extract(headers: &HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers))
}

static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process exports spans ([`init`] installed an exporter).
/// Without export the helpers below skip every OpenTelemetry step and no
/// export layer is installed, so a request pays nothing for them.
pub fn exporting() -> bool {
    EXPORTING.load(std::sync::atomic::Ordering::Relaxed)
}

/// `span`'s OpenTelemetry span context, when spans are exported and it
/// has a valid one. (Without export every span is disabled: only the
/// export layer takes spans.)
fn span_context(span: &tracing::Span) -> Option<SpanContext> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Makes the W3C Trace Context of `headers` the parent of `span` (no-op
/// without export).
pub fn set_parent_from(span: &tracing::Span, headers: &HeaderMap) {
    if exporting() && headers.contains_key(TRACEPARENT) {
        let _ = span.set_parent(extract(headers));
    }
}

/// The `traceparent` of `span`, if it has an OpenTelemetry context (export on).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    span_context(span).map(|sc| format_traceparent(&sc))
}

/// The trace id (32 lowercase hex digits) of `span`, when spans are
/// exported and it has an OpenTelemetry context (reading it starts the
/// span).
pub fn trace_id_of_span(span: &tracing::Span) -> Option<String> {
    span_context(span).map(|sc| hex::encode(sc.trace_id().to_bytes()))
}

/// The trace id (32 lowercase hex digits) of a `traceparent` value, when
/// it is a valid one (W3C Trace Context §3.2).
pub fn trace_id_of_traceparent(value: &HeaderValue) -> Option<String> {
    value
        .to_str()
        .ok()
        .and_then(parse_traceparent)
        .map(|sc| hex::encode(sc.trace_id().to_bytes()))
}

/// `00-<trace id>-<span id>-<flags>` (W3C Trace Context §3.2), 55 bytes of
/// lowercase hex and dashes. Hex-encoded byte by byte: `TraceId`'s
/// `Display` (`{:032x}` of a `u128`) costs about ten times as much, once
/// or twice on every exported request.
fn traceparent_bytes(sc: &SpanContext) -> [u8; 55] {
    let mut b = *b"00-00000000000000000000000000000000-0000000000000000-00";
    // The slices are exactly twice the bytes' lengths, so these can't fail.
    let _ = hex::encode_to_slice(sc.trace_id().to_bytes(), &mut b[3..35]);
    let _ = hex::encode_to_slice(sc.span_id().to_bytes(), &mut b[36..52]);
    let _ = hex::encode_to_slice([sc.trace_flags().to_u8()], &mut b[53..55]);
    b
}

/// `00-<trace id>-<span id>-<flags>` (W3C Trace Context §3.2).
pub fn format_traceparent(sc: &SpanContext) -> String {
    traceparent_bytes(sc)
        .iter()
        .map(|&b| char::from(b))
        .collect()
}

/// [`format_traceparent`] as a header value (always one: hex digits and
/// dashes).
fn traceparent_value(sc: &SpanContext) -> Option<HeaderValue> {
    HeaderValue::from_bytes(&traceparent_bytes(sc)).ok()
}

/// `span`'s `traceparent` as a header value, if it has an OpenTelemetry
/// context (export on).
pub fn traceparent_header_of(span: &tracing::Span) -> Option<HeaderValue> {
    span_context(span).and_then(|sc| traceparent_value(&sc))
}

/// Parses a `traceparent` value (version 00; W3C Trace Context §3.2); an
/// invalid one is `None`.
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let mut headers = HeaderMap::new();
    headers.insert(TRACEPARENT, HeaderValue::from_str(value).ok()?);
    let cx = TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(&headers));
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Sets `traceparent` (and `tracestate`) on an outbound request for the
/// current attempt:
/// - with export on, the attempt's own span (`span`), a fresh span id each
///   attempt;
/// - with export off, the trace the operation was created in (`stored`, a
///   `traceparent`), with a fresh random span id, so the provider can still
///   correlate attempts with the caller's trace;
/// - otherwise nothing (any `traceparent` in `headers` is removed).
pub fn inject_attempt(span: &tracing::Span, stored: Option<&str>, headers: &mut HeaderMap) {
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    let sc = if let Some(sc) = span_context(span) {
        sc
    } else if let Some(parent) = stored.and_then(parse_traceparent) {
        SpanContext::new(
            parent.trace_id(),
            opentelemetry::trace::SpanId::from_bytes(rand::random::<[u8; 8]>()),
            parent.trace_flags() & TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        )
    } else {
        return;
    };
    if let Some(v) = traceparent_value(&sc) {
        headers.insert(TRACEPARENT, v);
    }
    let state = sc.trace_state().header();
    if !state.is_empty()
        && let Ok(v) = HeaderValue::from_str(&state)
    {
        headers.insert(TRACESTATE, v);
    }
}

/// Links `span` to the trace an operation was created in (`stored`, a
/// `traceparent`): reconciliation runs in a trace of its own that points
/// back to the original request.
pub fn link_to(span: &tracing::Span, stored: Option<&str>) {
    if !exporting() {
        return;
    }
    if let Some(sc) = stored.and_then(parse_traceparent) {
        span.add_link(sc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spans are built only for the export layer: without export the
    /// request's span and the steps' spans are disabled at their callsites
    /// (the log layer takes events only), with it they are built.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn spans_are_built_only_when_exported() {
        let request_span = || tracing::info_span!(target: "effectgate::http", "HTTP request");
        let step_span = || tracing::debug_span!(target: "effectgate::ledger", "ledger command");
        let off = TelemetrySettings::default();
        for format in [LogFormat::Text, LogFormat::Json] {
            let (d, provider) = dispatch(format, &off, "effectgate=debug,warn").unwrap();
            assert!(provider.is_none());
            tracing::dispatcher::with_default(&d, || {
                assert!(request_span().is_disabled(), "{format:?}");
                assert!(step_span().is_disabled(), "{format:?}");
            });
        }
        let on = TelemetrySettings {
            traces_endpoint: Some("http://127.0.0.1:9/v1/traces".into()),
            export_timeout_ms: 100,
            ..TelemetrySettings::default()
        };
        let (d, provider) = dispatch(LogFormat::Text, &on, "effectgate=info,warn").unwrap();
        assert!(provider.is_some());
        tracing::dispatcher::with_default(&d, || {
            assert!(!request_span().is_disabled());
            assert!(!step_span().is_disabled());
        });
    }

    #[test]
    fn traces_url_appends_the_signal_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn traceparent_round_trip_and_invalid_values() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(tp).unwrap();
        assert_eq!(format_traceparent(&sc), tp);
        assert_eq!(traceparent_value(&sc).unwrap(), tp);
        let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        assert_eq!(
            format_traceparent(&parse_traceparent(unsampled).unwrap()),
            unsampled
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn an_attempt_without_export_continues_the_stored_trace_with_a_fresh_span() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut h = HeaderMap::new();
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-11111111111111111111111111111111-2222222222222222-01"),
        );
        inject_attempt(&tracing::Span::none(), Some(tp), &mut h);
        let sent = h.get(TRACEPARENT).unwrap().to_str().unwrap().to_owned();
        assert!(
            sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{sent}"
        );
        assert!(!sent.contains("00f067aa0ba902b7"), "{sent}");
        let mut h2 = HeaderMap::new();
        inject_attempt(&tracing::Span::none(), Some(tp), &mut h2);
        assert_ne!(
            h2.get(TRACEPARENT),
            h.get(TRACEPARENT),
            "a fresh span id per attempt"
        );
        let mut none = HeaderMap::new();
        none.insert(TRACEPARENT, HeaderValue::from_static(tp));
        inject_attempt(&tracing::Span::none(), None, &mut none);
        assert!(none.get(TRACEPARENT).is_none());
    }
}
