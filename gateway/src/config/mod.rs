//! Configuration: the TOML file format (spec types) and its conversion into
//! the runtime [`Settings`] the gateway runs with.
//!
//! Layering (lowest to highest precedence):
//! 1. built-in defaults ([`ConfigFile::default`]),
//! 2. the TOML file given with `--config`,
//! 3. environment variables prefixed `EFFECTGATE_`, with `__` separating
//!    nested keys, e.g. `EFFECTGATE_LISTEN__PROXY=0.0.0.0:8080` or
//!    `EFFECTGATE_STORAGE__PATH=/var/lib/effectgate/ledger.db`.
//!    (`EFFECTGATE_CONFIG` names the file itself and is not a field.)
//!
//! Unknown fields are errors. Every error names the field by its path
//! (`routes[0].upstream`).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use http::{HeaderName, HeaderValue, Method};

use sha2::{Digest, Sha256};

/// Default stored-response header allow-list (lower-case names).
pub const DEFAULT_STORED_HEADERS: &[&str] = &[
    "content-type",
    "content-language",
    "location",
    "etag",
    "last-modified",
    "request-id",
    "x-request-id",
];

/// A configuration error that names the offending field by its path.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// Dotted path of the field, e.g. `routes[0].upstream` (empty for the file itself).
    pub path: String,
    /// What is wrong with it.
    pub message: String,
}

impl ConfigError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

mod read_back;
mod spec;

use read_back::read_back;

pub use spec::*;

// ---------------------------------------------------------------------------
// Runtime types.
// ---------------------------------------------------------------------------

/// Validated settings the gateway runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Proxy listener address.
    pub proxy_addr: SocketAddr,
    /// Admin listener address.
    pub admin_addr: SocketAddr,
    /// SQLite ledger file.
    pub storage: StorageSpec,
    /// Gateway-wide limits.
    pub limits: LimitsSpec,
    /// sha256(key) → principal.
    pub keys: HashMap<[u8; 32], Principal>,
    /// Tenant ids.
    pub tenants: BTreeSet<String>,
    /// Routes, longest prefix first.
    pub routes: Vec<Route>,
    /// Reconciler settings.
    pub reconcile: ReconcileSpec,
    /// Policy call limits.
    pub policy_limits: PolicyLimitsSpec,
    /// Policy bindings: (tenant, binding with its module path resolved).
    pub policy_bindings: Vec<(String, PolicyBindingSpec)>,
    /// The config file, if one was loaded (for reloads).
    pub source: Option<PathBuf>,
    /// Webhooks by tenant.
    pub webhooks: HashMap<String, Webhook>,
    /// Tenants whose principals may approve their own requests.
    pub self_approval: BTreeSet<String>,
    /// Tenants' MCP tool overrides: tenant → tool → override.
    pub mcp_tools: HashMap<String, std::collections::BTreeMap<String, ToolOverride>>,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Tenant the key belongs to.
    pub tenant: String,
    /// Principal name (`actor` in transitions).
    pub name: String,
    /// Role of the key.
    pub role: Role,
}

/// A route ready to serve.
#[derive(Debug, Clone)]
pub struct Route {
    /// Route name.
    pub name: String,
    /// Path prefix (starts and ends with `/`).
    pub prefix: String,
    /// Provider base URL without a trailing slash.
    pub upstream: url::Url,
    /// Effectful or pass-through.
    pub mode: RouteMode,
    /// Methods recorded in the ledger; `None` = every method but GET,
    /// HEAD and OPTIONS (any other method, even an unusual one, may change
    /// the world).
    pub effectful_methods: Option<Vec<Method>>,
    /// Tenants allowed; `None` = all.
    pub tenants: Option<BTreeSet<String>>,
    /// Provider's idempotency header.
    pub provider_idempotency_header: Option<HeaderName>,
    /// Connect timeout (ms).
    pub connect_timeout_ms: u64,
    /// Response timeout (ms).
    pub response_timeout_ms: u64,
    /// Request body limit (bytes).
    pub max_body_bytes: usize,
    /// Stored response limit (bytes).
    pub max_stored_response_bytes: usize,
    /// Key retention (ms).
    pub key_retention_ms: u64,
    /// Stored response header allow-list.
    pub stored_response_headers: Vec<HeaderName>,
    /// Injected credentials (name, value).
    pub inject_headers: Vec<(HeaderName, HeaderValue)>,
    /// Retry policy for transient failures.
    pub retry: RetrySpec,
    /// The route's outbound HTTP client (its connect timeout is per route).
    pub client: crate::forward::HttpClient,
    /// Effect class.
    pub effect_class: EffectClass,
    /// Read-back, if the provider supports one.
    pub read_back: Option<ReadBack>,
    /// Fail open on policy failure.
    pub policy_fail_open: bool,
    /// Approval lifetime, ms.
    pub approval_ttl_ms: u64,
    /// Execute the stored request once approved.
    pub execute_on_approval: bool,
    /// Request body contract.
    pub request_schema: Option<std::sync::Arc<jsonschema::Validator>>,
    /// MCP options, for `mode = "mcp"` routes.
    pub mcp: Option<McpSpec>,
}

