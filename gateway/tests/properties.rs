//! Property tests of the gateway's parsers and canonicalisers: the
//! `Idempotency-Key` header, the request fingerprint (JSON and form
//! bodies, the query), read-back and compensation templates, the config
//! loader, MCP JSON-RPC and SSE answers, and problem+json rendering.
//!
//! Each property runs 256 cases; `PROPTEST_CASES=N` runs N. A failing case
//! is shrunk to a minimal one and printed; cases that found a bug are kept
//! as plain tests at the end of each section.

use std::collections::BTreeMap;
use std::io::Write as _;

use effectgate::config;
use effectgate::http::error::{PROBLEM_JSON, Problem};
use effectgate::idempotency::{IDEMPOTENCY_KEY, fingerprint, parse_key};
use effectgate::mcp::protocol::{is_event_stream, rpc_message, tool_outcome};
use effectgate::ops::OpError;
use effectgate::template::{
    BodyTemplate, Placeholders, Template, Vars, body_value, render_form, url_encode,
};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// 256 cases (`PROPTEST_CASES` overrides); failures are printed, not
/// saved to a file.
fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Idempotency-Key (draft-ietf-httpapi-idempotency-key-header §2.1, RFC 9651)

const MAX_KEY: usize = 255;

fn headers(values: &[&str]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_str(v).unwrap());
    }
    h
}

/// An RFC 9651 String item for `s`: quoted, `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Printable ASCII (what an sf-string may hold).
fn printable(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(0x20u8..0x7f, 1..=max).prop_map(|b| String::from_utf8(b).unwrap())
}

/// An RFC 9651 Token: ALPHA or `*`, then tchar, `:` or `/`.
fn sf_token(max: usize) -> impl Strategy<Value = String> {
    let first = prop_oneof![
        Just('*'),
        proptest::char::range('a', 'z'),
        proptest::char::range('A', 'Z')
    ];
    let tchar = prop_oneof![
        proptest::char::range('a', 'z'),
        proptest::char::range('A', 'Z'),
        proptest::char::range('0', '9'),
        proptest::sample::select(vec![
            '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~', ':', '/'
        ]),
    ];
    (first, proptest::collection::vec(tchar, 0..max)).prop_map(|(f, rest)| {
        let mut s = String::new();
        s.push(f);
        s.extend(rest);
        s
    })
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn an_sf_string_key_parses_to_its_value(s in printable(MAX_KEY)) {
        prop_assert_eq!(parse_key(&headers(&[&sf_string(&s)]), MAX_KEY).unwrap(), Some(s));
    }

    #[test]
    fn a_token_key_parses_to_itself(t in sf_token(MAX_KEY)) {
        let parsed = parse_key(&headers(&[&t]), MAX_KEY).unwrap();
        prop_assert_eq!(parsed, Some(t));
    }

    #[test]
    fn a_key_longer_than_the_bound_is_refused(s in printable(40), max in 1usize..40) {
        let r = parse_key(&headers(&[&sf_string(&s)]), max);
        if s.chars().count() > max {
            prop_assert!(r.is_err(), "{:?} with bound {}", s, max);
        } else {
            prop_assert_eq!(r.unwrap(), Some(s));
        }
    }

    #[test]
    fn a_repeated_header_is_refused(a in printable(20), b in printable(20)) {
        let r = parse_key(&headers(&[&sf_string(&a), &sf_string(&b)]), MAX_KEY);
        prop_assert!(r.unwrap_err().0.contains("more than once"));
    }

    #[test]
    fn any_header_value_is_a_key_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let Ok(v) = HeaderValue::from_bytes(&bytes) else { return Ok(()) };
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, v);
        if let Ok(Some(k)) = parse_key(&h, MAX_KEY) {
            prop_assert!(!k.is_empty() && k.chars().count() <= MAX_KEY);
            prop_assert!(k.bytes().all(|b| (0x20..0x7f).contains(&b)));
        }
    }
}

