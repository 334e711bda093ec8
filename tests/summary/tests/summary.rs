//! Runs last in `cargo test --workspace` and prints how many tests of the
//! run were skipped for lack of a component, and how to provide each.

use std::io::Write;
use std::path::Path;

#[test]
fn skipped_tests_of_this_run() {
    let text = test_summary::skips::summary_text(&test_summary::skips::summary());
    if !text.is_empty() {
        // Past the harness's output capture: the summary is the point.
        let _ = write!(std::io::stderr().lock(), "\n{text}\n");
    }
}

/// Cargo runs the packages' tests in name order: the summary is last only
/// while no other workspace member's name sorts after this one's.
#[test]
fn no_workspace_member_sorts_after_this_package() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("the workspace lists its members on one line");
    let me = env!("CARGO_PKG_NAME");
    let mut checked = 0;
    for member in members.split('"').skip(1).step_by(2) {
        let toml = std::fs::read_to_string(root.join(member).join("Cargo.toml")).unwrap();
        let name = toml
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = \""))
            .and_then(|r| r.split('"').next())
            .unwrap_or_else(|| panic!("{member}/Cargo.toml names its package"));
        assert!(
            name <= me,
            "workspace member {name:?} sorts after {me:?}: its tests would run after the skip summary"
        );
        checked += 1;
    }
    assert!(checked >= 5, "read {checked} members");
}
