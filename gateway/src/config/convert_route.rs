//! Checking one `[[routes]]` entry and converting it into a runtime
//! [`Route`]: its identity, fields, headers and outbound client.

use super::*;

/// Headers a provider key must not be sent in
/// (`routes[].provider_idempotency_header`): the message's framing and
/// content (RFC 9112 §6, RFC 9110 §8), its target (`Host`, RFC 9110
/// §7.2), the hop-by-hop fields (RFC 9110 §7.6.1), credentials, and the
/// ones the gateway sets on every forwarded request (request id,
/// forwarding, W3C Trace Context). Nor may it be one of the route's
/// `inject_headers`.
const NOT_FOR_A_KEY: &[&str] = &[
    super::REQUEST_ID_HEADER,
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "traceparent",
    "tracestate",
    "content-length",
    "transfer-encoding",
    "content-type",
    "content-encoding",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "authorization",
    "proxy-authorization",
    "cookie",
];

/// Longest `routes[].key_retention_hours`: 100 years of hours.
const MAX_KEY_RETENTION_HOURS: u64 = 100 * 366 * 24;

/// Stored response headers, and injected headers with their values.
type RouteHeaders = (Vec<HeaderName>, Vec<(HeaderName, HeaderValue)>);

/// `routes[ri]` checked and converted; its name is added to `names`.
pub(super) fn route(
    ri: usize,
    r: RouteSpec,
    names: &mut BTreeSet<String>,
    tenants: &BTreeSet<String>,
    base_dir: &Path,
    lease_ms: u64,
) -> Result<Route, ConfigError> {
    let rp = format!("routes[{ri}]");
    let (name, upstream) = route_identity(&rp, &r, names)?;
    let fields = route_fields(&rp, &r, tenants, base_dir, lease_ms)?;
    let (stored_response_headers, inject_headers) = route_headers(&rp, &r)?;
    if let Some(key_header) = &fields.provider_idempotency_header
        && let Some(i) = inject_headers.iter().position(|(n, _)| n == key_header)
    {
        return Err(ConfigError::new(
            format!("{rp}.provider_idempotency_header"),
            format!(
                "{key_header:?} is also {rp}.inject_headers[{i}]: the provider key would replace \
                 the injected value (a credential, say)"
            ),
        ));
    }
    let RouteFields {
        effectful_methods,
        route_tenants,
        provider_idempotency_header,
        request_schema,
        read_back,
    } = fields;
    let client = super::egress::outbound_client(
        super::egress::ClientSpec {
            path: &rp,
            tls: r.tls.as_ref(),
            proxy: r.proxy.as_deref(),
            proxy_credentials_env: r.proxy_credentials_env.as_deref(),
            connect_timeout_ms: r.connect_timeout_ms,
            idle_timeout_ms: r.idle_connection_timeout_ms,
            https: upstream.scheme() == "https",
        },
        base_dir,
    )?;
    let mut route = Route {
        client,
        name,
        prefix: r.prefix,
        upstream_base: super::UpstreamBase::of(&upstream),
        upstream,
        mode: r.mode,
        effectful_methods,
        tenants: route_tenants,
        provider_idempotency_header,
        connect_timeout_ms: r.connect_timeout_ms,
        response_timeout_ms: r.response_timeout_ms,
        max_body_bytes: r.max_body_bytes,
        max_stored_response_bytes: r.max_stored_response_bytes,
        key_retention_ms: r.key_retention_hours.saturating_mul(3_600_000),
        stored_response_headers,
        inject_headers,
        retry: r.retry,
        effect_class: r.effect_class,
        read_back,
        policy_fail_open: r.policy_fail_open,
        approval_ttl_ms: r.approval_ttl_ms,
        execute_on_approval: r.execute_on_approval,
        request_schema,
        tenant_scoped_field: r.tenant_scoped_field.clone(),
        mcp: match r.mode {
            RouteMode::Mcp => Some(r.mcp.clone().unwrap_or_default()),
            _ => None,
        },
        compensation: None,
        success: SuccessRule::Status2xx,
    };
    if let Some(c) = &r.compensation {
        route.compensation = Some(super::compensation::compensation(&rp, c, &route, lease_ms)?);
    }
    Ok(route)
}

