//! Tests that can't run for lack of a component (PostgreSQL, Python with
//! an SDK, Chromium) and the summary of them at the end of a run.
//!
//! A test that lacks a component calls [`skip`]: under `CI` that fails the
//! test; otherwise the test binary writes one line to the real stderr
//! (past the harness's output capture, once per component and binary)
//! naming the component and how to provide it, records the skip in a file
//! of the current `cargo test` run, and the test returns (it counts as
//! passed).
//!
//! The run is identified by the parent process (the `cargo` that spawns
//! every test binary of one `cargo test`): its pid and start time name a
//! folder under the system temp dir. The `test-summary` package, whose
//! name sorts after every other member so that cargo runs its tests last,
//! reads that folder with [`summary`] and prints the total.
//!
//! This file has no dependencies beyond `std`: the gateway's own process
//! suites include it too (`gateway/tests/common`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

/// The folder of the current run's skip records, or `None` when the
/// parent process can't be identified.
fn run_dir() -> Option<PathBuf> {
    let ppid = std::os::unix::process::parent_id();
    // Field 22 of /proc/<pid>/stat is the start time: with the pid it
    // tells one `cargo test` from a later one that got the same pid.
    let stat = std::fs::read_to_string(format!("/proc/{ppid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    let start = after_name.split_whitespace().nth(19)?;
    Some(root().join(format!("{ppid}-{start}")))
}

fn root() -> PathBuf {
    std::env::temp_dir().join("effectgate-test-skips")
}

/// Records that the calling test can't run because `component` is
/// missing, and says so once per component on the real stderr; `how`
/// tells how to provide it. Under `CI` it panics instead: there every
/// component must be present.
pub fn skip(component: &str, how: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "CI: {component} is missing: {how}"
    );
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let first = {
        let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
        let first = !said.iter().any(|c| c == component);
        if first {
            said.push(component.to_owned());
        }
        first
    };
    if first {
        let exe = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let suite = exe.rsplit_once('-').map_or(exe.as_str(), |(name, _)| name);
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED ({suite}): tests that need {component}; {how}"
        );
    }
    if let Some(dir) = run_dir()
        && std::fs::create_dir_all(&dir).is_ok()
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{}.skips", std::process::id())))
    {
        let line = format!("{component}\t{how}\n").replace(['\r'], " ");
        let _ = f.write_all(line.as_bytes());
    }
}

/// The skips recorded in the current run so far: component → (count, how
/// to provide it). The records are removed, as are those of runs whose
/// `cargo` has ended.
pub fn summary() -> BTreeMap<String, (usize, String)> {
    let mut out: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let Some(dir) = run_dir() else { return out };
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            for line in text.lines() {
                if let Some((component, how)) = line.split_once('\t') {
                    let entry = out
                        .entry(component.to_owned())
                        .or_insert_with(|| (0, how.to_owned()));
                    entry.0 += 1;
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Runs that ended without a summary (a single package tested, a
    // failure) leave their folder: drop those whose `cargo` is gone.
    if let Ok(entries) = std::fs::read_dir(root()) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.split('-').next().unwrap_or_default();
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    out
}

/// The summary as text: `SKIPPED: N tests …` and one line per component;
/// empty when nothing was skipped.
pub fn summary_text(skips: &BTreeMap<String, (usize, String)>) -> String {
    let total: usize = skips.values().map(|(n, _)| n).sum();
    if total == 0 {
        return String::new();
    }
    let mut s = format!(
        "SKIPPED: {total} test{} did not run for lack of a component (counted as passed above):\n",
        if total == 1 { "" } else { "s" }
    );
    for (component, (n, how)) in skips {
        s.push_str(&format!("  {n:>3} need {component}: {how}\n"));
    }
    s.push_str("  .ci/run provides all of them (see \"Tests\" in README.md).\n");
    s
}