// ---------------------------------------------------------------------------
// The fingerprint (draft §2.4; RFC 8785 for JSON bodies)

/// A JSON leaf: integers within ±2^53 (exact as IEEE 754 doubles),
/// finite doubles, strings (any Unicode), booleans, null.
fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..(1i64 << 53)).prop_map(|n| json!(n)),
        (-1e15f64..1e15).prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ]
}

/// A JSON value: objects, arrays, strings (any Unicode), integers within
/// ±2^53 (exact as IEEE 754 doubles), finite doubles, booleans, null.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = json_leaf();
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// How to spell a JSON text: the seed picks key order, whitespace, which
/// characters are written as `\u` escapes and how integers are spelled.
struct Spelling {
    rng: u64,
}

impl Spelling {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn ws(&mut self, out: &mut String) {
        for _ in 0..self.next() % 3 {
            out.push([' ', '\n', '\t', '\r'][(self.next() % 4) as usize]);
        }
    }
    fn string(&mut self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let escape = self.next().is_multiple_of(4);
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '/' if escape => out.push_str("\\/"),
                c if (c as u32) < 0x20 || escape => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        if self.next().is_multiple_of(2) {
                            out.push_str(&format!("\\u{u:04x}"));
                        } else {
                            out.push_str(&format!("\\u{u:04X}"));
                        }
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
    fn number(&mut self, n: &serde_json::Number, out: &mut String) {
        match n.as_i64() {
            Some(i) => match self.next() % 4 {
                0 => out.push_str(&format!("{i}.0")),
                1 => out.push_str(&format!("{i}e0")),
                2 if i != 0 => out.push_str(&format!("{i}0E-1")),
                _ => out.push_str(&i.to_string()),
            },
            None => out.push_str(&n.to_string()),
        }
    }
    fn value(&mut self, v: &Value, out: &mut String) {
        self.ws(out);
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => self.number(n, out),
            Value::String(s) => self.string(s, out),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    self.value(x, out);
                }
                self.ws(out);
                out.push(']');
            }
            Value::Object(m) => {
                let mut entries: Vec<(&String, &Value)> = m.iter().collect();
                // Fisher-Yates with the seed.
                for i in (1..entries.len()).rev() {
                    let j = (self.next() % (i as u64 + 1)) as usize;
                    entries.swap(i, j);
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    self.ws(out);
                    self.string(k, out);
                    self.ws(out);
                    out.push(':');
                    self.value(x, out);
                }
                self.ws(out);
                out.push('}');
            }
        }
        self.ws(out);
    }
}

fn spell(v: &Value, seed: u64) -> String {
    let mut out = String::new();
    Spelling { rng: seed | 1 }.value(v, &mut out);
    out
}

fn json_fp(body: &[u8]) -> String {
    fingerprint("POST", "r", "/v1/x", None, Some("application/json"), body)
}

/// The leaves of `v` (values that are not arrays or objects), in order.
fn leaf_count(v: &Value) -> usize {
    match v {
        Value::Array(a) => a.iter().map(leaf_count).sum(),
        Value::Object(m) => m.values().map(leaf_count).sum(),
        _ => 1,
    }
}

/// Replaces leaf `n` of `v` by `new`; returns the old leaf.
fn replace_leaf(v: &mut Value, n: &mut usize, new: &Value) -> Option<Value> {
    match v {
        Value::Array(a) => a.iter_mut().find_map(|x| replace_leaf(x, n, new)),
        Value::Object(m) => m.values_mut().find_map(|x| replace_leaf(x, n, new)),
        leaf if *n == 0 => Some(std::mem::replace(leaf, new.clone())),
        _ => {
            *n -= 1;
            None
        }
    }
}

