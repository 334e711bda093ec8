//! The policy host: a wasmtime engine with the component model, one
//! compilation per module (cached by content hash as an `InstancePre`, and
//! on disk when `policy.cache_dir` is set), and a fresh `Store` per call
//! with memory limits, an epoch deadline and optionally fuel.
//!
//! Instantiation stays cheap for large components (JavaScript and Python
//! policies carry their interpreter, pre-initialised into linear memory):
//! the pooling allocator keeps memory slots mapped, and each memory starts
//! from a copy-on-write image of the module's initial contents, so a call
//! only pays for the pages it writes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, StoreLimitsBuilder,
    Trap,
};
use wasmtime_wasi::WasiCtx;

use super::bindings::{self, PolicyPre};
use super::disk_cache::{CacheMiss, DiskCache};
use super::epoch::EpochTicker;
pub use super::failure::{BusyLimit, PolicyFailure};
use super::guard::{Breakers, Change, Outcome, Permit, Permits};
pub use super::host::HostState;
use super::host::Limiter;
use super::inspect::{exports_compensate, initial_memory_bytes, other_world, unprovided_imports};
use super::no_wait::{NoWait, NoWaitPoll};
use crate::config::PolicyLimitsSpec;

/// The CPU deadline of the `config-schema()` call made when a module is
/// loaded, at least (ms; a larger `[policy] deadline_ms` applies as is).
pub const LOAD_DEADLINE_MS: u64 = 2_000;

/// Linear memories one policy instance may hold, over all its core
/// modules (the Rust, JavaScript and Python components hold one). Every
/// call's memories share `policy.memory_bytes` together.
pub const MEMORIES_PER_INSTANCE: u32 = 2;

/// Tables one policy instance may hold, over all its core modules (the
/// Rust, JavaScript and Python components hold two).
pub const TABLES_PER_INSTANCE: u32 = 4;

/// Core module instances one policy instance may hold (a Python
/// component links 38).
pub const CORE_INSTANCES_PER_INSTANCE: u32 = 64;

/// Elements a policy's table may hold (wasmtime's pooling default).
pub const TABLE_ELEMENTS: usize = 20_000;

/// WASI handles (streams, pollables) one call may hold at once.
pub const RESOURCES_PER_CALL: usize = 4_096;

/// Where a compiled policy came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOrigin {
    /// Compiled from the module's bytes.
    Compiled,
    /// Deserialized from the disk cache (`policy.cache_dir`).
    DiskCache,
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
    /// Compiled now or loaded from the disk cache.
    pub origin: LoadOrigin,
    /// Time from the module's bytes to a callable policy: compilation or
    /// deserialization, linking and the `config-schema()` call.
    pub load_time: Duration,
    /// The size of the module, in bytes.
    pub module_bytes: usize,
    /// Whether it exports `compensate` (world 0.2.0); a 0.1.0 component
    /// doesn't, and its compensation decision is the default.
    pub has_compensate: bool,
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
    disk: Option<DiskCache>,
    permits: Permits,
    breakers: Breakers,
    instantiations: AtomicU64,
    /// Whether the pooling allocator is in use.
    pub pooling: bool,
    /// Advances the epoch while a call runs.
    ticker: EpochTicker,
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
    /// It is not a component of the policy world (missing exports, not a
    /// component, …).
    #[error("{0}")]
    Incompatible(String),
    /// It targets another version of the policy world.
    #[error(
        "the module targets a different policy world version ({found}); this gateway speaks {} (and loads components of {})",
        bindings::WORLD,
        bindings::EARLIER_WORLDS.join(", ")
    )]
    OtherWorld {
        /// The policy-world names it imports or exports, with their version.
        found: String,
    },
    /// It imports interfaces the host does not provide.
    #[error(
        "the module imports {}, which this gateway does not provide: a policy may import only {} and the WASI cli, clocks, io and random interfaces (no filesystem, no sockets, no HTTP). Build JavaScript policies with every componentize-js WASI feature disabled and Python policies with `componentize-py componentize --stub-wasi`",
        .imports.join(", "),
        bindings::WORLD
    )]
    UnprovidedImports {
        /// The import names the host lacks.
        imports: Vec<String>,
    },
    /// Its initial linear memory alone is above `policy.memory_bytes`.
    #[error(
        "the module asks for {requested} bytes of linear memory at start; policy.memory_bytes is {limit}: raise policy.memory_bytes (a JavaScript policy starts at about 9 MiB, a Python one at about 12.5 MiB; see policies/README.md)"
    )]
    MemoryLimit {
        /// `policy.memory_bytes`.
        limit: usize,
        /// The initial size of its memories together, in bytes.
        requested: u64,
    },
}

