//! What `ledger list`, `inbox list` and the other read commands print:
//! table cells, aligned columns, JSON lines and readable times.

/// `v` as one line of JSON, with U+2028, U+2029 and U+0085 escaped too
/// (valid JSON either way, but some line readers split a line at them).
pub(super) fn json_line(v: &serde_json::Value) -> String {
    v.to_string()
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
        .replace('\u{85}', "\\u0085")
}

/// A time in ms since the Unix epoch as RFC 3339 in UTC (`… ms` when out
/// of range).
pub(super) fn readable_time(ms: i64) -> String {
    crate::times::rfc3339(ms).unwrap_or_else(|| format!("{ms} ms"))
}

/// A table cell as printed: as it is, or quoted (with escapes) when it is
/// empty, a lone `-` (which stands for a missing value), or holds white
/// space, a quote, or a character Rust's `Debug` escapes (control and
/// format characters: bidirectional overrides, zero-width spaces), so
/// that every line splits into the same columns and shows what it holds.
pub(super) fn cell(s: &str) -> String {
    if s.is_empty()
        || s == "-"
        || s.chars().any(|c| {
            c.is_whitespace() || c == '"' || c == '\\' || c.escape_debug().nth(1).is_some()
        })
    {
        format!("{s:?}")
    } else {
        s.to_owned()
    }
}

/// Prints `head` and `rows` (cells as [`cell`] made them, `-` for a
/// missing value) as columns as wide as their widest cell, two spaces
/// apart; the columns at the indexes in `right` are aligned right. The
/// last column is not padded. Widths are terminal columns (Unicode
/// `East_Asian_Width`: a CJK character or an emoji takes two), not
/// characters, so a column starts at the same place on every line.
/// Without rows it prints nothing, not even the header: a script counting
/// lines counts rows.
pub(super) fn print_table(head: &[&str], rows: &[Vec<String>], right: &[usize]) {
    use unicode_width::UnicodeWidthStr;
    if rows.is_empty() {
        return;
    }
    let last = head.len().saturating_sub(1);
    let mut widths: Vec<usize> = head.iter().map(|h| h.width()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.width());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, c) in cells.iter().enumerate() {
            let fill = " ".repeat(widths[i].saturating_sub(c.width()));
            if i == last {
                out.push_str(c);
            } else if right.contains(&i) {
                out.push_str(&fill);
                out.push_str(c);
                out.push_str("  ");
            } else {
                out.push_str(c);
                out.push_str(&fill);
                out.push_str("  ");
            }
        }
        println!("{out}");
    };
    line(head.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}
