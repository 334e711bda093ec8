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
use figment::providers::{Env, Serialized};
use http::{HeaderName, HeaderValue, Method};

use sha2::{Digest, Sha256};

/// The request id header (lower case) the gateway reads from each call
/// and, when a call has none or a malformed one, sets to a fresh id before
/// any handler runs; it is forwarded and echoed in the answer.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

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
    /// Dotted path of the field, e.g. `routes[0].upstream`; for an error of
    /// the file itself, the file (`examples/x.toml`, or `examples/x.toml:3:9`
    /// with the line and column of a TOML syntax error).
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

mod checks;
mod compensation;
mod convert;
mod convert_route;
mod egress;
mod inbox;
mod listen_spec;
mod read_back;
mod route_spec;
mod spec;
mod storage;
mod telemetry;

use read_back::read_back;

pub use compensation::*;
pub use inbox::*;
pub use listen_spec::*;
pub use route_spec::*;
pub use spec::*;
pub use storage::*;

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
    /// TLS of the proxy listener (paths resolved), if any.
    pub proxy_tls: Option<ListenerTlsSpec>,
    /// TLS of the admin listener (paths resolved), if any.
    pub admin_tls: Option<ListenerTlsSpec>,
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
    /// Tenants' rate and in-flight limits, by tenant (only tenants with one).
    /// Rebuilt on reload: a reload starts their counts afresh.
    pub tenant_limits: HashMap<String, TenantLimits>,
    /// Tenants' MCP tool overrides: tenant → tool → override.
    pub mcp_tools: HashMap<String, std::collections::BTreeMap<String, ToolOverride>>,
    /// Trace export, resolved from `[telemetry]` and the `OTEL_*` variables.
    pub telemetry: crate::telemetry::TelemetrySettings,
    /// `[shutdown]`.
    pub shutdown: ShutdownSpec,
    /// `[[inbox]]` sources, by name.
    pub inbox: std::collections::BTreeMap<String, std::sync::Arc<InboxSource>>,
    /// What the config allows but likely doesn't mean, one sentence each,
    /// starting with the field it is about (an inbox source whose tenant
    /// has no webhook delivers nothing): `check-config` prints them, and
    /// the gateway logs them at WARN when it starts and on every reload
    /// ([`Settings::log_warnings`]).
    pub warnings: Vec<String>,
}

/// A tenant's call limits, ready to check.
#[derive(Debug, Clone, Default)]
pub struct TenantLimits {
    rate: Option<std::sync::Arc<governor::DefaultDirectRateLimiter>>,
    in_flight: Option<(u32, std::sync::Arc<tokio::sync::Semaphore>)>,
    /// `tenants[].max_stored_bytes`: body bytes its operations may hold.
    pub max_stored_bytes: Option<u64>,
}

impl TenantLimits {
    /// Limits from `tenants[].rate_limit` and `tenants[].max_in_flight`
    /// (both already checked to be at least 1).
    pub fn new(rate: Option<&RateLimitSpec>, max_in_flight: Option<u32>) -> Self {
        let nz = |n: u32| std::num::NonZeroU32::new(n.max(1)).expect("at least 1");
        Self {
            rate: rate.map(|r| {
                let q = governor::Quota::per_second(nz(r.per_second))
                    .allow_burst(nz(r.burst.unwrap_or(r.per_second)));
                std::sync::Arc::new(governor::RateLimiter::direct(q))
            }),
            in_flight: max_in_flight.map(|n| {
                (
                    n,
                    std::sync::Arc::new(tokio::sync::Semaphore::new(n as usize)),
                )
            }),
            max_stored_bytes: None,
        }
    }

    /// Takes one call from the rate limit.
    ///
    /// Errors: 429 `tenant-limited` with `Retry-After` (whole seconds, at
    /// least 1) when the bucket is empty.
    pub fn check_rate(&self, tenant: &str) -> Result<(), TenantLimited> {
        let Some(r) = &self.rate else { return Ok(()) };
        r.check().map_err(|not_until| {
            crate::metrics::tenant_limited(tenant, "rate");
            let wait = not_until.wait_time_from(governor::clock::Clock::now(
                &governor::clock::DefaultClock::default(),
            ));
            TenantLimited {
                limit: "rate",
                retry_after_s: wait.as_secs_f64().ceil().max(1.0) as u64,
            }
        })
    }

