//! Request and read-back templates: text with `{operation_id}`,
//! `{provider_key}`, `{tenant}` and `{body:/json/pointer}` placeholders,
//! and in compensation templates (`[routes.compensation]`) also
//! `{reference}` and `{response:/json/pointer}`. Parsed once at config
//! load; a placeholder the gateway doesn't know where the template is used
//! is a config error.
//!
//! Values are encoded for where they go ([`url_encode`] in paths and
//! queries, JSON strings in JSON bodies through [`render_json`], form
//! encoding through [`render_form`]). A compensation is rendered strictly
//! ([`Template::render_strict`]): a pointer the stored request or response
//! lacks is an error naming the placeholder, and nothing is sent.

use serde_json::{Map, Value};

/// One piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    OperationId,
    ProviderKey,
    Tenant,
    Body(String),
    Reference,
    Response(String),
}

/// Which placeholders a template may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholders {
    /// A route's read-back: `{operation_id}`, `{provider_key}`, `{tenant}`,
    /// `{body:/…}`.
    ReadBack,
    /// A compensation's request: the read-back's, plus `{reference}` and
    /// `{response:/…}` (the original's stored response).
    Compensation,
    /// A compensation's read-back: the read-back's, plus `{reference}`.
    CompensationReadBack,
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(Vec<Part>);

/// Values a template is rendered with.
pub struct Vars<'a> {
    /// The operation id.
    pub operation_id: &'a str,
    /// The provider key.
    pub provider_key: &'a str,
    /// The stored request body, parsed as JSON (or `Null`).
    pub body: &'a Value,
    /// The operation's tenant (`{tenant}`; also checked against a route's
    /// `tenant_scoped_field`).
    pub tenant: &'a str,
    /// `{reference}`: the provider's reference of the operation a
    /// compensation undoes, when known.
    pub reference: Option<&'a str>,
    /// `{response:/…}`: the stored response body of the operation a
    /// compensation undoes, parsed as JSON (or `Null`).
    pub response: &'a Value,
}

/// A placeholder a strict rendering could not fill: the stored request or
/// response has nothing at its pointer, or no reference is recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{placeholder}: {reason}")]
pub struct Unresolved {
    /// The placeholder as written, without braces: `body:/amount`,
    /// `response:/id`, `reference`.
    pub placeholder: String,
    /// Why it has no value.
    pub reason: String,
}

