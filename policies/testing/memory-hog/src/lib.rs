//! Test policy: `evaluate` allocates (and touches) memory without bound.
//! The gateway's memory limit must stop it.

use effectgate_policy_sdk::*;

struct MemoryHog;

impl Policy for MemoryHog {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: &Value, _request: &Request) -> Decision {
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        loop {
            chunks.push(vec![0xA5; 1 << 20]);
            std::hint::black_box(&chunks);
        }
    }
}

export_policy!(MemoryHog);