/// Two JSON leaves that denote the same value (`1` and `1.0`).
fn same_leaf(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn the_json_fingerprint_ignores_spelling(v in json_value(), s1 in any::<u64>(), s2 in any::<u64>()) {
        let a = spell(&v, s1);
        let b = spell(&v, s2);
        prop_assert!(serde_json::from_str::<Value>(&a).is_ok() && serde_json::from_str::<Value>(&b).is_ok());
        prop_assert_eq!(json_fp(a.as_bytes()), json_fp(b.as_bytes()), "{} vs {}", a, b);
        prop_assert_eq!(json_fp(a.as_bytes()), json_fp(&serde_json::to_vec(&v).unwrap()));
    }

    #[test]
    fn the_json_fingerprint_changes_with_a_value(
        v in json_value(),
        pick in any::<prop::sample::Index>(),
        new in json_leaf(),
        seed in any::<u64>(),
    ) {
        // At least one leaf to change.
        let v = json!([v, 0]);
        let mut changed = v.clone();
        let mut n = pick.index(leaf_count(&v));
        let old = replace_leaf(&mut changed, &mut n, &new).unwrap();
        prop_assume!(!same_leaf(&old, &new));
        prop_assert_ne!(
            json_fp(spell(&v, seed).as_bytes()),
            json_fp(spell(&changed, seed).as_bytes()),
            "{} → {}", old, new
        );
    }

    #[test]
    fn the_fingerprint_separates_its_parts(
        parts in (".{0,6}", ".{1,6}", ".{0,6}", ".{0,6}").prop_map(|(a, b, c, d)| vec![a, b, c, d]),
        cut in 1usize..6,
    ) {
        // Moving characters from one part to the next changes it (parts
        // are length-prefixed).
        let [m, r, p, b] = [&parts[0], &parts[1], &parts[2], &parts[3]];
        let moved: String = r.chars().rev().take(cut).collect::<Vec<_>>().into_iter().rev().collect();
        let r2 = &r[..r.len() - moved.len()];
        let p2 = format!("{moved}{p}");
        prop_assert_ne!(
            fingerprint(m, r, p, None, Some("text/plain"), b.as_bytes()),
            fingerprint(m, r2, &p2, None, Some("text/plain"), b.as_bytes())
        );
    }
}

/// Form pairs: names from a small set (so they repeat), values any text.
fn form_pairs() -> impl Strategy<Value = Vec<(String, String)>> {
    proptest::collection::vec(
        (
            proptest::sample::select(vec!["a", "b", "amount", "items[]", "meta[x]", "ü n"]),
            ".{0,8}",
        )
            .prop_map(|(n, v)| (n.to_owned(), v)),
        0..8,
    )
}