/// What one placeholder renders to: text, or (in a JSON body, when the
/// placeholder is the whole string) the JSON value itself.
enum Filled<'a> {
    Text(std::borrow::Cow<'a, str>),
    Json(&'a Value),
}

impl Template {
    /// Whether the template uses `{provider_key}`, the one value that is
    /// unique to an operation and scoped to its tenant.
    pub fn uses_provider_key(&self) -> bool {
        self.0.contains(&Part::ProviderKey)
    }

    /// Whether the template uses `{tenant}`.
    pub fn uses_tenant(&self) -> bool {
        self.0.contains(&Part::Tenant)
    }

    /// Whether the template uses `{reference}`.
    pub fn uses_reference(&self) -> bool {
        self.0.contains(&Part::Reference)
    }

    /// Parses a read-back template `s` ([`Placeholders::ReadBack`]).
    /// Errors: an unclosed `{`, or an unknown placeholder.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::parse_for(s, Placeholders::ReadBack)
    }

    /// Parses `s` allowing the placeholders of `set`.
    ///
    /// Errors: an unclosed `{`, an unknown placeholder, or one `set`
    /// doesn't allow (the message lists those it does).
    pub fn parse_for(s: &str, set: Placeholders) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = s;
        let pointer = |n: &str, prefix: &str| {
            n.strip_prefix(prefix)
                .filter(|p| p.is_empty() || p.starts_with('/'))
                .map(str::to_owned)
        };
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed '{{' in {s:?}"))?
                + open;
            let name = &rest[open + 1..close];
            let part = match name {
                "operation_id" => Some(Part::OperationId),
                "provider_key" => Some(Part::ProviderKey),
                "tenant" => Some(Part::Tenant),
                "reference" if set != Placeholders::ReadBack => Some(Part::Reference),
                n => match (pointer(n, "body:"), pointer(n, "response:")) {
                    (Some(p), _) => Some(Part::Body(p)),
                    (None, Some(p)) if set == Placeholders::Compensation => Some(Part::Response(p)),
                    _ => None,
                },
            };
            let Some(part) = part else {
                let allowed = match set {
                    Placeholders::ReadBack => {
                        "{operation_id}, {provider_key}, {tenant} or {body:/json/pointer}"
                    }
                    Placeholders::Compensation => {
                        "{reference}, {operation_id}, {provider_key}, {tenant}, {body:/json/pointer} or {response:/json/pointer}"
                    }
                    Placeholders::CompensationReadBack => {
                        "{reference}, {operation_id}, {provider_key}, {tenant} or {body:/json/pointer}"
                    }
                };
                return Err(format!("unknown placeholder {{{name}}}; use {allowed}"));
            };
            parts.push(part);
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Self(parts))
    }

    /// Renders the template; placeholder values pass through `encode`.
    /// A pointer that matches nothing (and a missing reference) renders as
    /// the empty string; strings render without quotes, other JSON values
    /// as JSON.
    pub fn render(&self, vars: &Vars<'_>, encode: impl Fn(&str) -> String) -> String {
        let mut out = String::new();
        for p in &self.0 {
            match fill(p, vars) {
                Ok(Filled::Text(t)) if matches!(p, Part::Text(_)) => out.push_str(&t),
                Ok(Filled::Text(t)) => out.push_str(&encode(&t)),
                Ok(Filled::Json(v)) => out.push_str(&encode(&text_of(v))),
                Err(_) => {}
            }
        }
        out
    }

    /// Renders the template like [`Template::render`], but refuses a
    /// placeholder without a value.
    ///
    /// Errors: [`Unresolved`] naming the first such placeholder.
    pub fn render_strict(
        &self,
        vars: &Vars<'_>,
        encode: impl Fn(&str) -> String,
    ) -> Result<String, Unresolved> {
        let mut out = String::new();
        for p in &self.0 {
            match fill(p, vars)? {
                Filled::Text(t) if matches!(p, Part::Text(_)) => out.push_str(&t),
                Filled::Text(t) => out.push_str(&encode(&t)),
                Filled::Json(v) => out.push_str(&encode(&text_of(v))),
            }
        }
        Ok(out)
    }

    /// Renders strictly as a JSON value: a template that is one placeholder
    /// of the request or response keeps the JSON type of what it points at
    /// (`"{body:/amount}"` → `100`); anything else is a JSON string.
    ///
    /// Errors: [`Unresolved`] as [`Template::render_strict`].
    pub fn render_json(&self, vars: &Vars<'_>) -> Result<Value, Unresolved> {
        if let [p @ (Part::Body(_) | Part::Response(_))] = self.0.as_slice()
            && let Filled::Json(v) = fill(p, vars)?
        {
            return Ok(v.clone());
        }
        self.render_strict(vars, |s| s.to_owned())
            .map(Value::String)
    }
}

/// The value of one part.
fn fill<'a>(p: &'a Part, vars: &Vars<'a>) -> Result<Filled<'a>, Unresolved> {
    use std::borrow::Cow::Borrowed;
    let at = |root: &'a Value, ptr: &str, name: &str, what: &str| match root.pointer(ptr) {
        None | Some(Value::Null) => Err(Unresolved {
            placeholder: format!("{name}:{ptr}"),
            reason: format!("the {what} has no value at {ptr:?}"),
        }),
        Some(v) => Ok(Filled::Json(v)),
    };
    Ok(match p {
        Part::Text(t) => Filled::Text(Borrowed(t)),
        Part::OperationId => Filled::Text(Borrowed(vars.operation_id)),
        Part::ProviderKey => Filled::Text(Borrowed(vars.provider_key)),
        Part::Tenant => Filled::Text(Borrowed(vars.tenant)),
        Part::Reference => match vars.reference {
            Some(r) if !r.is_empty() => Filled::Text(Borrowed(r)),
            _ => {
                return Err(Unresolved {
                    placeholder: "reference".into(),
                    reason: "no provider reference is recorded for the operation".into(),
                });
            }
        },
        Part::Body(ptr) => at(vars.body, ptr, "body", "stored request")?,
        Part::Response(ptr) => at(vars.response, ptr, "response", "stored response")?,
    })
}

/// A JSON value as template text: strings without quotes, the rest as JSON.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A JSON body template: a JSON value whose strings are templates.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyTemplate {
    /// An object.
    Object(Vec<(String, BodyTemplate)>),
    /// An array.
    Array(Vec<BodyTemplate>),
    /// A string: a template.
    Text(Template),
    /// A number, boolean or null, as written.
    Literal(Value),
}

