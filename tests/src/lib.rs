//! Integration harness: a mock provider and an effectgate instance on port
//! 0, with a SQLite ledger in a temporary directory.

use std::path::PathBuf;
use std::sync::{Arc, Once};

use effectgate::Gateway;
use effectgate::config::{self, Settings};
use effectgate::ledger::{Clock, SystemClock};
use mock_provider::MockProvider;

pub mod connect_proxy;
pub mod pki;
pub mod receiver;
pub mod skips;

/// Path of a built policy component, e.g. `policy_wasm("amount_threshold")`.
pub fn policy_wasm(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("POLICY_WASM_DIR")).join(format!("{name}.wasm"))
}

/// A JavaScript or Python policy component, which `cargo test` does not
/// build: `file` in the folder named by the environment variable `var`
/// (`.ci/run` builds the components and sets it), else in `default_dir`
/// (relative to the repository: where the example's own build writes it).
/// Without the file the test is skipped ([`skips::skip`]; under `CI` it
/// fails instead) and this returns `None`.
pub fn lang_policy_wasm(var: &str, default_dir: &str, file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(default_dir)
    });
    let path = dir.join(file);
    if path.is_file() {
        return Some(path);
    }
    skips::skip(
        &format!("the policy component {file}"),
        &format!(
            "build it as {default_dir}/README.md says and set {var} to its folder (.ci/run does both)"
        ),
    );
    None
}

/// Client key of tenant `a`.
pub const KEY_A: &str = "test-client-key-a";
/// Admin key of tenant `a`.
pub const ADMIN_A: &str = "test-admin-key-a";
/// Approver key of tenant `a`.
pub const APPROVER_A: &str = "test-approver-key-a";
/// Operator key of tenant `a`.
pub const OPERATOR_A: &str = "test-operator-key-a";
/// An approver key of tenant `a` whose principal has the client's name (self-approval).
pub const SELF_APPROVER_A: &str = "test-self-approver-key-a";
/// Approver key of tenant `b`.
pub const APPROVER_B: &str = "test-approver-key-b";
/// Client key of tenant `b`.
pub const KEY_B: &str = "test-client-key-b";
/// Admin key of tenant `b`.
pub const ADMIN_B: &str = "test-admin-key-b";
/// The provider secret injected by the `/pay/` route.
pub const PROVIDER_SECRET: &str = "sk_test_provider_secret";

fn hash(k: &str) -> String {
    hex(&config::key_digest(k))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

static ENV: Once = Once::new();

/// The standard test config: tenants `a` and `b`, route `/pay/` → the mock
/// provider, effectful for POST, provider idempotency header
/// `Idempotency-Key`, credential injected from `MOCK_PROVIDER_SECRET`.
/// `route_extra` is appended to the route table (TOML lines).
pub fn config_toml(provider_url: &str, db: &std::path::Path, route_extra: &str) -> String {
    config_toml_with(provider_url, db, route_extra, "", "")
}

/// [`config_toml`] with extra lines inside tenants `a` and `b`.
pub fn config_toml_with(
    provider_url: &str,
    db: &std::path::Path,
    route_extra: &str,
    tenant_a: &str,
    tenant_b: &str,
) -> String {
    format!(
        r#"
[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"

[storage]
path = "{db}"

[[tenants]]
id = "a"
keys = [{{ role = "client", sha256 = "{ka}" }}, {{ role = "admin", sha256 = "{aa}" }},
        {{ role = "approver", sha256 = "{pa}" }}, {{ role = "operator", sha256 = "{oa}" }},
        {{ role = "approver", name = "a:client", sha256 = "{sa}" }}]
{tenant_a}

[[tenants]]
id = "b"
keys = [{{ role = "client", sha256 = "{kb}" }}, {{ role = "admin", sha256 = "{ab}" }}, {{ role = "approver", sha256 = "{pb}" }}]
{tenant_b}

[[routes]]
name = "payments"
prefix = "/pay/"
upstream = "{provider_url}"
effectful_methods = ["POST"]
provider_idempotency_header = "Idempotency-Key"
max_body_bytes = 4096
response_timeout_ms = 3000
inject_headers = [{{ name = "Authorization", value_env = "MOCK_PROVIDER_SECRET", prefix = "Bearer " }}]
{route_extra}
"#,
        db = db.display(),
        ka = hash(KEY_A),
        aa = hash(ADMIN_A),
        kb = hash(KEY_B),
        ab = hash(ADMIN_B),
        pa = hash(APPROVER_A),
        oa = hash(OPERATOR_A),
        sa = hash(SELF_APPROVER_A),
        pb = hash(APPROVER_B),
    )
}

/// The paths (`policy_decisions[0].at`) of the times in `v` shown in ms
/// since the epoch alone: a number under `at`, a name ending in `_at`,
/// `since`, `held_until` or `settle_until`, with no `<name>_rfc3339`
/// beside it. Request and response bodies are the caller's and not looked
/// into.
pub fn times_without_rfc3339(v: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, &format!("{path}[{i}]"), out);
                }
            }
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    let at = if path.is_empty() {
                        key.clone()
                    } else {
                        format!("{path}.{key}")
                    };
                    if key.ends_with("_body") {
                        continue;
                    }
                    let time = key == "at"
                        || key.ends_with("_at")
                        || ["since", "held_until", "settle_until"].contains(&key.as_str());
                    if time && value.is_number() && !map.contains_key(&format!("{key}_rfc3339")) {
                        out.push(at.clone());
                    }
                    walk(value, &at, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, "", &mut out);
    out
}

