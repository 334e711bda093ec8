//! The request a task serves, as log lines name it: its `x-request-id`,
//! trace id and operation id, in a task-local the HTTP layer sets
//! ([`with_request`]), and the JSON log format that adds them to each line.

use std::sync::Arc;

/// The request a task serves, as its log lines name it: the
/// `x-request-id`, the trace id and, once the call is known to be one, the
/// operation id (the idempotency key). Set by the HTTP layer for each
/// request ([`with_request`]); an execution spawned for a waiting caller
/// carries it on ([`request_context`]).
///
/// The trace id is worked out the first time it is read (a log line
/// written while the request is served): reading the request span's
/// OpenTelemetry context starts that span, and a span started before the
/// request is routed takes every later attribute as a separate update.
#[derive(Debug, Default)]
pub struct RequestContext {
    id: Option<Arc<str>>,
    /// The request span, when it is built (only for export): the trace id
    /// is its own.
    span: Option<tracing::Span>,
    /// The caller's `traceparent`: the trace id when the span has none.
    caller: Option<http::HeaderValue>,
    trace_id: std::sync::OnceLock<Option<String>>,
    operation_id: std::sync::OnceLock<String>,
}

impl RequestContext {
    /// The context of a request with id `id` and trace id `trace_id` (32
    /// lowercase hex digits), either possibly absent.
    pub fn new(id: Option<Arc<str>>, trace_id: Option<String>) -> Self {
        Self {
            id,
            span: None,
            caller: None,
            trace_id: std::sync::OnceLock::from(trace_id),
            operation_id: std::sync::OnceLock::new(),
        }
    }

    /// The context of a request with id `id` served in `span` (the request
    /// span) with request headers `headers`: its trace id is the span's
    /// when spans are exported, else that of the caller's `traceparent`
    /// (none without a valid one), read when first asked for.
    pub fn of_request(
        id: Option<Arc<str>>,
        span: &tracing::Span,
        headers: &http::HeaderMap,
    ) -> Self {
        Self {
            id,
            // Spans are built only when they are exported.
            span: (!span.is_disabled()).then(|| span.clone()),
            caller: headers.get(super::TRACEPARENT).cloned(),
            trace_id: std::sync::OnceLock::new(),
            operation_id: std::sync::OnceLock::new(),
        }
    }

    /// The `x-request-id`.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The trace id (32 lowercase hex digits).
    pub fn trace_id(&self) -> Option<&str> {
        self.trace_id
            .get_or_init(|| {
                self.span
                    .as_ref()
                    .and_then(super::trace_id_of_span)
                    .or_else(|| {
                        self.caller
                            .as_ref()
                            .and_then(super::trace_id_of_traceparent)
                    })
            })
            .as_deref()
    }

    /// The operation id, once [`note_operation_id`] set it.
    pub fn operation_id(&self) -> Option<&str> {
        self.operation_id.get().map(String::as_str)
    }
}

tokio::task_local! {
    static REQUEST: Option<Arc<RequestContext>>;
}

/// `f` with `context` as the current request while it runs: the future
/// [`with_request`] returns.
pub type WithRequest<F> = tokio::task::futures::TaskLocalFuture<Option<Arc<RequestContext>>, F>;

/// Runs `f` with `context` as the current request ([`request_id`], the
/// log lines' ids).
pub fn with_request<F: std::future::Future>(
    context: Option<Arc<RequestContext>>,
    f: F,
) -> WithRequest<F> {
    REQUEST.scope(context, f)
}

/// Runs `f` with `context` as the current request, on this thread (a
/// blocking thread that works for a request: [`with_request`] is for
/// tasks).
pub fn in_request<R>(context: Option<Arc<RequestContext>>, f: impl FnOnce() -> R) -> R {
    REQUEST.sync_scope(context, f)
}

/// The request being served, as a cheap handle to pass to a spawned task.
pub fn request_context() -> Option<Arc<RequestContext>> {
    REQUEST.try_with(Clone::clone).ok().flatten()
}

/// The `x-request-id` of the request being served, if any.
pub fn request_id() -> Option<String> {
    request_context().and_then(|c| c.id().map(str::to_owned))
}

/// Names the operation the request being served is for: on its log lines
/// (`effectgate.operation_id`) and on the current span (export).
pub fn note_operation_id(operation_id: &str) {
    tracing::Span::current().record("effectgate.operation_id", operation_id);
    if let Some(c) = request_context() {
        let _ = c.operation_id.set(operation_id.to_owned());
    }
}

