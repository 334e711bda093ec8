//! Test policy: `evaluate` prints to stdout, then panics (Rust writes the
//! panic message to stderr before it aborts). The host must turn this into
//! a policy failure, on every thread it may run on.

use effectgate_policy_sdk::*;

struct Panicker;

impl Policy for Panicker {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: &Value, request: &Request) -> Decision {
        println!("evaluating {} {}", request.method, request.path);
        let missing: Option<u8> = std::hint::black_box(None);
        missing.expect("a policy bug");
        allow()
    }
    fn classify_failure(_config: &Value, _head: &ResponseHead, _body: &[u8]) -> FailureClass {
        eprintln!("classifying");
        panic!("a classifier bug")
    }
}

export_policy!(Panicker);