/// The route's prefix, name and upstream URL.
fn route_identity(
    rp: &str,
    r: &RouteSpec,
    names: &mut BTreeSet<String>,
) -> Result<(String, url::Url), ConfigError> {
    if !r.prefix.starts_with('/') || !r.prefix.ends_with('/') {
        return Err(ConfigError::new(
            format!("{rp}.prefix"),
            "must start and end with '/'",
        ));
    }
    if ["/admin/", "/approvals/", "/inbox/"]
        .iter()
        .any(|own| r.prefix.starts_with(own))
    {
        return Err(ConfigError::new(
            format!("{rp}.prefix"),
            "must not start with /admin/, /approvals/ or /inbox/ (the gateway's own paths)",
        ));
    }
    if leaves_base_path(&r.prefix) {
        return Err(ConfigError::new(
            format!("{rp}.prefix"),
            "must not hold a dot segment, a backslash or %00, %2e, %2f, %5c: the proxy \
             refuses every request path with one, so the route could never be called",
        ));
    }
    let name = r.name.clone().unwrap_or_else(|| r.prefix.clone());
    if name.is_empty() || name.len() > 128 {
        return Err(ConfigError::new(
            format!("{rp}.name"),
            "must be 1..=128 characters",
        ));
    }
    if compensated_id(&name).is_some() {
        return Err(ConfigError::new(
            format!("{rp}.name"),
            format!("must not end with {COMPENSATION_SUFFIX:?} (the names of compensation routes)"),
        ));
    }
    if !names.insert(name.clone()) {
        return Err(ConfigError::new(
            format!("{rp}.name"),
            format!("duplicate route name {name:?}"),
        ));
    }
    let upstream = url::Url::parse(&r.upstream)
        .map_err(|e| ConfigError::new(format!("{rp}.upstream"), format!("not a URL: {e}")))?;
    if !matches!(upstream.scheme(), "http" | "https") {
        return Err(ConfigError::new(
            format!("{rp}.upstream"),
            format!(
                "the scheme must be https:// or http://, not {}://",
                upstream.scheme()
            ),
        ));
    }
    if upstream.host_str().is_none() || upstream.query().is_some() || upstream.fragment().is_some()
    {
        return Err(ConfigError::new(
            format!("{rp}.upstream"),
            "must be scheme://host[:port][/path] without query",
        ));
    }
    Ok((name, upstream))
}

/// What a route's fields convert to, besides its identity and headers.
struct RouteFields {
    effectful_methods: Option<Vec<Method>>,
    route_tenants: Option<BTreeSet<String>>,
    provider_idempotency_header: Option<HeaderName>,
    request_schema: Option<std::sync::Arc<jsonschema::Validator>>,
    read_back: Option<ReadBack>,
}

/// The route's methods, tenants, provider header, bounds, request
/// contract, tenant-scoped field and read-back.
fn route_fields(
    rp: &str,
    r: &RouteSpec,
    tenants: &BTreeSet<String>,
    base_dir: &Path,
    lease_ms: u64,
) -> Result<RouteFields, ConfigError> {
    let effectful_methods = match &r.effectful_methods {
        None => None,
        Some(ms) => Some({
            let mut out = Vec::new();
            for (mi, m) in ms.iter().enumerate() {
                let upper = m.to_ascii_uppercase();
                let method = Method::from_bytes(upper.as_bytes()).map_err(|_| {
                    ConfigError::new(
                        format!("{rp}.effectful_methods[{mi}]"),
                        format!("not an HTTP method: {m:?}"),
                    )
                })?;
                out.push(method);
            }
            out
        }),
    };
    let route_tenants = match r.tenants.clone() {
        None => None,
        Some(ts) => {
            for (i, t) in ts.iter().enumerate() {
                if !tenants.contains(t) {
                    return Err(ConfigError::new(
                        format!("{rp}.tenants[{i}]"),
                        format!("unknown tenant {t:?}"),
                    ));
                }
            }
            Some(ts.into_iter().collect())
        }
    };
    let provider_idempotency_header = match &r.provider_idempotency_header {
        None => None,
        Some(h) => {
            let field = format!("{rp}.provider_idempotency_header");
            let name = HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| ConfigError::new(&field, format!("not a header name: {h:?}")))?;
            if NOT_FOR_A_KEY.contains(&name.as_str()) {
                return Err(ConfigError::new(
                    field,
                    format!(
                        "{h:?} frames, routes, traces or authenticates the request (RFC 9110, \
                         RFC 9112), or the gateway sets it: a provider key there would break \
                         the request; use the header the provider reads its key from, such \
                         as Idempotency-Key"
                    ),
                ));
            }
            Some(name)
        }
    };
    if r.connect_timeout_ms == 0 {
        return Err(ConfigError::new(
            format!("{rp}.connect_timeout_ms"),
            "must be at least 1",
        ));
    }
    if r.idle_connection_timeout_ms == 0 {
        return Err(ConfigError::new(
            format!("{rp}.idle_connection_timeout_ms"),
            "must be at least 1",
        ));
    }
    if r.response_timeout_ms == 0 {
        return Err(ConfigError::new(
            format!("{rp}.response_timeout_ms"),
            "must be at least 1",
        ));
    }
    if r.max_body_bytes == 0 {
        return Err(ConfigError::new(
            format!("{rp}.max_body_bytes"),
            "must be at least 1",
        ));
    }
    // At most about 100 years: an expiry past that would overflow the
    // ledger's ms timestamps (and could not be shown as a date).
    if !(1..=MAX_KEY_RETENTION_HOURS).contains(&r.key_retention_hours) {
        return Err(ConfigError::new(
            format!("{rp}.key_retention_hours"),
            format!("must be in 1..={MAX_KEY_RETENTION_HOURS} (about 100 years)"),
        ));
    }
    if r.retry.max_attempts == 0 {
        return Err(ConfigError::new(
            format!("{rp}.retry.max_attempts"),
            "must be at least 1",
        ));
    }
    let request_schema = request_schema(rp, r, base_dir)?;
    if let Some(p) = &r.tenant_scoped_field
        && (!p.starts_with('/') || p.split('/').skip(1).any(str::is_empty))
    {
        return Err(ConfigError::new(
            format!("{rp}.tenant_scoped_field"),
            format!("{p:?} is not a JSON pointer to a field (e.g. \"/metadata/tenant\")"),
        ));
    }
    let read_back = match &r.read_back {
        None => None,
        Some(rb) => {
            // The read-back runs under a reconciliation lease; one
            // that outlives it lets another instance read back too.
            if rb.timeout_ms >= lease_ms {
                return Err(ConfigError::new(
                    format!("{rp}.read_back.timeout_ms"),
                    format!(
                        "must be less than reconcile.lease_ms ({} ms), the lease a read-back runs under",
                        lease_ms
                    ),
                ));
            }
            Some(read_back(
                &format!("{rp}.read_back"),
                rb,
                r.tenant_scoped_field.as_deref(),
            )?)
        }
    };
    Ok(RouteFields {
        effectful_methods,
        route_tenants,
        provider_idempotency_header,
        request_schema,
        read_back,
    })
}