    /// Takes an in-flight permit, held until dropped; `None` without a limit.
    ///
    /// Errors: 429 `tenant-limited` with `Retry-After: 1` when all are taken.
    pub fn acquire_in_flight(
        &self,
        tenant: &str,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, TenantLimited> {
        let Some((_, s)) = &self.in_flight else {
            return Ok(None);
        };
        s.clone().try_acquire_owned().map(Some).map_err(|_| {
            crate::metrics::tenant_limited(tenant, "in-flight");
            TenantLimited {
                limit: "in-flight",
                retry_after_s: 1,
            }
        })
    }
}

/// A tenant's limit refused a call (answered 429 `tenant-limited`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantLimited {
    /// Which limit: `rate` or `in-flight`.
    pub limit: &'static str,
    /// Suggested `Retry-After`, in seconds (at least 1).
    pub retry_after_s: u64,
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
    /// `upstream` split once at load, so that a call's URI is put together
    /// without parsing the scheme and authority again; `None` for a URL the
    /// `http` crate doesn't take apart (the URI is then parsed whole).
    pub upstream_base: Option<UpstreamBase>,
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
    pub client: crate::egress::HttpClient,
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
    /// JSON pointer the gateway stamps the tenant id at in every effectful
    /// request body (`routes[].tenant_scoped_field`), if set.
    pub tenant_scoped_field: Option<String>,
    /// How a COMPLETED operation of this route is undone
    /// (`[routes.compensation]`), if it can be.
    pub compensation: Option<std::sync::Arc<Compensation>>,
    /// When a 2xx answer counts as applied: any 2xx, except on a
    /// compensation's route with a `success` pointer.
    pub success: SuccessRule,
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
    /// The route's `tenant_scoped_field`: the found value must hold the
    /// operation's tenant there.
    pub tenant_field: Option<String>,
    /// Settle delay, ms.
    pub settle_delay_ms: u64,
    /// Timeout, ms.
    pub timeout_ms: u64,
}

/// A route's upstream URL in the parts of a call's URI.
#[derive(Debug, Clone)]
pub struct UpstreamBase {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// Host and port (and user info, when the URL has it).
    pub authority: http::uri::Authority,
    /// What follows the authority, without a trailing slash (`""` for the
    /// root): a call's path is appended to it.
    pub path: String,
}

impl UpstreamBase {
    /// The parts of `upstream`, if `http::Uri` takes it apart.
    pub fn of(upstream: &url::Url) -> Option<Self> {
        let base = upstream.as_str().trim_end_matches('/');
        let uri: http::Uri = base.parse().ok()?;
        let (scheme, authority) = (uri.scheme()?.clone(), uri.authority()?.clone());
        let start = base.find("://")? + 3 + authority.as_str().len();
        Some(Self {
            scheme,
            authority,
            path: base.get(start..)?.to_owned(),
        })
    }
}

impl Route {
    /// The most of an MCP server's answer the gateway reads into memory,
    /// bytes: `max_stored_response_bytes`, at least 16 MiB (a tool's
    /// outcome is inside the answer, so it is read whole, and a replay
    /// must be the whole result). A larger answer is not read further.
    pub fn mcp_answer_bytes(&self) -> usize {
        self.max_stored_response_bytes.max(MCP_ANSWER_MIN_BYTES)
    }

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
    /// Logs each of [`Settings::warnings`] at WARN, as `config: <warning>`.
    pub fn log_warnings(&self) {
        for w in &self.warnings {
            tracing::warn!("config: {w}");
        }
    }