/// The sum of the counter `name` over its series whose labels include
/// every one of `labels` (`kind="busy"`), in Prometheus text.
pub fn counter(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Parses a config from TOML text (plus `EFFECTGATE_*` env, as in production).
pub fn settings_from(toml: &str, dir: &std::path::Path) -> Settings {
    ENV.call_once(|| {
        // SAFETY: set once, before any gateway reads the environment.
        unsafe { std::env::set_var("MOCK_PROVIDER_SECRET", PROVIDER_SECRET) };
    });
    let p = dir.join(format!("config-{}.toml", rand_suffix()));
    std::fs::write(&p, toml).unwrap();
    config::load(Some(&p)).unwrap_or_else(|e| panic!("config: {e}\n{toml}"))
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A gateway in front of a mock provider.
pub struct TestApp {
    /// The gateway.
    pub gw: Gateway,
    /// The provider.
    pub mock: MockProvider,
    /// Temporary directory holding the ledger.
    pub dir: tempfile::TempDir,
    /// Ledger path.
    pub db: PathBuf,
    /// HTTP client.
    pub http: reqwest::Client,
    toml: String,
}

/// Builder options for [`spawn_app`].
#[derive(Default)]
pub struct Opts {
    /// Extra TOML lines for the `/pay/` route.
    pub route_extra: String,
    /// Extra TOML appended after the route (more routes); `$MOCK_URL` in
    /// it is replaced by the mock provider's URL.
    pub more: String,
    /// Extra TOML lines inside tenant `a` (e.g. its policies).
    pub tenant_a: String,
    /// Extra TOML lines inside tenant `b`.
    pub tenant_b: String,
    /// Clock to run the gateway with.
    pub clock: Option<Arc<dyn Clock>>,
    /// `[storage]` to use instead of the temporary SQLite file.
    pub storage: Option<config::StorageSpec>,
    /// Serve the mock provider over TLS with these settings (its URL is
    /// then `https://localhost:PORT`).
    pub mock_tls: Option<mock_provider::TlsOptions>,
    /// Extra TOML lines inside `[listen]` (e.g. `proxy_tls = {…}`).
    pub listen_extra: String,
}

/// Spawns a mock provider and a gateway in front of it.
pub async fn spawn_app() -> TestApp {
    spawn_with(Opts::default()).await
}

/// [`spawn_app`] with options.
pub async fn spawn_with(opts: Opts) -> TestApp {
    let mock = match &opts.mock_tls {
        None => mock_provider::spawn("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap(),
        Some(tls) => mock_provider::spawn_tls("127.0.0.1:0".parse().unwrap(), tls)
            .await
            .unwrap(),
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let toml = format!(
        "{}\n{}",
        config_toml_with(
            &mock.url(),
            &db,
            &opts.route_extra,
            &opts.tenant_a,
            &opts.tenant_b
        )
        .replacen(
            "admin = \"127.0.0.1:0\"\n",
            &format!("admin = \"127.0.0.1:0\"\n{}\n", opts.listen_extra),
            1
        ),
        opts.more.replace("$MOCK_URL", &mock.url())
    );
    let mut settings = settings_from(&toml, dir.path());
    if let Some(storage) = opts.storage {
        settings.storage = storage;
    }
    let clock = opts.clock.unwrap_or_else(|| Arc::new(SystemClock));
    let gw = Gateway::start_with_clock(settings, clock).await.unwrap();
    TestApp {
        gw,
        mock,
        dir,
        db,
        http: reqwest::Client::new(),
        toml,
    }
}

impl TestApp {
    /// `http://proxy/<path>`.
    pub fn proxy(&self, path: &str) -> String {
        format!("http://{}{}", self.gw.proxy_addr, path)
    }
    /// `http://admin/<path>`.
    pub fn admin(&self, path: &str) -> String {
        format!("http://{}{}", self.gw.admin_addr, path)
    }
    /// POST a JSON body to `/pay/v1/charges` as tenant `a` with `key`.
    pub async fn charge(&self, key: &str, body: &str) -> reqwest::Response {
        self.charge_as(KEY_A, key, body).await
    }
    /// POST a JSON body to `/pay/v1/charges` with an API key and idempotency key.
    pub async fn charge_as(&self, api_key: &str, key: &str, body: &str) -> reqwest::Response {
        self.http
            .post(self.proxy("/pay/v1/charges"))
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    }
    /// POST a JSON body to `/pay/v1/charges` as tenant `a` with extra headers.
    pub async fn charge_with(
        &self,
        key: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut b = self
            .http
            .post(self.proxy("/pay/v1/charges"))
            .bearer_auth(KEY_A)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(body.to_owned()).send().await.unwrap()
    }
    /// The admin listener's `/metrics` text (Prometheus format).
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.admin("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
    /// One reconciler scan, run here and now.
    pub async fn tick(&self) -> Vec<(String, String, effectgate::ops::reconcile::Step)> {
        effectgate::workers::reconciler::tick(&self.gw.state)
            .await
            .unwrap()
    }
    /// POST JSON to an admin path with `key`.
    pub async fn admin_post(&self, key: &str, path: &str, body: &str) -> reqwest::Response {
        self.http
            .post(self.admin(path))
            .bearer_auth(key)
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    }
    /// Provider requests by method: (POSTs, GETs).
    pub fn provider_calls(&self) -> (usize, usize) {
        let r = self.mock.provider.requests();
        (
            r.iter().filter(|r| r.method == "POST").count(),
            r.iter().filter(|r| r.method == "GET").count(),
        )
    }
    /// GET an operation through the admin API as `admin_key` of `tenant`.
    pub async fn operation(&self, admin_key: &str, tenant: &str, id: &str) -> reqwest::Response {
        self.http
            .get(self.admin(&format!("/admin/tenants/{tenant}/operations/{id}")))
            .bearer_auth(admin_key)
            .send()
            .await
            .unwrap()
    }
    /// The operation's JSON as tenant `a`'s admin (panics unless 200, or
    /// when a time in it has no RFC 3339 form beside it: see
    /// [`times_without_rfc3339`]).
    pub async fn op_json(&self, id: &str) -> serde_json::Value {
        let r = self.operation(ADMIN_A, "a", id).await;
        assert_eq!(r.status(), 200, "operation {id}");
        let v = r.json().await.unwrap();
        let bare = times_without_rfc3339(&v);
        assert!(
            bare.is_empty(),
            "operation {id}: times in ms alone: {bare:?}"
        );
        v
    }
    /// The reason of the operation's last transition, from its JSON
    /// ([`TestApp::op_json`]; panics without transitions).
    pub fn last_reason(op: &serde_json::Value) -> &str {
        op["transitions"]
            .as_array()
            .and_then(|t| t.last())
            .and_then(|t| t["reason"].as_str())
            .expect("an operation with transitions")
    }
    /// Restarts the gateway on the same ledger file (same config).
    pub async fn restart(self) -> TestApp {
        self.restart_with_clock(Arc::new(SystemClock)).await
    }
    /// [`TestApp::restart`] with the gateway on `clock`: nothing of the
    /// old process's memory (its settle windows, its clock step) is kept.
    pub async fn restart_with_clock(self, clock: Arc<dyn Clock>) -> TestApp {
        let TestApp {
            gw,
            mock,
            dir,
            db,
            http,
            toml,
        } = self;
        gw.shutdown().await;
        let settings = settings_from(&toml, dir.path());
        let gw = Gateway::start_with_clock(settings, clock).await.unwrap();
        TestApp {
            gw,
            mock,
            dir,
            db,
            http,
            toml,
        }
    }
}

/// A Python interpreter that has `modules` (for the tests that drive an
/// official client SDK): `TEST_PYTHON`, else `MCP_PYTHON`, else the venv
/// `.ci/run` makes (`~/.cache/effectgate-py`). Without one, the test says
/// it is skipped ([`skips::skip`]) and returns `None`; under `CI` a
/// missing interpreter or module fails the test instead.
pub fn test_python(modules: &[&str]) -> Option<PathBuf> {
    let candidates = ["TEST_PYTHON", "MCP_PYTHON"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .chain(std::iter::once(format!(
            "{}/.cache/effectgate-py/bin/python",
            std::env::var("HOME").unwrap_or_default()
        )));
    for p in candidates {
        let p = PathBuf::from(p);
        if !p.exists() {
            continue;
        }
        let ok = std::process::Command::new(&p)
            .arg("-c")
            .arg(format!("import {}", modules.join(", ")))
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(p);
        }
    }
    skips::skip(
        &format!("Python with {}", modules.join(", ")),
        &format!(
            "set TEST_PYTHON to a python that has them (.ci/run makes ~/.cache/effectgate-py: pip install {})",
            modules.join(" ")
        ),
    );
    None
}

/// Runs `curl` with `args` and returns (exit code, stdout bytes, stderr).
pub async fn curl(args: &[&str]) -> (i32, Vec<u8>, String) {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .output()
        .await
        .expect("curl is installed (.ci/run installs it)");
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// PostgreSQL for the suites that need it: the URL comes from
/// `TEST_POSTGRES_URL`; each test gets a fresh schema.
pub mod pg {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use effectgate::config::StorageSpec;

    /// The variable naming the test database.
    pub const URL_VAR: &str = "TEST_POSTGRES_URL";

    /// The test database URL, or `None`: the calling test is skipped
    /// ([`crate::skips::skip`]; under `CI` it fails instead).
    pub fn url() -> Option<String> {
        match std::env::var(URL_VAR) {
            Ok(u) if !u.is_empty() => Some(u),
            _ => {
                crate::skips::skip("PostgreSQL", HOW);
                None
            }
        }
    }

    /// How to provide the test database.
    pub const HOW: &str = "set TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/DB (a database the tests may create schemas in; .ci/run starts a server and sets it)";

    /// A schema name nobody has used: `eg_<16 hex digits>`.
    pub fn fresh_schema() -> String {
        format!("eg_{:016x}", rand::random::<u64>())
    }

    /// A TCP relay in front of the test database that can be cut (every
    /// connection closed, new ones refused) and restored: the database
    /// "unreachable" without stopping the shared server.
    pub struct Relay {
        /// `TEST_POSTGRES_URL`, pointing at the relay.
        pub url: String,
        down: Arc<AtomicBool>,
        cut: tokio::sync::watch::Sender<u64>,
    }

    impl Relay {
        /// Starts a relay to the database of `url`.
        pub async fn start(url: &str) -> Relay {
            let mut parsed = url::Url::parse(url).unwrap();
            let target = format!(
                "{}:{}",
                parsed.host_str().unwrap_or("127.0.0.1"),
                parsed.port().unwrap_or(5432)
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            parsed.set_host(Some("127.0.0.1")).unwrap();
            parsed.set_port(Some(port)).unwrap();
            let down = Arc::new(AtomicBool::new(false));
            let (cut, _) = tokio::sync::watch::channel(0u64);
            let (d, c) = (down.clone(), cut.clone());
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if d.load(Ordering::SeqCst) {
                        continue; // dropped: the connection is reset
                    }
                    let mut cut = c.subscribe();
                    let target = target.clone();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            });
            Relay {
                url: parsed.to_string(),
                down,
                cut,
            }
        }

        /// Closes every relayed connection and refuses new ones.
        pub fn cut(&self) {
            self.down.store(true, Ordering::SeqCst);
            self.cut.send_modify(|n| *n += 1);
        }

        /// Relays again.
        pub fn restore(&self) {
            self.down.store(false, Ordering::SeqCst);
        }
    }

    /// `[storage]` for `url` in a fresh schema, with a small pool (tests
    /// run in parallel against one server).
    pub fn storage(url: &str) -> StorageSpec {
        StorageSpec {
            url: Some(url.to_owned()),
            schema: Some(fresh_schema()),
            max_connections: 6,
            min_connections: 0,
            ..StorageSpec::default()
        }
    }
}
