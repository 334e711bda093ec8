//! `cargo run --release -p quickstart`: the demo provider and the gateway
//! in one process, with `examples/quickstart.toml`.
//!
//! It builds the amount-threshold policy the config binds when it is
//! missing, starts the demo provider on 127.0.0.1:9090 and the gateway on
//! the config's listeners, prints where each listens and the first call to
//! try, and stops both on Ctrl-C (SIGHUP reloads the config, as with
//! `effectgate serve`).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::Context;
use clap::Parser;

/// Where the demo provider listens: the quickstart config's upstream.
const PROVIDER_ADDR: &str = "127.0.0.1:9090";

/// The policy module `examples/quickstart.toml` binds, relative to the
/// repository root.
const POLICY: &str = "policies/target/wasm32-wasip2/release/amount_threshold.wasm";

/// The demo provider and effectgate in one process; Ctrl-C stops both.
#[derive(Debug, Parser)]
#[command(name = "quickstart", about)]
struct Args {
    /// Start with an empty ledger (deletes the config's SQLite ledger
    /// file first). The demo provider always starts empty.
    #[arg(long)]
    fresh: bool,
    /// The config file (default: examples/quickstart.toml of this
    /// repository).
    #[arg(long)]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let root = repo_root();
    let config = args
        .config
        .clone()
        .unwrap_or_else(|| root.join("examples/quickstart.toml"));
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "effectgate=info,warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = build_policy_if_missing(&root) {
        eprintln!("error: {e:#}");
        return ExitCode::FAILURE;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&root, &config, args.fresh)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The repository this binary was built from.
fn repo_root() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    dir.canonicalize().unwrap_or(dir)
}

/// Builds the policy components (for wasm32-wasip2, into
/// `policies/target`, where the quickstart config looks) unless the
/// amount-threshold module is there already.
fn build_policy_if_missing(root: &Path) -> anyhow::Result<()> {
    if root.join(POLICY).exists() {
        return Ok(());
    }
    let manifest = root.join("policies/Cargo.toml");
    let build = format!(
        "cargo build --manifest-path {} --target wasm32-wasip2 --release --target-dir {}",
        manifest.display(),
        root.join("policies/target").display()
    );
    eprintln!(
        "quickstart: {POLICY} is missing; building the policy components once (about a minute):\n  rustup target add wasm32-wasip2\n  {build}"
    );
    // Only rustup-managed toolchains need (and have) the target added.
    if let Ok(status) = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip2"])
        .status()
        && !status.success()
    {
        anyhow::bail!(
            "`rustup target add wasm32-wasip2` failed; run it, then the quickstart again"
        );
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--target", "wasm32-wasip2", "--release"])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(root.join("policies/target"))
        // The policies are their own workspace with their own target dir.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .status()
        .context("cannot run cargo to build the policy components")?;
    if !status.success() || !root.join(POLICY).exists() {
        anyhow::bail!("building the policy components failed; the command was:\n  {build}");
    }
    Ok(())
}

async fn run(root: &Path, config: &Path, fresh: bool) -> anyhow::Result<()> {
    let settings = effectgate::config::load(Some(config))?;
    if fresh && let Ok(effectgate::config::Backend::Sqlite(db)) = settings.storage.backend() {
        // The `.lock` beside them stays: a gateway still running on this
        // ledger holds a lock on that file, and a new file would let a
        // second one in.
        for suffix in ["", "-wal", "-shm"] {
            let mut p = db.clone().into_os_string();
            p.push(suffix);
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => anyhow::bail!("cannot remove {}: {e}", PathBuf::from(p).display()),
            }
        }
    }
    let in_use = |what: &str, addr: &str| {
        format!(
            "cannot listen on {addr} for {what} (is an earlier quickstart, mock-provider or effectgate still running? `ss -ltnp` shows who holds it)"
        )
    };
    let provider = mock_provider::spawn(PROVIDER_ADDR.parse()?)
        .await
        .with_context(|| in_use("the demo provider", PROVIDER_ADDR))?;
    let (proxy, admin) = (settings.proxy_addr, settings.admin_addr);
    let ledger = settings.storage.display_name();
    let gateway = effectgate::Gateway::start(settings)
        .await
        .with_context(|| in_use("the gateway", &format!("{proxy} or {admin}")))?;
    let shown = |p: &Path| {
        p.strip_prefix(root)
            .map(Path::to_path_buf)
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string()
    };
    let proxy_url = format!("http://{}", gateway.proxy_addr);
    println!(
        "\
effectgate quickstart
  demo provider  http://{provider}   (GET /stats counts the effects it applied)
  gateway proxy  {proxy_url}   (route /pay/ -> the demo provider)
  gateway admin  http://{admin}   (admin API, /console, /metrics)
  config         {config}
  ledger         {ledger}{kept}

Try, in another terminal:
  curl -i -X POST {proxy_url}/pay/v1/charges \\
    -H 'Authorization: Bearer demo-client-key' -H 'Idempotency-Key: k1' \\
    -H 'Content-Type: application/json' -d '{{\"amount\":100}}'
then the walk-through in README.md. Ctrl-C stops both.
",
        provider = provider.addr,
        admin = gateway.admin_addr,
        config = shown(config),
        kept = if fresh {
            ""
        } else {
            " (kept across runs; --fresh starts an empty one)"
        },
    );
    gateway.run_until_signal().await?;
    drop(provider);
    println!("quickstart: the gateway and the demo provider stopped");
    Ok(())
}
