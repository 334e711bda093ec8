//! The field formatter of human-readable log lines: what tracing-subscriber's
//! `DefaultFields` writes, with a fast path for the common field.
//!
//! Every request span's fields (method, path, request id, route, tenant,
//! trace id, …) are formatted when the span opens and as each is recorded,
//! whether or not a line is ever logged inside it. `DefaultFields` writes
//! each string through `Debug` (escaping it character by character) and
//! each name through an ANSI style, about a tenth of a pass-through call's
//! instructions. A string of visible ASCII without `"` or `\` reads the
//! same under `Debug` with its quotes around it, so such a value is written
//! as `name="value"` directly; any other value, the `message` field and
//! every field when the writer colours its output go to `DefaultFields`'
//! own visitor, so a line reads exactly as before.

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
        }
    }
}

/// The visitor of [`LogFields`]: fields separated by one space.
#[derive(Debug)]
pub struct LogVisitor<'a> {
    writer: Writer<'a>,
    is_empty: bool,
    result: fmt::Result,
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
        self.delegate(|v| v.record_debug(field, value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.result.is_err() {
            return;
        }
        self.delegate(|v| v.record_error(field, value));
    }
}

impl VisitOutput<fmt::Result> for LogVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for LogVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

#[cfg(test)]
mod tests {
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

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

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
