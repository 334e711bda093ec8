//! Idempotency keys, request fingerprints and provider keys, following
//! draft-ietf-httpapi-idempotency-key-header-07 ("the draft").
//!
//! - §2.1 Syntax: the `Idempotency-Key` field is an Item Structured Header
//!   (RFC 9651) whose value is a String. The common unquoted form
//!   (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`) is accepted too.
//! - §2.2 Uniqueness: keys are scoped to `(tenant, key)`; the tenant comes
//!   from the authenticated principal, never from the request.
//! - §2.4 Idempotency Fingerprint: [`fingerprint`] is used only to detect a
//!   reused key with a different request.
//! - §2.7 Error Scenarios: missing key → 400, reused key with another
//!   payload → 422, concurrent request → 409.

use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::{Digest, Sha256};

/// Name of the request header (draft §2).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Response header set on a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// A malformed, empty, too long or repeated `Idempotency-Key` header
/// (draft-ietf-httpapi-idempotency-key-header §2.1); the text says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidKey(pub String);

/// Reads the `Idempotency-Key` of a request.
///
/// Returns `Ok(None)` when the header is absent.
///
/// Errors ([`InvalidKey`], answered 400 `idempotency-key-invalid`): the header appears
/// more than once; it is not a String or Token item and not a bare run of
/// visible ASCII; it is empty; or it is longer than `max_len` characters.
pub fn parse_key(headers: &HeaderMap, max_len: usize) -> Result<Option<String>, InvalidKey> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(raw) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(InvalidKey("the header appears more than once".into()));
    }
    let raw = raw
        .to_str()
        .map_err(|_| InvalidKey("the value must be printable ASCII".into()))?
        .trim();
    if raw.is_empty() {
        return Err(InvalidKey("the key is empty".into()));
    }
    let key = match sfv::Parser::new(raw).parse::<sfv::Item>() {
        // `a;b=1` would be key `a` with a parameter: another intent sent as
        // `a;b=2` would then replay the first.
        Ok(item) if !item.params.is_empty() => {
            return Err(InvalidKey(
                "parameters (`;…`) are not allowed on the key; send it as a string (\"...\")"
                    .into(),
            ));
        }
        Ok(item) => match item.bare_item {
            sfv::BareItem::String(s) => s.as_str().to_owned(),
            sfv::BareItem::Token(t) => t.as_str().to_owned(),
            _ => bare_key(raw)?,
        },
        Err(_) => bare_key(raw)?,
    };
    if key.is_empty() {
        return Err(InvalidKey("the key is empty".into()));
    }
    if key.chars().count() > max_len {
        return Err(InvalidKey(format!(
            "the key is longer than {max_len} characters"
        )));
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(InvalidKey("the key must be printable ASCII".into()));
    }
    Ok(Some(key))
}

/// The unquoted form: visible ASCII without spaces, quotes, commas or semicolons.
fn bare_key(raw: &str) -> Result<String, InvalidKey> {
    if !raw.is_empty()
        && raw
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"\",;\\".contains(&b))
    {
        Ok(raw.to_owned())
    } else {
        Err(InvalidKey(
            "expected a structured-header string (\"...\") or a bare token of visible ASCII".into(),
        ))
    }
}

/// How a body is canonicalised for the fingerprint.
fn canonical_body(content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mime = content_type
        .and_then(|c| c.split(';').next())
        .map(|c| c.trim().to_ascii_lowercase());
    match mime.as_deref() {
        Some(m) if m == "application/json" || m.ends_with("+json") => {
            // RFC 8785 JSON Canonicalization Scheme: key order and
            // whitespace do not change the fingerprint. It writes numbers
            // as IEEE-754 doubles; a body with a number that no double
            // holds exactly counts byte for byte instead, so that two
            // amounts past a double's precision never fingerprint alike.
            match serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .filter(|_| numbers_survive_jcs(body))
                .and_then(|v| serde_json_canonicalizer::to_vec(&v).ok())
            {
                Some(c) => c,
                None => body.to_vec(),
            }
        }
        Some("application/x-www-form-urlencoded") => {
            let mut pairs: Vec<(String, String)> =
                form_urlencoded::parse(body).into_owned().collect();
            sort_by_name(&mut pairs);
            let enc = form_urlencoded::Serializer::new(String::new())
                .extend_pairs(pairs)
                .finish();
            enc.into_bytes()
        }
        _ => body.to_vec(),
    }
}

