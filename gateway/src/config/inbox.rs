//! `[[inbox]]`: webhook sources providers POST to, at `/inbox/<name>` on
//! the proxy listener, and their validation into a runtime [`InboxSource`].

use std::path::{Path, PathBuf};

use http::HeaderName;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Default timestamp tolerance of the `stripe` and `standard-webhooks`
/// schemes: 5 min (Stripe's and Standard Webhooks' own default).
pub const DEFAULT_TOLERANCE_MS: u64 = 300_000;
/// Default bound of a webhook body: 256 KiB.
pub const DEFAULT_INBOX_MAX_BODY_BYTES: usize = 262_144;
/// Default dedupe window: 7 days (Stripe retries for up to 3).
pub const DEFAULT_DEDUPE_WINDOW_MS: u64 = 7 * 24 * 3_600_000;
/// Default time the last applied sequence of a key is kept after the
/// key's last event: 30 days.
pub const DEFAULT_SEQUENCE_WINDOW_MS: u64 = 30 * 24 * 3_600_000;
/// Default time an out-of-order event is held for the gap before it: 30 s.
pub const DEFAULT_REORDER_WINDOW_MS: u64 = 30_000;

/// `[[inbox]]`: one webhook source of one tenant.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxSpec {
    /// Source name: 1..=64 characters of `[A-Za-z0-9._-]`; served at
    /// `POST /inbox/<name>`.
    pub name: String,
    /// The tenant its events belong to (and are delivered to).
    pub tenant: String,
    /// Signature scheme: `stripe`, `standard-webhooks` or `hmac-sha256`.
    pub scheme: SignatureScheme,
    /// `hmac-sha256` only: the header holding `sha256=<hex>` (or bare hex)
    /// of the body, e.g. `X-Hub-Signature-256`.
    #[serde(default)]
    pub header: Option<String>,
    /// The signing secrets, one or two (two while a secret is rotated:
    /// either verifies).
    pub secrets: Vec<SecretSpec>,
    /// Timestamp tolerance (ms) of `stripe` and `standard-webhooks`: an
    /// older or as much newer signature is refused. Default 300000 (5 min).
    #[serde(default = "default_tolerance")]
    pub tolerance_ms: u64,
    /// Where the event id is: a JSON pointer into the body (`/id`) or
    /// `header:<name>`. Default: `header:webhook-id` for
    /// `standard-webhooks`, `/id` otherwise.
    #[serde(default)]
    pub event_id: Option<String>,
    /// JSON pointer of the event type (shown and used by `resolves`).
    /// Default `/type`.
    #[serde(default = "default_event_type")]
    pub event_type: String,
    /// Largest body accepted (bytes); a larger one gets 413. Default 262144.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// How long (ms) an event id is remembered: a redelivery within it is
    /// a duplicate; rows older are swept. Default 604800000 (7 days).
    #[serde(default = "default_window")]
    pub dedupe_window_ms: u64,
    /// How long (ms) a sequence key's last applied sequence is kept after
    /// the key's last event (at least `dedupe_window_ms`); older ordering
    /// rows are swept, and the key starts over at `sequence_start`.
    /// Default 2592000000 (30 days).
    #[serde(default = "default_sequence_window")]
    pub sequence_window_ms: u64,
    /// Whether accepted events are delivered to the tenant's webhook
    /// through the outbox. Default true.
    #[serde(default = "yes")]
    pub deliver: bool,
    /// JSON pointer of the entity an event is about (`/data/object/id`):
    /// events of one key are ordered by `sequence`. Default: no ordering.
    #[serde(default)]
    pub sequence_key: Option<String>,
    /// JSON pointer of the event's position for its key: an integer
    /// counter (gaps detected) or, with `sequence_gaps = false`, any
    /// increasing integer (a version, a created timestamp).
    #[serde(default)]
    pub sequence: Option<String>,
    /// Whether `sequence` counts by one, so a skipped number is a gap.
    /// Default true.
    #[serde(default = "yes")]
    pub sequence_gaps: bool,
    /// The first sequence of a key never seen before. Default 1.
    #[serde(default = "one")]
    pub sequence_start: i64,
    /// How long (ms) an event after a gap is held for the missing ones.
    /// Default 30000.
    #[serde(default = "default_reorder")]
    pub reorder_window_ms: u64,
    /// What happens when the gap doesn't fill: `deliver` (with
    /// `Effectgate-Gap: true`) or `quarantine` (held for an operator).
    /// Default `deliver`.
    #[serde(default)]
    pub on_gap: OnGap,
    /// Rules by which an event resolves the operation it names.
    #[serde(default)]
    pub resolves: Vec<ResolvesSpec>,
}

