//! Test policy: `compensate` answers what the tenant's config says
//! (`{"compensate": "allow" | "approval" | "deny"}`), naming the
//! compensating request's method and path in its reason; `long-deny` and
//! `long-approval` give a 64 KiB reason, which the gateway must refuse.
//! Every request is allowed.

use effectgate_policy_sdk::*;

struct CompensationGate;

impl Policy for CompensationGate {
    fn config_schema() -> String {
        r#"{"type": "object", "properties": {"compensate": {"enum": ["allow", "approval", "deny", "long-deny", "long-approval"]}},
            "required": ["compensate"], "additionalProperties": false}"#
            .into()
    }
    fn compensate(config: &Value, request: &Compensation) -> Decision {
        let what = format!(
            "{} {} undoing {}",
            request.method, request.path, request.operation.operation_id
        );
        match config["compensate"].as_str() {
            Some("approval") => require_approval(format!("a second person must approve {what}")),
            Some("deny") => deny(403, format!("compensations are not allowed here ({what})")),
            Some("long-deny") => deny(403, "x".repeat(64 * 1024)),
            Some("long-approval") => require_approval("x".repeat(64 * 1024)),
            _ => allow(),
        }
    }
}

export_policy!(CompensationGate);
