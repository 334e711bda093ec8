//! Tests of the state machine and of the rule that keeps it in one place.

use std::path::{Path, PathBuf};

use super::*;

#[test]
fn completed_never_goes_back() {
    for to in State::ALL {
        let ok = State::Completed.can_transition_to(to);
        // COMPLETED → COMPLETED records an audited forced replay; the state never goes back.
        assert_eq!(
            ok,
            matches!(to, State::Compensated | State::Completed),
            "COMPLETED → {to}"
        );
    }
}

#[test]
fn state_names_round_trip() {
    for s in State::ALL {
        assert_eq!(s.as_str().parse::<State>().unwrap(), s);
    }
    assert!("nope".parse::<State>().is_err());
}

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the ledger's sources") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `line` holds a quoted state name, in any case.
fn spells_a_state(line: &str) -> bool {
    let upper = line.to_ascii_uppercase();
    State::ALL
        .iter()
        .any(|s| upper.contains(&format!("'{}'", s.as_str())))
}

#[test]
fn the_scan_sees_a_spelled_state() {
    let spelled = format!("WHERE state = '{}'", State::Completed.as_str());
    assert!(spells_a_state(&spelled));
    assert!(spells_a_state(&spelled.to_lowercase()));
    assert!(!spells_a_state("WHERE state = ?"));
    assert!(!spells_a_state("error_kind = 'lease-expired'"));
}

/// No SQL text in the ledger spells a state name: states are bound from
/// [`State`] ([`State::as_str`]), so a renamed or added state can't leave a
/// statement behind. Scans every source file of the ledger (string
/// literals, and comments too) for a state name in single quotes, as SQL
/// would spell it, in any case; `migrations/` is outside it.
#[test]
fn no_source_spells_a_quoted_state_name() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ledger");
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("command/executor.rs")),
        "the scan found the ledger's sources under {}",
        root.display()
    );
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a ledger source file");
        for (n, line) in text.lines().enumerate() {
            if spells_a_state(line) {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "bind states with State::as_str() instead of spelling them:\n{}",
        found.join("\n")
    );
}
