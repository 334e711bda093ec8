//! `[routes.compensation]`: how a COMPLETED operation of a route is undone
//! by a compensating operation, and its runtime form [`Compensation`].
//!
//! ```toml
//! [routes.compensation]
//! method = "POST"
//! path = "/v1/refunds"
//! body = { charge = "{reference}", reason = "requested_by_customer" }
//! content_type = "application/json"      # or application/x-www-form-urlencoded
//! success = "2xx"                        # or { pointer = "/status", equals = "succeeded" }
//! read_back = { path = "/v1/refunds?charge={reference}", found_pointer = "/data/0", match = { "/charge" = "{reference}" } }
//! ```
//!
//! The compensation of operation `<id>` is the operation
//! `<id>#compensation` ([`compensation_id`]) on the route
//! `<route>#compensation` ([`Compensation::route`]): the route with the
//! compensation's read-back and success rule, so the reconciler, the
//! operator's actions and the approvals find its rules by the name they
//! read from the operation.

use std::sync::Arc;

use http::{HeaderName, Method};
use serde::{Deserialize, Serialize};

use super::{ConfigError, ReadBackSpec, Route, RouteMode};
use crate::template::{BodyTemplate, Placeholders, Template};

/// What a compensation's operation id and route name end with.
pub const COMPENSATION_SUFFIX: &str = "#compensation";

/// The operation id of the compensation of `operation_id`.
pub fn compensation_id(operation_id: &str) -> String {
    format!("{operation_id}{COMPENSATION_SUFFIX}")
}

/// The operation (or route) a compensation's id (or route name) undoes,
/// or `None` when `id` is not a compensation's.
pub fn compensated_id(id: &str) -> Option<&str> {
    id.strip_suffix(COMPENSATION_SUFFIX)
}

/// `[routes.compensation]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompensationSpec {
    /// Method of the compensating request. Default `POST`.
    #[serde(default = "default_method")]
    pub method: String,
    /// Path and query template, appended to the route's upstream, e.g.
    /// `/v1/refunds`. Required on HTTP routes; on an MCP route the
    /// original call's MCP endpoint is used.
    #[serde(default)]
    pub path: Option<String>,
    /// The body: a JSON value (a TOML table) whose strings are templates.
    /// Default: no body.
    #[serde(default)]
    pub body: Option<serde_json::Value>,
    /// `application/json` (default) or `application/x-www-form-urlencoded`
    /// (the body in bracket syntax, as Stripe reads it).
    #[serde(default)]
    pub content_type: Option<String>,
    /// Extra request headers (value templates). The route's credentials and
    /// its provider idempotency header (with the compensation's own provider
    /// key) are added as on every call.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// When the compensation took effect: `"2xx"` (default) or
    /// `{ pointer = "/status", equals = "succeeded" }` (a 2xx whose JSON
    /// body holds that value there; another value is FAILED).
    #[serde(default)]
    pub success: Option<SuccessSpec>,
    /// How to read back whether the compensation took effect (a
    /// `[routes.read_back]` table whose templates may also use
    /// `{reference}`). Without it an UNKNOWN compensation waits for an
    /// operator.
    #[serde(default)]
    pub read_back: Option<ReadBackSpec>,
    /// MCP routes: the compensating tool, e.g. `cancel_email`.
    #[serde(default)]
    pub tool: Option<String>,
    /// MCP routes: the tool's arguments, a JSON value whose strings are
    /// templates, e.g. `{ message_id = "{reference}" }`.
    #[serde(default)]
    pub arguments: Option<serde_json::Value>,
    /// Where the original's reference is in its stored response (a JSON
    /// pointer), when no reference was recorded for it (a read-back or an
    /// operator records one). On an MCP route it points into the tool's
    /// result (its `structuredContent`, or the JSON of its first text
    /// content), as `{response:…}` does there. Default: the route's
    /// `read_back.reference_pointer`.
    #[serde(default)]
    pub reference_pointer: Option<String>,
}

fn default_method() -> String {
    "POST".into()
}

/// `success` as written: `"2xx"` or a pointer and the value expected there.
/// Read by hand, not as an untagged enum, so that a table with a field
/// other than `pointer` and `equals` is refused naming that field (as every
/// other table of the file is), not taken with the field ignored.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum SuccessSpec {
    /// `"2xx"`.
    Status(String),
    /// `{ pointer = "/status", equals = "succeeded" }`.
    Pointer {
        /// JSON pointer into a 2xx response body.
        pointer: String,
        /// The value that means success (compared as text).
        equals: serde_json::Value,
    },
}

impl<'de> Deserialize<'de> for SuccessSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SuccessVisitor)
    }
}

/// Reads [`SuccessSpec`]: a string, or a table of exactly `pointer` and
/// `equals`.
struct SuccessVisitor;

