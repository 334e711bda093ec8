//! Test policy: returns output the gateway must refuse. Config `mode`:
//! `status` (deny with 200), `header` (adds a `connection` header),
//! `credential` (adds an `authorization` header), `long` (a 64 KiB reason).

use effectgate_policy_sdk::*;

struct BadOutput;

impl Policy for BadOutput {
    fn config_schema() -> String {
        r#"{"type": "object", "required": ["mode"], "properties": {"mode": {"enum": ["status", "header", "credential", "long"]}}}"#
            .into()
    }
    fn evaluate(config: &Value, _request: &Request) -> Decision {
        let header = |name: &str| {
            Decision::Allow(Allow {
                effect_class: None,
                add_headers: vec![Header {
                    name: name.into(),
                    value: "x".into(),
                }],
            })
        };
        match config["mode"].as_str() {
            Some("status") => deny(200, "not a 4xx"),
            Some("header") => header("connection"),
            Some("credential") => header("authorization"),
            _ => deny(403, "x".repeat(64 * 1024)),
        }
    }
}

export_policy!(BadOutput);