/// A validated read-back.
#[derive(Debug, Clone)]
pub struct ReadBack {
    /// Method.
    pub method: Method,
    /// Path template.
    pub path: crate::template::Template,
    /// MCP read-back tool, if any.
    pub tool: Option<String>,
    /// MCP read-back tool arguments (templates).
    pub tool_arguments: Vec<(String, crate::template::Template)>,
    /// Header templates.
    pub headers: Vec<(HeaderName, crate::template::Template)>,
    /// Found pointer.
    pub found_pointer: String,
    /// Match conditions: pointer into the found value → template.
    pub match_fields: Vec<(String, crate::template::Template)>,
    /// Reference pointer.
    pub reference_pointer: Option<String>,
    /// Settle delay, ms.
    pub settle_delay_ms: u64,
    /// Timeout, ms.
    pub timeout_ms: u64,
}

impl Route {
    /// Whether `method` on this route goes through the effect ledger.
    pub fn is_effectful(&self, method: &Method) -> bool {
        self.mode == RouteMode::Effectful
            && match &self.effectful_methods {
                Some(ms) => ms.contains(method),
                None => !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS),
            }
    }

    /// Whether `tenant` may use this route.
    pub fn allows_tenant(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|t| t.contains(tenant))
    }
}

impl Settings {
    /// The route whose prefix matches `path` (longest prefix wins), if any.
    pub fn match_route(&self, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| path.starts_with(&r.prefix))
    }
}

/// Loads `path` (or only defaults when `None`) layered with `EFFECTGATE_*`
/// environment variables, and validates it.
///
/// Errors: a [`ConfigError`] naming the field path: a missing file, a TOML
/// syntax error, an unknown field, a wrong type, or a failed check in
/// [`ConfigFile::into_settings`].
pub fn load(path: Option<&Path>) -> Result<Settings, ConfigError> {
    load_file(path)?.into_settings_from(path)
}

/// Loads and layers the file without the semantic checks.
pub fn load_file(path: Option<&Path>) -> Result<ConfigFile, ConfigError> {
    let mut fig = Figment::from(Serialized::defaults(ConfigFile::default()));
    if let Some(p) = path {
        if !p.exists() {
            return Err(ConfigError::new(
                "",
                format!("config file {} does not exist", p.display()),
            ));
        }
        fig = fig.merge(Toml::file_exact(p));
    }
    fig = fig.merge(Env::prefixed("EFFECTGATE_").ignore(&["config"]).split("__"));
    fig.extract::<ConfigFile>().map_err(|e| {
        let mut path = String::new();
        for (i, part) in e.path.iter().enumerate() {
            if part.parse::<usize>().is_ok() {
                path.push_str(&format!("[{part}]"));
            } else {
                if i > 0 {
                    path.push('.');
                }
                path.push_str(part);
            }
        }
        ConfigError::new(path, e.kind.to_string())
    })
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn parse_addr(path: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|e| ConfigError::new(path, format!("not a socket address ({e}): {s:?}")))
}

