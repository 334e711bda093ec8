//! Validating a route's `[routes.read_back]` into a runtime [`ReadBack`].

use http::{HeaderName, Method};

use super::{ConfigError, ReadBack, ReadBackSpec};
use crate::template::Placeholders;

/// Checks a read-back spec at `path` (for error messages) and parses its templates.
///
/// `tenant_field` is the route's `tenant_scoped_field`. A read-back must be
/// tied to this operation: `{provider_key}` (the only value that is unique
/// to the operation and scoped to its tenant) in its path, headers, tool
/// arguments or `match`, or a `tenant_field` (the gateway stamps the
/// tenant there; the found value must hold it at a `match` condition whose
/// whole value is `{tenant}`, or else at the same pointer); otherwise another
/// tenant's effect with the same `{body:…}` value could be taken for this
/// one. `{tenant}` alone ties nothing: without the stamp a caller could
/// have written any tenant into the provider's record.
pub(super) fn read_back(
    path: &str,
    rb: &ReadBackSpec,
    tenant_field: Option<&str>,
) -> Result<ReadBack, ConfigError> {
    read_back_for(path, rb, tenant_field, Placeholders::ReadBack)
}

/// [`read_back`] with the placeholders of `set`: a compensation's
/// read-back may also use `{reference}` (the provider's reference of the
/// operation it undoes), which ties it to that operation as
/// `{provider_key}` does.
pub(super) fn read_back_for(
    path: &str,
    rb: &ReadBackSpec,
    tenant_field: Option<&str>,
    set: Placeholders,
) -> Result<ReadBack, ConfigError> {
    let parse = |s: &str| crate::template::Template::parse_for(s, set);
    let method = Method::from_bytes(rb.method.to_ascii_uppercase().as_bytes()).map_err(|_| {
        ConfigError::new(
            format!("{path}.method"),
            format!("not an HTTP method: {:?}", rb.method),
        )
    })?;
    let tpl_text = match (&rb.path, &rb.tool) {
        (Some(p), _) => p.clone(),
        (None, Some(_)) => "/mcp".to_owned(),
        (None, None) => {
            return Err(ConfigError::new(
                format!("{path}.path"),
                "a read-back needs a `path` (or, on an MCP route, a `tool`)",
            ));
        }
    };
    if !tpl_text.starts_with('/') {
        return Err(ConfigError::new(
            format!("{path}.path"),
            "must start with '/'",
        ));
    }
    let mut tool_arguments = Vec::new();
    for (name, value) in &rb.arguments {
        let t =
            parse(value).map_err(|e| ConfigError::new(format!("{path}.arguments.{name}"), e))?;
        tool_arguments.push((name.clone(), t));
    }
    let tpl = parse(&tpl_text).map_err(|e| ConfigError::new(format!("{path}.path"), e))?;
    let mut headers = Vec::new();
    for (name, value) in &rb.headers {
        let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::new(
                format!("{path}.headers"),
                format!("not a header name: {name:?}"),
            )
        })?;
        let t = parse(value).map_err(|e| ConfigError::new(format!("{path}.headers.{name}"), e))?;
        headers.push((n, t));
    }
    for (field, p) in [
        ("found_pointer", Some(&rb.found_pointer)),
        ("reference_pointer", rb.reference_pointer.as_ref()),
    ] {
        if let Some(p) = p
            && !(p.is_empty() || p.starts_with('/'))
        {
            return Err(ConfigError::new(
                format!("{path}.{field}"),
                "a JSON pointer is empty or starts with '/'",
            ));
        }
    }
    if rb.timeout_ms == 0 {
        return Err(ConfigError::new(
            format!("{path}.timeout_ms"),
            "must be at least 1",
        ));
    }
    let mut match_fields = Vec::new();
    for (ptr, value) in &rb.match_fields {
        if !(ptr.is_empty() || ptr.starts_with('/')) {
            return Err(ConfigError::new(
                format!("{path}.match"),
                format!("{ptr:?} is not a JSON pointer"),
            ));
        }
        let t = parse(value).map_err(|e| ConfigError::new(format!("{path}.match.{ptr}"), e))?;
        match_fields.push((ptr.clone(), t));
    }
    // Only where the gateway can rely on it: the lookup path, or a
    // condition it checks itself. A header or tool argument may be ignored
    // by the provider.
    let tied = tpl.uses_provider_key()
        || match_fields.iter().any(|(_, t)| t.uses_provider_key())
        || (set == Placeholders::CompensationReadBack
            && (tpl.uses_reference() || match_fields.iter().any(|(_, t)| t.uses_reference())))
        || tenant_field.is_some();
    if !tied && set == Placeholders::CompensationReadBack {
        return Err(ConfigError::new(
            format!("{path}.match"),
            "the compensation's read-back is not tied to this compensation: use {reference} \
             (the provider's reference of the operation it undoes) or {provider_key} (the \
             compensation's own) in its path or match, e.g. match = { \"/charge\" = \"{reference}\" }",
        ));
    }
    if !tied {
        return Err(ConfigError::new(
            format!("{path}.match"),
            "the read-back is not tied to this operation: use {provider_key} in its path or \
             match (e.g. match = { \"/idempotency_key\" = \"{provider_key}\" }; in a header or \
             a tool argument the provider may ignore it), or set the \
             route's tenant_scoped_field. Only {provider_key} is scoped to the tenant; \
             {body:…} and {operation_id} are chosen by callers, so another tenant's effect \
             could be taken for this operation",
        ));
    }
    // With a tenant_scoped_field the found value must hold the tenant: at
    // a `match` condition that says `{tenant}`, else at the same pointer.
    // A condition replaces the same-pointer check only when its whole
    // value is `{tenant}`.
    let explicit_tenant = match_fields
        .iter()
        .any(|(_, t)| *t == crate::template::Template::parse("{tenant}").expect("valid"));
    Ok(ReadBack {
        tenant_field: tenant_field.filter(|_| !explicit_tenant).map(str::to_owned),
        method,
        path: tpl,
        headers,
        match_fields,
        tool: rb.tool.clone(),
        tool_arguments,
        found_pointer: rb.found_pointer.clone(),
        reference_pointer: rb.reference_pointer.clone(),
        settle_delay_ms: rb.settle_delay_ms,
        timeout_ms: rb.timeout_ms,
    })
}