/// The JSON log format with the request's ids: tracing-subscriber's JSON
/// object of the event, with `"span": {"request_id", "trace_id",
/// "effectgate.operation_id"}` added (each one present) when the line is
/// written while a request is served.
pub(super) struct JsonWithRequest<F> {
    pub(super) json: F,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for JsonWithRequest<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let Some(context) = request_context() else {
            return self.json.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.json.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        let object = line.trim_end();
        let Some(open) = object.strip_suffix('}') else {
            return writer.write_str(&line);
        };
        let mut ids = serde_json::Map::new();
        for (name, value) in [
            ("request_id", context.id()),
            ("trace_id", context.trace_id()),
            ("effectgate.operation_id", context.operation_id()),
        ] {
            if let Some(v) = value {
                ids.insert(name.to_owned(), serde_json::Value::from(v));
            }
        }
        let span = serde_json::Value::Object(ids).to_string();
        let sep = if open.ends_with('{') { "" } else { "," };
        writeln!(writer, "{open}{sep}\"span\":{span}}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::LogFields;
    use crate::telemetry::log_fields::tests::Sink;

    /// What `subscriber` writes for an `operation recorded` event (with
    /// its own `operation_id` field when `names_operation`) inside `ctx`,
    /// and for one outside any request.
    fn lines(json: bool, ctx: RequestContext, names_operation: bool) -> (String, String) {
        use std::sync::Mutex;
        let out = Sink(Arc::new(Mutex::new(Vec::new())));
        let sink = out.clone();
        let dispatch: tracing::Dispatch = if json {
            tracing_subscriber::fmt()
                .json()
                .with_current_span(false)
                .with_span_list(false)
                .map_event_format(|json| JsonWithRequest { json })
                .with_writer(move || sink.clone())
                .finish()
                .into()
        } else {
            tracing_subscriber::fmt()
                .fmt_fields(LogFields)
                .with_ansi(false)
                .without_time()
                .with_writer(move || sink.clone())
                .finish()
                .into()
        };
        let text = |out: &Sink| {
            let mut v = out.0.lock().unwrap();
            let s = String::from_utf8(v.clone()).unwrap();
            v.clear();
            s
        };
        tracing::dispatcher::with_default(&dispatch, || {
            in_request(Some(Arc::new(ctx)), || {
                note_operation_id("op-1");
                if names_operation {
                    tracing::info!(operation_id = "op-1", "operation recorded");
                } else {
                    tracing::info!("operation recorded");
                }
            });
        });
        let inside = text(&out);
        tracing::dispatcher::with_default(&dispatch, || tracing::info!("outside"));
        (inside, text(&out))
    }

    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

    /// A request's trace id is its span's when spans are exported (a new
    /// trace here: the span was given no parent), else the caller's
    /// `traceparent`'s, else none; it is read once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_request_traces_id_is_its_spans_when_exported_else_the_callers() {
        use crate::telemetry::{LogFormat, TelemetrySettings};
        let mut headers = http::HeaderMap::new();
        headers.insert(
            crate::telemetry::TRACEPARENT,
            http::HeaderValue::from_str(&format!("00-{TRACE}-00f067aa0ba902b7-01")).unwrap(),
        );
        let request_span = || tracing::info_span!(target: "effectgate::http", "HTTP request");
        let on = TelemetrySettings {
            traces_endpoint: Some("http://127.0.0.1:9/v1/traces".into()),
            export_timeout_ms: 100,
            ..TelemetrySettings::default()
        };
        let (exported, _provider) =
            crate::telemetry::dispatch(LogFormat::Text, &on, "effectgate=info").unwrap();
        tracing::dispatcher::with_default(&exported, || {
            let span = request_span();
            let ctx = RequestContext::of_request(None, &span, &headers);
            let own = crate::telemetry::traceparent_of(&span).unwrap();
            let id = ctx.trace_id().unwrap().to_owned();
            assert_eq!(id.len(), 32);
            assert_eq!(own[3..35], id);
            assert_ne!(id, TRACE);
            assert_eq!(ctx.trace_id(), Some(id.as_str()));
        });
        let (logged, _) = crate::telemetry::dispatch(
            LogFormat::Text,
            &TelemetrySettings::default(),
            "effectgate=info",
        )
        .unwrap();
        tracing::dispatcher::with_default(&logged, || {
            let span = request_span();
            assert_eq!(
                RequestContext::of_request(None, &span, &headers).trace_id(),
                Some(TRACE)
            );
            let none = RequestContext::of_request(None, &span, &http::HeaderMap::new());
            assert_eq!(none.trace_id(), None);
        });
    }

    #[test]
    fn a_text_line_in_a_request_ends_with_its_ids() {
        let ctx = || RequestContext::new(Some("req 1".into()), Some(TRACE.into()));
        let (inside, outside) = lines(false, ctx(), false);
        assert!(
            inside.ends_with(&format!(
                "operation recorded request_id=\"req 1\" trace_id=\"{TRACE}\" effectgate.operation_id=\"op-1\"\n"
            )),
            "{inside}"
        );
        assert!(outside.ends_with("outside\n"), "{outside}");
        // An event that names its operation id is not told it twice.
        let (inside, _) = lines(false, ctx(), true);
        assert!(
            inside.ends_with(&format!(
                "operation recorded operation_id=\"op-1\" request_id=\"req 1\" trace_id=\"{TRACE}\"\n"
            )),
            "{inside}"
        );
        // Only what is known.
        let (inside, _) = lines(false, RequestContext::new(None, None), false);
        assert!(
            inside.ends_with("operation recorded effectgate.operation_id=\"op-1\"\n"),
            "{inside}"
        );
    }

    #[test]
    fn a_json_line_in_a_request_names_its_ids_under_span() {
        let ctx = RequestContext::new(Some("req-1".into()), Some(TRACE.into()));
        let (inside, outside) = lines(true, ctx, false);
        assert_eq!(inside.lines().count(), 1, "{inside}");
        let v: serde_json::Value = serde_json::from_str(&inside).unwrap();
        assert_eq!(v["fields"]["message"], "operation recorded");
        assert_eq!(
            v["span"],
            serde_json::json!({
                "request_id": "req-1",
                "trace_id": TRACE,
                "effectgate.operation_id": "op-1",
            }),
            "{inside}"
        );
        assert_eq!(v["level"], "INFO");
        let v: serde_json::Value = serde_json::from_str(&outside).unwrap();
        assert!(v.get("span").is_none(), "{outside}");
        assert_eq!(v["fields"]["message"], "outside");
    }
}
