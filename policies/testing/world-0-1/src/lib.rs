//! Test policy built against `effectgate:policy@0.1.0` (`wit/policy.wit`
//! here, the world as first published): it has no `compensate` export, so
//! a gateway speaking 0.2.0 loads it and gives its compensations the
//! default for the effect class. It allows every request and logs through
//! the 0.1.0 `log` import.

wit_bindgen::generate!({ path: "wit", world: "policy" });

use effectgate::policy::types::{Allow, EffectClass};

struct WorldZeroOne;

impl Guest for WorldZeroOne {
    fn config_schema() -> String {
        r#"{"type": "object"}"#.into()
    }
    fn evaluate(_config: String, request: Request) -> Decision {
        effectgate::policy::log::log(
            effectgate::policy::log::Level::Debug,
            "allowing",
            &[("path".to_owned(), request.path)],
        );
        let _ = effectgate::policy::clock::now_ms();
        Decision::Allow(Allow {
            effect_class: None,
            add_headers: Vec::new(),
        })
    }
    fn classify_failure(_config: String, _head: ResponseHead, _body: Vec<u8>) -> FailureClass {
        FailureClass::Unknown
    }
    fn replay(_config: String, op: Operation) -> ReplayVerdict {
        match op.effect_class {
            EffectClass::Derived | EffectClass::Analytics => ReplayVerdict::Allow,
            EffectClass::Notification | EffectClass::Payment => ReplayVerdict::SameOperationOnly,
            EffectClass::Permission => ReplayVerdict::Revalidate,
            EffectClass::Irreversible => ReplayVerdict::Manual,
        }
    }
}

export!(WorldZeroOne);
