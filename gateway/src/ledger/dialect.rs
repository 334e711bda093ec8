//! SQL text per dialect. The ledger's statements are written once, with
//! SQLite's `?` / `?N` placeholders; PostgreSQL gets them as `$N`. Each
//! distinct statement is converted once and kept for the process's life
//! (the set of statements is fixed, so this is bounded).

use std::collections::HashMap;
use std::sync::{LazyLock, RwLock};

static CACHE: LazyLock<RwLock<HashMap<(usize, String), &'static str>>> =
    LazyLock::new(Default::default);

/// `sql` converted by `convert`, from the cache when seen before.
pub(super) fn cached(sql: &str, convert: fn(&str) -> String) -> &'static str {
    let key = (convert as usize, sql.to_owned());
    if let Some(s) = CACHE.read().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return s;
    }
    let converted: &'static str = Box::leak(convert(sql).into_boxed_str());
    CACHE
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(converted)
}

/// Free text as both backends store it: PostgreSQL `TEXT` can't hold NUL
/// (U+0000), so it becomes U+FFFD on SQLite too, and a provider reference
/// or a comment that carries one is stored, not refused.
pub(super) fn clean(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains('\0') {
        std::borrow::Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// SQLite placeholders (`?` in order, or `?N`) as PostgreSQL's `$N`.
/// Statements carry no `?` inside string literals.
pub(super) fn dollar_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut next = 0;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '?' {
            out.push(c);
            continue;
        }
        out.push('$');
        if chars.peek().is_some_and(|d| d.is_ascii_digit()) {
            while let Some(d) = chars.peek().copied().filter(char::is_ascii_digit) {
                out.push(d);
                chars.next();
            }
        } else {
            next += 1;
            out.push_str(&next.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_numbered() {
        assert_eq!(
            dollar_placeholders("SELECT a FROM t WHERE b = ? AND c = ?"),
            "SELECT a FROM t WHERE b = $1 AND c = $2"
        );
        assert_eq!(
            dollar_placeholders("WHERE (?1 IS NULL OR x = ?1) LIMIT ?12"),
            "WHERE ($1 IS NULL OR x = $1) LIMIT $12"
        );
    }
}
