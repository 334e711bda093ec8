//! The configuration file format: the types TOML is read into. Converted
//! into the runtime [`super::Settings`] by [`ConfigFile::into_settings`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::listen_spec::{LimitsSpec, ListenSpec, UpstreamTlsSpec};
use super::route_spec::{RouteSpec, ToolOverride};
use super::storage::StorageSpec;

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
    /// Trace export (OpenTelemetry over OTLP/HTTP).
    #[serde(default)]
    pub telemetry: TelemetrySpec,
    /// Graceful shutdown.
    #[serde(default)]
    pub shutdown: ShutdownSpec,
    /// Webhook sources (`POST /inbox/<name>` on the proxy listener).
    #[serde(default)]
    pub inbox: Vec<super::inbox::InboxSpec>,
}

/// `[telemetry]`: trace export over OTLP/HTTP (protobuf). Export is on when
/// an endpoint is set here or in `OTEL_EXPORTER_OTLP_ENDPOINT` (the
/// variable wins); without one it is off.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySpec {
    /// Collector base URL (`http://127.0.0.1:4318`; `/v1/traces` is
    /// appended unless present). Unset: no export, unless the variable is set.
    pub endpoint: Option<String>,
    /// `service.name` of the exported spans (`OTEL_SERVICE_NAME` wins).
    /// Default `effectgate`.
    pub service_name: String,
    /// Share of new traces sampled, 0.0–1.0; a caller's `traceparent`
    /// sampled flag is followed (parent-based). Default 1.0.
    pub sampling_ratio: f64,
    /// Extra headers on export requests (`OTEL_EXPORTER_OTLP_HEADERS`,
    /// `k=v,k2=v2`, is added). Default none.
    pub headers: std::collections::BTreeMap<String, String>,
    /// Timeout of one export request, in ms. Default 10000.
    pub export_timeout_ms: u64,
}

impl Default for TelemetrySpec {
    fn default() -> Self {
        Self {
            endpoint: None,
            service_name: "effectgate".into(),
            sampling_ratio: 1.0,
            headers: Default::default(),
            export_timeout_ms: 10_000,
        }
    }
}

/// `[shutdown]`: what SIGTERM (or SIGINT) does. `/readyz` answers 503 at
/// once, the listeners stop accepting, and calls in flight (with the
/// executions they started) get `drain_ms` to finish. A pass-through
/// stream still open then is cut; an execution still running keeps its
/// lease and is reconciled by the next owner.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownSpec {
    /// Drain deadline, in ms. Default 30000.
    pub drain_ms: u64,
}

impl Default for ShutdownSpec {
    fn default() -> Self {
        Self { drain_ms: 30_000 }
    }
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
    /// Concurrent policy instances the pool holds. Default 256. Policy
    /// calls in flight across all tenants never exceed it.
    pub pool_instances: u32,
    /// Policy calls one tenant may have in flight at once (at most
    /// `pool_instances`). Default 32.
    pub max_concurrent_per_tenant: u32,
    /// How long a call waits for one of its tenant's permits (and a free
    /// pool slot) before it fails as `busy`, in ms. Default 100.
    pub permit_wait_ms: u64,
    /// Failures in a row (trap, deadline, memory, fuel, invalid output) of
    /// one tenant's policy that open its circuit; 0 turns the breaker off.
    /// Default 5.
    pub breaker_failures: u32,
    /// How long an open circuit refuses the policy's calls before letting
    /// one trial call through, in ms. Default 30000.
    pub breaker_cooldown_ms: u64,
    /// Folder for compiled policies (wasmtime's serialized artifacts, one
    /// file per module content hash and engine), relative to the config
    /// file, created when missing. A restart or a reload then loads a
    /// policy without compiling it again. It must be writable by the
    /// gateway's user only: a verified entry is loaded as machine code.
    /// Default unset: policies are compiled in memory at every start.
    pub cache_dir: Option<PathBuf>,
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
            max_concurrent_per_tenant: 32,
            permit_wait_ms: 100,
            breaker_failures: 5,
            breaker_cooldown_ms: 30_000,
            cache_dir: None,
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
    /// relay (or this one after a restart) may deliver it, in ms. A
    /// webhook delivery times out at two thirds of it (at most 5 s), so it
    /// ends while the claim holds. Default 5000.
    pub outbox_lease_ms: u64,
    /// Retention sweeper: the most terminal operations past their key
    /// retention one delete statement removes (with their history). Each
    /// scan deletes batches until one comes back short, at most
    /// `sweep_max_batches` of them. Dead letters and non-terminal
    /// operations are never deleted. Default 500.
    pub sweep_batch: u32,
    /// Retention sweeper: the most batches per scan (0 turns the sweeper
    /// off; keys still start fresh when a caller reuses an expired one).
    /// Default 10.
    pub sweep_max_batches: u32,
    /// A webhook event is delivered at most this many times; the last
    /// failure makes it a dead-lettered event (admin API, console). Default 20.
    #[serde(default = "default_outbox_max_attempts")]
    pub outbox_max_attempts: u32,
    /// A webhook event older than this (ms) is not tried again after a
    /// failure: it becomes a dead-lettered event. Default 86400000 (24 h).
    #[serde(default = "default_outbox_max_age_ms")]
    pub outbox_max_age_ms: u64,
    /// Delivered webhook events are deleted this long (ms) after their
    /// delivery. Dead-lettered ones are kept. Default 604800000 (7 days).
    #[serde(default = "default_outbox_retention_ms")]
    pub outbox_retention_ms: u64,
}