impl BodyTemplate {
    /// Parses a JSON template. `field` is the config path of `v` (for
    /// errors: `routes[0].compensation.body.charge`).
    ///
    /// Errors: the path of the first string that doesn't parse, with why.
    pub fn parse(v: &Value, field: &str, set: Placeholders) -> Result<Self, (String, String)> {
        Ok(match v {
            Value::Object(m) => BodyTemplate::Object(
                m.iter()
                    .map(|(k, v)| Ok((k.clone(), Self::parse(v, &format!("{field}.{k}"), set)?)))
                    .collect::<Result<_, (String, String)>>()?,
            ),
            Value::Array(a) => BodyTemplate::Array(
                a.iter()
                    .enumerate()
                    .map(|(i, v)| Self::parse(v, &format!("{field}[{i}]"), set))
                    .collect::<Result<_, _>>()?,
            ),
            Value::String(s) => {
                BodyTemplate::Text(Template::parse_for(s, set).map_err(|e| (field.to_owned(), e))?)
            }
            other => BodyTemplate::Literal(other.clone()),
        })
    }

    /// Whether any string of it uses `{reference}`.
    pub fn uses_reference(&self) -> bool {
        match self {
            BodyTemplate::Object(m) => m.iter().any(|(_, t)| t.uses_reference()),
            BodyTemplate::Array(a) => a.iter().any(BodyTemplate::uses_reference),
            BodyTemplate::Text(t) => t.uses_reference(),
            BodyTemplate::Literal(_) => false,
        }
    }

    /// Renders it strictly into a JSON value (see [`Template::render_json`]).
    ///
    /// Errors: the first [`Unresolved`] placeholder.
    pub fn render(&self, vars: &Vars<'_>) -> Result<Value, Unresolved> {
        Ok(match self {
            BodyTemplate::Object(m) => Value::Object(
                m.iter()
                    .map(|(k, t)| Ok((k.clone(), t.render(vars)?)))
                    .collect::<Result<Map<_, _>, Unresolved>>()?,
            ),
            BodyTemplate::Array(a) => {
                Value::Array(a.iter().map(|t| t.render(vars)).collect::<Result<_, _>>()?)
            }
            BodyTemplate::Text(t) => t.render_json(vars)?,
            BodyTemplate::Literal(v) => v.clone(),
        })
    }
}

/// A rendered JSON body as `application/json` bytes: values are JSON
/// strings (quoted, escaped) or the JSON values a placeholder pointed at.
pub fn render_json(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// A rendered JSON body as `application/x-www-form-urlencoded` bytes in
/// Stripe's bracket syntax: `{"a": {"b": 1}, "l": ["x"]}` →
/// `a[b]=1&l[0]=x`; strings as they are, other values as JSON text, every
/// name and value form-encoded; `null` leaves nothing.
pub fn render_form(v: &Value) -> Vec<u8> {
    fn walk(key: &str, v: &Value, out: &mut form_urlencoded::Serializer<'_, String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    let name = if key.is_empty() {
                        k.clone()
                    } else {
                        format!("{key}[{k}]")
                    };
                    walk(&name, v, out);
                }
            }
            Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    walk(&format!("{key}[{i}]"), v, out);
                }
            }
            Value::Null => {}
            other => {
                out.append_pair(key, &text_of(other));
            }
        }
    }
    let mut out = form_urlencoded::Serializer::new(String::new());
    walk("", v, &mut out);
    out.finish().into_bytes()
}

/// Most levels a form field's name may nest (`a[b][c]` is three): the
/// depth `serde_json` allows a JSON body, which is read with its default
/// limit (128) and is `Null` past it.
pub const MAX_FORM_DEPTH: usize = 128;

