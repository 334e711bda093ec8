//! The gateway processes: `effectgate serve` children on loopback ports,
//! killed with SIGKILL and restarted, paused with SIGSTOP and continued.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// Timing of the gateways' config (ms).
pub const LEASE_MS: u64 = 1_500;
/// The route's response timeout (ms).
pub const RESPONSE_TIMEOUT_MS: u64 = 800;
/// The read-back settle delay (ms): longer than the provider's lag.
pub const SETTLE_MS: u64 = 1_200;
/// The bound on a clock step and on a gateway's clock offset (ms): three
/// leases, past the lease and the settle delay either way.
pub const CLOCK_BOUND_MS: i64 = 3 * LEASE_MS as i64;

/// Where a gateway keeps its ledger.
#[derive(Debug, Clone)]
pub enum Store {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL URL (through this gateway's relay) and the schema.
    Postgres { url: String, schema: String },
}

/// One gateway process.
pub struct Gateway {
    /// Its index.
    pub index: usize,
    child: Option<Child>,
    /// Its proxy port (clients read it; it changes if a restart needs new ports).
    pub proxy: Arc<AtomicU16>,
    /// Its admin port.
    pub admin: u16,
    bin: PathBuf,
    dir: PathBuf,
    store: Store,
    provider: String,
    keys: Vec<(String, String, String)>,
    /// Whether it is stopped (SIGSTOP).
    pub paused: bool,
    /// How far its ledger clock was stepped from the system clock (ms);
    /// a new process starts at 0.
    pub clock_offset_ms: i64,
}

fn free_port() -> u16 {
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

impl Gateway {
    /// Starts gateway `index` and waits until it is ready. `keys` are
    /// (tenant, client key, admin key).
    pub async fn start(
        index: usize,
        bin: &Path,
        dir: &Path,
        store: Store,
        provider: &str,
        keys: &[(String, String, String)],
    ) -> anyhow::Result<Gateway> {
        let mut g = Gateway {
            index,
            child: None,
            proxy: Arc::new(AtomicU16::new(free_port())),
            admin: free_port(),
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            store,
            provider: provider.to_owned(),
            keys: keys.to_vec(),
            paused: false,
            clock_offset_ms: 0,
        };
        g.spawn().await?;
        Ok(g)
    }

    fn config(&self) -> String {
        let storage = match &self.store {
            Store::Sqlite(p) => format!("path = \"{}\"\nbusy_timeout_ms = 5000", p.display()),
            Store::Postgres { url, schema } => format!(
                "url = \"{url}\"\nschema = \"{schema}\"\nmax_connections = 8\nacquire_timeout_ms = 2000\ncall_timeout_ms = 3000\nstatement_timeout_ms = 3000"
            ),
        };
        let mut tenants = String::new();
        for (t, k, a) in &self.keys {
            tenants.push_str(&format!(
                "[[tenants]]\nid = \"{t}\"\nkeys = [{{ role = \"client\", sha256 = \"{}\" }}, {{ role = \"admin\", sha256 = \"{}\" }}]\n",
                sha(k),
                sha(a)
            ));
        }
        format!(
            r#"
[listen]
proxy = "127.0.0.1:{proxy}"
admin = "127.0.0.1:{admin}"
[storage]
{storage}
[limits]
lease_ms = {LEASE_MS}
[reconcile]
interval_ms = 100
reserved_grace_ms = 1000
duplicate_wait_ms = 1500
lease_ms = 3000
max_read_backs = 1000
backoff_base_ms = 50
backoff_max_ms = 200
{tenants}
[[routes]]
name = "pay"
prefix = "/pay/"
upstream = "{provider}"
effectful_methods = ["POST"]
effect_class = "payment"
provider_idempotency_header = "X-Provider-Key"
response_timeout_ms = {RESPONSE_TIMEOUT_MS}
tenant_scoped_field = "/metadata/tenant"
retry = {{ max_attempts = 3, base_delay_ms = 20, max_delay_ms = 100, max_wait_ms = 2500 }}
[routes.read_back]
path = "/v1/charges?key={{provider_key}}"
found_pointer = "/data/0"
reference_pointer = "/id"
settle_delay_ms = {SETTLE_MS}
timeout_ms = 1000
"#,
            proxy = self.proxy.load(Ordering::SeqCst),
            admin = self.admin,
            provider = self.provider,
        )
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        // A start fails while the database is cut off (the relay refuses
        // it) or a port was taken meanwhile: wait, new ports, again.
        for _ in 0..40 {
            let cfg = self.dir.join(format!("gw{}.toml", self.index));
            std::fs::write(&cfg, self.config())?;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(format!("gw{}.log", self.index)))?;
            let child = Command::new(&self.bin)
                .args(["serve", "--config"])
                .arg(&cfg)
                .env("RUST_LOG", "warn")
                .env_remove("FAILPOINTS")
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .spawn()
                .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", self.bin.display()))?;
            self.child = Some(child);
            self.clock_offset_ms = 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let ready = http
                    .get(format!("http://127.0.0.1:{}/readyz", self.admin))
                    .timeout(Duration::from_secs(1))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                let exited = self.child.as_mut().unwrap().try_wait()?.is_some();
                if ready && !exited {
                    return Ok(());
                }
                if exited {
                    self.child = None;
                    self.proxy.store(free_port(), Ordering::SeqCst);
                    self.admin = free_port();
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    break;
                }
                if Instant::now() > deadline {
                    anyhow::bail!("gateway {} did not become ready", self.index);
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        anyhow::bail!(
            "gateway {} exited before it was ready, five times",
            self.index
        )
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// SIGKILL, reaped.
    pub fn kill(&mut self) {
        if self.paused {
            self.resume();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on its ports (new ones if they were taken).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }

    /// Whether it is running (started, and not exited).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Steps its ledger clock by `ms` (negative: back) through
    /// `POST /admin/clock/step` (a gateway built with the `failpoints`
    /// feature) and returns the HTTP status; on 200 the offset is kept.
    pub async fn step_clock(&mut self, ms: i64) -> anyhow::Result<u16> {
        let admin_key = &self.keys[0].2;
        let r = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/admin/clock/step", self.admin))
            .bearer_auth(admin_key)
            .json(&serde_json::json!({ "ms": ms }))
            .timeout(Duration::from_secs(2))
            .send()
            .await?;
        let status = r.status().as_u16();
        if status == 200 {
            self.clock_offset_ms += ms;
        }
        Ok(status)
    }

    /// SIGSTOP.
    pub fn pause(&mut self) {
        self.signal("-STOP");
        self.paused = true;
    }

    /// SIGCONT.
    pub fn resume(&mut self) {
        self.signal("-CONT");
        self.paused = false;
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}
