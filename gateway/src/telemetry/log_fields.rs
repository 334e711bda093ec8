//! The field formatter of human-readable log lines: what tracing-subscriber's
//! `DefaultFields` writes, with a fast path for the common field, and the
//! ids of the request being served after the event's own fields.
//!
//! A string of visible ASCII without `"` or `\` reads the same under
//! `Debug` with its quotes around it, so such a value is written as
//! `name="value"` directly (`DefaultFields` writes each string through
//! `Debug`, escaping it character by character, and each name through an
//! ANSI style); any other value, the `message` field and every field when
//! the writer colours its output go to `DefaultFields`' own visitor, so a
//! line reads exactly as it would with it.
//!
//! A line written while a request is served ends with that request's
//! `request_id`, `trace_id` and `effectgate.operation_id` (each one
//! known; the operation id not when the event names its `operation_id`
//! itself), from its [`super::RequestContext`].

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};

/// The formatter ([`tracing_subscriber::fmt::FormatFields`] through
/// [`MakeVisitor`]); install it with `fmt::layer().fmt_fields(LogFields)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogFields;

impl<'a> MakeVisitor<Writer<'a>> for LogFields {
    type Visitor = LogVisitor<'a>;

    fn make_visitor(&self, writer: Writer<'a>) -> LogVisitor<'a> {
        LogVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
            names_operation: false,
        }
    }
}

/// The visitor of [`LogFields`]: fields separated by one space.
#[derive(Debug)]
pub struct LogVisitor<'a> {
    writer: Writer<'a>,
    is_empty: bool,
    result: fmt::Result,
    /// The event has an `operation_id` field of its own.
    names_operation: bool,
}

/// Whether `Debug` writes `value` as itself between quotes: visible ASCII
/// (no space, no control character) without `"` or `\`.
fn plain(value: &str) -> bool {
    value
        .bytes()
        .all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\')
}

impl LogVisitor<'_> {
    /// Formats one field with `DefaultFields`' visitor, continuing this
    /// line.
    fn delegate(&mut self, f: impl FnOnce(&mut DefaultVisitor<'_>)) {
        let mut v = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        f(&mut v);
        self.result = v.finish();
        self.is_empty = false;
    }
}

impl Visit for LogVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        self.names_operation |= name == "operation_id";
        // `DefaultFields` skips the `log` crate's metadata fields without
        // a separator.
        if name.starts_with("log.") {
            return;
        }
        if name == "message"
            || name.starts_with("r#")
            || self.writer.has_ansi_escapes()
            || !plain(value)
        {
            return self.delegate(|v| v.record_str(field, value));
        }
        let w = &mut self.writer;
        let pad = if self.is_empty { "" } else { " " };
        self.is_empty = false;
        self.result = w
            .write_str(pad)
            .and_then(|()| w.write_str(name))
            .and_then(|()| w.write_str("=\""))
            .and_then(|()| w.write_str(value))
            .and_then(|()| w.write_char('"'));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        // `DefaultFields` skips the `log` crate's metadata fields without
        // a separator.
        if field.name().starts_with("log.") {
            return;
        }
        self.names_operation |= field.name() == "operation_id";
        self.delegate(|v| v.record_debug(field, value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.result.is_err() {
            return;
        }
        self.delegate(|v| v.record_error(field, value));
    }
}

impl LogVisitor<'_> {
    /// Writes `name=value` after the fields so far (the value as `Debug`
    /// writes a string unless it is plain).
    fn append(&mut self, name: &str, value: &str) {
        let pad = if self.is_empty { "" } else { " " };
        self.is_empty = false;
        let w = &mut self.writer;
        self.result = if plain(value) {
            write!(w, "{pad}{name}=\"{value}\"")
        } else {
            write!(w, "{pad}{name}={value:?}")
        };
    }
}

impl VisitOutput<fmt::Result> for LogVisitor<'_> {
    fn finish(mut self) -> fmt::Result {
        if self.result.is_ok()
            && let Some(c) = super::request_context()
        {
            for (name, value) in [
                ("request_id", c.id()),
                ("trace_id", c.trace_id()),
                (
                    "effectgate.operation_id",
                    c.operation_id().filter(|_| !self.names_operation),
                ),
            ] {
                if let Some(v) = value
                    && self.result.is_ok()
                {
                    self.append(name, v);
                }
            }
        }
        self.result
    }
}

impl VisitFmt for LogVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tracing_subscriber::fmt::FormatFields;
    use tracing_subscriber::fmt::format::DefaultFields;

    /// The fields of one event, as `fields` formats them.
    fn line<F: for<'w> FormatFields<'w> + Send + Sync + 'static>(fields: F) -> String {
        use std::sync::{Arc, Mutex};
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Sink(sink.clone()))
            .with_ansi(false)
            .without_time()
            .with_target(false)
            .with_level(false)
            .fmt_fields(fields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "req",
                url.path = "/pay/v1/charges",
                request_id = "a b",
                n = 3u64,
                quoted = "say \"hi\"",
                tenant = tracing::field::Empty,
            );
            span.record("tenant", "acme");
            let _g = span.enter();
            // A `log` crate metadata field first: skipped, no separator.
            let inner = tracing::info_span!("inner", log.target = "x", y = 1u64);
            let _i = inner.enter();
            let err = std::io::Error::other("boom");
            tracing::info!(
                path = "/x\ny",
                ok = true,
                error = &err as &(dyn std::error::Error + 'static),
                "operation recorded: {}",
                "café"
            );
        });
        String::from_utf8(out.lock().unwrap().clone()).unwrap()
    }

    /// A log writer into shared memory: what a test's subscriber wrote.
    #[derive(Clone)]
    pub(in crate::telemetry) struct Sink(
        pub(in crate::telemetry) std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    );

    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_read_exactly_as_with_the_default_fields() {
        let ours = line(LogFields);
        assert_eq!(ours, line(DefaultFields::new()));
        assert!(
            ours.contains(
                r#"req{url.path="/pay/v1/charges" request_id="a b" n=3 quoted="say \"hi\"" tenant="acme"}"#
            ),
            "{ours}"
        );
        assert!(ours.contains("inner{y=1}"), "{ours}");
        assert!(
            ours.contains(r#"operation recorded: café path="/x\ny" ok=true error=boom"#),
            "{ours}"
        );
    }

    #[test]
    fn plain_values_are_visible_ascii_without_quotes_or_backslashes() {
        assert!(plain("/pay/v1/charges?x=1"));
        assert!(plain(""));
        for not in ["a b", "a\"b", "a\\b", "tab\t", "é", "\u{1b}[31m"] {
            assert!(!plain(not), "{not:?}");
        }
    }
}
