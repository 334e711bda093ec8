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
use serde::{Deserialize, Serialize};
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

// ---------------------------------------------------------------------------
// Spec types: the file format.
// ---------------------------------------------------------------------------

/// The whole configuration file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Listener addresses.
    #[serde(default)]
    pub listen: ListenSpec,
    /// Where the effect ledger lives.
    #[serde(default)]
    pub storage: StorageSpec,
    /// Gateway-wide limits.
    #[serde(default)]
    pub limits: LimitsSpec,
    /// Tenants and their API keys.
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
    /// Routes: path prefix → provider.
    #[serde(default)]
    pub routes: Vec<RouteSpec>,
    /// The reconciler.
    #[serde(default)]
    pub reconcile: ReconcileSpec,
    /// Limits of policy calls.
    #[serde(default)]
    pub policy: PolicyLimitsSpec,
}

/// `[policy]`: limits of every policy call (one fresh store per call).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyLimitsSpec {
    /// Linear memory a policy may use, in bytes. Default 16 MiB.
    pub memory_bytes: usize,
    /// CPU deadline per call, in ms (epoch ticks of 1 ms). Default 10.
    pub deadline_ms: u64,
    /// Fuel per call (wasm instructions, roughly); unset = no fuel metering.
    pub fuel: Option<u64>,
    /// Longest reason a policy may return, in bytes. Default 1024.
    pub max_reason_bytes: usize,
    /// Most headers an allow may add. Default 16.
    pub max_add_headers: usize,
    /// Longest added header value, in bytes. Default 1024.
    pub max_header_bytes: usize,
    /// Use the pooling instance allocator (falls back to on-demand
    /// allocation where the machine refuses the reservation). Default true.
    pub pooling: bool,
    /// Concurrent policy instances the pool holds. Default 256.
    pub pool_instances: u32,
}

impl Default for PolicyLimitsSpec {
    fn default() -> Self {
        Self {
            memory_bytes: 16 << 20,
            deadline_ms: 10,
            fuel: None,
            max_reason_bytes: 1024,
            max_add_headers: 16,
            max_header_bytes: 1024,
            pooling: true,
            pool_instances: 256,
        }
    }
}

/// `[[tenants.policies]]`: a policy bound to a tenant's route.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyBindingSpec {
    /// Route name, or `"*"` for every route. Policies run in file order.
    pub route: String,
    /// Path of the policy component (`.wasm`), relative to the config file.
    pub module: PathBuf,
    /// The tenant's config for this policy, validated against the policy's
    /// `config-schema()` at load time.
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// `[reconcile]`: the background task that resolves UNKNOWN operations by
/// read-back, takes over EXECUTING operations whose lease expired, and
/// executes RESERVED operations whose caller went away.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcileSpec {
    /// Run the reconciler in this instance. Default true.
    pub enabled: bool,
    /// Time between scans, in ms. Default 1000.
    pub interval_ms: u64,
    /// Most operations handled per scan. Default 100.
    pub batch: u32,
    /// A RESERVED operation untouched this long (ms) is executed by the
    /// reconciler (its caller went away before the first attempt). Default 30000.
    pub reserved_grace_ms: u64,
    /// How long a duplicate request for an UNKNOWN operation waits for the
    /// reconciliation it triggers, in ms. Default 5000.
    pub duplicate_wait_ms: u64,
    /// Length of a reconciliation lease, in ms. Default 10000.
    pub lease_ms: u64,
    /// Read-backs that may fail before the operation is dead-lettered. Default 10.
    pub max_read_backs: u32,
    /// Backoff after a failed read-back: base, in ms (doubles each time,
    /// full jitter). Default 1000.
    pub backoff_base_ms: u64,
    /// Backoff cap, in ms. Default 60000.
    pub backoff_max_ms: u64,
    /// How long the outbox relay holds a claimed event before another
    /// relay (or this one after a restart) may deliver it, in ms. Default 5000.
    pub outbox_lease_ms: u64,
}

impl Default for ReconcileSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_ms: 1_000,
            batch: 100,
            reserved_grace_ms: 30_000,
            duplicate_wait_ms: 5_000,
            lease_ms: 10_000,
            max_read_backs: 10,
            backoff_base_ms: 1_000,
            backoff_max_ms: 60_000,
            outbox_lease_ms: 5_000,
        }
    }
}

