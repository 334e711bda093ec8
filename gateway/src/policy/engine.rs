//! The policy host: a wasmtime engine with the component model, one
//! compilation per module (cached by content hash as an `InstancePre`), and a
//! fresh `Store` per call with memory limits, an epoch deadline and
//! optionally fuel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, StoreLimits,
    StoreLimitsBuilder, Trap,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{self, PolicyPre};
use crate::config::PolicyLimitsSpec;

/// Why a policy call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyFailure {
    /// The CPU deadline passed.
    Timeout,
    /// The fuel ran out.
    OutOfFuel,
    /// The memory limit was hit.
    OutOfMemory,
    /// The policy trapped (panic, `unreachable`, …).
    Trap(String),
    /// The policy's output broke a rule (status, sizes, headers).
    InvalidOutput(String),
    /// The module could not be instantiated.
    Instantiate(String),
}

impl PolicyFailure {
    /// Short kind for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PolicyFailure::Timeout => "timeout",
            PolicyFailure::OutOfFuel => "out-of-fuel",
            PolicyFailure::OutOfMemory => "out-of-memory",
            PolicyFailure::Trap(_) => "trap",
            PolicyFailure::InvalidOutput(_) => "invalid-output",
            PolicyFailure::Instantiate(_) => "instantiate",
        }
    }
}

impl std::fmt::Display for PolicyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyFailure::Timeout => f.write_str("the policy exceeded its CPU deadline"),
            PolicyFailure::OutOfFuel => f.write_str("the policy ran out of fuel"),
            PolicyFailure::OutOfMemory => f.write_str("the policy exceeded its memory limit"),
            PolicyFailure::Trap(d) => write!(f, "the policy trapped: {d}"),
            PolicyFailure::InvalidOutput(d) => write!(f, "the policy returned invalid output: {d}"),
            PolicyFailure::Instantiate(d) => write!(f, "the policy could not be instantiated: {d}"),
        }
    }
}

/// Per-call host state.
pub struct HostState {
    limits: StoreLimits,
    wasi: WasiCtx,
    table: ResourceTable,
    /// Label for the policy's log lines (`tenant/policy`).
    label: Arc<str>,
    log_budget: usize,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::effectgate::policy::types::Host for HostState {}

impl bindings::effectgate::policy::log::Host for HostState {
    fn log(
        &mut self,
        level: bindings::effectgate::policy::log::Level,
        message: String,
        fields: Vec<(String, String)>,
    ) {
        use bindings::effectgate::policy::log::Level;
        // At most 16 lines of 1 KiB per call.
        if self.log_budget == 0 {
            return;
        }
        self.log_budget -= 1;
        // Bounded by characters, never split inside one.
        let clip = |s: &str, n: usize| -> String { s.chars().take(n).collect() };
        let message = clip(&message, 1024);
        let fields: Vec<String> = fields
            .into_iter()
            .take(16)
            .map(|(k, v)| format!("{}={}", clip(&k, 64), clip(&v, 256)))
            .collect();
        let fields = fields.join(" ");
        let policy = &*self.label;
        match level {
            Level::Debug => tracing::debug!(policy, fields, "{message}"),
            Level::Info => tracing::info!(policy, fields, "{message}"),
            Level::Warn => tracing::warn!(policy, fields, "{message}"),
            Level::Error => tracing::error!(policy, fields, "{message}"),
        }
    }
}

impl bindings::effectgate::policy::clock::Host for HostState {
    fn now_ms(&mut self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A compiled policy module.
pub struct CompiledPolicy {
    /// sha256 of the module bytes.
    pub hash: [u8; 32],
    /// The same, as hex.
    pub hash_hex: String,
    pre: PolicyPre<HostState>,
    /// The module's config schema (from `config-schema()`).
    pub config_schema: String,
}

impl std::fmt::Debug for CompiledPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledPolicy")
            .field("hash", &self.hash_hex)
            .finish()
    }
}

/// The engine that compiles and runs policies.
pub struct PolicyEngine {
    engine: Engine,
    linker: Linker<HostState>,
    limits: PolicyLimitsSpec,
    cache: Mutex<HashMap<[u8; 32], Arc<CompiledPolicy>>>,
    /// Whether the pooling allocator is in use.
    pub pooling: bool,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("pooling", &self.pooling)
            .finish()
    }
}

/// Errors of loading a policy module.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// Path.
        path: String,
        /// Error.
        error: String,
    },
    /// It is not a component of the policy world (wrong version, missing exports, …).
    #[error("{0}")]
    Incompatible(String),
}

/// The deadline of a policy's `config-schema` call at load, in ms (at
/// least; a larger `[policy] deadline_ms` applies as is).
pub const LOAD_DEADLINE_MS: u64 = 2_000;

