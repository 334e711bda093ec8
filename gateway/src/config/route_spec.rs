//! The `[[routes]]` table of the config file: a route's mode, retries,
//! MCP options and injected headers (the rest of the format is in
//! `spec.rs`).

use serde::{Deserialize, Serialize};

use super::*;

/// Whether a route records effectful calls in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// Methods in `effectful_methods` go through the ledger; others stream through.
    #[default]
    Effectful,
    /// Every request streams through without touching the ledger.
    Pass,
    /// A Model Context Protocol server (streamable HTTP): `tools/call`
    /// requests of tools that change the world go through the ledger; the
    /// rest streams through. See `[routes.mcp]`.
    Mcp,
}

/// `[routes.mcp]`: how tool calls on an MCP route are identified and classified.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpSpec {
    /// `params._meta` field carrying the agent runtime's intent id (used
    /// when the request has no `Idempotency-Key`). Default
    /// `effectgate/operation-id`.
    #[serde(default = "default_intent_meta_field")]
    pub intent_meta_field: String,
    /// Derive the operation id when no intent id is given: tenant +
    /// principal + `scope_header` value + tool name + canonical-JSON hash
    /// of the arguments. A byte-identical call (same arguments, same scope)
    /// within the key retention is then the same intent. Off by default.
    #[serde(default)]
    pub derived_identity: bool,
    /// Header scoping derived identities, e.g. the MCP session or a
    /// conversation id. Default `mcp-session-id`.
    #[serde(default = "default_scope_header")]
    pub scope_header: String,
    /// Per-tool overrides of the server's annotations (which are hints from
    /// a server that may be untrusted).
    #[serde(default)]
    pub tools: std::collections::BTreeMap<String, ToolOverride>,
}

impl Default for McpSpec {
    fn default() -> Self {
        Self {
            intent_meta_field: default_intent_meta_field(),
            derived_identity: false,
            scope_header: default_scope_header(),
            tools: Default::default(),
        }
    }
}

fn default_intent_meta_field() -> String {
    "effectgate/operation-id".into()
}
fn default_scope_header() -> String {
    "mcp-session-id".into()
}

/// `[routes.mcp.tools.<name>]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolOverride {
    /// Treat the tool as read-only (no ledger) or not, whatever the server says.
    #[serde(default)]
    pub read_only: Option<bool>,
    /// Effect class of the tool's calls.
    #[serde(default)]
    pub effect_class: Option<EffectClass>,
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
    /// Provider base URL (`https://host[:port][/base]` or `http://…`).
    /// Fixed by config; a caller can never choose it.
    pub upstream: String,
    /// TLS toward the provider (private CA, client certificate, server
    /// name); also used by the route's read-backs.
    #[serde(default)]
    pub tls: Option<UpstreamTlsSpec>,
    /// Egress proxy: `"http://host:port"` (an HTTP `CONNECT` proxy; wins
    /// over the environment), or `"direct"` (never a proxy). Default: the
    /// `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` environment variables.
    #[serde(default)]
    pub proxy: Option<String>,
    /// Environment variable holding `user:password` for the route's
    /// `proxy` (sent as `Proxy-Authorization: Basic`). Default: none.
    #[serde(default)]
    pub proxy_credentials_env: Option<String>,
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
    /// How long an idle connection to the provider is kept open for the
    /// next call, in ms. Default 30000.
    #[serde(default = "default_idle_connection_timeout_ms")]
    pub idle_connection_timeout_ms: u64,
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
    /// MCP options (with `mode = "mcp"`).
    #[serde(default)]
    pub mcp: Option<McpSpec>,
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
    /// A JSON pointer (e.g. `/metadata/tenant`) at which the gateway writes
    /// the caller's tenant id into every effectful request body before it
    /// is stored and forwarded (a JSON object, or a form body in bracket
    /// syntax: `metadata[tenant]=…`), overwriting what the caller sent
    /// there. A read-back then only accepts a found value that holds this
    /// tenant at the same pointer, which ties a read-back keyed on a body
    /// field to this tenant's effects. Default: none.
    #[serde(default)]
    pub tenant_scoped_field: Option<String>,
    /// JSON Schema file (relative to the config file) that request bodies of
    /// effectful calls must satisfy; a body that fails it gets 422 before
    /// the ledger and is never retried.
    #[serde(default)]
    pub request_schema: Option<PathBuf>,
    /// How a COMPLETED operation of this route is undone by a compensating
    /// operation (see `config/compensation.rs`). Without it, compensation
    /// requests get 409 "no compensation defined".
    #[serde(default)]
    pub compensation: Option<CompensationSpec>,
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
    /// Longest `Retry-After` honoured, in ms (seconds, or an HTTP-date,
    /// RFC 9110 §10.2.3); a provider asking for more ends the retries
    /// (FAILED, dead letter `retry-after-too-long`).
    /// Default 10000.
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
fn default_idle_connection_timeout_ms() -> u64 {
    crate::egress::DEFAULT_IDLE_TIMEOUT_MS
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