/// sha256 of a key, as used in the key table.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ConfigFile {
    /// Checks every field and builds the runtime [`Settings`]. Reads key
    /// and credential values from env or files named in the config.
    ///
    /// Errors: the first invalid field, by path.
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        self.into_settings_from(None)
    }

    /// [`ConfigFile::into_settings`] for a file at `source`: relative paths
    /// (policy modules, request schemas) resolve against its directory.
    pub fn into_settings_from(self, source: Option<&Path>) -> Result<Settings, ConfigError> {
        let base_dir = source
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let proxy_addr = parse_addr("listen.proxy", &self.listen.proxy)?;
        // Relative paths in a config file mean "next to the file".
        let mut storage = self.storage.clone();
        if storage.path.is_relative() && source.is_some() {
            storage.path = base_dir.join(&storage.path);
        }
        let admin_addr = parse_addr("listen.admin", &self.listen.admin)?;
        if self.storage.path.as_os_str().is_empty() {
            return Err(ConfigError::new("storage.path", "must not be empty"));
        }
        if self.storage.max_read_connections == 0 {
            return Err(ConfigError::new(
                "storage.max_read_connections",
                "must be at least 1",
            ));
        }
        if !(1..=255).contains(&self.limits.max_idempotency_key_len) {
            return Err(ConfigError::new(
                "limits.max_idempotency_key_len",
                "must be in 1..=255",
            ));
        }
        if self.limits.max_list_limit == 0 {
            return Err(ConfigError::new(
                "limits.max_list_limit",
                "must be at least 1",
            ));
        }

        let mut tenants = BTreeSet::new();
        let mut keys = HashMap::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            let tp = format!("tenants[{ti}]");
            if !valid_id(&t.id) {
                return Err(ConfigError::new(
                    format!("{tp}.id"),
                    "must be 1..=64 characters of [A-Za-z0-9._-]",
                ));
            }
            if !tenants.insert(t.id.clone()) {
                return Err(ConfigError::new(
                    format!("{tp}.id"),
                    format!("duplicate tenant {:?}", t.id),
                ));
            }
            for (ki, k) in t.keys.iter().enumerate() {
                let kp = format!("{tp}.keys[{ki}]");
                let digest = match (&k.sha256, &k.env, &k.file) {
                    (Some(h), None, None) => {
                        let bytes = hex::decode(h.trim())
                            .ok()
                            .filter(|b| b.len() == 32)
                            .ok_or_else(|| {
                                ConfigError::new(
                                    format!("{kp}.sha256"),
                                    "must be 64 hex characters",
                                )
                            })?;
                        let mut d = [0u8; 32];
                        d.copy_from_slice(&bytes);
                        d
                    }
                    (None, Some(var), None) => {
                        let v = std::env::var(var).map_err(|_| {
                            ConfigError::new(
                                format!("{kp}.env"),
                                format!("environment variable {var} is not set"),
                            )
                        })?;
                        if v.is_empty() {
                            return Err(ConfigError::new(
                                format!("{kp}.env"),
                                format!("{var} is empty"),
                            ));
                        }
                        key_digest(&v)
                    }
                    (None, None, Some(file)) => {
                        let v = std::fs::read_to_string(file).map_err(|e| {
                            ConfigError::new(
                                format!("{kp}.file"),
                                format!("cannot read {}: {e}", file.display()),
                            )
                        })?;
                        let v = v.trim();
                        if v.is_empty() {
                            return Err(ConfigError::new(
                                format!("{kp}.file"),
                                "key file is empty",
                            ));
                        }
                        key_digest(v)
                    }
                    _ => {
                        return Err(ConfigError::new(
                            kp,
                            "exactly one of `sha256`, `env`, `file` must be set",
                        ));
                    }
                };
                let principal = Principal {
                    tenant: t.id.clone(),
                    name: k
                        .name
                        .clone()
                        .unwrap_or_else(|| format!("{}:{}", t.id, k.role.as_str())),
                    role: k.role,
                };
                if keys.insert(digest, principal).is_some() {
                    return Err(ConfigError::new(kp, "the same key is configured twice"));
                }
            }
        }

        let mut routes = Vec::new();
        let mut names = BTreeSet::new();
        let mut policy_bindings = Vec::new();
        for (ri, r) in self.routes.into_iter().enumerate() {
            let rp = format!("routes[{ri}]");
            if !r.prefix.starts_with('/') || !r.prefix.ends_with('/') {
                return Err(ConfigError::new(
                    format!("{rp}.prefix"),
                    "must start and end with '/'",
                ));
            }
            if r.prefix.starts_with("/admin/") || r.prefix.starts_with("/approvals/") {
                return Err(ConfigError::new(
                    format!("{rp}.prefix"),
                    "must not start with /admin/ or /approvals/ (the gateway's own paths)",
                ));
            }
            let name = r.name.clone().unwrap_or_else(|| r.prefix.clone());
            if name.is_empty() || name.len() > 128 {
                return Err(ConfigError::new(
                    format!("{rp}.name"),
                    "must be 1..=128 characters",
                ));
            }
            if !names.insert(name.clone()) {
                return Err(ConfigError::new(
                    format!("{rp}.name"),
                    format!("duplicate route name {name:?}"),
                ));
            }
            let upstream = url::Url::parse(&r.upstream).map_err(|e| {
                ConfigError::new(format!("{rp}.upstream"), format!("not a URL: {e}"))
            })?;
            if upstream.scheme() != "http" {
                return Err(ConfigError::new(
                    format!("{rp}.upstream"),
                    "only http:// upstreams are supported",
                ));
            }
            if upstream.host_str().is_none()
                || upstream.query().is_some()
                || upstream.fragment().is_some()
            {
                return Err(ConfigError::new(
                    format!("{rp}.upstream"),
                    "must be scheme://host[:port][/path] without query",
                ));
            }
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
            let route_tenants = match r.tenants {
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
                Some(h) => Some(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    ConfigError::new(
                        format!("{rp}.provider_idempotency_header"),
                        format!("not a header name: {h:?}"),
                    )
                })?),
            };
            if r.connect_timeout_ms == 0 {
                return Err(ConfigError::new(
                    format!("{rp}.connect_timeout_ms"),
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
            if r.key_retention_hours == 0 {
                return Err(ConfigError::new(
                    format!("{rp}.key_retention_hours"),
                    "must be at least 1",
                ));
            }
            if r.retry.max_attempts == 0 {
                return Err(ConfigError::new(
                    format!("{rp}.retry.max_attempts"),
                    "must be at least 1",
                ));
            }
            let request_schema = match &r.request_schema {
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
            };
            let read_back = match &r.read_back {
                None => None,
                Some(rb) => Some(read_back(&format!("{rp}.read_back"), rb)?),
            };
            let stored_names: Vec<String> = match &r.stored_response_headers {
                Some(v) => v.clone(),
                None => DEFAULT_STORED_HEADERS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            };
            let mut stored_response_headers = Vec::new();
            for (hi, h) in stored_names.iter().enumerate() {
                stored_response_headers.push(HeaderName::from_bytes(h.as_bytes()).map_err(
                    |_| {
                        ConfigError::new(
                            format!("{rp}.stored_response_headers[{hi}]"),
                            format!("not a header name: {h:?}"),
                        )
                    },
                )?);
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
                let mut value = HeaderValue::from_str(&format!("{}{}", ih.prefix, secret))
                    .map_err(|_| {
                        ConfigError::new(
                            format!("{ip}.value_env"),
                            "value is not a valid header value",
                        )
                    })?;
                value.set_sensitive(true);
                inject_headers.push((name, value));
            }
            let client = crate::forward::client_for(r.connect_timeout_ms);
            routes.push(Route {
                client,
                name,
                prefix: r.prefix,
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
                mcp: match r.mode {
                    RouteMode::Mcp => Some(r.mcp.clone().unwrap_or_default()),
                    _ => None,
                },
            });
        }
        for (ti, t) in self.tenants.iter().enumerate() {
            for (pi, b) in t.policies.iter().enumerate() {
                if b.route != "*" && !names.contains(&b.route) {
                    return Err(ConfigError::new(
                        format!("tenants[{ti}].policies[{pi}].route"),
                        format!("unknown route {:?}", b.route),
                    ));
                }
                let mut b = b.clone();
                b.module = base_dir.join(&b.module);
                policy_bindings.push((t.id.clone(), b));
            }
        }
        let mut webhooks = HashMap::new();
        let mut self_approval = BTreeSet::new();
        let mut mcp_tools = HashMap::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            if t.allow_self_approval {
                self_approval.insert(t.id.clone());
            }
            if !t.mcp_tools.is_empty() {
                mcp_tools.insert(t.id.clone(), t.mcp_tools.clone());
            }
            if let Some(w) = &t.webhook {
                let wp = format!("tenants[{ti}].webhook");
                let url: http::Uri = w
                    .url
                    .parse()
                    .map_err(|_| ConfigError::new(format!("{wp}.url"), "not a URL"))?;
                if url.scheme_str() != Some("http") || url.host().is_none() {
                    return Err(ConfigError::new(
                        format!("{wp}.url"),
                        "must be an http:// URL",
                    ));
                }
                let secret = std::env::var(&w.secret_env).map_err(|_| {
                    ConfigError::new(
                        format!("{wp}.secret_env"),
                        format!("environment variable {} is not set", w.secret_env),
                    )
                })?;
                webhooks.insert(
                    t.id.clone(),
                    Webhook {
                        url,
                        secret: secret.into_bytes(),
                    },
                );
            }
        }
        if self.policy.memory_bytes < 64 * 1024 {
            return Err(ConfigError::new(
                "policy.memory_bytes",
                "must be at least 65536 (one wasm page)",
            ));
        }
        if self.policy.deadline_ms == 0 {
            return Err(ConfigError::new("policy.deadline_ms", "must be at least 1"));
        }
        let mut seen = BTreeSet::new();
        for (ri, r) in routes.iter().enumerate() {
            if !seen.insert(r.prefix.clone()) {
                return Err(ConfigError::new(
                    format!("routes[{ri}].prefix"),
                    format!("duplicate prefix {:?}", r.prefix),
                ));
            }
        }
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        if self.reconcile.interval_ms == 0 {
            return Err(ConfigError::new(
                "reconcile.interval_ms",
                "must be at least 1",
            ));
        }
        if self.reconcile.batch == 0 {
            return Err(ConfigError::new("reconcile.batch", "must be at least 1"));
        }
        Ok(Settings {
            proxy_addr,
            admin_addr,
            storage,
            limits: self.limits,
            keys,
            tenants,
            routes,
            reconcile: self.reconcile,
            policy_limits: self.policy,
            policy_bindings,
            source: source.map(Path::to_path_buf),
            webhooks,
            self_approval,
            mcp_tools,
        })
    }
}

#[cfg(test)]
mod tests;
