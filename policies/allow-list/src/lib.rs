//! `allow-list`: denies (403) every request whose method and path are not
//! on the tenant's list.
//!
//! Config: `{"rules": [{"methods": ["POST"], "path_prefix": "/v1/charges"}]}`.
//! A rule without `methods` allows every method. `path_prefix` matches
//! whole path segments: `/tools/send_email` allows `/tools/send_email` and
//! `/tools/send_email/…`, never `/tools/send_email_bulk`; a prefix ending
//! in `/` allows everything below it.

use effectgate_policy_sdk::*;

struct AllowList;

impl Policy for AllowList {
    fn config_schema() -> String {
        r#"{
  "type": "object",
  "required": ["rules"],
  "additionalProperties": false,
  "properties": {
    "rules": {
      "type": "array",
      "items": {
        "type": "object",
        "required": ["path_prefix"],
        "additionalProperties": false,
        "properties": {
          "methods": {"type": "array", "items": {"type": "string"}},
          "path_prefix": {"type": "string", "pattern": "^/"}
        }
      }
    }
  }
}"#
        .into()
    }

    fn evaluate(config: &Value, request: &Request) -> Decision {
        let empty = Vec::new();
        let allowed = config["rules"]
            .as_array()
            .unwrap_or(&empty)
            .iter()
            .any(|rule| {
                let method_ok = match rule["methods"].as_array() {
                    None => true,
                    Some(ms) => ms.iter().any(|m| {
                        m.as_str()
                            .is_some_and(|m| m.eq_ignore_ascii_case(&request.method))
                    }),
                };
                let path_ok = rule["path_prefix"]
                    .as_str()
                    .is_some_and(|p| segment_prefix(p, &request.path));
                method_ok && path_ok
            });
        if allowed {
            allow()
        } else {
            deny(
                403,
                format!(
                    "{} {} is not on this tenant's allow-list",
                    request.method, request.path
                ),
            )
        }
    }
}

/// Whether `prefix` names `path` or one of its ancestors, by whole segments.
fn segment_prefix(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        None => false,
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
    }
}

export_policy!(AllowList);
