//! `replay-matrix`: the replay defaults table of docs/design.md, with per-tenant
//! overrides by effect class.
//!
//! | effect class | default |
//! |---|---|
//! | derived | allow |
//! | analytics | allow |
//! | notification, payment | same-operation-only |
//! | permission | revalidate |
//! | irreversible | manual |
//!
//! Config: `{"overrides": {"payment": "manual"}}`.

use effectgate_policy_sdk::*;

struct ReplayMatrix;

fn class_name(c: EffectClass) -> &'static str {
    match c {
        EffectClass::Derived => "derived",
        EffectClass::Analytics => "analytics",
        EffectClass::Notification => "notification",
        EffectClass::Payment => "payment",
        EffectClass::Permission => "permission",
        EffectClass::Irreversible => "irreversible",
    }
}

impl Policy for ReplayMatrix {
    fn config_schema() -> String {
        r#"{
  "type": "object",
  "additionalProperties": false,
  "properties": {
    "overrides": {
      "type": "object",
      "propertyNames": {"enum": ["derived", "analytics", "notification", "payment", "permission", "irreversible"]},
      "additionalProperties": {"enum": ["allow", "same-operation-only", "revalidate", "manual", "deny"]}
    }
  }
}"#
        .into()
    }

    fn replay(config: &Value, op: &Operation) -> ReplayVerdict {
        config["overrides"][class_name(op.effect_class)]
            .as_str()
            .and_then(replay_verdict_named)
            .unwrap_or_else(|| default_replay(op.effect_class))
    }
}

export_policy!(ReplayMatrix);