/// `[routes.read_back]`: how to ask the provider whether an operation's
/// effect exists. Templates may use `{operation_id}`, `{provider_key}` and
/// `{body:/json/pointer}` (a field of the stored request body); values are
/// percent-encoded.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadBackSpec {
    /// Method. Default GET.
    #[serde(default = "default_read_back_method")]
    pub method: String,
    /// Path and query template, appended to the route's upstream, e.g.
    /// `/v1/charges?idempotency_key={provider_key}`.
    pub path: String,
    /// Extra headers (value templates). The route's credentials are injected too.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// JSON pointer into a 2xx body: a non-empty value there means found;
    /// missing, null, `[]`, `{}` or `""` means absent. 404 means absent.
    pub found_pointer: String,
    /// JSON pointer, into the found value, to the provider's reference for
    /// the effect (e.g. `/id`).
    #[serde(default)]
    pub reference_pointer: Option<String>,
    /// "Absent" is trusted only this many ms after the last attempt could
    /// have reached the provider (for providers whose search lags; Stripe's
    /// search says "under a minute"). Default 5000.
    #[serde(default = "default_settle_delay_ms")]
    pub settle_delay_ms: u64,
    /// Conditions that tie a found value to this operation: JSON pointer
    /// (into the found value) → template that must equal it, e.g.
    /// `{ "/idempotency_key" = "{provider_key}" }`. When the found pointer
    /// names an array, the first element meeting every condition is the
    /// match; none → absent. A read-back keyed on a request body field
    /// (`{body:/client_ref}`) should always set one: the provider may hold
    /// another tenant's effect under the same field value.
    #[serde(default, rename = "match")]
    pub match_fields: std::collections::BTreeMap<String, String>,
    /// Read-back request timeout, in ms. Default 5000.
    #[serde(default = "default_read_back_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_read_back_method() -> String {
    "GET".into()
}
fn default_settle_delay_ms() -> u64 {
    5_000
}
fn default_read_back_timeout_ms() -> u64 {
    5_000
}

/// Effect class of a route: drives replay defaults (DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EffectClass {
    /// Rebuildable from a source of truth (index, cache).
    Derived,
    /// Side-effect-light.
    Analytics,
    /// Visible to a person (e-mail, message).
    Notification,
    /// Moves money.
    Payment,
    /// Changes authority.
    Permission,
    /// Can't be undone; the default when a route doesn't say.
    #[default]
    Irreversible,
}

impl EffectClass {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            EffectClass::Derived => "derived",
            EffectClass::Analytics => "analytics",
            EffectClass::Notification => "notification",
            EffectClass::Payment => "payment",
            EffectClass::Permission => "permission",
            EffectClass::Irreversible => "irreversible",
        }
    }

    /// Whether the default replay verdict lets an operator requeue a dead
    /// letter of this class with the same operation (allow or
    /// same-operation-only in DESIGN.md's table).
    pub fn allows_requeue(self) -> bool {
        matches!(
            self,
            EffectClass::Derived
                | EffectClass::Analytics
                | EffectClass::Notification
                | EffectClass::Payment
        )
    }
}

/// `[listen]`: the proxy and admin listeners are separate sockets.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenSpec {
    /// Proxy listener, default `127.0.0.1:8080`. Port 0 picks a free port.
    pub proxy: String,
    /// Admin listener, default `127.0.0.1:8081`.
    pub admin: String,
}

impl Default for ListenSpec {
    fn default() -> Self {
        Self {
            proxy: "127.0.0.1:8080".into(),
            admin: "127.0.0.1:8081".into(),
        }
    }
}

/// `[storage]`: the SQLite ledger file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageSpec {
    /// SQLite file path, default `effectgate.db`. A relative path in a
    /// config file is relative to that file's folder (without a file: to the
    /// working directory). Created (with its migrations) if missing.
    pub path: PathBuf,
    /// Maximum connections in the read pool (writes use one connection,
    /// which is how SQLite serialises writers anyway). Default 4.
    pub max_read_connections: u32,
    /// How long a statement waits for a locked database, in ms. Default 5000.
    pub busy_timeout_ms: u64,
    /// SQLite `synchronous` mode: `full` (default) fsyncs every committed
    /// transition, so nothing is lost even on power loss; `normal` (WAL)
    /// survives a crash of the gateway process but may lose the last
    /// transitions on power loss or an OS crash, for more effectful
    /// throughput (about 1.4× on the README's benchmark machine).
    pub synchronous: Synchronous,
}