/// Form-encodes `pairs`; the seed picks `+` or `%20` for a space and
/// whether unreserved bytes are percent-encoded anyway.
fn form_spell(pairs: &[(String, String)], seed: u64) -> String {
    let mut rng = Spelling { rng: seed | 1 };
    let mut enc = |s: &str| {
        let mut out = String::new();
        for b in s.bytes() {
            match b {
                b' ' if rng.next().is_multiple_of(2) => out.push('+'),
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*'
                    if !rng.next().is_multiple_of(3) =>
                {
                    out.push(b as char)
                }
                b => out.push_str(&format!("%{b:02X}")),
            }
        }
        out
    };
    pairs
        .iter()
        .map(|(n, v)| format!("{}={}", enc(n), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// `pairs` shuffled by the seed, keeping the order of pairs of one name.
fn shuffle_by_name(pairs: &[(String, String)], seed: u64) -> Vec<(String, String)> {
    let mut groups: BTreeMap<&str, Vec<&(String, String)>> = BTreeMap::new();
    for p in pairs {
        groups.entry(p.0.as_str()).or_default().push(p);
    }
    let mut rng = Spelling { rng: seed | 1 };
    let mut out = Vec::new();
    while !groups.is_empty() {
        let names: Vec<&str> = groups.keys().copied().collect();
        let name = names[(rng.next() % names.len() as u64) as usize];
        let g = groups.get_mut(name).unwrap();
        out.push(g.remove(0).clone());
        if g.is_empty() {
            groups.remove(name);
        }
    }
    out
}

const FORM: &str = "application/x-www-form-urlencoded";

proptest! {
    #![proptest_config(config())]
    #[test]
    fn the_form_fingerprint_ignores_order_across_names_and_encoding(
        pairs in form_pairs(), s1 in any::<u64>(), s2 in any::<u64>(),
    ) {
        let a = form_spell(&pairs, s1);
        let b = form_spell(&shuffle_by_name(&pairs, s2), s2);
        let fp = |body: &str| fingerprint("POST", "r", "/p", None, Some(FORM), body.as_bytes());
        prop_assert_eq!(fp(&a), fp(&b), "{} vs {}", a, b);
        // The query is canonicalised the same way.
        let q = |query: &str| fingerprint("GET", "r", "/p", Some(query), None, b"");
        prop_assert_eq!(q(&a), q(&b));
    }

    #[test]
    fn the_form_fingerprint_keeps_the_order_of_one_name_and_every_value(
        pairs in form_pairs(), i in any::<prop::sample::Index>(), j in any::<prop::sample::Index>(), new in ".{0,8}",
    ) {
        prop_assume!(!pairs.is_empty());
        let fp = |p: &[(String, String)]| {
            fingerprint("POST", "r", "/p", None, Some(FORM), form_spell(p, 7).as_bytes())
        };
        let (i, j) = (i.index(pairs.len()), j.index(pairs.len()));
        if pairs[i].0 == pairs[j].0 && pairs[i].1 != pairs[j].1 {
            let mut swapped = pairs.clone();
            swapped.swap(i, j);
            prop_assert_ne!(fp(&pairs), fp(&swapped));
        }
        let mut changed = pairs.clone();
        prop_assume!(changed[i].1 != new);
        changed[i].1 = new;
        prop_assert_ne!(fp(&pairs), fp(&changed));
    }
}

// ---------------------------------------------------------------------------
// Templates

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn vars<'a>(body: &'a Value, response: &'a Value, reference: Option<&'a str>) -> Vars<'a> {
    Vars {
        operation_id: "op",
        provider_key: "eg_1",
        body,
        tenant: "t",
        reference,
        response,
    }
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn url_encoding_round_trips_and_adds_no_delimiter(s in "\\PC{0,16}|[./?#%]{0,6}") {
        let e = url_encode(&s);
        prop_assert!(
            e.bytes().all(|b| b.is_ascii_alphanumeric() || b"%-._*".contains(&b)),
            "{:?} → {:?}", s, e
        );
        prop_assert!(e != "." && e != "..", "a dot segment: {:?}", e);
        prop_assert_eq!(percent_decode(&e), s.as_bytes());
    }

    #[test]
    fn a_value_stays_in_its_path_segment_and_query_pair(v in "\\PC{0,12}|[./?#%&=]{0,6}") {
        let t = Template::parse("/v1/items/{body:/v}/x?ref={body:/v}&k={provider_key}").unwrap();
        let body = json!({ "v": v });
        let rendered = t.render(&vars(&body, &Value::Null, None), url_encode);
        let uri: http::Uri = format!("http://p{rendered}").parse().unwrap();
        let segments: Vec<&str> = uri.path().split('/').collect();
        prop_assert_eq!(segments.len(), 5, "{}", rendered);
        prop_assert_eq!(segments[1], "v1");
        prop_assert_eq!(segments[2], "items");
        prop_assert_eq!(segments[4], "x");
        prop_assert!(segments[3] != "." && segments[3] != "..");
        prop_assert_eq!(percent_decode(segments[3]), v.as_bytes());
        prop_assert!(!rendered.contains('#'));
        let pairs: Vec<(String, String)> =
            form_urlencoded::parse(uri.query().unwrap().as_bytes()).into_owned().collect();
        prop_assert_eq!(pairs, vec![("ref".to_owned(), v.clone()), ("k".to_owned(), "eg_1".to_owned())]);
    }

    #[test]
    fn any_template_text_parses_or_is_refused_without_a_panic(s in "\\PC{0,40}|[{}a-z_:/]{0,30}") {
        for set in [Placeholders::ReadBack, Placeholders::Compensation, Placeholders::CompensationReadBack] {
            if let Ok(t) = Template::parse_for(&s, set) {
                let body = json!({"a": 1});
                let _ = t.render(&vars(&body, &body, Some("r")), url_encode);
                let _ = t.render_strict(&vars(&body, &body, None), url_encode);
                let _ = t.render_json(&vars(&body, &body, Some("r")));
            }
        }
    }

    #[test]
    fn a_compensation_form_body_round_trips(
        fields in proptest::collection::btree_map("[a-z]{1,6}", "\\PC{0,10}", 1..6),
    ) {
        // Each field of the compensation body is a `{body:/…}` of the
        // stored request; rendered as a form and read back, the values
        // arrive unchanged.
        let spec: Map<String, Value> = fields
            .keys()
            .map(|k| (k.clone(), json!(format!("{{body:/{k}}}"))))
            .collect();
        let t = BodyTemplate::parse(&Value::Object(spec), "compensation.body", Placeholders::Compensation).unwrap();
        let stored: Map<String, Value> = fields.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let stored = Value::Object(stored);
        let rendered = t.render(&vars(&stored, &Value::Null, None)).unwrap();
        prop_assert_eq!(&rendered, &stored);
        let form = render_form(&rendered);
        prop_assert_eq!(body_value(Some(FORM), &form), stored);
    }

    #[test]
    fn any_form_body_reads_as_json_without_a_panic(s in "[a-z\\[\\]0-9=&%]{0,40}") {
        let v = body_value(Some(FORM), s.as_bytes());
        prop_assert!(v.is_object() || v.is_array());
    }
}

#[test]
fn dot_segments_are_percent_encoded() {
    // Found by `url_encoding_round_trips_and_adds_no_delimiter`: `.` and
    // `..` went into read-back paths as they are, so `/v1/items/{id}`
    // with id `..` read `/v1/`.
    assert_eq!(url_encode("."), "%2E");
    assert_eq!(url_encode(".."), "%2E%2E");
    assert_eq!(url_encode("..."), "%2E%2E%2E");
    assert_eq!(url_encode(".a"), ".a");
}

// ---------------------------------------------------------------------------
// The config loader

/// A TOML value of any type, small.
fn toml_value() -> impl Strategy<Value = toml::Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(toml::Value::Integer),
        any::<bool>().prop_map(toml::Value::Boolean),
        "\\PC{0,10}".prop_map(toml::Value::String),
        proptest::sample::select(vec![
            "127.0.0.1:0",
            "http://127.0.0.1:9",
            "/x/",
            "a",
            "POST",
            "sqlite",
            "postgres://u@h/d",
        ])
        .prop_map(|s| toml::Value::String(s.to_owned())),
        (-1e6f64..1e6).prop_map(toml::Value::Float),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(toml::Value::Array),
            proptest::collection::btree_map(config_key(), inner, 0..4)
                .prop_map(|m| toml::Value::Table(m.into_iter().collect())),
        ]
    })
}

