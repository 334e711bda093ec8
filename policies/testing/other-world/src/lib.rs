//! Test policy built against `effectgate:policy@0.9.0` (`wit/policy.wit`
//! here), a version this gateway does not speak.

wit_bindgen::generate!({ path: "wit", world: "policy" });

struct OtherWorld;

impl Guest for OtherWorld {
    fn config_schema() -> String {
        // Uses the import, so the component keeps it.
        format!(r#"{{"type": "object", "description": "built at {}"}}"#, effectgate::policy::clock::now_ms())
    }
}

export!(OtherWorld);