impl PolicyEngine {
    /// An engine with these limits. A background thread advances the epoch
    /// every millisecond (it stops when the engine is dropped).
    ///
    /// Errors: wasmtime refused the configuration.
    pub fn new(limits: &PolicyLimitsSpec) -> anyhow::Result<Self> {
        let build = |pooling: bool| -> wasmtime::Result<Engine> {
            let mut cfg = Config::new();
            cfg.wasm_component_model(true);
            cfg.epoch_interruption(true);
            cfg.consume_fuel(limits.fuel.is_some());
            // Reserve only what the memory limit allows, plus a small guard:
            // the default 4 GiB reservation per memory would make a pool of
            // hundreds of slots reserve terabytes of address space.
            let reservation = (limits.memory_bytes as u64).next_multiple_of(64 * 1024);
            cfg.memory_reservation(reservation);
            cfg.memory_guard_size(64 * 1024);
            cfg.memory_reservation_for_growth(0);
            if pooling {
                let mut pool = PoolingAllocationConfig::default();
                pool.total_component_instances(limits.pool_instances);
                pool.total_core_instances(limits.pool_instances.saturating_mul(4));
                pool.total_memories(limits.pool_instances);
                pool.total_tables(limits.pool_instances.saturating_mul(4));
                pool.max_memory_size(reservation as usize);
                // Reset a reused slot's low 256 KiB (a policy's stack and
                // small heap) with memset instead of returning the pages to
                // the kernel: a fresh call then doesn't page-fault through
                // them. Halves the per-call cost.
                pool.linear_memory_keep_resident(256 << 10);
                pool.table_keep_resident(16 << 10);

                cfg.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
            }
            Engine::new(&cfg)
        };
        let (engine, pooling) = match build(limits.pooling) {
            Ok(e) => (e, limits.pooling),
            Err(e) if limits.pooling => {
                tracing::warn!(error = %e, "pooling allocator unavailable; using on-demand allocation");
                (build(false).map_err(|e| anyhow::anyhow!("{e}"))?, false)
            }
            Err(e) => return Err(anyhow::anyhow!("{e}")),
        };
        let mut linker = Linker::new(&engine);
        add_wasi_without_io_access(&mut linker)?;
        bindings::Policy::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("policy-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })?;
        Ok(Self {
            engine,
            linker,
            limits: limits.clone(),
            cache: Mutex::new(HashMap::new()),
            pooling,
        })
    }

    /// The limits calls run with.
    pub fn limits(&self) -> &PolicyLimitsSpec {
        &self.limits
    }

    /// Compiles `bytes` (or takes it from the cache by content hash) and
    /// reads its config schema.
    ///
    /// Errors: not a component, or not one of the `effectgate:policy@0.1.0`
    /// world (the message names the world it expected and what is missing).
    pub fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledPolicy>, LoadError> {
        let hash: [u8; 32] = Sha256::digest(bytes).into();
        if let Some(c) = self.cache.lock().unwrap().get(&hash) {
            return Ok(c.clone());
        }
        let component = Component::new(&self.engine, bytes)
            .map_err(|e| LoadError::Incompatible(format!("not a WebAssembly component: {e}")))?;
        let world_check = check_world(&self.engine, &component);
        let pre = self.linker.instantiate_pre(&component).map_err(|e| {
            LoadError::Incompatible(format!(
                "{}{e:#}",
                world_check
                    .as_deref()
                    .map(|w| format!("{w}; "))
                    .unwrap_or_default()
            ))
        })?;
        let pre = PolicyPre::new(pre).map_err(|e| {
            LoadError::Incompatible(format!(
                "{}it does not export the {} world: {e:#}",
                world_check
                    .as_deref()
                    .map(|w| format!("{w}; "))
                    .unwrap_or_default(),
                bindings::WORLD
            ))
        })?;
        let mut compiled = CompiledPolicy {
            hash,
            hash_hex: hex::encode(hash),
            pre,
            config_schema: String::new(),
        };
        let schema = self
            // At load, not on a request: the first call of a fresh module
            // on a busy machine may take longer than a request's deadline,
            // which a policy's config schema must not fail on.
            .call_within(
                &compiled,
                "load",
                self.limits.deadline_ms.max(LOAD_DEADLINE_MS),
                |p, s| p.call_config_schema(s),
            )
            .map_err(|e| LoadError::Incompatible(format!("config-schema() failed: {e}")))?;
        compiled.config_schema = schema;
        let compiled = Arc::new(compiled);
        self.cache.lock().unwrap().insert(hash, compiled.clone());
        Ok(compiled)
    }

    /// Reads and compiles the module at `path`.
    pub fn load(&self, path: &std::path::Path) -> Result<Arc<CompiledPolicy>, LoadError> {
        let bytes = std::fs::read(path).map_err(|e| LoadError::Read {
            path: path.display().to_string(),
            error: e.to_string(),
        })?;
        self.compile(&bytes)
    }

    /// Drops cached compilations not in `keep` (after a reload), so old
    /// modules are freed.
    pub fn retain(&self, keep: &[[u8; 32]]) {
        self.cache.lock().unwrap().retain(|h, _| keep.contains(h));
    }

    /// Number of cached compilations.
    pub fn cached(&self) -> usize {
        self.cache.lock().unwrap().len()
    }

    /// Calls into a fresh instance of `policy` with the configured limits.
    /// (At load, `config-schema` gets at least [`LOAD_DEADLINE_MS`].)
    pub fn call<R>(
        &self,
        policy: &CompiledPolicy,
        label: &str,
        f: impl FnOnce(&bindings::Policy, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyFailure> {
        self.call_within(policy, label, self.limits.deadline_ms, f)
    }

    /// [`PolicyEngine::call`] with its own deadline, in ms (epochs).
    fn call_within<R>(
        &self,
        policy: &CompiledPolicy,
        label: &str,
        deadline_ms: u64,
        f: impl FnOnce(&bindings::Policy, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyFailure> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            .instances(16)
            .tables(16)
            .memories(4)
            .trap_on_grow_failure(true)
            .build();
        let state = HostState {
            limits,
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
            label: label.into(),
            log_budget: 16,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(deadline_ms);
        store.epoch_deadline_trap();
        if let Some(fuel) = self.limits.fuel {
            store
                .set_fuel(fuel)
                .map_err(|e| PolicyFailure::Instantiate(e.to_string()))?;
        }
        let started = Instant::now();
        let instance = policy
            .pre
            .instantiate(&mut store)
            .map_err(|e| classify_error(e, &store))?;
        let out = f(&instance, &mut store).map_err(|e| classify_error(e, &store));
        crate::metrics::policy_call(
            started.elapsed(),
            out.as_ref().err().map(PolicyFailure::kind),
        );
        out
    }
}

fn classify_error(e: wasmtime::Error, store: &Store<HostState>) -> PolicyFailure {
    let _ = store;
    if let Some(trap) = e.downcast_ref::<Trap>() {
        return match trap {
            Trap::Interrupt => PolicyFailure::Timeout,
            Trap::OutOfFuel => PolicyFailure::OutOfFuel,
            other => PolicyFailure::Trap(other.to_string()),
        };
    }
    let text = format!("{e:#}");
    if text.contains("memory")
        && (text.contains("limit") || text.contains("grow") || text.contains("exceed"))
    {
        return PolicyFailure::OutOfMemory;
    }
    PolicyFailure::Trap(text)
}

/// Names the policy world version a component imports, if it is not ours.
fn check_world(engine: &Engine, component: &Component) -> Option<String> {
    let ty = component.component_type();
    let mut names: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_owned()).collect();
    names.extend(ty.exports(engine).map(|(n, _)| n.to_owned()));
    let other: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("effectgate:policy/") && !n.ends_with("@0.1.0"))
        .collect();
    if other.is_empty() {
        None
    } else {
        Some(format!(
            "the module targets a different policy world version ({}); this gateway speaks {}",
            other
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            bindings::WORLD
        ))
    }
}

/// Links the WASI interfaces a Rust `wasm32-wasip2` component imports for
/// its standard library (cli, io, clocks, random), with an empty context:
/// no arguments, no environment, no stdin, output discarded. Filesystem and
/// socket interfaces are **not** linked, so a policy that imports them fails
/// to load.
fn add_wasi_without_io_access(l: &mut Linker<HostState>) -> anyhow::Result<()> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
    use wasmtime_wasi::p2::bindings::sync::io as sync_io;
    use wasmtime_wasi::p2::bindings::{cli, clocks, random};
    use wasmtime_wasi::random::WasiRandom;
    let e = |e: wasmtime::Error| anyhow::anyhow!("{e}");
    sync_io::error::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table).map_err(e)?;
    sync_io::poll::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table).map_err(e)?;
    sync_io::streams::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table).map_err(e)?;
    clocks::wall_clock::add_to_linker::<HostState, WasiClocks>(l, HostState::clocks).map_err(e)?;
    clocks::monotonic_clock::add_to_linker::<HostState, WasiClocks>(l, HostState::clocks)
        .map_err(e)?;
    random::random::add_to_linker::<HostState, WasiRandom>(l, |t| t.wasi.random()).map_err(e)?;
    random::insecure::add_to_linker::<HostState, WasiRandom>(l, |t| t.wasi.random()).map_err(e)?;
    random::insecure_seed::add_to_linker::<HostState, WasiRandom>(l, |t| t.wasi.random())
        .map_err(e)?;
    cli::exit::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::environment::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::stdin::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::stdout::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::stderr::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::terminal_input::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::terminal_output::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::terminal_stdin::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::terminal_stdout::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    cli::terminal_stderr::add_to_linker::<HostState, WasiCli>(l, HostState::cli).map_err(e)?;
    Ok(())
}

struct HasIo;

impl wasmtime::component::HasData for HasIo {
    type Data<'a> = &'a mut ResourceTable;
}