/// Keys: the config's own names (so some documents get deep), others, and
/// keys that are not bare.
fn config_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(vec![
            "listen", "proxy", "admin", "storage", "path", "url", "limits", "lease_ms",
            "reconcile", "enabled", "interval_ms", "routes", "name", "prefix", "upstream",
            "effectful_methods", "retry", "max_attempts", "read_back", "tenants", "id", "keys",
            "role", "sha256", "policies", "compensation", "mode", "mcp", "tls", "egress",
        ])
        .prop_map(str::to_owned),
        1 => "[a-z_]{1,8}",
        1 => "\\PC{0,6}",
    ]
}

fn config_doc() -> impl Strategy<Value = toml::Table> {
    proptest::collection::btree_map(config_key(), toml_value(), 0..5)
        .prop_map(|m| m.into_iter().collect())
}

/// The config's top-level fields (`ConfigFile`): a check may name one the
/// document left at its default.
const TOP_LEVEL: [&str; 9] = [
    "listen",
    "storage",
    "limits",
    "tenants",
    "routes",
    "reconcile",
    "policy",
    "telemetry",
    "shutdown",
];

fn load_text(text: &str) -> Result<config::Settings, config::ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    config::load(Some(&p))
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn random_toml_is_a_config_or_an_error_naming_a_field(doc in config_doc()) {
        let Ok(text) = toml::to_string(&doc) else { return Ok(()) };
        if let Err(e) = load_text(&text) {
            prop_assert!(!e.path.is_empty(), "no field named for\n{}\n{}", text, e);
            prop_assert!(!e.message.is_empty());
            // A path names a field of the document (or the file itself).
            let first = e.path.split(['.', '[', ':']).next().unwrap_or("");
            prop_assert!(
                e.path.ends_with(".toml") || e.path.contains(".toml:")
                    || doc.keys().any(|k| {
                        let quoted = toml::Value::String(k.clone()).to_string();
                        first == k || e.path.starts_with(&quoted)
                    })
                    || TOP_LEVEL.contains(&first),
                "{} names nothing in\n{}", e, text
            );
        }
    }

    #[test]
    fn random_text_is_never_a_panic(text in "\\PC{0,80}|[\\[\\]a-z=\"\\n. ]{0,80}") {
        if let Err(e) = load_text(&text) {
            prop_assert!(!e.path.is_empty() && !e.message.is_empty());
        }
    }
}

