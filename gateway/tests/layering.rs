//! The layering of `gateway/src`: a module names only modules of lower
//! layers (or its own subtree). Fails, naming the file and line, when an
//! import points upward or sideways. Run alone with
//! `cargo test -p effectgate --test layering`; `print_import_graph` prints
//! the graph (`-- --nocapture`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layers, lowest first. Modules in one layer may not name each other.
const LAYERS: &[&[&str]] = &[
    &["times", "failpoint", "template", "metrics", "egress", "tls"],
    &["telemetry"],
    &["config"],
    &["idempotency", "encoding", "ledger"],
    &["mcp", "forward"],
    &["policy"],
    &["state"],
    &["ops"],
    &["workers"],
    &["http"],
    &["server"],
    &["cli"],
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to (`ops/execute/mod.rs` → `ops`).
fn owner(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

/// Code lines of a file (comments and doc comments dropped).
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter_map(|(i, l)| {
        let code = l.split("//").next().unwrap_or("");
        (!code.trim().is_empty()).then_some((i + 1, code))
    })
}

/// Every `crate::X` a line names.
fn named(line: &str) -> Vec<String> {
    line.match_indices("crate::")
        .filter(|(i, _)| !line[..*i].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        .map(|(i, _)| {
            line[i + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut all = Vec::new();
    files(&src(), &mut all);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in all {
        let Some(me) = owner(&f) else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        for (_, line) in code_lines(&text) {
            for other in named(line) {
                if other != me {
                    g.entry(me.clone()).or_default().insert(other);
                }
            }
        }
    }
    g
}

#[test]
fn every_module_has_a_layer() {
    let mut all = Vec::new();
    files(&src(), &mut all);
    for f in all {
        if let Some(m) = owner(&f) {
            assert!(
                rank(&m).is_some(),
                "{} is in no layer of LAYERS",
                f.display()
            );
        }
    }
}

#[test]
fn imports_point_only_downward() {
    let mut all = Vec::new();
    files(&src(), &mut all);
    let mut wrong = Vec::new();
    for f in all {
        let Some(me) = owner(&f) else { continue };
        let Some(my_rank) = rank(&me) else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        for (n, line) in code_lines(&text) {
            for other in named(line) {
                if other == me {
                    continue;
                }
                match rank(&other) {
                    Some(r) if r < my_rank => {}
                    _ => wrong.push(format!(
                        "{}:{n}: {me} names crate::{other}",
                        f.strip_prefix(src()).unwrap().display()
                    )),
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports pointing upward or sideways:\n{}",
        wrong.join("\n")
    );
}

/// The use cases name no HTTP framework types, and the ledger no error
/// type or policy of a higher layer.
#[test]
fn ops_and_ledger_stay_free_of_higher_types() {
    let rules: &[(&str, &[&str])] = &[
        ("ops", &["axum", "http::Response", "IntoResponse"]),
        ("ledger", &["OpError", "ApiError", "crate::policy"]),
    ];
    let mut wrong = Vec::new();
    for (dir, banned) in rules {
        let mut fs = Vec::new();
        files(&src().join(dir), &mut fs);
        for f in fs {
            let text = std::fs::read_to_string(&f).unwrap();
            for (n, line) in code_lines(&text) {
                for b in *banned {
                    if line.contains(b) {
                        wrong.push(format!("{}:{n}: {b}", f.display()));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_checker_sees_a_violation() {
    // The checks above can fail: a line naming a higher layer is caught.
    assert_eq!(named("use crate::http::proxy; // x"), vec!["http"]);
    assert_eq!(named("let a = my_crate::x;"), Vec::<String>::new());
    assert!(rank("http") > rank("ops"));
}

#[test]
fn print_import_graph() {
    for (m, deps) in graph() {
        let deps: Vec<_> = deps.into_iter().collect();
        println!(
            "{m} (layer {}) -> {}",
            rank(&m).unwrap_or(99),
            deps.join(", ")
        );
    }
}