impl<'de> serde::de::Visitor<'de> for SuccessVisitor {
    type Value = SuccessSpec;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(r#""2xx" or { pointer = "/json/pointer", equals = value }"#)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SuccessSpec, E> {
        Ok(SuccessSpec::Status(v.to_owned()))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<SuccessSpec, A::Error> {
        const FIELDS: &[&str] = &["pointer", "equals"];
        let (mut pointer, mut equals) = (None, None);
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "pointer" if pointer.is_none() => pointer = Some(map.next_value::<String>()?),
                "equals" if equals.is_none() => {
                    equals = Some(map.next_value::<serde_json::Value>()?);
                }
                "pointer" | "equals" => {
                    return Err(serde::de::Error::duplicate_field(
                        FIELDS[usize::from(key == "equals")],
                    ));
                }
                other => return Err(serde::de::Error::unknown_field(other, FIELDS)),
            }
        }
        Ok(SuccessSpec::Pointer {
            pointer: pointer.ok_or_else(|| serde::de::Error::missing_field("pointer"))?,
            equals: equals.ok_or_else(|| serde::de::Error::missing_field("equals"))?,
        })
    }
}

/// When a 2xx answer counts as applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum SuccessRule {
    /// Any 2xx.
    #[default]
    Status2xx,
    /// A 2xx whose JSON body holds `equals` (as text) at `pointer`.
    Pointer {
        /// JSON pointer.
        pointer: String,
        /// Expected value, as text (strings without quotes).
        equals: String,
    },
}

/// How a compensation's body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEncoding {
    /// `application/json`: values are JSON strings, or the JSON value a
    /// whole-string placeholder points at.
    Json,
    /// `application/x-www-form-urlencoded` in bracket syntax.
    Form,
}

impl BodyEncoding {
    /// The `Content-Type` sent.
    pub fn content_type(self) -> &'static str {
        match self {
            BodyEncoding::Json => "application/json",
            BodyEncoding::Form => "application/x-www-form-urlencoded",
        }
    }
}

/// A route's validated compensation.
#[derive(Debug, Clone)]
pub struct Compensation {
    /// Method.
    pub method: Method,
    /// Path and query template (`None`: an MCP route's original endpoint).
    pub path: Option<Template>,
    /// Body template.
    pub body: Option<BodyTemplate>,
    /// Body encoding.
    pub encoding: BodyEncoding,
    /// Header templates.
    pub headers: Vec<(HeaderName, Template)>,
    /// MCP: the compensating tool.
    pub tool: Option<String>,
    /// MCP: its arguments template.
    pub arguments: Option<BodyTemplate>,
    /// Pointer to the original's reference in its stored response.
    pub reference_pointer: Option<String>,
    /// The route the compensating operations run on (`<route>#compensation`):
    /// the route's upstream, client, credentials, limits and retries, with
    /// the compensation's read-back and success rule.
    pub route: Route,
}

impl Compensation {
    /// Whether rendering the compensation needs `{reference}` (its request
    /// or its read-back uses it).
    pub fn needs_reference(&self) -> bool {
        self.path.as_ref().is_some_and(Template::uses_reference)
            || self.body.as_ref().is_some_and(BodyTemplate::uses_reference)
            || self
                .arguments
                .as_ref()
                .is_some_and(BodyTemplate::uses_reference)
            || self.headers.iter().any(|(_, t)| t.uses_reference())
            || self.route.read_back.as_ref().is_some_and(|rb| {
                rb.path.uses_reference()
                    || rb.match_fields.iter().any(|(_, t)| t.uses_reference())
                    || rb.tool_arguments.iter().any(|(_, t)| t.uses_reference())
            })
    }
}

