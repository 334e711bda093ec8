//! Crash points for the failure-injection suite.
//!
//! Built only with the `failpoints` cargo feature (the test suite enables
//! it; release builds of the binary don't). A point configured with the
//! `fail` crate's `return` action, e.g.
//! `FAILPOINTS="before-record=return"`, kills the process with SIGKILL
//! right there: no destructors, no flushing, exactly like `kill -9`.
//!
//! Other actions work too: `before-send=sleep(1500)` stalls the attempt
//! (blocking its thread) after the claim, before anything is sent.
//!
//! Points: `after-claim` (a new operation was reserved and claimed in one
//! commit: EXECUTING under its first lease, nothing sent), `after-reserve`
//! (a compensation is RESERVED, nothing sent),
//! `before-send` (claimed, about to renew the lease if needed and send),
//! `before-record` (the provider answered, the ledger has not recorded it),
//! `after-record` (recorded, the caller not yet answered),
//! `before-outcome-commit` (an outcome and its operation event written,
//! the transaction not yet committed), `before-inbox-commit` (a webhook
//! event, its delivery and its resolution of the operation it names
//! written, the transaction not yet committed), `after-inbox-commit`
//! (committed, the provider not yet answered), `before-deliver` (the
//! relay holds an outbox event, about to POST it); [`crash`] adds the
//! group commit's `batch-before-commit` and `batch-after-commit`.
//!
//! The feature also adds the admin endpoint `POST /admin/clock/step`
//! (`http::admin`, `ops::operator::step_clock`): a running gateway's
//! ledger clock stepped forward or back, for the chaos soak.

/// Kills this process with SIGKILL at crash point `name`.
#[cfg(feature = "failpoints")]
#[allow(unsafe_code)] // the crash itself: kill(2) on this process
fn die(name: &str) {
    tracing::warn!(point = name, "crash point reached: SIGKILL");
    // SAFETY: getpid and kill have no preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// Passes crash point `name`.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    fail::fail_point!(name, |_| die(name));
}

/// Passes crash point `name` (a no-op without the `failpoints` feature).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}

/// Kills the process with SIGKILL at crash point `name`, for a point
/// whose condition the caller checked itself (the group commit's
/// `batch-before-commit` and `batch-after-commit`, configured as
/// `return(<prefix>)` like `ledger-commit-fail`: the process dies at a
/// batch of two or more writes holding a new operation whose id starts
/// with the prefix, before its `COMMIT` / after it and before any write of
/// it is answered). A no-op without the `failpoints` feature.
pub fn crash(name: &str) {
    #[cfg(feature = "failpoints")]
    die(name);
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Whether failure injection `name` is on with a `return(<prefix>)`
/// whose prefix starts `key` (always false without the `failpoints`
/// feature). Point: `ledger-commit-fail` (the batch holding a write of an
/// operation id with that prefix fails its `COMMIT`).
#[cfg(feature = "failpoints")]
pub fn names(name: &str, key: &str) -> bool {
    fail::fail_point!(name, |prefix: Option<String>| prefix
        .is_some_and(|p| key.starts_with(p.as_str())));
    false
}

/// Whether failure injection `name` names `key` (always false without
/// the `failpoints` feature).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn names(_name: &str, _key: &str) -> bool {
    false
}

/// Reads `FAILPOINTS` from the environment (binary start-up).
pub fn setup() {
    #[cfg(feature = "failpoints")]
    std::mem::forget(fail::FailScenario::setup());
}
