//! Test policy: `evaluate` sleeps for the config's `ms` before it allows.
//! A sleep waits in the host (`wasi:io/poll`), where the CPU deadline
//! can't interrupt it: the gateway must refuse the wait.

use effectgate_policy_sdk::*;

struct Sleeper;

impl Policy for Sleeper {
    fn config_schema() -> String {
        r#"{"type": "object", "required": ["ms"], "properties": {"ms": {"type": "integer", "minimum": 0}}}"#
            .into()
    }
    fn evaluate(config: &Value, _request: &Request) -> Decision {
        let ms = config["ms"].as_u64().unwrap_or(0);
        std::thread::sleep(std::time::Duration::from_millis(ms));
        allow()
    }
}

export_policy!(Sleeper);