/// A stored body as JSON for `{body:/…}` and `{response:/…}`: JSON as it
/// is (`Null` past 128 levels of nesting, `serde_json`'s limit); a form
/// (`application/x-www-form-urlencoded`) in bracket syntax as nested
/// objects of strings (`a[b]=1` → `{"a": {"b": "1"}}`; `l[]=x` and `l[0]=x`
/// → `{"l": ["x"]}`), without the fields whose names nest deeper than
/// [`MAX_FORM_DEPTH`] (a value that deep would be dropped, and walked, by
/// recursion: a caller's body must not exhaust the stack); anything else
/// `Null`.
pub fn body_value(content_type: Option<&str>, bytes: &[u8]) -> Value {
    let form = content_type.is_some_and(|c| {
        c.split(';').next().is_some_and(|m| {
            m.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
    });
    if !form {
        return serde_json::from_slice(bytes).unwrap_or(Value::Null);
    }
    let mut root = Value::Object(Map::new());
    for (k, v) in form_urlencoded::parse(bytes) {
        let (head, mut rest) = match k.find('[') {
            Some(i) => (&k[..i], &k[i..]),
            None => (&k[..], ""),
        };
        let mut path = vec![head.to_owned()];
        while let Some(inner) = rest.strip_prefix('[') {
            let Some(end) = inner.find(']') else { break };
            path.push(inner[..end].to_owned());
            rest = &inner[end + 1..];
            if path.len() > MAX_FORM_DEPTH {
                break;
            }
        }
        if path.len() > MAX_FORM_DEPTH {
            continue;
        }
        let mut node = &mut root;
        for (i, seg) in path.iter().enumerate() {
            let last = i == path.len() - 1;
            // `[]` appends; `[n]` (after the name) indexes an array, at
            // most one past its end, so no index allocates more.
            let index = if seg.is_empty() {
                Some(None)
            } else {
                seg.parse::<usize>().ok().filter(|_| i > 0).map(Some)
            };
            let fresh = node.is_null() || node.as_object().is_some_and(Map::is_empty);
            if let Some(index) = index
                && (node.is_array() || fresh)
            {
                if !node.is_array() {
                    *node = Value::Array(Vec::new());
                }
                let arr = node.as_array_mut().expect("just made an array");
                let at = index.unwrap_or(arr.len()).min(arr.len());
                if at == arr.len() {
                    arr.push(Value::Null);
                }
                if last {
                    arr[at] = Value::String(v.to_string());
                    break;
                }
                node = &mut arr[at];
                continue;
            }
            if !node.is_object() {
                *node = Value::Object(Map::new());
            }
            let obj = node.as_object_mut().expect("just made an object");
            if last {
                obj.insert(seg.clone(), Value::String(v.to_string()));
                break;
            }
            node = obj
                .entry(seg.clone())
                .or_insert_with(|| Value::Object(Map::new()));
        }
    }
    root
}

/// Percent-encodes a value for a URL path or query component: every byte
/// but `A-Z a-z 0-9 * - . _` as `%XX` (a space as `%20`), so a value never
/// adds a `/`, `?` or `#`. A value that is all dots (`.`, `..`) is encoded
/// whole (`%2E`): as a path segment it would otherwise name this or the
/// parent resource (RFC 3986 §5.2.4 removes dot segments).
pub fn url_encode(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b == b'.') {
        return "%2E".repeat(s.len());
    }
    form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars<'a>(body: &'a Value, response: &'a Value, reference: Option<&'a str>) -> Vars<'a> {
        Vars {
            operation_id: "o/1",
            provider_key: "eg_1",
            body,
            tenant: "a",
            reference,
            response,
        }
    }

    #[test]
    fn renders_all_placeholders_encoded() {
        let t = Template::parse(
            "/v1/charges?ref={body:/client_ref}&k={provider_key}&op={operation_id}",
        )
        .unwrap();
        let body = json!({"client_ref": "a b&c"});
        let s = t.render(&vars(&body, &Value::Null, None), url_encode);
        assert_eq!(s, "/v1/charges?ref=a%20b%26c&k=eg_1&op=o%2F1");
    }

    #[test]
    fn dot_segments_are_encoded() {
        let t = Template::parse("/v1/charges/{body:/id}/refunds").unwrap();
        for (id, want) in [
            (".", "/v1/charges/%2E/refunds"),
            ("..", "/v1/charges/%2E%2E/refunds"),
            ("a.b", "/v1/charges/a.b/refunds"),
            ("../x", "/v1/charges/..%2Fx/refunds"),
        ] {
            let body = json!({ "id": id });
            assert_eq!(t.render(&vars(&body, &Value::Null, None), url_encode), want);
        }
    }

    #[test]
    fn rejects_unknown_and_unclosed() {
        assert!(Template::parse("/x/{nope}").is_err());
        assert!(Template::parse("/x/{operation_id").is_err());
        assert!(Template::parse("/x/{body:amount}").is_err());
        // Compensation placeholders only where a compensation renders them.
        assert!(Template::parse("/x/{reference}").is_err());
        assert!(
            Template::parse_for("/x/{response:/id}", Placeholders::CompensationReadBack).is_err()
        );
        assert!(Template::parse_for("/x/{reference}", Placeholders::CompensationReadBack).is_ok());
        assert!(Template::parse_for("/x/{response:/id}", Placeholders::Compensation).is_ok());
    }

    #[test]
    fn strict_rendering_names_the_missing_pointer() {
        let t = Template::parse_for(
            "/v1/refunds/{response:/data/id}",
            Placeholders::Compensation,
        )
        .unwrap();
        let e = t
            .render_strict(
                &vars(&Value::Null, &json!({"id": "ch_1"}), None),
                url_encode,
            )
            .unwrap_err();
        assert_eq!(e.placeholder, "response:/data/id");
        let e = Template::parse_for("{reference}", Placeholders::Compensation)
            .unwrap()
            .render_strict(&vars(&Value::Null, &Value::Null, None), url_encode)
            .unwrap_err();
        assert_eq!(e.placeholder, "reference");
    }

    #[test]
    fn values_are_encoded_for_where_they_go() {
        let spec = json!({"charge": "{reference}", "amount": "{body:/amount}", "note": "for {body:/who} \"q\"",
                          "metadata": {"op": "{operation_id}"}, "tags": ["{body:/who}"]});
        let t = BodyTemplate::parse(&spec, "body", Placeholders::Compensation).unwrap();
        assert!(t.uses_reference());
        let body = json!({"amount": 100, "who": "a&b=c"});
        let v = t.render(&vars(&body, &Value::Null, Some("ch_1"))).unwrap();
        assert_eq!(
            v,
            json!({"charge": "ch_1", "amount": 100, "note": "for a&b=c \"q\"", "metadata": {"op": "o/1"}, "tags": ["a&b=c"]})
        );
        let json_text = String::from_utf8(render_json(&v)).unwrap();
        assert!(
            json_text.contains(r#""note":"for a&b=c \"q\"""#),
            "{json_text}"
        );
        let form = String::from_utf8(render_form(&v)).unwrap();
        assert_eq!(
            form,
            "amount=100&charge=ch_1&metadata%5Bop%5D=o%2F1&note=for+a%26b%3Dc+%22q%22&tags%5B0%5D=a%26b%3Dc"
        );
        let path = Template::parse_for("/v1/x/{body:/who}", Placeholders::Compensation)
            .unwrap()
            .render_strict(&vars(&body, &Value::Null, None), url_encode)
            .unwrap();
        assert_eq!(path, "/v1/x/a%26b%3Dc");
        let e = BodyTemplate::parse(
            &json!({"a": {"b": "{nope}"}}),
            "routes[0].compensation.body",
            Placeholders::Compensation,
        )
        .unwrap_err();
        assert_eq!(e.0, "routes[0].compensation.body.a.b");
    }

    #[test]
    fn form_bodies_read_as_json() {
        let v = body_value(
            Some("application/x-www-form-urlencoded"),
            b"amount=100&metadata[order]=42&expand[]=a&expand[]=b&items[0][price]=p",
        );
        assert_eq!(
            v,
            json!({"amount": "100", "metadata": {"order": "42"}, "expand": ["a", "b"], "items": [{"price": "p"}]})
        );
        assert_eq!(
            body_value(Some("application/json"), b"{\"a\":1}"),
            json!({"a": 1})
        );
        assert_eq!(body_value(None, b"nope"), Value::Null);
        for odd in ["a[b]]=1", "a[=1", "]=1", "[]=1", "a[0][=1", "a[99999999]=1"] {
            let _ = body_value(Some("application/x-www-form-urlencoded"), odd.as_bytes());
        }
    }

    /// A caller's form field nested 20,000 levels deep (60 KB) is left
    /// out; the rest of the body is read, and nothing recurses that deep
    /// (dropping such a value used to overflow the stack and abort the
    /// gateway, in the reconciler's read-back and in a compensation).
    /// [`MAX_FORM_DEPTH`] levels are kept; one more is not.
    #[test]
    fn a_form_field_nested_past_the_limit_is_left_out() {
        let form = Some("application/x-www-form-urlencoded");
        let deep = format!("client_ref=r1&amount=5&a{}=1", "[a]".repeat(20_000));
        assert_eq!(
            body_value(form, deep.as_bytes()),
            json!({"client_ref": "r1", "amount": "5"})
        );
        let at_limit = format!("k{}=v", "[k]".repeat(MAX_FORM_DEPTH - 1));
        let v = body_value(form, at_limit.as_bytes());
        let pointer = format!("/k{}", "/k".repeat(MAX_FORM_DEPTH - 1));
        assert_eq!(v.pointer(&pointer), Some(&json!("v")));
        let past = format!("k{}=v", "[k]".repeat(MAX_FORM_DEPTH));
        assert_eq!(body_value(form, past.as_bytes()), json!({}));
    }
}
