//! The skip summary of a `cargo test --workspace` run: the tests that
//! could not run for lack of a component (PostgreSQL, Python with an SDK,
//! Chromium) record themselves through [`skips::skip`]; this package's
//! test prints their total last.

#[path = "../../src/skips.rs"]
pub mod skips;
