//! Test policy: `evaluate` reads a file. Rust's standard library then
//! imports `wasi:filesystem`, which the gateway does not provide, so the
//! module must be refused at load time, naming the import.

use effectgate_policy_sdk::*;

struct FsReader;

impl Policy for FsReader {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: &Value, _request: &Request) -> Decision {
        match std::fs::read_to_string("/etc/hostname") {
            Ok(_) => deny(403, "read a file"),
            Err(_) => allow(),
        }
    }
}

export_policy!(FsReader);
