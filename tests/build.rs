//! Builds the policy components (`policies/`) for wasm32-wasip2 with their
//! own target directory, so the integration tests can load them. Exposes
//! their folder as `POLICY_WASM_DIR` at compile time.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let policies = manifest_dir.join("../policies");
    for p in [
        "Cargo.toml",
        "sdk",
        "amount-threshold",
        "replay-matrix",
        "retry-classifier",
        "allow-list",
        "testing",
    ] {
        println!("cargo:rerun-if-changed={}", policies.join(p).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        manifest_dir.join("../wit").display()
    );
    let target_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("policies-target");
    // The one extra piece a fresh clone needs; idempotent and quick when present.
    if let Ok(status) = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip2"])
        .status()
        && !status.success()
    {
        println!("cargo:warning=rustup could not add the wasm32-wasip2 target");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(policies.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .status()
        .expect("run cargo for the policy components");
    assert!(
        status.success(),
        "building the policy components failed; is the target installed? (rustup target add wasm32-wasip2)"
    );
    println!(
        "cargo:rustc-env=POLICY_WASM_DIR={}",
        target_dir.join("wasm32-wasip2/release").display()
    );
}