fn default_outbox_max_attempts() -> u32 {
    20
}

fn default_outbox_max_age_ms() -> u64 {
    86_400_000
}

fn default_outbox_retention_ms() -> u64 {
    7 * 86_400_000
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
            outbox_max_attempts: default_outbox_max_attempts(),
            outbox_max_age_ms: default_outbox_max_age_ms(),
            outbox_retention_ms: default_outbox_retention_ms(),
            sweep_batch: 500,
            sweep_max_batches: 10,
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
    /// `/v1/charges?idempotency_key={provider_key}`. On an MCP route it is
    /// the MCP endpoint path (default `/mcp`).
    #[serde(default)]
    pub path: Option<String>,
    /// MCP routes: the read-only tool to call, e.g. `get_email_status`.
    /// `found_pointer` then points into the tool result's
    /// `structuredContent` (or the JSON of its first text content).
    #[serde(default)]
    pub tool: Option<String>,
    /// MCP routes: the tool's arguments, each a template, e.g.
    /// `{ to = "{body:/params/arguments/to}" }`.
    #[serde(default)]
    pub arguments: std::collections::BTreeMap<String, String>,
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

/// Effect class of a route: drives replay defaults (docs/design.md).
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
    /// Every class, in the order of the docs.
    pub const ALL: [EffectClass; 6] = [
        EffectClass::Derived,
        EffectClass::Analytics,
        EffectClass::Notification,
        EffectClass::Payment,
        EffectClass::Permission,
        EffectClass::Irreversible,
    ];

    /// The class named `name` (lower case, as [`EffectClass::as_str`]
    /// writes it), or `None` for any other text.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }

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
    /// same-operation-only in docs/design.md's table).
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
    /// Effectful calls of this tenant in flight at once, at most; one more
    /// gets 429 with `Retry-After: 1`. Default: no limit.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// Bytes of request and response bodies this tenant's operations may
    /// hold in the effect ledger; a new operation past it gets 507
    /// `tenant-quota-exceeded` (nothing recorded or sent) until the
    /// retention sweeper frees room. Default: no limit.
    #[serde(default)]
    pub max_stored_bytes: Option<u64>,
    /// Calls per second of this tenant (every call through the proxy),
    /// `{ per_second, burst }`; past it 429 with `Retry-After`. Default: no limit.
    #[serde(default)]
    pub rate_limit: Option<RateLimitSpec>,
    /// This tenant's overrides of MCP tool annotations, by tool name; they
    /// win over the route's (`[routes.mcp.tools]`) and the server's hints.
    #[serde(default)]
    pub mcp_tools: std::collections::BTreeMap<String, ToolOverride>,
}

/// `tenants[].rate_limit`: a token bucket (GCRA) per tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSpec {
    /// Sustained calls per second (at least 1).
    pub per_second: u32,
    /// Calls allowed in a burst above the rate (at least 1). Default: `per_second`.
    #[serde(default)]
    pub burst: Option<u32>,
}

/// `tenants[].webhook`: approval notifications, delivered at least once
/// from the outbox. Each POST carries `Effectgate-Event-Id` and
/// `Effectgate-Signature: sha256=<hex HMAC-SHA256 of the body>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    /// `http://…` or `https://…` URL.
    pub url: String,
    /// Environment variable holding the signing secret.
    pub secret_env: String,
    /// TLS toward the receiver (a private CA, a client certificate).
    #[serde(default)]
    pub tls: Option<UpstreamTlsSpec>,
    /// Egress proxy for deliveries; as `routes[].proxy`.
    #[serde(default)]
    pub proxy: Option<String>,
    /// As `routes[].proxy_credentials_env`.
    #[serde(default)]
    pub proxy_credentials_env: Option<String>,
    /// Operation events delivered besides approvals and inbox events:
    /// any of [`OPERATION_EVENTS`]. Default `operation.unknown`,
    /// `operation.dead_lettered`, `operation.reconciled`.
    #[serde(default)]
    pub events: Option<Vec<String>>,
}

/// The operation events a webhook can subscribe to.
pub const OPERATION_EVENTS: &[&str] = &[
    "operation.unknown",
    "operation.dead_lettered",
    "operation.reconciled",
    "operation.completed",
    "operation.failed",
];

/// The operation events a webhook gets without `events`.
pub const DEFAULT_OPERATION_EVENTS: &[&str] = &[
    "operation.unknown",
    "operation.dead_lettered",
    "operation.reconciled",
];

/// A validated webhook.
#[derive(Debug, Clone)]
pub struct Webhook {
    /// URL.
    pub url: http::Uri,
    /// Signing secret.
    pub secret: Vec<u8>,
    /// The client deliveries go out with (TLS and proxy settings applied).
    pub client: crate::egress::HttpClient,
    /// Operation events it receives.
    pub events: std::collections::BTreeSet<String>,
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
    /// Path of a file holding the key (surrounding whitespace trimmed);
    /// relative to the config file's folder.
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