/// SQLite durability mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// fsync every commit.
    #[default]
    Full,
    /// fsync at checkpoints only.
    Normal,
}

impl Default for StorageSpec {
    fn default() -> Self {
        Self {
            path: PathBuf::from("effectgate.db"),
            max_read_connections: 4,
            busy_timeout_ms: 5000,
            synchronous: Synchronous::Full,
        }
    }
}

/// `[limits]`: gateway-wide limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// Maximum length of an `Idempotency-Key` value in characters (1..=255). Default 255.
    pub max_idempotency_key_len: usize,
    /// Length of a claim (lease) on an operation, in ms. While a provider
    /// call runs, its owner extends the lease every third of this, so a
    /// healthy long call keeps it; an owner that dies loses it this long
    /// after its last extension, and the reconciler takes over. Default 10000.
    pub lease_ms: u64,
    /// Maximum operations one admin list call returns. Default 500.
    pub max_list_limit: u32,
    /// Largest total size of a proxied request's headers (names + values),
    /// in bytes; larger gets 431. Default 65536.
    pub max_header_bytes: usize,
}

impl Default for LimitsSpec {
    fn default() -> Self {
        Self {
            max_idempotency_key_len: 255,
            lease_ms: 10_000,
            max_list_limit: 500,
            max_header_bytes: 65_536,
        }
    }
}

/// `[[tenants]]`: one customer account.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Tenant id: 1..=64 characters of `[A-Za-z0-9._-]`.
    pub id: String,
    /// API keys of this tenant's principals.
    #[serde(default)]
    pub keys: Vec<KeySpec>,
    /// Policies bound to this tenant's routes, in evaluation order.
    #[serde(default)]
    pub policies: Vec<PolicyBindingSpec>,
    /// Where approval events are POSTed (signed with HMAC-SHA256).
    #[serde(default)]
    pub webhook: Option<WebhookSpec>,
    /// Whether the principal that made a request may approve it. Default false.
    #[serde(default)]
    pub allow_self_approval: bool,
}

/// `tenants[].webhook`: approval notifications, delivered at least once
/// from the outbox. Each POST carries `Effectgate-Event-Id` and
/// `Effectgate-Signature: sha256=<hex HMAC-SHA256 of the body>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    /// `http://…` URL.
    pub url: String,
    /// Environment variable holding the signing secret.
    pub secret_env: String,
}

/// A validated webhook.
#[derive(Debug, Clone)]
pub struct Webhook {
    /// URL.
    pub url: http::Uri,
    /// Signing secret.
    pub secret: Vec<u8>,
}

/// `[[tenants.keys]]`: one gateway API key. Exactly one of `sha256`, `env`,
/// `file` gives the secret; plaintext keys are not accepted in the file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// Principal name, shown in the ledger's transitions (`actor`). Default: `<tenant>:<role>`.
    #[serde(default)]
    pub name: Option<String>,
    /// Role: `client` (proxy), `approver`, `operator` or `admin` (admin API).
    pub role: Role,
    /// Lower-case hex sha256 of the key.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Name of an environment variable holding the key.
    #[serde(default)]
    pub env: Option<String>,
    /// Path of a file holding the key (surrounding whitespace trimmed).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

/// A principal's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Sends calls through the proxy listener.
    Client,
    /// Decides approvals (admin listener).
    Approver,
    /// Reads the ledger and replays operations (admin listener).
    Operator,
    /// Everything on the admin listener for its tenant.
    Admin,
}

impl Role {
    /// The role's lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Approver => "approver",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// Whether a route records effectful calls in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// Methods in `effectful_methods` go through the ledger; others stream through.
    #[default]
    Effectful,
    /// Every request streams through without touching the ledger.
    Pass,
}