impl PolicyEngine {
    /// An engine with these limits. A background thread advances the epoch
    /// every millisecond while a call runs (it parks when none does, and
    /// ends when the engine is dropped: [`EpochTicker`]). With
    /// `limits.cache_dir` set, compiled modules are kept in that folder
    /// (created if missing).
    ///
    /// Errors: wasmtime refused the configuration; the cache folder can't
    /// be created (the message names `policy.cache_dir`).
    pub fn new(limits: &PolicyLimitsSpec) -> anyhow::Result<Self> {
        let build = |pooling: bool| -> wasmtime::Result<Engine> {
            let mut cfg = Config::new();
            cfg.wasm_component_model(true);
            // Each memory starts as a copy-on-write mapping of the module's
            // initial image (wasmtime's default, stated here because large
            // pre-initialised JavaScript and Python components rely on it).
            cfg.memory_init_cow(true);
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
                // Each instance may hold at most so many core instances,
                // memories and tables, and the pool has that many for
                // each of its instances: a tenant whose permits are all
                // in use holds at most its permits' share of each, never
                // the memories or tables other tenants' calls need. A
                // Python component links some 40 core modules (the
                // interpreter, libc and their shims).
                pool.max_core_instances_per_component(CORE_INSTANCES_PER_INSTANCE);
                pool.max_memories_per_component(MEMORIES_PER_INSTANCE);
                pool.max_tables_per_component(TABLES_PER_INSTANCE);
                // The same counts per core module as per instance, so
                // that a module loads with the pool exactly when it loads
                // without it (`check-config`, `policy check`).
                pool.max_memories_per_module(MEMORIES_PER_INSTANCE);
                pool.max_tables_per_module(TABLES_PER_INSTANCE);
                pool.table_elements(TABLE_ELEMENTS);
                let per = |n: u32| limits.pool_instances.saturating_mul(n);
                pool.total_core_instances(per(CORE_INSTANCES_PER_INSTANCE));
                pool.total_memories(per(MEMORIES_PER_INSTANCE));
                pool.total_tables(per(TABLES_PER_INSTANCE));
                pool.max_memory_size(reservation as usize);
                // Reset the pages a call dirtied (up to 2 MiB of them: a
                // policy's stack and heap, a JavaScript engine's working
                // set) back to the memory image in place instead of
                // returning them to the kernel, so the next call doesn't
                // page-fault through them. Where the kernel can say which
                // pages are dirty (PAGEMAP_SCAN, Linux 6.7+), only those
                // are reset; elsewhere the lowest 2 MiB are. Keeping pages
                // resident halved a Rust policy's per-call cost; resetting
                // only the dirty ones took a JavaScript policy's from about
                // 700 to 450 µs here (Python's from 1.35 to 1.2 ms).
                pool.linear_memory_keep_resident(2 << 20);
                pool.table_keep_resident(16 << 10);
                pool.pagemap_scan(wasmtime::Enabled::Auto);

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
        let disk = match &limits.cache_dir {
            Some(dir) => Some(
                DiskCache::open(dir, &engine)
                    .map_err(|e| anyhow::anyhow!("policy.cache_dir: {e}"))?,
            ),
            None => None,
        };
        let mut linker = Linker::new(&engine);
        add_wasi_without_io_access(&mut linker)?;
        bindings::Policy::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        add_earlier_worlds(&mut linker).map_err(|e| anyhow::anyhow!("{e}"))?;
        let weak = engine.weak();
        let ticker = EpochTicker::start("policy-epoch", move || {
            weak.upgrade().map(|e| e.increment_epoch()).is_some()
        })?;
        Ok(Self {
            engine,
            linker,
            limits: limits.clone(),
            cache: Mutex::new(HashMap::new()),
            disk,
            permits: Permits::new(limits),
            breakers: Breakers::new(limits),
            instantiations: AtomicU64::new(0),
            pooling,
            ticker,
        })
    }

    /// Waits (up to `policy.permit_wait_ms`) for one of `tenant`'s permits
    /// and a pool slot; a call holds them while it runs.
    ///
    /// Errors: [`PolicyFailure::Busy`]; the caller counts and logs it.
    pub async fn permit(&self, tenant: &str) -> Result<Permit, PolicyFailure> {
        self.permits.acquire(tenant).await
    }

    /// Permits of `tenant` free now (`policy.max_concurrent_per_tenant` less
    /// its calls in flight).
    pub fn free_permits(&self, tenant: &str) -> usize {
        self.permits.available(tenant)
    }

    /// Instances created for calls since the engine started (load-time
    /// `config-schema()` calls included).
    pub fn instantiations(&self) -> u64 {
        self.instantiations.load(Ordering::Relaxed)
    }

    /// Runs `call` (a call of `tenant`'s `policy`, on behalf of
    /// `principal` when a caller's request is evaluated) unless the
    /// policy's circuit is open; the result feeds its breaker. Circuits are
    /// kept per tenant, policy and principal: a caller whose own input
    /// makes the policy fail (a body that runs it to its deadline) opens
    /// its own circuit, not its tenant's other callers'. Opening and
    /// closing a circuit is logged and counted.
    ///
    /// Errors: [`PolicyFailure::CircuitOpen`] without running `call`
    /// (counted as a failure of that kind), else `call`'s.
    pub fn guarded<R>(
        &self,
        tenant: &str,
        principal: Option<&str>,
        policy: &str,
        call: impl FnOnce() -> Result<R, PolicyFailure>,
    ) -> Result<R, PolicyFailure> {
        let scope = match principal {
            Some(p) => format!("{tenant}/{p}"),
            None => tenant.to_owned(),
        };
        let pass = self
            .breakers
            .admit(&scope, policy, Instant::now())
            .inspect_err(|f| crate::metrics::policy_failure(f.kind()))?;
        let trial = pass.is_trial();
        let out = call();
        match pass.resolve(Outcome::of(&out), Instant::now()) {
            Some(Change::Opened) => {
                crate::metrics::policy_breaker_trip(tenant, policy);
                tracing::warn!(
                    tenant,
                    policy,
                    trial,
                    failures = self.limits.breaker_failures,
                    cooldown_ms = self.limits.breaker_cooldown_ms,
                    "policy circuit opened: its calls fail at once until the cool-down ends"
                );
            }
            Some(Change::Closed) => {
                tracing::info!(
                    tenant,
                    policy,
                    "policy circuit closed: a trial call succeeded"
                );
            }
            None => {}
        }
        out
    }

    /// The limits calls run with.
    pub fn limits(&self) -> &PolicyLimitsSpec {
        &self.limits
    }

    /// Compiles `bytes` (or takes it from the cache by content hash) and
    /// reads its config schema. See [`PolicyEngine::compile_named`].
    pub fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledPolicy>, LoadError> {
        self.compile_named(bytes, "policy module")
    }

    /// Compiles `bytes` (or takes it from the in-memory cache by content
    /// hash, else from the disk cache) and reads its config schema. `name`
    /// (the module's path) labels the log lines about its cache entry.
    ///
    /// Errors: not a component; a component of another policy world
    /// version ([`LoadError::OtherWorld`]); one importing interfaces the
    /// host lacks ([`LoadError::UnprovidedImports`]); one whose initial
    /// memory is above `policy.memory_bytes` ([`LoadError::MemoryLimit`]);
    /// missing exports or a failing `config-schema()`
    /// ([`LoadError::Incompatible`]).
    pub fn compile_named(
        &self,
        bytes: &[u8],
        name: &str,
    ) -> Result<Arc<CompiledPolicy>, LoadError> {
        let started = Instant::now();
        let hash: [u8; 32] = Sha256::digest(bytes).into();
        if let Some(c) = self.cache.lock().unwrap().get(&hash) {
            return Ok(c.clone());
        }
        // WebAssembly binary format §5.5.16: a module or component starts
        // with the magic bytes `\0asm`; anything else is named as such,
        // not as the parser's dump of the first bytes.
        if !bytes.starts_with(b"\0asm") {
            return Err(LoadError::Incompatible(
                "it is not a WebAssembly binary (it does not start with the bytes \\0asm): \
                 name the .wasm file a policy build wrote, such as \
                 policies/target/wasm32-wasip2/release/amount_threshold.wasm"
                    .into(),
            ));
        }
        let requested = initial_memory_bytes(bytes);
        if requested > self.limits.memory_bytes as u64 {
            return Err(LoadError::MemoryLimit {
                limit: self.limits.memory_bytes,
                requested,
            });
        }
        let cached = self.disk.as_ref().and_then(|d| match d.get(&self.engine, &hash) {
            Ok(c) => Some(c),
            Err(CacheMiss::Absent) => None,
            Err(e) => {
                tracing::warn!(module = name, error = %e, "policy cache entry not used; compiling the module");
                None
            }
        });
        let origin = if cached.is_some() {
            LoadOrigin::DiskCache
        } else {
            LoadOrigin::Compiled
        };
        let component = match cached {
            Some(c) => c,
            None => Component::new(&self.engine, bytes).map_err(|e| {
                LoadError::Incompatible(format!("cannot compile it as a component: {e:#}"))
            })?,
        };
        if let Some(found) = other_world(&self.engine, &component) {
            return Err(LoadError::OtherWorld { found });
        }
        let unprovided = unprovided_imports(&self.engine, &component);
        if !unprovided.is_empty() {
            return Err(LoadError::UnprovidedImports {
                imports: unprovided,
            });
        }
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Incompatible(format!("{e:#}")))?;
        let pre = PolicyPre::new(pre).map_err(|e| {
            LoadError::Incompatible(format!(
                "it does not export the {} world: {e:#}",
                bindings::WORLD
            ))
        })?;
        let has_compensate = exports_compensate(&self.engine, &component);
        let mut compiled = CompiledPolicy {
            has_compensate,
            hash,
            hash_hex: hex::encode(hash),
            pre,
            config_schema: String::new(),
            origin,
            load_time: Duration::ZERO,
            module_bytes: bytes.len(),
        };
        // The first instance of a module sets up its memory image (for a
        // JavaScript or Python component, megabytes): this load-time call
        // gets at least LOAD_DEADLINE_MS, request-time calls the configured
        // deadline.
        let schema = self
            .call_with_deadline(
                &compiled,
                "load",
                self.limits.deadline_ms.max(LOAD_DEADLINE_MS),
                |p, s| p.call_config_schema(s),
            )
            .map_err(|e| LoadError::Incompatible(format!("config-schema() failed: {e}")))?;
        compiled.config_schema = schema;
        if let (Some(disk), LoadOrigin::Compiled) = (&self.disk, origin) {
            match disk.put(&hash, &component) {
                Ok(path) => {
                    tracing::debug!(module = name, entry = %path.display(), "compiled policy cached")
                }
                Err(e) => tracing::warn!(module = name, error = %e, "compiled policy not cached"),
            }
        }
        compiled.load_time = started.elapsed();
        let compiled = Arc::new(compiled);
        self.cache.lock().unwrap().insert(hash, compiled.clone());
        Ok(compiled)
    }

