//! `[listen]` and `[limits]`: the listeners (addresses, TLS), the TLS the
//! gateway uses towards providers, and the gateway-wide limits, as the
//! TOML file spells them. Read into [`super::ConfigFile`] and converted
//! with the rest of it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[listen]`: the proxy and admin listeners are separate sockets.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenSpec {
    /// Proxy listener, default `127.0.0.1:8080`. Port 0 picks a free port.
    pub proxy: String,
    /// Admin listener, default `127.0.0.1:8081`.
    pub admin: String,
    /// TLS on the proxy listener (HTTP/1.1 and HTTP/2 by ALPN). Default: plain HTTP.
    #[serde(default)]
    pub proxy_tls: Option<ListenerTlsSpec>,
    /// TLS on the admin listener; the console's session cookie then gets
    /// `Secure`. Default: plain HTTP.
    #[serde(default)]
    pub admin_tls: Option<ListenerTlsSpec>,
}

/// `listen.proxy_tls` / `listen.admin_tls`: the listener's certificate.
/// Both files are re-read on reload (SIGHUP or `POST /admin/reload`), so a
/// renewed certificate applies without a restart; a reload whose files
/// can't be used keeps the old ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsSpec {
    /// PEM certificate chain, leaf first (relative to the config file).
    pub cert_file: PathBuf,
    /// PEM private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// `[routes.tls]` and `tenants[].webhook.tls`: how the gateway verifies a
/// provider (or webhook receiver) and authenticates to it. Paths are
/// relative to the config file. Certificates are always verified; there is
/// no option to skip that.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTlsSpec {
    /// PEM bundle of CA certificates that replaces the system's roots (for
    /// a private CA). Default: the system store (`/etc/ssl/certs` on
    /// Debian, or `SSL_CERT_FILE`).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain presented to the provider (mutual TLS).
    #[serde(default)]
    pub client_cert_file: Option<PathBuf>,
    /// PEM private key of `client_cert_file`.
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
    /// Name sent in SNI and checked against the provider's certificate,
    /// instead of the URL's host (for a provider addressed by IP).
    #[serde(default)]
    pub server_name: Option<String>,
}