// ---------------------------------------------------------------------------
// MCP answers: JSON-RPC in JSON or SSE (`text/event-stream`)

fn content_type(ct: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
    h
}

/// A media type spelled in random case, with or without parameters.
fn spelled_media_type(mt: &'static str) -> impl Strategy<Value = String> {
    (
        proptest::collection::vec(any::<bool>(), mt.len()),
        proptest::sample::select(vec!["", "; charset=utf-8", " ;charset=UTF-8"]),
    )
        .prop_map(move |(upper, params)| {
            let s: String = mt
                .chars()
                .zip(upper)
                .map(|(c, u)| if u { c.to_ascii_uppercase() } else { c })
                .collect();
            format!("{s}{params}")
        })
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn the_result_is_found_in_any_event_stream(
        ct in spelled_media_type("text/event-stream"),
        notes in proptest::collection::vec(".{0,10}", 0..4),
        id in any::<i64>(),
        text in "\\PC{0,20}",
        eol in proptest::sample::select(vec!["\n", "\r\n", "\r"]),
        pretty in any::<bool>(),
        space in any::<bool>(),
    ) {
        let result = json!({"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": text}]}});
        let mut events = Vec::new();
        for n in &notes {
            events.push(json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": n}}));
        }
        events.push(result.clone());
        let mut body = String::new();
        for e in &events {
            body.push_str(&format!("event: message{eol}"));
            let data = if pretty { serde_json::to_string_pretty(e).unwrap() } else { e.to_string() };
            for line in data.lines() {
                body.push_str(if space { "data: " } else { "data:" });
                body.push_str(line);
                body.push_str(eol);
            }
            body.push_str(eol);
        }
        prop_assert!(is_event_stream(&ct));
        let found = rpc_message(&content_type(&ct), body.as_bytes());
        prop_assert_eq!(found.as_ref(), Some(&result), "{}", body);
        prop_assert_eq!(tool_outcome(&result).0, effectgate::ledger::State::Completed);
    }

    #[test]
    fn any_answer_is_a_message_or_none(
        ct in prop_oneof![spelled_media_type("text/event-stream"), spelled_media_type("application/json"), ".{0,20}"],
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let Ok(v) = HeaderValue::from_str(&ct) else { return Ok(()) };
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, v);
        if let Some(m) = rpc_message(&h, &body) {
            let _ = tool_outcome(&m);
        }
    }

    #[test]
    fn a_json_answer_is_read_whole(
        ct in spelled_media_type("application/json"), id in any::<i64>(), is_error in any::<bool>(),
    ) {
        let msg = json!({"jsonrpc": "2.0", "id": id, "result": {"isError": is_error, "content": []}});
        let found = rpc_message(&content_type(&ct), msg.to_string().as_bytes()).unwrap();
        prop_assert_eq!(&found, &msg);
        let want = if is_error { effectgate::ledger::State::Failed } else { effectgate::ledger::State::Completed };
        prop_assert_eq!(tool_outcome(&found).0, want);
    }
}