/// Whether every number of `body` (valid JSON) keeps its value through
/// RFC 8785 §3.2.2.3, which writes it as the nearest IEEE-754 double:
/// `1.0`, `1e2` and `0.1` do; `9007199254740993` (2^53 + 1) and
/// `0.10000000000000000001` don't. Values are compared as decimals, not as
/// text.
pub(crate) fn numbers_survive_jcs(body: &[u8]) -> bool {
    json_numbers(body).all(|literal| {
        // An integer of at most 15 digits is a double exactly (2^53 has
        // 16): most amounts and ids, without a parse.
        let digits = literal.strip_prefix('-').unwrap_or(literal);
        if digits.len() <= 15 && digits.bytes().all(|b| b.is_ascii_digit()) {
            return true;
        }
        let canonical = serde_json::from_str::<serde_json::Value>(literal)
            .ok()
            .and_then(|v| serde_json_canonicalizer::to_string(&v).ok());
        match (decimal(literal), canonical.as_deref().and_then(decimal)) {
            (Some(a), Some(b)) => a == b,
            _ => false,
        }
    })
}

/// The number tokens of a JSON text, outside its strings.
fn json_numbers(body: &[u8]) -> impl Iterator<Item = &str> {
    let mut i = 0;
    let mut in_string = false;
    std::iter::from_fn(move || {
        while i < body.len() {
            let b = body[i];
            if in_string {
                match b {
                    b'\\' => i += 2,
                    b'"' => {
                        in_string = false;
                        i += 1;
                    }
                    _ => i += 1,
                }
                continue;
            }
            match b {
                b'"' => {
                    in_string = true;
                    i += 1;
                }
                b'-' | b'0'..=b'9' => {
                    let start = i;
                    while i < body.len()
                        && matches!(body[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                    {
                        i += 1;
                    }
                    return std::str::from_utf8(&body[start..i]).ok();
                }
                _ => i += 1,
            }
        }
        None
    })
}

/// A JSON number's exact value as (negative, significant digits without
/// leading or trailing zeros, power of ten): `-12.50` and `-1.25e1` are
/// both `(true, "125", -1)`; zero is `(false, "", 0)` whatever its sign.
/// `None` for an exponent past ±10^18 (no double comes near).
fn decimal(number: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match number.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, number),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    if exponent.unsigned_abs() > 1_000_000_000_000_000 {
        return None;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let mut power = exponent - frac.len() as i64;
    let digits = digits.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    power += (digits.len() - trimmed.len()) as i64;
    if trimmed.is_empty() {
        return Some((false, String::new(), 0));
    }
    Some((negative, trimmed.to_owned(), power))
}

/// Sorts `pairs` by name, keeping the order of pairs of one name: `a=1&b=2`
/// and `b=2&a=1` are one request, but `a=1&a=2` and `a=2&a=1` are two
/// (`items[]=a&items[]=b` is a list; for many parsers the last `amount=`
/// wins).
fn sort_by_name(pairs: &mut [(String, String)]) {
    pairs.sort_by(|x, y| x.0.cmp(&y.0));
}

/// The canonical query: pairs decoded, sorted by name, re-encoded.
fn canonical_query(query: Option<&str>) -> String {
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .into_owned()
        .collect();
    sort_by_name(&mut pairs);
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// The request fingerprint (draft §2.4): lower-case hex sha256 over the
/// method, the media type (Content-Type without parameters), route name,
/// path (after the route prefix), canonical query and canonical body. JSON bodies (`application/json`, `*+json`) are
/// canonicalised per RFC 8785, but for one with a number that no IEEE-754
/// double holds exactly (RFC 8785 §3.2.2.3 would round it), which counts
/// byte for byte; `application/x-www-form-urlencoded` bodies
/// and the query have their pairs sorted by name (repeated names keep
/// their order); other bodies count byte for byte. Each part is
/// length-prefixed so that parts cannot run into each other.
pub fn fingerprint(
    method: &str,
    route: &str,
    path: &str,
    query: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> String {
    let mut h = Sha256::new();
    let media_type = content_type
        .and_then(|c| c.split(';').next())
        .map(|c| c.trim().to_ascii_lowercase())
        .unwrap_or_default();
    for part in [
        method.as_bytes(),
        media_type.as_bytes(),
        route.as_bytes(),
        path.as_bytes(),
        canonical_query(query).as_bytes(),
        &canonical_body(content_type, body),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

/// The provider key for an operation reserved at `at_ms` (ms since the
/// Unix epoch, on the ledger's clock): `eg_`, the reservation time as 11
/// hex digits, then the first 21 hex digits of HMAC-SHA256(secret, tenant
/// ‖ 0x00 ‖ operation id ‖ 0x00 ‖ incarnation); 35 characters.
///
/// `incarnation` is random, drawn once when the operation is reserved, and
/// the key is stored in the operation's row before the first attempt: every
/// attempt, restart and instance of that operation sends the same key,
/// while a key reused after its retention (a new operation under the same
/// id) gets a new provider key, so a provider that keeps keys longer than
/// the gateway never replays the old effect for the new request.
/// Tenant-scoped: two tenants' equal keys never collide at the provider.
///
/// The time comes first so that keys sort in the order they were drawn:
/// the ledger's index of provider keys (the inbox finds an operation by
/// the key a provider's event names) takes each new key at its end, where
/// the keys of one commit share a page, instead of one random page per
/// operation. Times before the epoch count as 0, past 2^44 − 1 ms (the
/// year 2527) as that.
pub fn provider_key(
    secret: &[u8],
    tenant: &str,
    operation_id: &str,
    incarnation: &[u8],
    at_ms: i64,
) -> String {
    let at = at_ms.clamp(0, 0xFFF_FFFF_FFFF);
    let mac = mac_hex(secret, tenant, operation_id, incarnation);
    format!("eg_{at:011x}{}", &mac[..21])
}

/// HMAC-SHA256(secret, tenant ‖ 0x00 ‖ id ‖ 0x00 ‖ salt), in hex.
fn mac_hex(secret: &[u8], tenant: &str, id: &str, salt: &[u8]) -> String {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(tenant.as_bytes());
    mac.update(&[0]);
    mac.update(id.as_bytes());
    mac.update(&[0]);
    mac.update(salt);
    hex::encode(mac.finalize().into_bytes())
}

/// The provider key of the compensation `compensation_id`
/// (`<id>#compensation`) of an operation whose provider key is
/// `original_key`: `eg_` + the first 32 hex digits of HMAC-SHA256(secret,
/// tenant ‖ 0x00 ‖ compensation id ‖ 0x00 ‖ original key), derived again
/// from the original whenever the compensation is resumed (so no time in
/// it). The original's key is itself drawn from its incarnation,
/// so every retry of the compensation sends the same key (the same
/// compensation at the provider), while a later incarnation of the
/// original (its key reused after its retention) gets another.
pub fn compensation_provider_key(
    secret: &[u8],
    tenant: &str,
    compensation_id: &str,
    original_key: &str,
) -> String {
    format!(
        "eg_{}",
        &mac_hex(secret, tenant, compensation_id, original_key.as_bytes())[..32]
    )
}

/// A fresh incarnation for [`provider_key`]: 16 random bytes.
pub fn new_incarnation() -> [u8; 16] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn hm(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IDEMPOTENCY_KEY, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn parses_string_token_and_bare_forms() {
        assert_eq!(
            parse_key(&hm(&["\"abc 1\""]), 255).unwrap().unwrap(),
            "abc 1"
        );
        assert_eq!(parse_key(&hm(&["k1"]), 255).unwrap().unwrap(), "k1");
        assert_eq!(
            parse_key(&hm(&["8e03978e-40d5-43e8-bc93-6894a57f9324"]), 255)
                .unwrap()
                .unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert!(parse_key(&HeaderMap::new(), 255).unwrap().is_none());
    }

    #[test]
    fn rejects_repeated_long_and_malformed() {
        assert!(parse_key(&hm(&["a", "b"]), 255).is_err());
        assert!(parse_key(&hm(&[&"x".repeat(256)]), 255).is_err());
        assert!(parse_key(&hm(&[&"x".repeat(255)]), 255).is_ok());
        assert!(parse_key(&hm(&["\"\""]), 255).is_err());
        // An empty value (`Idempotency-Key;` in curl) says so.
        for empty in ["", "  "] {
            assert_eq!(
                parse_key(&hm(&[empty]), 255).unwrap_err().0,
                "the key is empty",
                "{empty:?}"
            );
        }
        assert!(parse_key(&hm(&["a b"]), 255).is_err());
        assert!(parse_key(&hm(&["\"unterminated"]), 255).is_err());
    }

    #[test]
    fn json_fingerprint_ignores_key_order_and_whitespace() {
        let a = fingerprint(
            "POST",
            "r",
            "/v1/c",
            None,
            Some("application/json"),
            br#"{"amount":100,"currency":"eur"}"#,
        );
        let b = fingerprint(
            "POST",
            "r",
            "/v1/c",
            None,
            Some("application/json; charset=utf-8"),
            br#"{ "currency": "eur", "amount": 100 }"#,
        );
        assert_eq!(a, b);
        let c = fingerprint(
            "POST",
            "r",
            "/v1/c",
            None,
            Some("application/json"),
            br#"{"amount":101,"currency":"eur"}"#,
        );
        assert_ne!(a, c);
    }

    fn json_fp(body: &str) -> String {
        fingerprint(
            "POST",
            "r",
            "/v1/c",
            None,
            Some("application/json"),
            body.as_bytes(),
        )
    }

    /// Amounts that differ only past a double's precision fingerprint
    /// apart (RFC 8785 alone would round both to one double).
    #[test]
    fn numbers_past_a_doubles_precision_fingerprint_apart() {
        for (a, b) in [
            (
                r#"{"amount":1234567890123456789}"#,
                r#"{"amount":1234567890123456788}"#,
            ),
            (
                r#"{"amount":9007199254740993}"#,
                r#"{"amount":9007199254740992}"#,
            ),
            (
                r#"{"n":[-18446744073709551617]}"#,
                r#"{"n":[-18446744073709551616]}"#,
            ),
            (r#"{"rate":0.10000000000000000001}"#, r#"{"rate":0.1}"#),
        ] {
            assert_ne!(json_fp(a), json_fp(b), "{a} / {b}");
            assert!(!numbers_survive_jcs(a.as_bytes()), "{a}");
        }
        // Such a body still fingerprints alike when sent again as it was.
        let big = r#"{"amount":1234567890123456789}"#;
        assert_eq!(json_fp(big), json_fp(big));
    }

    /// Numbers a double holds exactly keep the canonical form: other
    /// spellings of one value, whitespace and key order don't count, and
    /// digits inside strings are not numbers.
    #[test]
    fn exact_numbers_keep_the_canonical_fingerprint() {
        for (a, b) in [
            (r#"{"a":1.0,"b":100}"#, r#"{"b":1e2,"a":1}"#),
            (r#"{"a":-0.0}"#, r#"{ "a" : 0 }"#),
            (r#"{"a":0.1,"b":-12.50}"#, r#"{"b":-1.25E1,"a":0.1}"#),
            (r#"{"a":9007199254740992}"#, r#"{"a":9007199254740992.0}"#),
            (
                r#"{"id":"123456789012345678901234","s":"a\"1e999"}"#,
                r#"{"s":"a\"1e999", "id":"123456789012345678901234"}"#,
            ),
        ] {
            assert!(numbers_survive_jcs(a.as_bytes()), "{a}");
            assert_eq!(json_fp(a), json_fp(b), "{a} / {b}");
        }
    }

    #[test]
    fn decimal_values_compare_across_spellings() {
        assert_eq!(decimal("-12.50"), Some((true, "125".into(), -1)));
        assert_eq!(decimal("-1.25e1"), decimal("-12.50"));
        assert_eq!(decimal("100"), Some((false, "1".into(), 2)));
        assert_eq!(decimal("0.000"), Some((false, String::new(), 0)));
        assert_eq!(decimal("-0"), decimal("0"));
        assert_eq!(decimal("1e99999999999999999999"), None);
        // The one exponent whose absolute value doesn't fit an i64.
        assert_eq!(decimal("1e-9223372036854775808"), None);
        assert_eq!(decimal("0e-9223372036854775808"), None);
    }

    #[test]
    fn form_and_query_order_ignored_raw_bytes_count() {
        let f = |ct: &str, b: &[u8]| fingerprint("POST", "r", "/p", Some("b=2&a=1"), Some(ct), b);
        let ct = "application/x-www-form-urlencoded";
        assert_eq!(f(ct, b"x=1&y=2"), f(ct, b"y=2&x=1"));
        assert_eq!(
            f(ct, b"x=1"),
            fingerprint("POST", "r", "/p", Some("a=1&b=2"), Some(ct), b"x=1")
        );
        assert_ne!(f("text/plain", b"x=1&y=2"), f("text/plain", b"y=2&x=1"));
        // Repeated names keep their order: a list, or the last value wins.
        assert_ne!(f(ct, b"items[]=a&items[]=b"), f(ct, b"items[]=b&items[]=a"));
        assert_ne!(
            f(ct, b"amount=100&amount=5000"),
            f(ct, b"amount=5000&amount=100")
        );
        assert_eq!(f(ct, b"x=1&a=1&a=2"), f(ct, b"a=1&a=2&x=1"));
        let q = |q: &str| fingerprint("GET", "r", "/p", Some(q), None, b"");
        assert_ne!(q("a=1&a=2"), q("a=2&a=1"));
        assert_eq!(q("a=1&b=2"), q("b=2&a=1"));
        assert_ne!(
            fingerprint("POST", "r", "/p", None, None, b""),
            fingerprint("PUT", "r", "/p", None, None, b"")
        );
    }

    #[test]
    fn provider_key_is_deterministic_and_tenant_scoped() {
        let at = 1_796_000_000_000;
        let a = provider_key(b"s", "a", "k1", b"i1", at);
        assert_eq!(a, provider_key(b"s", "a", "k1", b"i1", at));
        assert_ne!(a, provider_key(b"s", "b", "k1", b"i1", at));
        assert_ne!(
            a,
            provider_key(b"s", "a", "k1", b"i2", at),
            "a new incarnation"
        );
        assert_eq!(a.len(), 35);
        assert!(a.starts_with("eg_1a229f12800"), "{a}");
        assert!(a[3..].bytes().all(|b| b.is_ascii_hexdigit()), "{a}");
    }

    #[test]
    fn provider_keys_sort_in_the_order_they_were_drawn() {
        // Whatever the HMAC part, a later reservation's key sorts after.
        let mut keys: Vec<String> = (0..200)
            .map(|i| {
                provider_key(
                    b"s",
                    "a",
                    &format!("k{i}"),
                    &[i as u8],
                    1_796_000_000_000 + i,
                )
            })
            .collect();
        let drawn = keys.clone();
        keys.sort();
        assert_eq!(keys, drawn);
        // Out-of-range times are clamped, not formatted wider.
        assert_eq!(
            provider_key(b"s", "a", "k", b"i", -5)[3..14],
            *"00000000000"
        );
        assert_eq!(
            provider_key(b"s", "a", "k", b"i", i64::MAX)[3..14],
            *"fffffffffff"
        );
        assert_eq!(provider_key(b"s", "a", "k", b"i", i64::MAX).len(), 35);
    }

    #[test]
    fn a_compensation_key_is_derived_again_from_the_original() {
        let original = provider_key(b"s", "a", "k1", b"i1", 1);
        let c = compensation_provider_key(b"s", "a", "k1#compensation", &original);
        assert_eq!(
            c,
            compensation_provider_key(b"s", "a", "k1#compensation", &original)
        );
        let other = provider_key(b"s", "a", "k1", b"i2", 1);
        assert_ne!(
            c,
            compensation_provider_key(b"s", "a", "k1#compensation", &other)
        );
        assert_eq!(c.len(), 35);
    }
}

/// Whether JSON text repeats a key inside any object. Such a body means
/// different things to different parsers (first value wins, last value
/// wins), so the fingerprint, a policy and the provider could each read
/// another request; effectful calls refuse it (RFC 8785 and I-JSON, RFC
/// 7493 §2.3, require unique keys). Text that is not JSON is `false`.
pub fn has_duplicate_keys(bytes: &[u8]) -> bool {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    struct Scan;
    impl<'de> DeserializeSeed<'de> for Scan {
        type Value = bool;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
            d.deserialize_any(Scan)
        }
    }
    impl<'de> Visitor<'de> for Scan {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut dup = false;
            while let Some(k) = map.next_key::<String>()? {
                dup |= !seen.insert(k);
                dup |= map.next_value_seed(Scan)?;
            }
            Ok(dup)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            let mut dup = false;
            while let Some(d) = seq.next_element_seed(Scan)? {
                dup |= d;
            }
            Ok(dup)
        }
        fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_str<E>(self, _: &str) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_unit<E>(self) -> Result<bool, E> {
            Ok(false)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Scan.deserialize(&mut de).unwrap_or(false)
}

#[cfg(test)]
mod duplicate_key_tests {
    use super::has_duplicate_keys;

    #[test]
    fn finds_repeated_keys_at_any_depth() {
        assert!(has_duplicate_keys(br#"{"amount":1,"amount":2}"#));
        assert!(has_duplicate_keys(br#"{"a":[{"x":1,"y":2,"x":3}]}"#));
        assert!(!has_duplicate_keys(br#"{"a":{"x":1},"b":{"x":1}}"#));
        assert!(!has_duplicate_keys(b"not json"));
    }
}
