//! Headers as storable text: (name, value) pairs that keep every byte,
//! for the effect ledger, and the visible-ASCII view a policy gets.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// A header value as storable text, one `char` per byte (ISO-8859-1), so
/// that obs-text bytes (0x80–0xFF, RFC 9110 §5.5) survive the effect ledger.
/// Visible-ASCII values are stored unchanged.
pub fn value_text(v: &HeaderValue) -> String {
    v.as_bytes().iter().map(|&b| char::from(b)).collect()
}

/// The reverse of [`value_text`]. `None` when `s` holds a `char` above
/// U+00FF or a byte a header value can't hold (control characters).
pub fn text_value(s: &str) -> Option<HeaderValue> {
    let bytes: Vec<u8> = s
        .chars()
        .map(|c| u8::try_from(c).ok())
        .collect::<Option<_>>()?;
    HeaderValue::from_bytes(&bytes).ok()
}

/// Headers as a storable list of (name, value) pairs, in order, repeated
/// names kept. Values are encoded by [`value_text`], so no header is lost.
pub fn to_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(n, v)| (n.as_str().to_owned(), value_text(v)))
        .collect()
}

/// Headers whose values are visible ASCII, as (name, value) pairs: the view
/// a policy gets. Others are left out rather than guessed at.
pub fn visible_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect()
}

/// The reverse of [`to_pairs`]. A pair that can't be a header (a name that
/// is not a token) is skipped.
pub fn from_pairs(pairs: &[(String, String)]) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(pairs.len());
    for (n, v) in pairs {
        if let (Ok(n), Some(v)) = (HeaderName::from_bytes(n.as_bytes()), text_value(v)) {
            h.append(n, v);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_header_values_keep_every_byte() {
        let mut h = HeaderMap::new();
        h.append(
            "x-note",
            HeaderValue::from_bytes("café".as_bytes()).unwrap(),
        );
        h.append("x-note", HeaderValue::from_static("second"));
        h.append(
            "x-raw",
            HeaderValue::from_bytes(&[b'a', 0xff, b'b']).unwrap(),
        );
        let pairs = to_pairs(&h);
        assert_eq!(pairs.len(), 3);
        assert_eq!(pairs[1], ("x-note".to_owned(), "second".to_owned()));
        let back = from_pairs(&pairs);
        assert_eq!(back, h);
        let notes: Vec<&[u8]> = back
            .get_all("x-note")
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        assert_eq!(notes, vec!["café".as_bytes(), b"second".as_slice()]);
        // A policy only sees the visible-ASCII values.
        assert_eq!(
            visible_pairs(&h),
            vec![("x-note".to_owned(), "second".to_owned())]
        );
        // Text that no header value can hold is refused, not mangled.
        assert!(text_value("snow ☃").is_none());
        assert!(text_value("a\u{0}b").is_none());
    }
}
