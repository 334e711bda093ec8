//! `effectgate policy new NAME --lang rust|js|python`: a minimal policy
//! project, and `effectgate policy wit`: the world's WIT text.
//!
//! Every project gets `wit/policy.wit`, written from the WIT this gateway
//! was built with ([`bindings::WIT`]), and its language's tool generates
//! the bindings from that file at build time (wit-bindgen for Rust,
//! componentize-js for JavaScript, componentize-py for Python), so they
//! match the gateway that wrote them. Besides: a `config-schema` returning
//! a small schema, an `evaluate` that allows, `classify-failure` leaving
//! failures to the gateway, `replay` with the design's defaults, a
//! `cases.toml` with one case, and a README with the build command.

use std::path::{Path, PathBuf};

use super::bindings;

/// A language a policy can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    /// Rust, built with cargo for `wasm32-wasip2` against wit-bindgen.
    Rust,
    /// JavaScript (an ES module), built with componentize-js.
    Js,
    /// Python, built with componentize-py.
    Python,
}

impl std::str::FromStr for Lang {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rust" => Ok(Lang::Rust),
            "js" | "javascript" => Ok(Lang::Js),
            "python" | "py" => Ok(Lang::Python),
            other => Err(format!(
                "unknown language {other:?}: use rust, js or python"
            )),
        }
    }
}

/// Why a project could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    /// The name is not usable as a package and file name.
    #[error(
        "invalid policy name {0:?}: use 1 to 64 lower-case letters, digits and '-', starting with a letter"
    )]
    BadName(String),
    /// The target folder exists and is not empty.
    #[error("{0} exists and is not empty; choose another name or --dir")]
    NotEmpty(String),
    /// A file could not be written.
    #[error("cannot write {path}: {error}")]
    Write {
        /// The file or folder.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
}

/// The world's WIT text, as this gateway was built with it.
pub fn wit() -> &'static str {
    bindings::WIT
}

/// The component file a project named `name` builds: `name` with `-`
/// replaced by `_`, plus `.wasm` (cargo's naming for a `cdylib`).
pub fn wasm_file(name: &str) -> String {
    format!("{}.wasm", name.replace('-', "_"))
}

fn check_name(name: &str) -> Result<(), ScaffoldError> {
    let ok = (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ScaffoldError::BadName(name.to_owned()))
    }
}

/// Writes a new policy project named `name` in `dir` (created; it must be
/// missing or empty). Returns the files written, relative to `dir`.
///
/// Errors: a bad name, a non-empty `dir`, or a file that can't be written.
pub fn create(name: &str, lang: Lang, dir: &Path) -> Result<Vec<PathBuf>, ScaffoldError> {
    check_name(name)?;
    if let Ok(mut entries) = std::fs::read_dir(dir)
        && entries.next().is_some()
    {
        return Err(ScaffoldError::NotEmpty(dir.display().to_string()));
    }
    let files = project_files(name, lang);
    for (rel, text) in &files {
        let path = dir.join(rel);
        let write = || -> std::io::Result<()> {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, text)?;
            if rel.ends_with(".sh") {
                make_executable(&path)?;
            }
            Ok(())
        };
        write().map_err(|error| ScaffoldError::Write {
            path: path.display().to_string(),
            error,
        })?;
    }
    Ok(files.into_iter().map(|(p, _)| PathBuf::from(p)).collect())
}

#[cfg(unix)]
fn make_executable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

#[cfg(not(unix))]
fn make_executable(_path: &Path) -> std::io::Result<()> {
    Ok(())
}

/// The files of a new project: (path relative to the project, contents).
pub fn project_files(name: &str, lang: Lang) -> Vec<(&'static str, String)> {
    let fill = |t: &str| {
        t.replace("{{bind}}", BIND)
            .replace("{{name}}", name)
            .replace("{{wasm}}", &wasm_file(name))
            .replace("{{world}}", bindings::WORLD)
    };
    let mut files = vec![
        ("wit/policy.wit", bindings::WIT.to_owned()),
        ("cases.toml", fill(CASES)),
    ];
    match lang {
        Lang::Rust => files.extend([
            ("Cargo.toml", fill(RUST_CARGO)),
            ("src/lib.rs", fill(RUST_LIB)),
            ("README.md", fill(RUST_README)),
            (".gitignore", "/target\n".to_owned()),
        ]),
        Lang::Js => files.extend([
            ("package.json", fill(JS_PACKAGE)),
            ("policy.js", fill(JS_POLICY)),
            ("README.md", fill(JS_README)),
            (".gitignore", "/node_modules\n/*.wasm\n".to_owned()),
        ]),
        Lang::Python => files.extend([
            ("app.py", fill(PY_APP)),
            ("build.sh", fill(PY_BUILD)),
            ("README.md", fill(PY_README)),
            (
                ".gitignore",
                "/bindings\n/*.wasm\n__pycache__/\n".to_owned(),
            ),
        ]),
    }
    files
}