/// The response headers stored with a replay, and the headers the route
/// injects (their values from the environment, marked sensitive).
fn route_headers(rp: &str, r: &RouteSpec) -> Result<RouteHeaders, ConfigError> {
    let stored_names: Vec<String> = match &r.stored_response_headers {
        Some(v) => v.clone(),
        None => DEFAULT_STORED_HEADERS
            .iter()
            .map(|s| s.to_string())
            .collect(),
    };
    // A stored body is replayed byte for byte, so the headers that
    // say how to read it are always stored with it.
    let mut stored_response_headers = vec![http::header::CONTENT_ENCODING, http::header::VARY];
    for (hi, h) in stored_names.iter().enumerate() {
        if ["content-encoding", "vary"].contains(&h.to_ascii_lowercase().as_str()) {
            continue;
        }
        stored_response_headers.push(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
            ConfigError::new(
                format!("{rp}.stored_response_headers[{hi}]"),
                format!("not a header name: {h:?}"),
            )
        })?);
    }
    let mut inject_headers = Vec::new();
    for (ii, ih) in r.inject_headers.iter().enumerate() {
        let ip = format!("{rp}.inject_headers[{ii}]");
        let name = HeaderName::from_bytes(ih.name.as_bytes()).map_err(|_| {
            ConfigError::new(
                format!("{ip}.name"),
                format!("not a header name: {:?}", ih.name),
            )
        })?;
        let secret = std::env::var(&ih.value_env).map_err(|_| {
            ConfigError::new(
                format!("{ip}.value_env"),
                format!("environment variable {} is not set", ih.value_env),
            )
        })?;
        let mut value =
            HeaderValue::from_str(&format!("{}{}", ih.prefix, secret)).map_err(|_| {
                ConfigError::new(
                    format!("{ip}.value_env"),
                    "value is not a valid header value",
                )
            })?;
        value.set_sensitive(true);
        inject_headers.push((name, value));
    }
    Ok((stored_response_headers, inject_headers))
}

/// The route's request contract: the JSON Schema file, read and compiled.
fn request_schema(
    rp: &str,
    r: &RouteSpec,
    base_dir: &Path,
) -> Result<Option<std::sync::Arc<jsonschema::Validator>>, ConfigError> {
    Ok(match &r.request_schema {
        None => None,
        Some(p) => {
            let path = base_dir.join(p);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                ConfigError::new(
                    format!("{rp}.request_schema"),
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                ConfigError::new(
                    format!("{rp}.request_schema"),
                    format!("{} is not JSON: {e}", path.display()),
                )
            })?;
            let v = jsonschema::validator_for(&schema).map_err(|e| {
                ConfigError::new(
                    format!("{rp}.request_schema"),
                    format!("{} is not a valid JSON Schema: {e}", path.display()),
                )
            })?;
            Some(std::sync::Arc::new(v))
        }
    })
}
