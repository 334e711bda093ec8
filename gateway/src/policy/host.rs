//! The per-call host state of a policy instance: its resource limiter
//! (memory and table growth), its WASI context without I/O, and the host
//! functions of the world (log, clock).

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings;

/// The store's resource limiter: wasmtime's [`StoreLimits`] (each memory
/// and table on its own), the bytes of all the call's memories together
/// held to `memory_bytes`, and a note of the size a refused growth asked
/// for, so the failure can name it.
pub(super) struct Limiter {
    pub(super) inner: StoreLimits,
    pub(super) memory_bytes: usize,
    /// Bytes of the call's memories so far (bytes).
    pub(super) memory_total: usize,
    pub(super) refused_memory: Option<usize>,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // A new memory grows from 0 to its initial size.
        let total = self
            .memory_total
            .saturating_sub(current)
            .saturating_add(desired);
        if total > self.memory_bytes {
            self.refused_memory = Some(total);
            wasmtime::bail!(
                "forcing a trap: the call's memories would hold {total} bytes together; policy.memory_bytes is {}",
                self.memory_bytes
            );
        }
        let allowed = self.inner.memory_growing(current, desired, maximum)?;
        if allowed {
            self.memory_total = total;
        }
        Ok(allowed)
    }
    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.memory_grow_failed(error)
    }
    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }
    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.table_grow_failed(error)
    }
    fn instances(&self) -> usize {
        self.inner.instances()
    }
    fn tables(&self) -> usize {
        self.inner.tables()
    }
    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

/// Per-call host state.
pub struct HostState {
    pub(super) limits: Limiter,
    pub(super) wasi: WasiCtx,
    pub(super) table: ResourceTable,
    /// Label for the policy's log lines (`tenant/policy`).
    pub(super) label: Arc<str>,
    pub(super) log_budget: usize,
    /// Keeps the epoch advancing while the call runs.
    pub(super) _ticking: super::epoch::Ticking,
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
        // Bounded by characters, never split inside one; control
        // characters escaped, so that a line break or an escape sequence
        // can't forge a log line or reach a terminal.
        let clip = super::failure::shown;
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
