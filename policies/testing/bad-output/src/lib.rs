//! Test policy: returns output the gateway must refuse. Config `mode`:
//! `status` (deny with 200), `header` (adds a `connection` header),
//! `credential` (adds an `authorization` header), `long` (a 64 KiB reason),
//! `long-name` (a header name of 2 KiB), `content` (adds
//! `content-encoding: gzip` to a plain body), `request-id` (replaces the
//! gateway's `x-request-id`), `non-ascii` (a header value `café`);
//! and one valid output, `pin` (adds `x-policy-pin: pinned`), for the
//! test that a policy's header replaces the caller's.

use effectgate_policy_sdk::*;

struct BadOutput;

impl Policy for BadOutput {
    fn config_schema() -> String {
        r#"{"type": "object", "required": ["mode"], "properties": {"mode": {"enum": ["status", "header", "credential", "long", "long-name", "content", "request-id", "non-ascii", "pin"]}}}"#
            .into()
    }
    fn evaluate(config: &Value, _request: &Request) -> Decision {
        let add = |name: &str, value: &str| {
            Decision::Allow(Allow {
                effect_class: None,
                add_headers: vec![Header {
                    name: name.into(),
                    value: value.into(),
                }],
            })
        };
        match config["mode"].as_str() {
            Some("status") => deny(200, "not a 4xx"),
            Some("header") => add("connection", "x"),
            Some("credential") => add("authorization", "x"),
            Some("long-name") => add(&"x".repeat(2048), "x"),
            Some("content") => add("content-encoding", "gzip"),
            Some("request-id") => add("x-request-id", "forged-by-policy"),
            Some("non-ascii") => add("x-policy-note", "café"),
            Some("pin") => add("x-policy-pin", "pinned"),
            _ => deny(403, "x".repeat(64 * 1024)),
        }
    }
}

export_policy!(BadOutput);
