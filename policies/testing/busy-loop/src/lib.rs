//! Test policy: `evaluate` never returns. The gateway's epoch deadline
//! must stop it.

use effectgate_policy_sdk::*;

struct BusyLoop;

impl Policy for BusyLoop {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: &Value, request: &Request) -> Decision {
        let mut x: u64 = request.body.len() as u64;
        loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

export_policy!(BusyLoop);
