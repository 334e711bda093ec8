//! Helpers shared by the suites that run `effectgate serve` as a child
//! process (crash, webhook crash, multi-instance).
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Skips for lack of a component, shared with the `tests` package.
#[path = "../../../tests/src/skips.rs"]
pub mod skips;

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The hex sha256 of an API key, as configs store it.
pub fn sha(k: &str) -> String {
    effectgate::config::key_digest(k)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One gateway process; a failing assertion never leaves it behind.
pub struct Gw {
    /// The process.
    pub child: Child,
    /// Proxy port.
    pub proxy: u16,
    /// Admin port.
    pub admin: u16,
}

impl Drop for Gw {
    fn drop(&mut self) {
        // A stopped (SIGSTOP) process must be continued to die; one that
        // was already killed and reaped is left alone.
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.child.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `effectgate serve` with the config file `config(proxy, admin)`
/// writes, with `env` set, and waits (at most 20 s) until its `/readyz`
/// answers 200. A port picked free can be taken before the gateway binds
/// it (an outgoing connection gets it): then the gateway exits and is
/// started again on other ports, up to five times. Its stderr goes to
/// `log` when given, and is shown if it exits before it is ready.
pub async fn spawn_gateway(
    config: impl Fn(u16, u16) -> PathBuf,
    env: &[(&str, &str)],
    log: Option<&Path>,
) -> Gw {
    let http = reqwest::Client::new();
    for _ in 0..5 {
        let (proxy, admin) = (free_port(), free_port());
        let cfg = config(proxy, admin);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_effectgate"));
        cmd.args(["serve", "--config"])
            .arg(&cfg)
            .env_remove("FAILPOINTS")
            .stdout(Stdio::null())
            .stderr(match log {
                Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
                None => Stdio::null(),
            });
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut gw = Gw {
            child: cmd.spawn().unwrap(),
            proxy,
            admin,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = http
                .get(format!("http://127.0.0.1:{admin}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            // Ready, and it is ours: the child still runs.
            let exited = gw.child.try_wait().unwrap().is_some();
            if ready && !exited {
                return gw;
            }
            if exited {
                let text = log
                    .and_then(|p| std::fs::read_to_string(p).ok())
                    .unwrap_or_default();
                eprintln!("gateway exited before it was ready; starting it again\n{text}");
                break;
            }
            assert!(Instant::now() < deadline, "gateway did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    panic!("the gateway exited before it was ready, five times");
}

/// `TEST_POSTGRES_URL`, or `None`: the calling test is skipped
/// ([`skips::skip`] names PostgreSQL and how to provide it once per test
/// binary; under `CI` it fails instead).
pub fn pg_url() -> Option<String> {
    match std::env::var("TEST_POSTGRES_URL") {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            skips::skip(
                "PostgreSQL",
                "set TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/DB (a database the tests may create schemas in; .ci/run starts a server and sets it)",
            );
            None
        }
    }
}

/// Fails the test with `out`'s stderr unless the command succeeded.
pub fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A schema name nobody has used: `eg_<16 hex digits>`.
pub fn fresh_schema() -> String {
    format!("eg_{:016x}", rand::random::<u64>())
}