/// `inbox[].resolves[]`: an event that names an operation of this tenant
/// and says how it ended. Exactly one of `provider_key`, `reference` or
/// `match` names the operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolvesSpec {
    /// Event types (at `event_type`) that say the effect exists.
    #[serde(default)]
    pub succeeded: Vec<String>,
    /// Event types that say it failed: only an immediate read-back follows.
    #[serde(default)]
    pub failed: Vec<String>,
    /// JSON pointer to the operation's provider key in the event
    /// (`/data/object/metadata/idempotency_key`).
    #[serde(default)]
    pub provider_key: Option<String>,
    /// JSON pointer to the provider's reference in the event
    /// (`/data/object/id`); recorded on the operation it completes, and
    /// names it when no other rule part does.
    #[serde(default)]
    pub reference: Option<String>,
    /// Route whose operations `match` is checked against.
    #[serde(default)]
    pub route: Option<String>,
    /// `{ "<event pointer>" = "<template>" }`: every condition must hold
    /// for an UNKNOWN operation of `route` (`{body:…}`, `{provider_key}`,
    /// `{tenant}` as in read-back `match`).
    #[serde(default, rename = "match")]
    pub match_fields: std::collections::BTreeMap<String, String>,
    /// JSON pointer of what a completed operation stores as its response
    /// (replayed to the caller's retry). Default `/data/object` (Stripe's
    /// and most providers' event envelope); the whole event when nothing
    /// is there.
    #[serde(default = "default_object")]
    pub object: String,
}

fn default_object() -> String {
    "/data/object".into()
}

/// One signing secret: from an environment variable or a file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// Environment variable holding it.
    #[serde(default)]
    pub env: Option<String>,
    /// File holding it (surrounding whitespace trimmed).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

/// How a source signs its webhooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignatureScheme {
    /// `Stripe-Signature: t=<s>,v1=<hex HMAC-SHA256 of "t.body">`.
    Stripe,
    /// `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64>`
    /// over `id.timestamp.body` (standardwebhooks.com); a `whsec_` secret
    /// is base64 after the prefix.
    StandardWebhooks,
    /// A named header with `sha256=<hex HMAC-SHA256 of the body>`.
    HmacSha256,
}

/// The warning for source `i` when its event id is read from a header that
/// is not an id its scheme signs: any header but the `webhook-id` of
/// `standard-webhooks` (whose signature also covers `webhook-timestamp`,
/// which names no event; `stripe` signs the `t` inside its own header, and
/// `hmac-sha256` the body alone). A resend of a signed event under another
/// id in that header verifies, and is stored and delivered as a new event;
/// with an id from the (signed) body it is a duplicate. Some providers give
/// the id only in a header (GitHub's `X-GitHub-Delivery`), so the setting
/// is allowed, with this warning.
pub fn unsigned_event_id(i: usize, src: &InboxSource) -> Option<String> {
    let EventIdAt::Header(h) = &src.event_id else {
        return None;
    };
    if src.scheme == SignatureScheme::StandardWebhooks && h == "webhook-id" {
        return None;
    }
    Some(format!(
        "inbox[{i}].event_id: the header {h} is not an event id the {} signature of {:?} covers, so a resend of a signed event under another id there is taken as a new event (stored, delivered); use a JSON pointer into the body when the provider puts the id there",
        src.scheme.as_str(),
        src.name
    ))
}

impl SignatureScheme {
    /// The name in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            SignatureScheme::Stripe => "stripe",
            SignatureScheme::StandardWebhooks => "standard-webhooks",
            SignatureScheme::HmacSha256 => "hmac-sha256",
        }
    }
}

/// What happens to an event whose gap didn't fill within the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnGap {
    /// Delivered with `Effectgate-Gap: true`.
    #[default]
    Deliver,
    /// Quarantined until an operator releases or drops it.
    Quarantine,
}

fn default_tolerance() -> u64 {
    DEFAULT_TOLERANCE_MS
}
fn default_event_type() -> String {
    "/type".into()
}
fn default_max_body() -> usize {
    DEFAULT_INBOX_MAX_BODY_BYTES
}
fn default_sequence_window() -> u64 {
    DEFAULT_SEQUENCE_WINDOW_MS
}
fn default_window() -> u64 {
    DEFAULT_DEDUPE_WINDOW_MS
}
fn default_reorder() -> u64 {
    DEFAULT_REORDER_WINDOW_MS
}
fn yes() -> bool {
    true
}
fn one() -> i64 {
    1
}