impl Default for ListenSpec {
    fn default() -> Self {
        Self {
            proxy: "127.0.0.1:8080".into(),
            admin: "127.0.0.1:8081".into(),
            proxy_tls: None,
            admin_tls: None,
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
    /// Largest body a replay is decoded to, in bytes, when the duplicate's
    /// `Accept-Encoding` doesn't accept the stored `Content-Encoding`
    /// (a bound against compression bombs). Default 67108864 (64 MiB).
    #[serde(default = "default_max_decoded_replay_bytes")]
    pub max_decoded_replay_bytes: usize,
    /// Replays decoded at once (each holds up to about twice
    /// `max_decoded_replay_bytes` while it decodes); more wait for a turn.
    /// Read at start. Default 2.
    #[serde(default = "default_max_concurrent_replay_decodes")]
    pub max_concurrent_replay_decodes: usize,
    /// Time a connection has to deliver a request head, in ms: from accept
    /// (TLS handshake included) for the first one, and on HTTP/1.1 from the
    /// end of the previous answer for the next (so it also bounds an idle
    /// keep-alive connection). Past it the connection is closed, nothing
    /// having been read. Default 10000.
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// Time to read an effectful call's body (which is buffered), in ms;
    /// past it the answer is 408 and nothing is reserved. Default 30000.
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// A connection with no request in flight this long is closed, in ms.
    /// Default 60000.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// Open connections on the proxy listener at most. Default: half of
    /// what is left of the process's descriptor limit (raised to its hard
    /// limit at start) after 256, at least 64 and at most 10000; the other
    /// half is left for upstream connections. At the cap the oldest connection without a complete
    /// request head is closed first.
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Open connections on the admin listener at most. Default 256.
    #[serde(default = "default_max_admin_connections")]
    pub max_admin_connections: usize,
    /// Largest request body the admin listener reads (admin API and
    /// console forms), in bytes; larger gets 413 `payload-too-large`. Set
    /// at start. Default 65536.
    #[serde(default = "default_max_admin_body_bytes")]
    pub max_admin_body_bytes: usize,
    /// Longest text an operator or approver gives with an action (a
    /// requeue's, resolve's, replay's or compensation's `reason`, an
    /// approval's `comment`), in characters; longer is refused with 400
    /// naming the field. At least 1. Default 1024.
    #[serde(default = "default_max_reason_chars")]
    pub max_reason_chars: usize,
    /// How long an operator console session lasts after its login, in ms
    /// (the cookie's `Max-Age`; a revoked key ends it sooner). At least 1.
    /// Default 28800000 (8 hours).
    #[serde(default = "default_console_session_ms")]
    pub console_session_ms: u64,
    /// Console sessions one key may have open at once; a login past it
    /// ends that key's session nearest its end. At least 1. Default 16.
    #[serde(default = "default_console_sessions_per_key")]
    pub console_sessions_per_key: usize,
    /// MCP endpoints (paths a `tools/list` went to) of one route whose
    /// tools' annotations are kept at most; past it that route's endpoint
    /// listed longest ago is forgotten, and its tools count as
    /// world-changing until listed again. At least 1. Default 1024.
    #[serde(default = "default_mcp_tool_endpoints")]
    pub mcp_tool_endpoints: usize,
    /// Longest `provider_reference` an operator's resolution may give, in
    /// bytes; longer is refused with 400 naming `body.provider_reference`.
    /// 1..=2048 (the reference is indexed, and PostgreSQL refuses an index
    /// entry much longer). Default 255.
    #[serde(default = "default_max_provider_reference_bytes")]
    pub max_provider_reference_bytes: usize,
    /// Longest event id, and sequence key, an inbox source accepts from a
    /// verified webhook, in bytes; a longer one is refused with 400
    /// (`event-id-missing`, `sequence-missing`) and nothing is stored.
    /// 1..=2048 (both are keys of the inbox's tables, and PostgreSQL
    /// refuses an index entry much longer). Default 255.
    #[serde(default = "default_max_inbox_id_bytes")]
    pub max_inbox_id_bytes: usize,
}

fn default_max_inbox_id_bytes() -> usize {
    255
}

fn default_max_provider_reference_bytes() -> usize {
    255
}

fn default_console_sessions_per_key() -> usize {
    16
}

fn default_mcp_tool_endpoints() -> usize {
    1024
}

fn default_console_session_ms() -> u64 {
    8 * 3600 * 1000
}

fn default_header_read_timeout_ms() -> u64 {
    10_000
}

fn default_body_read_timeout_ms() -> u64 {
    30_000
}

fn default_idle_timeout_ms() -> u64 {
    60_000
}

fn default_max_admin_connections() -> usize {
    256
}

fn default_max_reason_chars() -> usize {
    1024
}

fn default_max_admin_body_bytes() -> usize {
    64 * 1024
}

fn default_max_decoded_replay_bytes() -> usize {
    64 << 20
}

fn default_max_concurrent_replay_decodes() -> usize {
    2
}

impl Default for LimitsSpec {
    fn default() -> Self {
        Self {
            max_idempotency_key_len: 255,
            lease_ms: 10_000,
            max_list_limit: 500,
            max_header_bytes: 65_536,
            max_decoded_replay_bytes: default_max_decoded_replay_bytes(),
            max_concurrent_replay_decodes: default_max_concurrent_replay_decodes(),
            header_read_timeout_ms: default_header_read_timeout_ms(),
            body_read_timeout_ms: default_body_read_timeout_ms(),
            idle_timeout_ms: default_idle_timeout_ms(),
            max_connections: None,
            max_admin_connections: default_max_admin_connections(),
            max_admin_body_bytes: default_max_admin_body_bytes(),
            max_reason_chars: default_max_reason_chars(),
            console_session_ms: default_console_session_ms(),
            console_sessions_per_key: default_console_sessions_per_key(),
            mcp_tool_endpoints: default_mcp_tool_endpoints(),
            max_provider_reference_bytes: default_max_provider_reference_bytes(),
            max_inbox_id_bytes: default_max_inbox_id_bytes(),
        }
    }
}