#[test]
fn an_event_stream_in_any_case_is_read() {
    // Found by `the_result_is_found_in_any_event_stream`: the media type
    // was compared case-sensitively, so `Text/Event-Stream` (RFC 9110
    // §8.3.1: case-insensitive) was read as JSON and the result was lost.
    let body = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n";
    for ct in [
        "Text/Event-Stream",
        "TEXT/EVENT-STREAM; charset=utf-8",
        " text/event-stream",
    ] {
        assert_eq!(
            rpc_message(&content_type(ct), body),
            Some(json!({"jsonrpc": "2.0", "id": 1, "result": {}})),
            "{ct}"
        );
    }
    assert!(!is_event_stream("text/event-streams"));
    assert!(!is_event_stream("application/json"));
}

// ---------------------------------------------------------------------------
// problem+json (RFC 9457)

fn rendered(e: OpError) -> (StatusCode, HeaderMap, Value) {
    use axum::response::IntoResponse;
    use http_body_util::BodyExt;
    let resp = e.into_response();
    let (parts, body) = resp.into_parts();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let bytes = rt.block_on(body.collect()).unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&bytes).expect("problem+json is JSON");
    (parts.status, parts.headers, v)
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn any_detail_renders_as_problem_json(detail in "\\PC{0,60}|[\"\\\\\\x00-\\x1f\\x{2028}<>&]{0,20}", field in "\\PC{0,12}") {
        let cases: Vec<(OpError, String)> = vec![
            (OpError::BadRequest { field: field.clone(), message: detail.clone() }, detail.clone()),
            (OpError::Conflict(detail.clone()), detail.clone()),
            (OpError::NotFound(detail.clone()), detail.clone()),
            (
                OpError::PolicyDenied { status: StatusCode::FORBIDDEN, policy: field.clone(), reason: detail.clone() },
                format!("denied by policy {field}: {detail}"),
            ),
            (
                OpError::IdempotencyKeyInvalid(detail.clone()),
                format!("invalid Idempotency-Key header: {detail}"),
            ),
        ];
        for (e, want_detail) in cases {
            let status = e.status();
            let kind = e.kind();
            let (s, h, v) = rendered(e);
            prop_assert_eq!(s, status);
            prop_assert_eq!(h.get(header::CONTENT_TYPE).unwrap(), PROBLEM_JSON);
            prop_assert_eq!(&v["detail"], &json!(want_detail));
            prop_assert_eq!(&v["status"], &json!(status.as_u16()));
            prop_assert_eq!(v["type"].as_str().unwrap(), format!("urn:effectgate:problem:{kind}"));
            prop_assert!(v["title"].is_string());
        }
    }

    #[test]
    fn internal_text_never_reaches_the_caller(secret in "[a-zA-Z0-9 ]{0,40}") {
        let secret = format!("SELECT-{secret}");
        for e in [OpError::Internal(secret.clone()), OpError::LedgerUnavailable(secret.clone())] {
            let (_, _, v) = rendered(e);
            prop_assert!(!v.to_string().contains(&secret), "{}", v);
            prop_assert!(v["error_id"].is_string());
        }
    }
}