/// Where an event's id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventIdAt {
    /// A JSON pointer into the body.
    Pointer(String),
    /// A request header.
    Header(HeaderName),
}

/// How an event names an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveBy {
    /// The provider key at this pointer.
    ProviderKey(String),
    /// The provider reference at this pointer.
    Reference(String),
    /// Conditions over the UNKNOWN operations of a route.
    Match {
        /// The route.
        route: String,
        /// (event pointer, template over the operation).
        fields: Vec<(String, crate::template::Template)>,
    },
}

/// A validated `resolves` rule.
#[derive(Debug, Clone)]
pub struct Resolves {
    /// Event types that say the effect exists.
    pub succeeded: Vec<String>,
    /// Event types that say it failed.
    pub failed: Vec<String>,
    /// How the operation is named.
    pub by: ResolveBy,
    /// Pointer of the provider reference to record.
    pub reference: Option<String>,
    /// Pointer of the stored response.
    pub object: String,
}

/// A validated `[[inbox]]` source.
#[derive(Debug, Clone)]
pub struct InboxSource {
    /// Name (`/inbox/<name>`).
    pub name: String,
    /// Tenant.
    pub tenant: String,
    /// Signature scheme.
    pub scheme: SignatureScheme,
    /// `hmac-sha256`: the signature header.
    pub header: Option<HeaderName>,
    /// One or two secrets (bytes; a `standard-webhooks` `whsec_` secret
    /// already base64-decoded).
    pub secrets: Vec<Vec<u8>>,
    /// Timestamp tolerance (ms).
    pub tolerance_ms: u64,
    /// Where the event id is.
    pub event_id: EventIdAt,
    /// Pointer of the event type.
    pub event_type: String,
    /// Body bound (bytes).
    pub max_body_bytes: usize,
    /// Dedupe window (ms).
    pub dedupe_window_ms: u64,
    /// How long (ms) an idle key's ordering row is kept.
    pub sequence_window_ms: u64,
    /// Deliver accepted events to the tenant.
    pub deliver: bool,
    /// `(sequence_key pointer, sequence pointer)`, when ordered.
    pub ordering: Option<(String, String)>,
    /// Counter sequences: skipped numbers are gaps.
    pub sequence_gaps: bool,
    /// First sequence of a new key.
    pub sequence_start: i64,
    /// Hold time for a gap (ms).
    pub reorder_window_ms: u64,
    /// What an unfilled gap does.
    pub on_gap: OnGap,
    /// Resolution rules.
    pub resolves: Vec<Resolves>,
}

fn pointer(path: &str, p: &str) -> Result<String, ConfigError> {
    if p.is_empty() || p.starts_with('/') {
        Ok(p.to_owned())
    } else {
        Err(ConfigError::new(
            path,
            format!("{p:?} is not a JSON pointer (empty, or starting with '/')"),
        ))
    }
}

/// Reads one secret as bytes; `standard-webhooks` decodes `whsec_<base64>`.
fn secret(
    path: &str,
    s: &SecretSpec,
    base_dir: &Path,
    scheme: SignatureScheme,
) -> Result<Vec<u8>, ConfigError> {
    let raw = match (&s.env, &s.file) {
        (Some(var), None) => std::env::var(var).map_err(|_| {
            ConfigError::new(
                format!("{path}.env"),
                format!("environment variable {var} is not set"),
            )
        })?,
        (None, Some(f)) => {
            let f = if f.is_relative() {
                base_dir.join(f)
            } else {
                f.clone()
            };
            std::fs::read_to_string(&f)
                .map_err(|e| {
                    ConfigError::new(format!("{path}.file"), format!("{}: {e}", f.display()))
                })?
                .trim()
                .to_owned()
        }
        _ => {
            return Err(ConfigError::new(
                path,
                "exactly one of `env` or `file` gives the secret",
            ));
        }
    };
    if raw.is_empty() {
        return Err(ConfigError::new(path, "the secret is empty"));
    }
    if scheme == SignatureScheme::StandardWebhooks {
        return standard_webhooks_key(&raw)
            .ok_or_else(|| ConfigError::new(path, "a whsec_ secret is base64 after the prefix"));
    }
    Ok(raw.into_bytes())
}