/// `routes[ri].compensation` checked against its route `base` (already
/// converted) and turned into a [`Compensation`] with its own route.
///
/// Errors: a field that doesn't parse, named by its path
/// (`routes[0].compensation.body.charge`).
pub(super) fn compensation(
    rp: &str,
    spec: &CompensationSpec,
    base: &Route,
    lease_ms: u64,
) -> Result<Arc<Compensation>, ConfigError> {
    let cp = format!("{rp}.compensation");
    let method = Method::from_bytes(spec.method.to_ascii_uppercase().as_bytes())
        .ok()
        .filter(|m| !matches!(*m, Method::TRACE | Method::CONNECT))
        .ok_or_else(|| {
            ConfigError::new(
                format!("{cp}.method"),
                format!("not an HTTP method the gateway sends: {:?}", spec.method),
            )
        })?;
    let mcp = base.mode == RouteMode::Mcp;
    let path = match (&spec.path, mcp) {
        (Some(p), _) => {
            if !p.starts_with('/') {
                return Err(ConfigError::new(
                    format!("{cp}.path"),
                    "must start with '/'",
                ));
            }
            Some(
                Template::parse_for(p, Placeholders::Compensation)
                    .map_err(|e| ConfigError::new(format!("{cp}.path"), e))?,
            )
        }
        (None, true) => None,
        (None, false) => {
            return Err(ConfigError::new(
                format!("{cp}.path"),
                "a compensation needs a `path` (on an MCP route, a `tool`)",
            ));
        }
    };
    let body = spec
        .body
        .as_ref()
        .map(|b| BodyTemplate::parse(b, &format!("{cp}.body"), Placeholders::Compensation))
        .transpose()
        .map_err(|(field, e)| ConfigError::new(field, e))?;
    let encoding = match spec
        .content_type
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("application/json") => BodyEncoding::Json,
        Some("application/x-www-form-urlencoded") => BodyEncoding::Form,
        Some(other) => {
            return Err(ConfigError::new(
                format!("{cp}.content_type"),
                format!(
                    "{other:?} is not supported: use \"application/json\" or \"application/x-www-form-urlencoded\""
                ),
            ));
        }
    };
    if encoding == BodyEncoding::Form
        && !matches!(spec.body, None | Some(serde_json::Value::Object(_)))
    {
        return Err(ConfigError::new(
            format!("{cp}.body"),
            "a form body must be a table of fields",
        ));
    }
    let mut headers = Vec::new();
    for (name, value) in &spec.headers {
        let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigError::new(
                format!("{cp}.headers"),
                format!("not a header name: {name:?}"),
            )
        })?;
        let t = Template::parse_for(value, Placeholders::Compensation)
            .map_err(|e| ConfigError::new(format!("{cp}.headers.{name}"), e))?;
        headers.push((n, t));
    }
    let success = match &spec.success {
        None => SuccessRule::Status2xx,
        Some(SuccessSpec::Status(s)) if s.eq_ignore_ascii_case("2xx") => SuccessRule::Status2xx,
        Some(SuccessSpec::Status(s)) => {
            return Err(ConfigError::new(
                format!("{cp}.success"),
                format!(
                    "{s:?}: use \"2xx\" or {{ pointer = \"/status\", equals = \"succeeded\" }}"
                ),
            ));
        }
        Some(SuccessSpec::Pointer { pointer, equals }) => {
            if !(pointer.is_empty() || pointer.starts_with('/')) {
                return Err(ConfigError::new(
                    format!("{cp}.success.pointer"),
                    "a JSON pointer is empty or starts with '/'",
                ));
            }
            SuccessRule::Pointer {
                pointer: pointer.clone(),
                equals: match equals {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                },
            }
        }
    };
    let (tool, arguments) = match (&spec.tool, mcp) {
        (Some(t), true) => (
            Some(t.clone()),
            spec.arguments
                .as_ref()
                .map(|a| {
                    BodyTemplate::parse(a, &format!("{cp}.arguments"), Placeholders::Compensation)
                })
                .transpose()
                .map_err(|(field, e)| ConfigError::new(field, e))?,
        ),
        (Some(_), false) => {
            return Err(ConfigError::new(
                format!("{cp}.tool"),
                "a compensating tool needs an MCP route (mode = \"mcp\")",
            ));
        }
        (None, true) => {
            return Err(ConfigError::new(
                format!("{cp}.tool"),
                "an MCP route's compensation names its compensating tool",
            ));
        }
        (None, false) if spec.arguments.is_some() => {
            return Err(ConfigError::new(
                format!("{cp}.arguments"),
                "arguments go with a compensating tool (MCP routes)",
            ));
        }
        (None, false) => (None, None),
    };
    if mcp && spec.body.is_some() {
        return Err(ConfigError::new(
            format!("{cp}.body"),
            "an MCP route's compensation is a tool call: give its `arguments`, not a body",
        ));
    }
    if let Some(p) = &spec.reference_pointer
        && !(p.is_empty() || p.starts_with('/'))
    {
        return Err(ConfigError::new(
            format!("{cp}.reference_pointer"),
            "a JSON pointer is empty or starts with '/'",
        ));
    }
    let read_back = match &spec.read_back {
        None => None,
        Some(rb) => {
            if rb.timeout_ms >= lease_ms {
                return Err(ConfigError::new(
                    format!("{cp}.read_back.timeout_ms"),
                    format!(
                        "must be less than reconcile.lease_ms ({lease_ms} ms), the lease a read-back runs under"
                    ),
                ));
            }
            // No tenant field: the gateway stamps callers' bodies, not the
            // provider's record of a compensation. `{reference}` ties it:
            // it names the original effect, which is this tenant's.
            Some(super::read_back::read_back_for(
                &format!("{cp}.read_back"),
                rb,
                None,
                Placeholders::CompensationReadBack,
            )?)
        }
    };
    let mut route = base.clone();
    route.name = format!("{}{COMPENSATION_SUFFIX}", base.name);
    route.read_back = read_back;
    route.success = success;
    // The operator asked for it: once approved, it runs.
    route.execute_on_approval = true;
    route.request_schema = None;
    route.compensation = None;
    Ok(Arc::new(Compensation {
        method,
        path,
        body,
        encoding,
        headers,
        tool,
        arguments,
        reference_pointer: spec.reference_pointer.clone().or_else(|| {
            base.read_back
                .as_ref()
                .and_then(|rb| rb.reference_pointer.clone())
        }),
        route,
    }))
}
