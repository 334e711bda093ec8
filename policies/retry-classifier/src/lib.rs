//! `retry-classifier`: classifies provider failures by a provider-specific
//! body field (Stripe-style `error.type`) first, then by status.
//!
//! Config (all optional):
//! ```json
//! {"error_type_pointer": "/error/type",
//!  "transient_types": ["api_error", "rate_limit_error"],
//!  "permanent_types": ["card_error", "invalid_request_error", "idempotency_error"],
//!  "transient_statuses": [429, 503], "permanent_statuses": [400, 401, 402, 403, 404, 409, 422],
//!  "unknown_statuses": [500, 502, 504]}
//! ```

use effectgate_policy_sdk::*;

struct RetryClassifier;

fn list<'a>(config: &'a Value, key: &str, default: &'a [&'a str]) -> Vec<String> {
    match config[key].as_array() {
        Some(a) => a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        None => default.iter().map(|s| s.to_string()).collect(),
    }
}

fn statuses(config: &Value, key: &str, default: &[u16]) -> Vec<u16> {
    match config[key].as_array() {
        Some(a) => a
            .iter()
            .filter_map(|v| v.as_u64().map(|n| n as u16))
            .collect(),
        None => default.to_vec(),
    }
}

impl Policy for RetryClassifier {
    fn config_schema() -> String {
        r#"{
  "type": "object",
  "additionalProperties": false,
  "properties": {
    "error_type_pointer": {"type": "string", "pattern": "^(/.*)?$"},
    "transient_types": {"type": "array", "items": {"type": "string"}},
    "permanent_types": {"type": "array", "items": {"type": "string"}},
    "transient_statuses": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 599}},
    "permanent_statuses": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 599}},
    "unknown_statuses": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 599}}
  }
}"#
        .into()
    }

    fn classify_failure(config: &Value, head: &ResponseHead, body: &[u8]) -> FailureClass {
        let pointer = config["error_type_pointer"]
            .as_str()
            .unwrap_or("/error/type");
        if let Ok(v) = serde_json::from_slice::<Value>(body)
            && let Some(kind) = v.pointer(pointer).and_then(Value::as_str)
        {
            if list(
                config,
                "transient_types",
                &["api_error", "rate_limit_error"],
            )
            .iter()
            .any(|t| t == kind)
            {
                return FailureClass::Transient;
            }
            if list(
                config,
                "permanent_types",
                &["card_error", "invalid_request_error", "idempotency_error"],
            )
            .iter()
            .any(|t| t == kind)
            {
                return FailureClass::Permanent;
            }
        }
        if statuses(config, "transient_statuses", &[429, 503]).contains(&head.status) {
            FailureClass::Transient
        } else if statuses(
            config,
            "permanent_statuses",
            &[400, 401, 402, 403, 404, 409, 422],
        )
        .contains(&head.status)
        {
            FailureClass::Permanent
        } else {
            FailureClass::Unknown
        }
    }
}

export_policy!(RetryClassifier);