/// `[[routes]]`: a path prefix → one provider.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// Route name, used in fingerprints, the ledger and logs. Default: the prefix.
    #[serde(default)]
    pub name: Option<String>,
    /// Path prefix, starting and ending with `/`, e.g. `/pay/`. The prefix is
    /// removed and the rest of the path appended to `upstream`.
    pub prefix: String,
    /// Provider base URL (`http://host:port[/base]`). Fixed by config; a
    /// caller can never choose it.
    pub upstream: String,
    /// `effectful` (default) or `pass`.
    #[serde(default)]
    pub mode: RouteMode,
    /// Methods that change the world. Default: every method but GET, HEAD, OPTIONS.
    #[serde(default)]
    pub effectful_methods: Option<Vec<String>>,
    /// Tenants allowed on this route. Default: all.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// Header the provider reads its idempotency key from, e.g.
    /// `Idempotency-Key`. Unset: the provider has no such support and only
    /// the ledger deduplicates.
    #[serde(default)]
    pub provider_idempotency_header: Option<String>,
    /// TCP connect timeout in ms. Default 2000.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Time from sending the request to the end of the response head, in ms.
    /// Default 10000. Past it an effectful call's outcome is UNKNOWN.
    #[serde(default = "default_response_timeout_ms")]
    pub response_timeout_ms: u64,
    /// Largest request body accepted on an effectful call, in bytes. Default 1 MiB.
    /// Larger bodies get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Largest response body stored in the ledger for replay, in bytes.
    /// Default 256 KiB. A larger body reaches the first caller whole, but is
    /// not stored; see README "Stored responses".
    #[serde(default = "default_max_stored_response_bytes")]
    pub max_stored_response_bytes: usize,
    /// How long an idempotency key (and its stored response) is kept, in
    /// hours. Default 24.
    #[serde(default = "default_key_retention_hours")]
    pub key_retention_hours: u64,
    /// Response headers stored and replayed (case-insensitive). Default:
    /// content-type, content-language, location, etag, last-modified,
    /// request-id, x-request-id.
    #[serde(default)]
    pub stored_response_headers: Option<Vec<String>>,
    /// Provider credentials injected into every forwarded request.
    #[serde(default)]
    pub inject_headers: Vec<InjectHeaderSpec>,
    /// Retries of transient failures (connect refused, 429, 503).
    #[serde(default)]
    pub retry: RetrySpec,
    /// Effect class. Default `irreversible`.
    #[serde(default)]
    pub effect_class: EffectClass,
    /// How to read back an operation's effect. Without it, UNKNOWN
    /// operations on this route are resolved only by an operator.
    #[serde(default)]
    pub read_back: Option<ReadBackSpec>,
    /// When a policy traps, times out or runs out of memory: `false`
    /// (default) fails the request closed with 503 `policy-failed`; `true`
    /// lets it through as if the policy had allowed. Either way the failure
    /// is logged and counted.
    #[serde(default)]
    pub policy_fail_open: bool,
    /// How long an approval stays pending before it expires, in ms. Default 86400000 (24 h).
    #[serde(default = "default_approval_ttl_ms")]
    pub approval_ttl_ms: u64,
    /// When an approval is granted, the gateway executes the stored request
    /// itself (byte for byte what was approved); the caller polls for the
    /// result. Default false: the caller re-sends the same request.
    #[serde(default)]
    pub execute_on_approval: bool,
    /// JSON Schema file (relative to the config file) that request bodies of
    /// effectful calls must satisfy; a body that fails it gets 422 before
    /// the ledger and is never retried.
    #[serde(default)]
    pub request_schema: Option<PathBuf>,
}

/// Whether the caller waits while transient failures are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RetryMode {
    /// The caller waits, up to `max_wait_ms`, then gets 202.
    #[default]
    Wait,
    /// The caller gets 202 at the first transient failure; retries go on
    /// in the background.
    Background,
}

/// `[routes.retry]`: bounded retries of transient failures, with
/// exponential backoff and full jitter, honouring `Retry-After`. Every
/// attempt carries the same provider key.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetrySpec {
    /// Attempts in all, including the first (1 = no retry). Default 3.
    pub max_attempts: u32,
    /// Backoff base in ms: attempt n waits a random time in
    /// `[0, min(max_delay_ms, base_delay_ms · 2^(n-1))]`. Default 100.
    pub base_delay_ms: u64,
    /// Backoff cap in ms. Default 2000.
    pub max_delay_ms: u64,
    /// Longest `Retry-After` honoured, in ms; a provider asking for more
    /// ends the retries. Default 10000.
    pub max_retry_after_ms: u64,
    /// `wait` (default) or `background`.
    pub mode: RetryMode,
    /// In `wait` mode, the longest a caller waits for the attempts, in ms;
    /// past it the caller gets 202 and the attempts go on. Default 30000.
    pub max_wait_ms: u64,
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            base_delay_ms: 100,
            max_delay_ms: 2_000,
            max_retry_after_ms: 10_000,
            mode: RetryMode::Wait,
            max_wait_ms: 30_000,
        }
    }
}

fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_response_timeout_ms() -> u64 {
    10_000
}
fn default_max_body_bytes() -> usize {
    1024 * 1024
}
fn default_max_stored_response_bytes() -> usize {
    256 * 1024
}
fn default_approval_ttl_ms() -> u64 {
    86_400_000
}
fn default_key_retention_hours() -> u64 {
    24
}

/// `[[routes.inject_headers]]`: a provider credential, read from the
/// environment at load time. Callers never see it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectHeaderSpec {
    /// Header name, e.g. `Authorization`.
    pub name: String,
    /// Environment variable holding the value.
    pub value_env: String,
    /// Text put before the value, e.g. `"Bearer "`.
    #[serde(default)]
    pub prefix: String,
}

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
}

/// A validated read-back.
#[derive(Debug, Clone)]
pub struct ReadBack {
    /// Method.
    pub method: Method,
    /// Path template.
    pub path: crate::template::Template,
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
            if r.prefix.starts_with("/admin/") {
                return Err(ConfigError::new(
                    format!("{rp}.prefix"),
                    "must not start with /admin/",
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
        for (ti, t) in self.tenants.iter().enumerate() {
            if t.allow_self_approval {
                self_approval.insert(t.id.clone());
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
        })
    }
}

fn read_back(path: &str, rb: &ReadBackSpec) -> Result<ReadBack, ConfigError> {
    let method = Method::from_bytes(rb.method.to_ascii_uppercase().as_bytes()).map_err(|_| {
        ConfigError::new(
            format!("{path}.method"),
            format!("not an HTTP method: {:?}", rb.method),
        )
    })?;
    if !rb.path.starts_with('/') {
        return Err(ConfigError::new(
            format!("{path}.path"),
            "must start with '/'",
        ));
    }
    let tpl = crate::template::Template::parse(&rb.path)
        .map_err(|e| ConfigError::new(format!("{path}.path"), e))?;
    let mut headers = Vec::new();
    for (name, value) in &rb.headers {
        let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::new(
                format!("{path}.headers"),
                format!("not a header name: {name:?}"),
            )
        })?;
        let t = crate::template::Template::parse(value)
            .map_err(|e| ConfigError::new(format!("{path}.headers.{name}"), e))?;
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
        let t = crate::template::Template::parse(value)
            .map_err(|e| ConfigError::new(format!("{path}.match.{ptr}"), e))?;
        match_fields.push((ptr.clone(), t));
    }
    Ok(ReadBack {
        method,
        path: tpl,
        headers,
        match_fields,
        found_pointer: rb.found_pointer.clone(),
        reference_pointer: rb.reference_pointer.clone(),
        settle_delay_ms: rb.settle_delay_ms,
        timeout_ms: rb.timeout_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml: &str) -> Result<Settings, ConfigError> {
        let dir = tempfile_dir();
        let p = dir.join("c.toml");
        std::fs::write(&p, toml).unwrap();
        load(Some(&p))
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "eg-config-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\nupstrem = 1\n")
            .unwrap_err();
        assert_eq!(e.path, "routes[0].upstrem");
        assert!(e.message.contains("upstrem"), "{e}");
    }

    #[test]
    fn bad_upstream_names_the_field() {
        let e = parse("[[routes]]\nprefix = \"/a/\"\nupstream = \"ftp://x\"\n").unwrap_err();
        assert_eq!(e.path, "routes[0].upstream");
    }

    #[test]
    fn plaintext_key_field_is_refused() {
        let e = parse(
            "[[tenants]]\nid = \"t\"\n[[tenants.keys]]\nrole = \"client\"\nkey = \"secret\"\n",
        )
        .unwrap_err();
        assert_eq!(e.path, "tenants[0].keys[0].key");
        assert!(e.message.contains("key"), "{e}");
    }

    #[test]
    fn default_methods_exclude_safe_ones_and_longest_prefix_wins() {
        let s = parse(
            "[[routes]]\nprefix = \"/a/\"\nupstream = \"http://x\"\n[[routes]]\nprefix = \"/a/b/\"\nupstream = \"http://y\"\n",
        )
        .unwrap();
        let r = s.match_route("/a/b/c").unwrap();
        assert_eq!(r.prefix, "/a/b/");
        assert!(r.is_effectful(&Method::POST));
        assert!(!r.is_effectful(&Method::GET));
        assert!(!r.is_effectful(&Method::HEAD));
        assert!(!r.is_effectful(&Method::OPTIONS));
        assert!(s.match_route("/b/").is_none());
    }
}
