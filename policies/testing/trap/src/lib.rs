//! Test policy: `evaluate` traps (`unreachable`).

use effectgate_policy_sdk::*;

struct Trap;

impl Policy for Trap {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: &Value, request: &Request) -> Decision {
        if std::hint::black_box(request.body.len()) < usize::MAX {
            core::arch::wasm32::unreachable()
        }
        allow()
    }
}

export_policy!(Trap);