/// The case file every project starts with.
const CASES: &str = r#"# effectgate policy test {{wasm}} cases.toml
# Cases: `request` (evaluate), `classify` (classify-failure), `replay` or
# `compensate`, each with an `expect`; see "Case files" in the gateway's
# policies/README.md.
config = {}

[[cases]]
name = "a request is allowed"
request = { method = "POST", path = "/v1/things", body = { amount = 100 } }
expect = { decision = "allow" }
"#;

const BIND: &str = r#"```toml
[[tenants.policies]]
route = "payments"                  # a route name, or "*" for every route
module = "path/to/{{wasm}}"         # relative to the config file
config = {}                         # validated against config-schema()
```"#;

const RUST_CARGO: &str = r#"[package]
name = "{{name}}"
description = "An effectgate policy ({{world}})."
version = "0.1.0"
edition = "2024"
publish = false

[lib]
crate-type = ["cdylib"]

[dependencies]
# Generates the world's bindings from wit/policy.wit at build time.
wit-bindgen = { version = "0.61", default-features = false, features = ["macros", "realloc"] }

[profile.release]
opt-level = "s"
panic = "abort"
strip = true

# A workspace of its own, wherever the project is created.
[workspace]
"#;

const RUST_LIB: &str = r##"//! {{name}}: an effectgate policy for the {{world}} world
//! (`wit/policy.wit`, written by `effectgate policy new`).

wit_bindgen::generate!({ path: "wit", world: "policy" });

// The world's `use` brings Decision, Request, Operation, ResponseHead,
// FailureClass, ReplayVerdict and Compensation into this module; the rest
// are here.
use effectgate::policy::types::{Allow, EffectClass};

struct Policy;

impl Guest for Policy {
    /// The JSON Schema of the per-tenant config; the gateway validates
    /// every tenant's `config` against it when it loads the policy.
    fn config_schema() -> String {
        r#"{"type": "object", "additionalProperties": false, "properties": {}}"#.into()
    }

    /// Decides on a request: `Decision::Allow`, `Decision::Deny(Deny { status, reason })`
    /// (4xx; add `Deny` to the `use effectgate::policy::types::{…}` line
    /// above) or `Decision::RequireApproval(reason)`. `config` is the
    /// tenant's config as JSON text.
    fn evaluate(config: String, request: Request) -> Decision {
        let _ = (config, request);
        Decision::Allow(Allow {
            effect_class: None,
            add_headers: Vec::new(),
        })
    }

    /// Classifies a provider failure; `Unknown` leaves it to the gateway.
    fn classify_failure(config: String, head: ResponseHead, body: Vec<u8>) -> FailureClass {
        let _ = (config, head, body);
        FailureClass::Unknown
    }

    /// May an operation be replayed? The gateway's defaults by effect class.
    fn replay(config: String, op: Operation) -> ReplayVerdict {
        let _ = config;
        match op.effect_class {
            EffectClass::Derived | EffectClass::Analytics => ReplayVerdict::Allow,
            EffectClass::Notification | EffectClass::Payment => ReplayVerdict::SameOperationOnly,
            EffectClass::Permission => ReplayVerdict::Revalidate,
            EffectClass::Irreversible => ReplayVerdict::Manual,
        }
    }

    /// May an operator compensate (undo) a completed operation with the
    /// compensating request in `request`? The gateway's defaults: an
    /// approval for permission and irreversible operations, allow for the rest.
    fn compensate(config: String, request: Compensation) -> Decision {
        let _ = config;
        match request.operation.effect_class {
            EffectClass::Permission | EffectClass::Irreversible => Decision::RequireApproval(
                "compensating this operation needs an approval".into(),
            ),
            _ => Decision::Allow(Allow {
                effect_class: None,
                add_headers: Vec::new(),
            }),
        }
    }
}

export!(Policy);
"##;

const RUST_README: &str = r#"# {{name}}

An effectgate policy in Rust, for the `{{world}}` world (`wit/policy.wit`).
wit-bindgen generates the bindings from that file when it builds.

```sh
rustup target add wasm32-wasip2
# --target-dir: the module lands here even when CARGO_TARGET_DIR is set
cargo build --target wasm32-wasip2 --release --target-dir target
# → target/wasm32-wasip2/release/{{wasm}}
effectgate policy check target/wasm32-wasip2/release/{{wasm}}
effectgate policy test target/wasm32-wasip2/release/{{wasm}} cases.toml
```

Bind it in the gateway's config:

{{bind}}
"#;

const JS_PACKAGE: &str = r#"{
  "name": "{{name}}",
  "version": "0.1.0",
  "private": true,
  "description": "An effectgate policy ({{world}}).",
  "type": "module",
  "scripts": {
    "build": "componentize-js policy.js --wit wit --world-name policy --disable stdio random clocks http fetch-event --out {{wasm}}"
  },
  "devDependencies": {
    "@bytecodealliance/componentize-js": "0.23.0"
  }
}
"#;

const JS_POLICY: &str = r#"// {{name}}: an effectgate policy for the {{world}} world
// (wit/policy.wit, written by `effectgate policy new`). componentize-js
// generates the bindings from that file when it builds.
//
// WIT values in JavaScript: records are objects with camelCase fields
// (request.operationId, request.body is a Uint8Array), enums are their
// WIT names ("payment", "same-operation-only"), option<T> is T or
// undefined, and a decision is {tag: "allow", val: {effectClass, addHeaders}},
// {tag: "deny", val: {status, reason}} or {tag: "require-approval", val: reason}.
// Log with `import { log } from "effectgate:policy/log@0.2.0"`:
// log("info", "message", [["key", "value"]]).

// The JSON Schema of the per-tenant config; the gateway validates every
// tenant's `config` against it when it loads the policy.
export function configSchema() {
  return JSON.stringify({ type: "object", additionalProperties: false, properties: {} });
}

// Decides on a request. `config` is the tenant's config as JSON text.
export function evaluate(config, request) {
  return { tag: "allow", val: { effectClass: undefined, addHeaders: [] } };
}

// Classifies a provider failure; "unknown" leaves it to the gateway.
export function classifyFailure(config, head, body) {
  return "unknown";
}

// May an operation be replayed? The gateway's defaults by effect class.
const REPLAY = {
  derived: "allow",
  analytics: "allow",
  notification: "same-operation-only",
  payment: "same-operation-only",
  permission: "revalidate",
  irreversible: "manual",
};
export function replay(config, op) {
  return REPLAY[op.effectClass] ?? "manual";
}

// May an operator compensate (undo) a completed operation with the
// compensating request in `request`? The gateway's defaults: an approval
// for permission and irreversible operations, allow for the rest.
export function compensate(config, request) {
  const cls = request.operation.effectClass;
  if (cls === "permission" || cls === "irreversible") {
    return { tag: "require-approval", val: "compensating this operation needs an approval" };
  }
  return { tag: "allow", val: { effectClass: undefined, addHeaders: [] } };
}
"#;

const JS_README: &str = r#"# {{name}}

An effectgate policy in JavaScript, for the `{{world}}` world
(`wit/policy.wit`). componentize-js generates the bindings from that file
when it builds; every optional WASI feature is disabled, so the component
imports only the policy world.

```sh
npm install
npm run build
# → {{wasm}}
effectgate policy check {{wasm}}
effectgate policy test {{wasm}} cases.toml
```

The component carries a JavaScript engine (about 11 MiB; its memory starts
at about 9 MiB): give the gateway `[policy] memory_bytes` of at least
32 MiB.

Bind it in the gateway's config:

{{bind}}
"#;

const PY_APP: &str = r#""""{{name}}: an effectgate policy for the {{world}} world
(``wit/policy.wit``, written by ``effectgate policy new``).

componentize-py generates the ``wit_world`` module from that file when it
builds (``./build.sh``); ``./build.sh --bindings`` writes it to
``bindings/`` for an editor.
"""

import json

import wit_world
from wit_world.imports.types import (
    Allow,
    Compensation,
    Decision,
    Decision_Allow,
    Decision_RequireApproval,
    EffectClass,
    FailureClass,
    Operation,
    ReplayVerdict,
    Request,
    ResponseHead,
)

REPLAY = {
    EffectClass.DERIVED: ReplayVerdict.ALLOW,
    EffectClass.ANALYTICS: ReplayVerdict.ALLOW,
    EffectClass.NOTIFICATION: ReplayVerdict.SAME_OPERATION_ONLY,
    EffectClass.PAYMENT: ReplayVerdict.SAME_OPERATION_ONLY,
    EffectClass.PERMISSION: ReplayVerdict.REVALIDATE,
    EffectClass.IRREVERSIBLE: ReplayVerdict.MANUAL,
}


class WitWorld(wit_world.WitWorld):
    def config_schema(self) -> str:
        """The JSON Schema of the per-tenant config; the gateway validates
        every tenant's ``config`` against it when it loads the policy."""
        return json.dumps({"type": "object", "additionalProperties": False, "properties": {}})

    def evaluate(self, config: str, request: Request) -> Decision:
        """Decides on a request: ``Decision_Allow``, ``Decision_Deny(Deny(status, reason))``
        (4xx) or ``Decision_RequireApproval(reason)``. ``config`` is the
        tenant's config as JSON text."""
        return Decision_Allow(Allow(effect_class=None, add_headers=[]))

    def classify_failure(self, config: str, head: ResponseHead, body: bytes) -> FailureClass:
        """Classifies a provider failure; ``UNKNOWN`` leaves it to the gateway."""
        return FailureClass.UNKNOWN

    def replay(self, config: str, op: Operation) -> ReplayVerdict:
        """May an operation be replayed? The gateway's defaults by effect class."""
        return REPLAY[op.effect_class]

    def compensate(self, config: str, request: Compensation) -> Decision:
        """May an operator compensate (undo) a completed operation with the
        compensating request in ``request``? The gateway's defaults: an
        approval for permission and irreversible operations, allow for the rest."""
        if request.operation.effect_class in (EffectClass.PERMISSION, EffectClass.IRREVERSIBLE):
            return Decision_RequireApproval("compensating this operation needs an approval")
        return Decision_Allow(Allow(effect_class=None, add_headers=[]))
"#;

const PY_BUILD: &str = r#"#!/usr/bin/env bash
# Builds {{wasm}} from app.py with componentize-py (pip install
# componentize-py==0.25.*; or set COMPONENTIZE_PY to its path). The
# bindings come from wit/policy.wit; --stub-wasi replaces the WASI imports
# with trapping stubs, so the component imports only the policy world.
#   ./build.sh              # → {{wasm}}
#   ./build.sh --bindings   # only the bindings, in ./bindings (for an editor)
set -euo pipefail
cd "$(dirname "$0")"
cpy=${COMPONENTIZE_PY:-componentize-py}
if [ "${1:-}" = "--bindings" ]; then
  rm -rf bindings
  exec "$cpy" -d wit -w policy bindings bindings
fi
"$cpy" -q -d wit -w policy componentize --stub-wasi -p . app -o {{wasm}}
echo "{{wasm}}"
"#;

const PY_README: &str = r#"# {{name}}

An effectgate policy in Python, for the `{{world}}` world
(`wit/policy.wit`). componentize-py generates the bindings (the
`wit_world` module) from that file when it builds.

```sh
pip install componentize-py==0.25.*
./build.sh
# → {{wasm}}
effectgate policy check {{wasm}}
effectgate policy test {{wasm}} cases.toml
```

The component carries a Python interpreter (about 17 MiB; its memory
starts at about 12.5 MiB): give the gateway `[policy] memory_bytes` of at
least 32 MiB.

Bind it in the gateway's config:

{{bind}}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_language_gets_the_embedded_wit_a_case_and_a_readme() {
        for lang in [Lang::Rust, Lang::Js, Lang::Python] {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("spend-cap");
            let files = create("spend-cap", lang, &root).unwrap();
            let wit = std::fs::read_to_string(root.join("wit/policy.wit")).unwrap();
            assert_eq!(wit, bindings::WIT, "{lang:?}");
            let cases: toml::Value =
                toml::from_str(&std::fs::read_to_string(root.join("cases.toml")).unwrap()).unwrap();
            assert_eq!(cases["cases"].as_array().unwrap().len(), 1, "{lang:?}");
            let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
            assert!(readme.contains("spend_cap.wasm"), "{lang:?}: {readme}");
            #[cfg(unix)]
            if lang == Lang::Python {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(root.join("build.sh"))
                    .unwrap()
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o111, 0o111, "build.sh is executable");
            }
            assert!(readme.contains("effectgate policy test"), "{lang:?}");
            assert!(!readme.contains("{{"), "{lang:?}: unfilled template");
            for f in &files {
                let text = std::fs::read_to_string(root.join(f)).unwrap();
                assert!(!text.contains("{{name}}"), "{lang:?} {f:?}");
            }
        }
    }

    #[test]
    fn names_are_checked_and_a_non_empty_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "Caps", "1st", "a_b", "a-", "a/b", &"a".repeat(65)] {
            assert!(
                matches!(
                    create(bad, Lang::Rust, &dir.path().join("x")),
                    Err(ScaffoldError::BadName(_))
                ),
                "{bad:?}"
            );
        }
        std::fs::write(dir.path().join("keep"), "x").unwrap();
        let e = create("ok", Lang::Js, dir.path()).unwrap_err();
        assert!(matches!(e, ScaffoldError::NotEmpty(_)), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("keep")).unwrap(),
            "x"
        );
    }

    #[test]
    fn languages_parse_by_name() {
        assert_eq!("rust".parse::<Lang>(), Ok(Lang::Rust));
        assert_eq!("js".parse::<Lang>(), Ok(Lang::Js));
        assert_eq!("python".parse::<Lang>(), Ok(Lang::Python));
        assert!(
            "go".parse::<Lang>()
                .unwrap_err()
                .contains("rust, js or python")
        );
    }
}