/// The key of a Standard Webhooks secret: `whsec_<base64>` decoded, or
/// (without the prefix) the text's bytes. `None` for a `whsec_` secret
/// that is not base64.
pub fn standard_webhooks_key(secret: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    match secret.strip_prefix("whsec_") {
        Some(b64) => base64::engine::general_purpose::STANDARD.decode(b64).ok(),
        None => Some(secret.as_bytes().to_vec()),
    }
}

/// Checks `[[inbox]]` entry `i` and builds its [`InboxSource`].
///
/// `tenants` are the configured tenant ids, `routes` the route names.
pub(super) fn inbox_source(
    i: usize,
    s: &InboxSpec,
    tenants: &std::collections::BTreeSet<String>,
    routes: &[super::Route],
    base_dir: &Path,
) -> Result<InboxSource, ConfigError> {
    let p = format!("inbox[{i}]");
    if s.name.is_empty()
        || s.name.len() > 64
        || !s
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(ConfigError::new(
            format!("{p}.name"),
            "1..=64 characters of [A-Za-z0-9._-]",
        ));
    }
    if !tenants.contains(&s.tenant) {
        return Err(ConfigError::new(
            format!("{p}.tenant"),
            format!("no tenant {:?}", s.tenant),
        ));
    }
    let header = match (s.scheme, &s.header) {
        (SignatureScheme::HmacSha256, Some(h)) => {
            Some(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                ConfigError::new(format!("{p}.header"), format!("not a header name: {h:?}"))
            })?)
        }
        (SignatureScheme::HmacSha256, None) => {
            return Err(ConfigError::new(
                format!("{p}.header"),
                "the hmac-sha256 scheme needs the header that carries the signature",
            ));
        }
        (_, Some(_)) => {
            return Err(ConfigError::new(
                format!("{p}.header"),
                "only the hmac-sha256 scheme takes a header; the others have fixed ones",
            ));
        }
        (_, None) => None,
    };
    if s.secrets.is_empty() || s.secrets.len() > 2 {
        return Err(ConfigError::new(
            format!("{p}.secrets"),
            "one secret, or two while rotating",
        ));
    }
    let secrets = s
        .secrets
        .iter()
        .enumerate()
        .map(|(k, sec)| secret(&format!("{p}.secrets[{k}]"), sec, base_dir, s.scheme))
        .collect::<Result<Vec<_>, _>>()?;
    if s.tolerance_ms == 0 {
        return Err(ConfigError::new(
            format!("{p}.tolerance_ms"),
            "must be at least 1",
        ));
    }
    let event_id = match s.event_id.as_deref() {
        None if s.scheme == SignatureScheme::StandardWebhooks => {
            EventIdAt::Header(HeaderName::from_static("webhook-id"))
        }
        None => EventIdAt::Pointer("/id".into()),
        Some(h) if h.starts_with("header:") => {
            let name = &h["header:".len()..];
            let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                ConfigError::new(
                    format!("{p}.event_id"),
                    format!("not a header name: {name:?}"),
                )
            })?;
            // The gateway's own ([`super::REQUEST_ID_HEADER`]): no event id
            // can be read from it.
            if name.as_str() == super::REQUEST_ID_HEADER {
                return Err(ConfigError::new(
                    format!("{p}.event_id"),
                    "x-request-id is the gateway's own request id: a request without one, or with one sent twice or malformed, is given a fresh id before the inbox reads it, so every resend would be a new event; point at the provider's delivery id header or a body field",
                ));
            }
            EventIdAt::Header(name)
        }
        Some(ptr) => EventIdAt::Pointer(pointer(&format!("{p}.event_id"), ptr)?),
    };
    let event_type = pointer(&format!("{p}.event_type"), &s.event_type)?;
    if s.max_body_bytes == 0 {
        return Err(ConfigError::new(
            format!("{p}.max_body_bytes"),
            "must be at least 1",
        ));
    }
    if s.dedupe_window_ms < s.tolerance_ms {
        return Err(ConfigError::new(
            format!("{p}.dedupe_window_ms"),
            "must be at least tolerance_ms: a replay inside the tolerance must still be a duplicate",
        ));
    }
    if s.sequence_window_ms < s.dedupe_window_ms {
        return Err(ConfigError::new(
            format!("{p}.sequence_window_ms"),
            "must be at least dedupe_window_ms: an event still remembered must still be ordered",
        ));
    }
    let ordering = match (&s.sequence_key, &s.sequence) {
        (Some(k), Some(q)) => Some((
            pointer(&format!("{p}.sequence_key"), k)?,
            pointer(&format!("{p}.sequence"), q)?,
        )),
        (None, None) => None,
        (Some(_), None) => {
            return Err(ConfigError::new(
                format!("{p}.sequence"),
                "a sequence_key needs the pointer of its sequence",
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                format!("{p}.sequence_key"),
                "a sequence needs the pointer of its sequence_key",
            ));
        }
    };
    if ordering.is_some() && s.reorder_window_ms == 0 {
        return Err(ConfigError::new(
            format!("{p}.reorder_window_ms"),
            "must be at least 1",
        ));
    }
    let mut resolves = Vec::new();
    for (k, r) in s.resolves.iter().enumerate() {
        resolves.push(resolves_rule(&format!("{p}.resolves[{k}]"), r, routes)?);
    }
    Ok(InboxSource {
        name: s.name.clone(),
        tenant: s.tenant.clone(),
        scheme: s.scheme,
        header,
        secrets,
        tolerance_ms: s.tolerance_ms,
        event_id,
        event_type,
        max_body_bytes: s.max_body_bytes,
        dedupe_window_ms: s.dedupe_window_ms,
        sequence_window_ms: s.sequence_window_ms,
        deliver: s.deliver,
        ordering,
        sequence_gaps: s.sequence_gaps,
        sequence_start: s.sequence_start,
        reorder_window_ms: s.reorder_window_ms,
        on_gap: s.on_gap,
        resolves,
    })
}

