//! Read-back templates: text with `{operation_id}`, `{provider_key}`,
//! `{tenant}` and `{body:/json/pointer}` placeholders. Parsed once at config load; a
//! placeholder the gateway doesn't know is a config error.

use serde_json::Value;

/// One piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    OperationId,
    ProviderKey,
    Tenant,
    Body(String),
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

    /// Parses `s`. Errors: an unclosed `{`, or an unknown placeholder.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed '{{' in {s:?}"))?
                + open;
            let name = &rest[open + 1..close];
            parts.push(match name {
                "operation_id" => Part::OperationId,
                "provider_key" => Part::ProviderKey,
                "tenant" => Part::Tenant,
                n if n.starts_with("body:") && (n.len() == 5 || n[5..].starts_with('/')) => Part::Body(n[5..].to_owned()),
                n => {
                    return Err(format!(
                        "unknown placeholder {{{n}}}; use {{operation_id}}, {{provider_key}}, {{tenant}} or {{body:/json/pointer}}"
                    ));
                }
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Self(parts))
    }

    /// Renders the template; placeholder values pass through `encode`.
    /// A body pointer that matches nothing renders as the empty string;
    /// strings render without quotes, other JSON values as JSON.
    pub fn render(&self, vars: &Vars<'_>, encode: impl Fn(&str) -> String) -> String {
        let mut out = String::new();
        for p in &self.0 {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::OperationId => out.push_str(&encode(vars.operation_id)),
                Part::ProviderKey => out.push_str(&encode(vars.provider_key)),
                Part::Tenant => out.push_str(&encode(vars.tenant)),
                Part::Body(ptr) => {
                    let v = match vars.body.pointer(ptr) {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                    };
                    out.push_str(&encode(&v));
                }
            }
        }
        out
    }
}

/// Percent-encodes a value for a URL path or query component.
pub fn url_encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_all_placeholders_encoded() {
        let t = Template::parse(
            "/v1/charges?ref={body:/client_ref}&k={provider_key}&op={operation_id}",
        )
        .unwrap();
        let body = json!({"client_ref": "a b&c"});
        let s = t.render(
            &Vars {
                operation_id: "o/1",
                provider_key: "eg_1",
                body: &body,
                tenant: "a",
            },
            url_encode,
        );
        assert_eq!(s, "/v1/charges?ref=a%20b%26c&k=eg_1&op=o%2F1");
    }

    #[test]
    fn rejects_unknown_and_unclosed() {
        assert!(Template::parse("/x/{nope}").is_err());
        assert!(Template::parse("/x/{operation_id").is_err());
        assert!(Template::parse("/x/{body:amount}").is_err());
    }
}