    /// The route whose prefix matches `path` (longest prefix wins), if any.
    pub fn match_route(&self, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| path.starts_with(&r.prefix))
    }

    /// The route named `name` (`routes[].name`), if it is still configured;
    /// `<name>#compensation` is the compensation route of route `<name>`
    /// (see [`Compensation::route`]).
    pub fn route_named(&self, name: &str) -> Option<&Route> {
        if let Some(base) = compensated_id(name) {
            return self
                .routes
                .iter()
                .find(|r| r.name == base)
                .and_then(|r| r.compensation.as_ref())
                .map(|c| &c.route);
        }
        self.routes.iter().find(|r| r.name == name)
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

/// Loads `path` like [`load`], but converts and checks only `[storage]`
/// ([`ConfigFile::storage_settings_from`]): for the commands that only open
/// the ledger (`migrate`, `ledger …`, `inbox list`).
///
/// Errors: as [`load_file`], or a [`ConfigError`] naming the `storage.*`
/// field.
pub fn load_storage(path: Option<&Path>) -> Result<StorageSpec, ConfigError> {
    load_file(path)?.storage_settings_from(path)
}

/// Loads and layers the file without the semantic checks.
///
/// Errors name the file (missing, unreadable, with the line and column of
/// a TOML syntax error), else the field by its path; a field set by an
/// `EFFECTGATE_*` variable also names the variable.
pub fn load_file(path: Option<&Path>) -> Result<ConfigFile, ConfigError> {
    let mut fig = Figment::from(Serialized::defaults(ConfigFile::default()));
    if let Some(p) = path {
        let file = p.display().to_string();
        let text = match std::fs::read_to_string(p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ConfigError::new(file, "the config file does not exist"));
            }
            Err(e) => return Err(ConfigError::new(file, format!("cannot read it: {e}"))),
        };
        // Parsed once, as TOML 1.1 (an inline table may span lines), and
        // handed to the layers as data: the file's own provider would
        // parse it again as TOML 1.0 and refuse what this accepted.
        let table = match toml::from_str::<toml::Table>(&text) {
            Ok(table) => table,
            Err(e) => {
                let mut message = e.message().trim().replace('\n', "; ");
                let at = match e.span() {
                    Some(span) => {
                        let (line, col) = line_col(&text, span.start);
                        if let Some(l) = text.lines().nth(line - 1) {
                            message.push_str(&format!(", in: {}", l.trim()));
                        }
                        format!("{file}:{line}:{col}")
                    }
                    None => file,
                };
                return Err(ConfigError::new(
                    at,
                    format!("TOML syntax error: {message}"),
                ));
            }
        };
        fig = fig.merge(Serialized::defaults(table));
    }
    if let Some(e) = list_from_env(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok())) {
        return Err(e);
    }
    fig = fig.merge(
        Env::prefixed(ENV_PREFIX)
            .ignore(&["config", "log_format"])
            .split("__"),
    );
    fig.extract::<ConfigFile>().map_err(|e| {
        let path = field_path(&e.path);
        let mut message = describe(&e.kind);
        if let Some(var) = env_var_for(&e.path) {
            message.push_str(&format!(" (set by the environment variable {var})"));
        }
        ConfigError::new(path, message)
    })
}

/// A field path as written in messages: `routes[0].upstream`. An array
/// index is `[n]`; a key that is not a bare TOML key (`A-Za-z0-9_-`, TOML
/// 1.0 §Keys) is quoted as TOML quotes it (`tenants[0]."a.b"`), so a key
/// with a dot, a space or nothing in it names one field, not several.
fn field_path(parts: &[String]) -> String {
    let mut path = String::new();
    for (i, part) in parts.iter().enumerate() {
        let bare = !part.is_empty()
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if bare && i > 0 && part.bytes().all(|b| b.is_ascii_digit()) {
            path.push_str(&format!("[{part}]"));
            continue;
        }
        if i > 0 {
            path.push('.');
        }
        if bare {
            path.push_str(part);
        } else {
            path.push_str(&toml::Value::String(part.clone()).to_string());
        }
    }
    path
}

/// The least [`Route::mcp_answer_bytes`] is: 16 MiB.
pub const MCP_ANSWER_MIN_BYTES: usize = 16 << 20;