fn resolves_rule(
    p: &str,
    r: &ResolvesSpec,
    routes: &[super::Route],
) -> Result<Resolves, ConfigError> {
    if r.succeeded.is_empty() && r.failed.is_empty() {
        return Err(ConfigError::new(
            format!("{p}.succeeded"),
            "name the event types that say the effect exists (succeeded) or failed (failed)",
        ));
    }
    let reference = r
        .reference
        .as_deref()
        .map(|q| pointer(&format!("{p}.reference"), q))
        .transpose()?;
    let by = match (&r.provider_key, r.match_fields.is_empty()) {
        (Some(k), true) => ResolveBy::ProviderKey(pointer(&format!("{p}.provider_key"), k)?),
        (Some(_), false) => {
            return Err(ConfigError::new(
                format!("{p}.match"),
                "a rule names its operation by provider_key or by match, not both",
            ));
        }
        (None, false) => {
            let Some(route) = &r.route else {
                return Err(ConfigError::new(
                    format!("{p}.route"),
                    "a match rule needs the route whose operations it matches",
                ));
            };
            let Some(rt) = routes.iter().find(|x| &x.name == route) else {
                return Err(ConfigError::new(
                    format!("{p}.route"),
                    format!("no route {route:?}"),
                ));
            };
            let mut fields = Vec::new();
            for (ptr, value) in &r.match_fields {
                let ptr = pointer(&format!("{p}.match"), ptr)?;
                let t = crate::template::Template::parse_for(
                    value,
                    crate::template::Placeholders::ReadBack,
                )
                .map_err(|e| ConfigError::new(format!("{p}.match.{ptr}"), e))?;
                fields.push((ptr, t));
            }
            // Tied to this tenant as a read-back `match` must be: by the
            // provider key (scoped to the tenant), or by the tenant the
            // gateway stamps at the route's `tenant_scoped_field`, which a
            // `{tenant}` condition then checks. `{body:…}` values are
            // chosen by callers: another tenant's could be the same.
            let tenant = crate::template::Template::parse("{tenant}").expect("valid");
            let tied = fields.iter().any(|(_, t)| t.uses_provider_key())
                || (rt.tenant_scoped_field.is_some() && fields.iter().any(|(_, t)| *t == tenant));
            if !tied {
                return Err(ConfigError::new(
                    format!("{p}.match"),
                    "the rule is not tied to this tenant: one condition must use {provider_key} \
                     (e.g. \"/data/object/metadata/idempotency_key\" = \"{provider_key}\"), or be \
                     \"{tenant}\" on a route with tenant_scoped_field; {body:…} values are chosen \
                     by callers, so another tenant's operation could match",
                ));
            }
            ResolveBy::Match {
                route: route.clone(),
                fields,
            }
        }
        (None, true) => match &reference {
            Some(q) => ResolveBy::Reference(q.clone()),
            None => {
                return Err(ConfigError::new(
                    format!("{p}.provider_key"),
                    "name the operation: provider_key, reference or match",
                ));
            }
        },
    };
    Ok(Resolves {
        succeeded: r.succeeded.clone(),
        failed: r.failed.clone(),
        by,
        reference,
        object: pointer(&format!("{p}.object"), &r.object)?,
    })
}
