//! `effectgate check-config` on bad configs: each case of
//! `tests/snapshots/check-config.txt` is written to a file of its own
//! and checked; the exit code and the output must match the case's
//! expectation exactly. `UPDATE_SNAPSHOTS=1` rewrites the expectations
//! from the current output (review the diff).
//!
//! A case:
//!
//! ```text
//! === name
//! env: EFFECTGATE_LISTEN__PROXI=127.0.0.1:1   (optional, repeatable)
//! missing: true                               (optional: no config file)
//! --- config
//! the TOML
//! --- output
//! exit 2
//! the output, with the config's path as {file} and its folder as {dir}
//! ```

use std::path::Path;
use std::process::Command;

const CASES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/snapshots/check-config.txt"
);

struct Case {
    name: String,
    env: Vec<(String, String)>,
    missing: bool,
    config: String,
    output: String,
}

fn parse(text: &str) -> (String, Vec<Case>) {
    let (preamble, rest) = text.split_at(text.find("=== ").expect("at least one case"));
    let mut cases = Vec::new();
    for chunk in rest.split("\n=== ").map(|c| c.trim_start_matches("=== ")) {
        let (head, body) = chunk.split_once("\n--- config\n").expect("--- config");
        let (config, output) = body.split_once("--- output\n").expect("--- output");
        let mut lines = head.lines();
        let name = lines.next().unwrap().trim().to_owned();
        let mut case = Case {
            name,
            env: Vec::new(),
            missing: false,
            config: config.to_owned(),
            output: output.trim_end().to_owned(),
        };
        for l in lines {
            if let Some(kv) = l.strip_prefix("env: ") {
                let (k, v) = kv.split_once('=').expect("env: NAME=value");
                case.env.push((k.to_owned(), v.to_owned()));
            } else if l.trim() == "missing: true" {
                case.missing = true;
            } else if !l.trim().is_empty() {
                panic!("case {}: unknown line {l:?}", case.name);
            }
        }
        cases.push(case);
    }
    (preamble.to_owned(), cases)
}

fn run(case: &Case, dir: &Path) -> String {
    let file = dir.join(format!("{}.toml", case.name));
    if !case.missing {
        std::fs::write(&file, &case.config).unwrap();
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_effectgate"));
    cmd.args(["check-config", "--config"]).arg(&file);
    for (k, _) in std::env::vars() {
        if k.to_ascii_uppercase().starts_with("EFFECTGATE_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in &case.env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "exit {}\n{}{}",
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.replace(&file.display().to_string(), "{file}")
        .replace(&dir.display().to_string(), "{dir}")
        .trim_end()
        .to_owned()
}

#[test]
fn bad_configs_get_the_messages_of_the_snapshot_file() {
    let text = std::fs::read_to_string(CASES).unwrap();
    let (preamble, cases) = parse(&text);
    assert!(cases.len() >= 8, "{} cases", cases.len());
    let dir = tempfile::tempdir().unwrap();
    let update = std::env::var_os("UPDATE_SNAPSHOTS").is_some();
    let mut rewritten = preamble;
    let mut failures = Vec::new();
    for case in &cases {
        let got = run(case, dir.path());
        if got != case.output {
            failures.push(format!(
                "case {}:\n--- expected\n{}\n--- got\n{got}",
                case.name, case.output
            ));
        }
        rewritten.push_str(&format!("=== {}\n", case.name));
        for (k, v) in &case.env {
            rewritten.push_str(&format!("env: {k}={v}\n"));
        }
        if case.missing {
            rewritten.push_str("missing: true\n");
        }
        rewritten.push_str(&format!("--- config\n{}--- output\n{got}\n\n", case.config));
    }
    if update {
        std::fs::write(CASES, rewritten.trim_end().to_owned() + "\n").unwrap();
        return;
    }
    assert!(
        failures.is_empty(),
        "{}\n(UPDATE_SNAPSHOTS=1 rewrites {CASES})",
        failures.join("\n\n")
    );
}