/// The prefix of the environment variables that override config fields.
const ENV_PREFIX: &str = "EFFECTGATE_";

/// The top-level lists of the file: an `EFFECTGATE_*` variable can set a
/// whole one (as an inline array), but not a field of one element
/// (`EFFECTGATE_ROUTES__0__UPSTREAM` would replace the whole list with a
/// table).
const LISTS: &[&str] = &["routes", "tenants", "inbox"];

/// The error for the first of `names` (environment variable names) that
/// names a field inside one of the [`LISTS`], naming the variable; `None`
/// when none does. Names are read as the environment layer reads them:
/// the prefix in any case, trimmed, `__` and `.` separating the segments,
/// and a name with an empty segment ignored.
fn list_from_env(names: impl Iterator<Item = String>) -> Option<ConfigError> {
    names.into_iter().find_map(|name| {
        let rest = name
            .get(..ENV_PREFIX.len())
            .filter(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
            .map(|_| name[ENV_PREFIX.len()..].trim().to_ascii_lowercase())?;
        let rest = rest.replace("__", ".");
        let segments: Vec<&str> = rest.split('.').collect();
        if segments.iter().any(|s| s.is_empty()) {
            return None;
        }
        let top = segments[0];
        (segments.len() > 1 && LISTS.contains(&top)).then(|| {
            ConfigError::new(
                top,
                format!(
                    "a list: an environment variable can't set a field of one element \
                     ({name} is set); write the list in the config file, or set it whole"
                ),
            )
        })
    })
}

/// A deserialisation error in words, with each alternative quoted once.
fn describe(kind: &figment::error::Kind) -> String {
    use figment::error::{Kind, OneOf};
    match kind {
        Kind::UnknownField(found, expected) => {
            format!("unknown field `{found}`, expected {}", OneOf(expected))
        }
        Kind::UnknownVariant(found, expected) => {
            format!("unknown value `{found}`, expected {}", OneOf(expected))
        }
        other => other.to_string(),
    }
}

/// The `EFFECTGATE_*` variable that set the field at `path` (or a table
/// above it), if one did.
fn env_var_for(path: &[String]) -> Option<String> {
    let field = path.join(".").to_ascii_lowercase();
    std::env::vars_os().find_map(|(name, _)| {
        let name = name.into_string().ok()?;
        let key = name
            .get(..ENV_PREFIX.len())
            .filter(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
            .map(|_| name[ENV_PREFIX.len()..].to_ascii_lowercase())?;
        let key = key.split("__").collect::<Vec<_>>().join(".");
        (key != "config"
            && !key.is_empty()
            && (field == key || field.starts_with(&format!("{key}."))))
        .then_some(name)
    })
}

/// The 1-based line and column (in characters) of byte `offset` of `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, col)
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

/// Whether `path` could leave a route's base path once a server reads it:
/// a `.` or `..` segment (also before a `;` path parameter: `..;x` is `..`
/// to servlet containers), a backslash, or `%00`, `%2e`, `%2f`, `%5c` in
/// either case. The proxy refuses such request paths; a route's `prefix`
/// may hold none of them either. Reads the path in place (it runs on every
/// call).
pub fn leaves_base_path(path: &str) -> bool {
    let encoded = path.as_bytes().contains(&b'%')
        && path.as_bytes().windows(3).any(|w| {
            w[0] == b'%'
                && matches!(
                    (w[1], w[2].to_ascii_lowercase()),
                    (b'0', b'0') | (b'2', b'e') | (b'2', b'f') | (b'5', b'c')
                )
        });
    let dots = || {
        path.split('/').any(|seg| {
            let bare = seg.split(';').next().unwrap_or("");
            bare == "." || bare == ".."
        })
    };
    // Most paths have no `.`, so no dot segment: their segments aren't
    // looked at.
    let dotted = || path.as_bytes().contains(&b'.') && dots();
    encoded || path.contains('\\') || dotted()
}

/// `n` and the noun, plural unless `n` is 1: `1 tenant`, `3 routes`.
pub fn counted(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// sha256 of a key, as used in the key table.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

#[cfg(test)]
mod tests;