    /// The disk cache's folder, if `policy.cache_dir` is set.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.disk.as_ref().map(DiskCache::dir)
    }

    /// The disk cache entry the module with content hash `hash` has or
    /// would have, if `policy.cache_dir` is set.
    pub fn cache_entry(&self, hash: &[u8; 32]) -> Option<std::path::PathBuf> {
        self.disk.as_ref().map(|d| d.entry_path(hash))
    }

    /// Reads and compiles the module at `path`.
    pub fn load(&self, path: &std::path::Path) -> Result<Arc<CompiledPolicy>, LoadError> {
        let bytes = std::fs::read(path).map_err(|e| LoadError::Read {
            path: path.display().to_string(),
            error: e.to_string(),
        })?;
        self.compile_named(&bytes, &path.display().to_string())
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
    pub fn call<R>(
        &self,
        policy: &CompiledPolicy,
        label: &str,
        f: impl FnOnce(&bindings::Policy, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyFailure> {
        self.call_with_deadline(policy, label, self.limits.deadline_ms, f)
    }

    /// Calls the policy's `compensate` export (world 0.2.0) in a fresh
    /// instance with the configured limits. `Ok(None)` when the component
    /// has no such export (world 0.1.0): the caller applies the default.
    ///
    /// Errors: the call failed (trap, deadline, memory, a `compensate` of
    /// another type).
    pub fn call_compensate(
        &self,
        policy: &CompiledPolicy,
        label: &str,
        config: &str,
        request: &bindings::Compensation,
    ) -> Result<Option<bindings::Decision>, PolicyFailure> {
        if !policy.has_compensate {
            return Ok(None);
        }
        let mut store = self.store(label, self.limits.deadline_ms)?;
        let started = Instant::now();
        self.instantiations.fetch_add(1, Ordering::Relaxed);
        let out = (|| {
            let instance = policy.pre.instance_pre().instantiate(&mut store)?;
            let func = instance
                .get_typed_func::<(&str, &bindings::Compensation), (bindings::Decision,)>(
                    &mut store,
                    "compensate",
                )?;
            let (decision,) = func.call(&mut store, (config, request))?;
            Ok(decision)
        })()
        .map_err(|e| classify_error(e, &store));
        crate::metrics::policy_call(
            started.elapsed(),
            out.as_ref().err().map(PolicyFailure::kind),
        );
        out.map(Some)
    }

    /// A fresh store with the configured limits and a CPU deadline of
    /// `deadline_ms` epoch ticks.
    fn store(&self, label: &str, deadline_ms: u64) -> Result<Store<HostState>, PolicyFailure> {
        // Core instances, tables and memories a store may hold, as the
        // pool allows one instance (also without the pool).
        let limits = Limiter {
            inner: StoreLimitsBuilder::new()
                .memory_size(self.limits.memory_bytes)
                .table_elements(TABLE_ELEMENTS)
                .instances(CORE_INSTANCES_PER_INSTANCE as usize)
                .tables(TABLES_PER_INSTANCE as usize)
                .memories(MEMORIES_PER_INSTANCE as usize)
                .trap_on_grow_failure(true)
                .build(),
            memory_bytes: self.limits.memory_bytes,
            memory_total: 0,
            refused_memory: None,
        };
        // `wasi:random` builds its bytes in the host before the policy
        // gets them: no more than the policy's memory could hold.
        let wasi = WasiCtx::builder()
            .max_random_size(self.limits.memory_bytes as u64)
            .build();
        // Handles (streams, pollables) a call may hold at once: each is
        // host memory outside `memory_bytes`.
        let mut table = ResourceTable::new();
        table.set_max_capacity(RESOURCES_PER_CALL);
        let state = HostState {
            limits,
            wasi,
            table,
            label: label.into(),
            log_budget: 16,
            _ticking: self.ticker.running(),
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
        Ok(store)
    }

    /// [`PolicyEngine::call`] with a CPU deadline of `deadline_ms` epoch
    /// ticks (1 ms each) instead of `policy.deadline_ms`.
    fn call_with_deadline<R>(
        &self,
        policy: &CompiledPolicy,
        label: &str,
        deadline_ms: u64,
        f: impl FnOnce(&bindings::Policy, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyFailure> {
        let mut store = self.store(label, deadline_ms)?;
        let started = Instant::now();
        self.instantiations.fetch_add(1, Ordering::Relaxed);
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

/// Links the interfaces of the earlier world versions
/// ([`bindings::EARLIER_WORLDS`]) to the same host functions, so their
/// components load: `log` and `clock` of 0.1.0 are those of today, and
/// `types` has no functions.
fn add_earlier_worlds(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    use bindings::effectgate::policy::clock::Host as _;
    use bindings::effectgate::policy::log::{Host as _, Level};
    for world in bindings::EARLIER_WORLDS {
        let Some(version) = world.rsplit('@').next() else {
            continue;
        };
        linker.instance(&format!("effectgate:policy/types@{version}"))?;
        linker
            .instance(&format!("effectgate:policy/log@{version}"))?
            .func_wrap(
                "log",
                |mut store: wasmtime::StoreContextMut<'_, HostState>,
                 (level, message, fields): (Level, String, Vec<(String, String)>)| {
                    store.data_mut().log(level, message, fields);
                    Ok(())
                },
            )?;
        linker
            .instance(&format!("effectgate:policy/clock@{version}"))?
            .func_wrap(
                "now-ms",
                |mut store: wasmtime::StoreContextMut<'_, HostState>, (): ()| {
                    Ok((store.data_mut().now_ms(),))
                },
            )?;
    }
    Ok(())
}

fn classify_error(e: wasmtime::Error, store: &Store<HostState>) -> PolicyFailure {
    if let Some(requested) = store.data().limits.refused_memory {
        return PolicyFailure::OutOfMemory {
            limit: store.data().limits.memory_bytes,
            requested,
        };
    }
    if let Some(full) = e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>() {
        return PolicyFailure::PoolExhausted(full.to_string());
    }
    if let Some(trap) = e.downcast_ref::<Trap>() {
        return match trap {
            Trap::Interrupt => PolicyFailure::Timeout,
            Trap::OutOfFuel => PolicyFailure::OutOfFuel,
            other => PolicyFailure::Trap(other.to_string()),
        };
    }
    // The error's chain without the wasm backtrace wasmtime adds around
    // it, which names the policy's functions: text the policy chose (its
    // `name` section).
    let backtrace = e
        .downcast_ref::<wasmtime::WasmBacktrace>()
        .map(ToString::to_string);
    let text = e
        .chain()
        .map(ToString::to_string)
        .filter(|t| Some(t) != backtrace.as_ref())
        .collect::<Vec<_>>()
        .join(": ");
    PolicyFailure::Trap(super::failure::shown(&text, super::failure::DETAIL_CHARS))
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
    sync_io::poll::add_to_linker::<HostState, NoWait>(l, |t| NoWaitPoll(&mut t.table))
        .map_err(e)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine of `memory_bytes` per call, with a pool of `pool`
    /// instances, or without the pool (`None`).
    fn engine(pool: Option<u32>, memory_bytes: usize) -> PolicyEngine {
        let engine = PolicyEngine::new(&PolicyLimitsSpec {
            pooling: pool.is_some(),
            pool_instances: pool.unwrap_or(4),
            memory_bytes,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(engine.pooling, pool.is_some(), "the pool is available here");
        engine
    }

    /// A component of core modules, each instantiated once.
    fn component(modules: &[String]) -> Vec<u8> {
        let mut text = String::from("(component\n");
        for (i, m) in modules.iter().enumerate() {
            text += &format!("(core module $m{i} {m})\n(core instance (instantiate $m{i}))\n");
        }
        text += ")";
        wat::parse_str(&text).unwrap()
    }

    /// Core modules of one memory each, of `pages` 64 KiB pages.
    fn memories(pages: &[u32]) -> Vec<String> {
        pages.iter().map(|p| format!("(memory {p})")).collect()
    }

    /// A fresh store of `engine` with an instance of `bytes` in it, or why
    /// it has none (compiling it or instantiating it failed).
    fn instance(
        engine: &PolicyEngine,
        bytes: &[u8],
    ) -> (Store<HostState>, Result<(), PolicyFailure>) {
        let mut store = engine.store("test", 1_000).unwrap();
        let out = match Component::new(&engine.engine, bytes) {
            Err(e) => Err(PolicyFailure::Instantiate(e.to_string())),
            Ok(c) => Linker::new(&engine.engine)
                .instantiate(&mut store, &c)
                .map(|_| ())
                .map_err(|e| classify_error(e, &store)),
        };
        (store, out)
    }

    /// The pool holds as many memories and tables for each of its
    /// instances as one instance may use: two instances of two memories
    /// each fit a pool of two (with one memory an instance, the second
    /// found the pool's memories used up), and a component of three
    /// memories is refused, so a tenant's permits hold only their share
    /// of the pool's memories.
    #[test]
    fn each_pool_instance_has_room_for_the_memories_one_may_use() {
        let engine = engine(Some(2), 1 << 20);
        let two = component(&memories(&[1, 1]));
        let (_a, a) = instance(&engine, &two);
        let (_b, b) = instance(&engine, &two);
        assert_eq!((a, b), (Ok(()), Ok(())));
        let (_c, c) = instance(&engine, &two);
        assert!(matches!(c, Err(PolicyFailure::PoolExhausted(_))), "{c:?}");
        drop((_a, _b, _c));
        let (_s, three) = instance(&engine, &component(&memories(&[1, 1, 1])));
        assert!(three.is_err(), "{three:?}");
    }

    /// A call's memories share `policy.memory_bytes` together, with the
    /// pool and without it: two memories of 2 pages each are over a limit
    /// of 2 pages, one is not.
    #[test]
    fn a_calls_memories_share_the_memory_limit() {
        const LIMIT: usize = 2 * 65_536;
        for pool in [Some(2), None] {
            let engine = engine(pool, LIMIT);
            let (_s, one) = instance(&engine, &component(&memories(&[2])));
            assert_eq!(one, Ok(()), "{pool:?}");
            let (_s, two) = instance(&engine, &component(&memories(&[2, 2])));
            assert_eq!(
                two,
                Err(PolicyFailure::OutOfMemory {
                    limit: LIMIT,
                    requested: 2 * LIMIT
                }),
                "{pool:?}"
            );
        }
    }

    /// Tables are held to [`TABLE_ELEMENTS`] with the pool and without it,
    /// at start and when grown; a module loads with the pool exactly when
    /// it loads without it (memories and tables per module alike).
    #[test]
    fn the_same_module_limits_hold_with_and_without_the_pool() {
        let grow = "(table 1 funcref) (func $grow (drop (table.grow 0 (ref.null func) (i32.const 100000000)))) (start $grow)";
        let cases = [
            (format!("(table {} funcref)", TABLE_ELEMENTS), true),
            (format!("(table {} funcref)", TABLE_ELEMENTS + 1), false),
            (grow.to_owned(), false),
            ("(memory 1) (memory 1)".to_owned(), true),
            ("(memory 1) (memory 1) (memory 1)".to_owned(), false),
            ("(table 1 funcref) (table 1 funcref)".to_owned(), true),
        ];
        for pool in [Some(2), None] {
            let engine = engine(pool, 1 << 20);
            for (module, loads) in &cases {
                let (_s, out) = instance(&engine, &component(std::slice::from_ref(module)));
                assert_eq!(out.is_ok(), *loads, "{pool:?} {module}: {out:?}");
            }
        }
    }

    /// A pollable that is ready now passes `block` and `poll`, a timer
    /// already due included (zero length); waiting on one that isn't
    /// ready traps, as does `poll` with nothing ready.
    #[test]
    fn a_policy_may_poll_what_is_ready_and_never_wait() {
        use wasmtime_wasi::clocks::WasiClocksView as _;
        use wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host as _;
        use wasmtime_wasi::p2::bindings::sync::io::poll::{Host as _, HostPollable as _};
        let engine = engine(None, 1 << 20);
        let mut store = engine.store("test", 1_000).unwrap();
        let state = store.data_mut();
        let due = state.clocks().subscribe_duration(0).unwrap();
        let later = state.clocks().subscribe_duration(60_000_000_000).unwrap();
        let (due, later) = (due.rep(), later.rep());
        let r = wasmtime::component::Resource::new_borrow;
        let mut poll = NoWaitPoll(&mut state.table);
        assert_eq!(poll.poll(vec![r(later), r(due)]).unwrap(), [1]);
        assert!(poll.block(r(due)).is_ok());
        let waited = poll.block(r(later)).unwrap_err().to_string();
        assert!(waited.contains("tried to wait"), "{waited}");
        assert!(poll.poll(vec![r(later)]).is_err());
        assert!(poll.poll(Vec::new()).is_err());
    }

    /// `wasi:random` builds no more bytes than the policy's memory could
    /// hold.
    #[test]
    fn random_bytes_are_bounded_by_the_memory_limit() {
        use wasmtime_wasi::p2::bindings::random::random::Host as _;
        let engine = engine(None, 1 << 20);
        let mut store = engine.store("test", 1_000).unwrap();
        let random = store.data_mut().wasi.random();
        assert_eq!(random.get_random_bytes(16).unwrap().len(), 16);
        assert!(random.get_random_bytes((1 << 20) + 1).is_err());
    }

    /// A caller whose own requests make the policy fail opens only its own
    /// circuit: another principal of the tenant is still served, and the
    /// tenant-wide calls (classifier, replay verdicts) too.
    #[test]
    fn circuits_of_callers_requests_are_per_principal() {
        let engine = PolicyEngine::new(&PolicyLimitsSpec {
            breaker_failures: 2,
            breaker_cooldown_ms: 60_000,
            pool_instances: 4,
            ..Default::default()
        })
        .unwrap();
        let fail = || Err::<(), _>(PolicyFailure::Timeout);
        for _ in 0..2 {
            assert_eq!(
                engine.guarded("t", Some("t:attacker"), "p", fail),
                Err(PolicyFailure::Timeout)
            );
        }
        assert!(matches!(
            engine.guarded("t", Some("t:attacker"), "p", || Ok(())),
            Err(PolicyFailure::CircuitOpen { .. })
        ));
        assert_eq!(engine.guarded("t", Some("t:other"), "p", || Ok(())), Ok(()));
        assert_eq!(engine.guarded("t", None, "p", || Ok(())), Ok(()));
    }
}
