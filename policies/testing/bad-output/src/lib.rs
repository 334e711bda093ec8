//! Test policy: returns output the gateway must refuse. Config `mode`:
//! `status` (deny with 200), `header` (adds a `connection` header),
//! `credential` (adds an `authorization` header), `long` (a 64 KiB reason);
//! and one valid output, `pin` (adds `x-policy-pin: pinned`), for the
//! test that a policy's header replaces the caller's.

use effectgate_policy_sdk::*;

struct BadOutput;

impl Policy for BadOutput {
    fn config_schema() -> String {
        r#"{"type": "object", "required": ["mode"], "properties": {"mode": {"enum": ["status", "header", "credential", "long", "pin"]}}}"#
            .into()
    }
    fn evaluate(config: &Value, _request: &Request) -> Decision {
        let header = |name: &str| {
            Decision::Allow(Allow {
                effect_class: None,
                add_headers: vec![Header {
                    name: name.into(),
                    value: if name == "x-policy-pin" { "pinned" } else { "x" }.into(),
                }],
            })
        };
        match config["mode"].as_str() {
            Some("status") => deny(200, "not a 4xx"),
            Some("header") => header("connection"),
            Some("credential") => header("authorization"),
            Some("pin") => header("x-policy-pin"),
            _ => deny(403, "x".repeat(64 * 1024)),
        }
    }
}

export_policy!(BadOutput);
