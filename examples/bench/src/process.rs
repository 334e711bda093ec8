//! `effectgate serve` processes of the bench's own, in front of its mock
//! provider: scenarios (m) and (t) measure a gateway as users run it,
//! apart from the bench process (which holds the client and the mock
//! provider). The binary is `$BENCH_EFFECTGATE_BIN`, else `effectgate` next to
//! the bench's binary (`cargo build --release -p bench -p effectgate`).
//! Not `EFFECTGATE_BIN`: every `EFFECTGATE_…` variable is a setting of the
//! gateway's configuration, read by the bench's in-process gateways and by
//! the processes it starts, which refuse one they don't know.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running gateway process with its config and ledger in a temp folder;
/// killed when dropped.
pub struct GatewayProcess {
    child: Child,
    /// Port of the proxy listener (loopback).
    pub proxy: u16,
    _dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time the process has used so far, user and system, all its
    /// threads (`/proc/<pid>/stat`, in clock ticks of 10 ms), ms.
    pub fn cpu_ms(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // Fields after the command name (which may hold spaces), from
        // `state` (field 3) on: utime is field 14, stime field 15.
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(ticks as f64 * 10.0)
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The gateway binary, if there is one.
pub fn binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BENCH_EFFECTGATE_BIN") {
        return Some(PathBuf::from(p));
    }
    let p = std::env::current_exe().ok()?.parent()?.join("effectgate");
    p.exists().then_some(p)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Whether `GET /readyz` on `port` answers 200.
fn ready(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// Starts `bin serve` with `[listen]` and `[storage]` of its own and the
/// rest of the config from `rest` (tenants, routes), its environment
/// without `RUST_LOG` and `OTEL_*` but for `env`, stdout and stderr to
/// `/dev/null`; returns once `/readyz` answers 200 (at most 20 s).
///
/// Errors: the process can't start, exits, or isn't ready in time.
pub async fn spawn(
    bin: &std::path::Path,
    rest: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<GatewayProcess> {
    let dir = tempfile::tempdir()?;
    let (proxy, admin) = (free_port()?, free_port()?);
    let cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            "[listen]\nproxy = \"127.0.0.1:{proxy}\"\nadmin = \"127.0.0.1:{admin}\"\n{rest}",
            rest = rest.replace("{db}", &dir.path().join("ledger.db").display().to_string())
        ),
    )?;
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config"]).arg(&cfg);
    for (k, _) in std::env::vars() {
        if k == "RUST_LOG" || k.starts_with("OTEL_") || k.starts_with("EFFECTGATE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let mut gw = GatewayProcess {
        child,
        proxy,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready(admin) {
        if gw.child.try_wait()?.is_some() || Instant::now() > deadline {
            anyhow::bail!("{} did not become ready", bin.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(gw)
}
