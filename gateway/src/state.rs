//! The state every request and worker shares: the settings snapshot and
//! policy set (swapped as one on reload), the ledger and the policy engine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::{Principal, Settings};
use arc_swap::ArcSwap;

use crate::ledger::{Clock, Ledger};
use crate::policy::{PolicyEngine, PolicySet};

/// What a reload swaps as one: the settings and the policy set built
/// from them. Handlers take one snapshot per request, so in-flight calls
/// finish on the set they started with.
#[derive(Debug)]
pub struct Runtime {
    /// Validated settings.
    pub settings: Settings,
    /// Tenants' policies.
    pub policies: PolicySet,
}

impl std::ops::Deref for Runtime {
    type Target = Settings;
    fn deref(&self) -> &Settings {
        &self.settings
    }
}

/// State shared by every request handler and worker: one `Arc` around
/// [`Shared`], so a clone (axum clones the state for every layer and
/// handler of every request) is one reference count, not one per field.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] shares.
pub struct Shared {
    runtime: Arc<ArcSwap<Runtime>>,
    /// The policy engine (one per gateway; survives reloads).
    pub engine: Arc<PolicyEngine>,
    /// The effect ledger.
    pub ledger: Ledger,
    /// Secret the provider keys are derived from.
    pub provider_key_secret: Arc<Vec<u8>>,
    /// This instance's id: lease owner in the ledger.
    pub instance_id: Arc<str>,
    reload_lock: Arc<tokio::sync::Mutex<()>>,
    /// Operator console sessions.
    pub sessions: Sessions,
    /// MCP tool annotations seen in `tools/list` answers.
    pub mcp_tools: crate::mcp::protocol::ToolCache,
    /// Certificates of the TLS listeners, re-read on reload.
    pub listener_certs: Arc<ListenerCerts>,
    /// Body bytes of new operations between their stored-bytes quota check
    /// and their reservation, per tenant.
    pub quota_holds: QuotaHolds,
    /// Draining state and the executions running in the background.
    pub lifecycle: Arc<Lifecycle>,
}

/// What graceful shutdown needs to know: whether the gateway is draining
/// (`/readyz` then answers 503), and the calls and provider executions
/// running in tasks of their own, awaited within the drain deadline.
#[derive(Debug, Default)]
pub struct Lifecycle {
    draining: std::sync::atomic::AtomicBool,
    /// Every execution of an operation runs in a task of this tracker.
    pub executions: tokio_util::task::TaskTracker,
    /// The effectful flow of every proxied call runs in a task of this
    /// tracker, from its read request to its answer (so a caller that
    /// hangs up drops only its wait).
    pub calls: tokio_util::task::TaskTracker,
    /// Held for one outbox relay pass
    /// ([`crate::workers::outbox::relay_once`]): concurrent callers of one
    /// instance (the relay loop, and a caller that runs a pass of its own)
    /// take turns, so an event this instance is still delivering is not
    /// claimed and sent again by another of its passes when its claim has
    /// lapsed in ledger time (a clock step) before the receiver answered.
    /// Another instance may still take a lapsed claim: delivery is at
    /// least once.
    pub(crate) relay_pass: tokio::sync::Mutex<()>,
}

impl Lifecycle {
    /// Marks the gateway as draining (from SIGTERM on).
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether shutdown has started.
    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A logged-in operator console session.
#[derive(Debug, Clone)]
pub struct Session {
    pub(crate) principal: Principal,
    /// sha256 of the key the session was opened with: checked against the
    /// current key table on every request, so a revoked key or a changed
    /// role ends the session at the next reload.
    pub(crate) key_digest: [u8; 32],
    pub(crate) csrf: String,
    pub(crate) expires_at: i64,
}

/// Console sessions, by id.
#[derive(Debug, Default, Clone)]
pub struct Sessions(pub(crate) Arc<Mutex<HashMap<String, Session>>>);

/// The certificates of the gateway's TLS listeners (`None`: plain HTTP).
#[derive(Debug, Default)]
pub struct ListenerCerts {
    /// `listen.proxy_tls`.
    pub proxy: Option<Arc<crate::tls::ListenerCert>>,
    /// `listen.admin_tls`.
    pub admin: Option<Arc<crate::tls::ListenerCert>>,
}

impl ListenerCerts {
    fn load(settings: &Settings) -> anyhow::Result<Self> {
        let load = |t: &Option<crate::config::ListenerTlsSpec>| {
            t.as_ref()
                .map(|t| crate::tls::ListenerCert::load(&t.cert_file, &t.key_file))
                .transpose()
        };
        Ok(Self {
            proxy: load(&settings.proxy_tls)?,
            admin: load(&settings.admin_tls)?,
        })
    }

    /// Re-reads every listener's files; the first failure is returned (with
    /// the field it came from) and that listener keeps its certificate.
    fn reload(&self) -> Result<(), String> {
        for (field, cert) in [
            ("listen.proxy_tls", &self.proxy),
            ("listen.admin_tls", &self.admin),
        ] {
            if let Some(c) = cert {
                c.reload()
                    .map_err(|e| format!("config: {field}.{}: {e}", e.field))?;
            }
        }
        Ok(())
    }
}

/// The operation events each tenant with a webhook receives
/// (`tenants[].webhook.events`).
fn subscriptions(settings: &Settings) -> crate::ledger::Subscriptions {
    settings
        .webhooks
        .iter()
        .map(|(t, w)| (t.clone(), w.events.clone()))
        .collect()
}

/// Registers every metric family at 0 for the label sets `settings`
/// defines (see [`crate::metrics::register_all`]).
pub fn register_metrics(settings: &Settings) {
    let stems: Vec<(&str, String)> = settings
        .policy_bindings
        .iter()
        .map(|(t, b)| {
            let stem = b
                .module
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            (t.as_str(), stem)
        })
        .collect();
    crate::metrics::register_all(&crate::metrics::Labels {
        routes: settings
            .routes
            .iter()
            .map(|r| (r.name.as_str(), r.mcp.is_some()))
            .collect(),
        tenants: settings.tenants.iter().map(String::as_str).collect(),
        policies: stems.iter().map(|(t, s)| (*t, s.as_str())).collect(),
        quota_tenants: settings
            .tenant_limits
            .iter()
            .filter(|(_, l)| l.max_stored_bytes.is_some())
            .map(|(t, _)| t.as_str())
            .collect(),
        inbox_sources: settings.inbox.keys().map(String::as_str).collect(),
    });
}

impl AppState {
    /// Builds the state: opens (and migrates) the ledger, loads the
    /// provider-key secret, compiles the tenants' policies.
    ///
    /// Errors: the ledger can't be opened or migrated; a policy can't be
    /// loaded or a tenant's policy config is invalid (the gateway refuses to start).
    pub async fn new(settings: Settings, clock: Arc<dyn Clock>) -> anyhow::Result<Self> {
        let engine = Arc::new(PolicyEngine::new(&settings.policy_limits)?);
        let policies = {
            let (engine, settings) = (engine.clone(), settings.clone());
            tokio::task::spawn_blocking(move || {
                PolicySet::build(&engine, &settings).map(|p| (p, settings))
            })
            .await??
            .0
        };
        let listener_certs = Arc::new(ListenerCerts::load(&settings)?);
        // A SQLite ledger is this process's alone: a second gateway on the
        // file stops here, before it opens or migrates it.
        let ledger = Ledger::open_exclusive(&settings.storage, clock).await?;
        let secret = ledger.provider_key_secret().await?;
        ledger.set_event_subscriptions(subscriptions(&settings));
        crate::metrics::handle();
        register_metrics(&settings);
        let instance_id = format!(
            "{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        Ok(Self(Arc::new(Shared {
            runtime: Arc::new(ArcSwap::from_pointee(Runtime { settings, policies })),
            engine,
            ledger,
            provider_key_secret: Arc::new(secret),
            instance_id: instance_id.into(),
            reload_lock: Arc::new(tokio::sync::Mutex::new(())),
            sessions: Default::default(),
            mcp_tools: Default::default(),
            listener_certs,
            quota_holds: Default::default(),
            lifecycle: Default::default(),
        })))
    }

    /// The current settings and policies (one snapshot).
    pub fn settings(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    /// Re-reads the config file (or uses `replacement`), compiles the new
    /// policy set in the background and swaps it in atomically. In-flight
    /// calls finish on the old set; compiled modules no longer used are
    /// freed. On any error the old set stays in place.
    ///
    /// Listener addresses and storage can't change without a restart; a
    /// reload that changes them is refused.
    ///
    /// Errors: the config or a policy is invalid (the message says why).
    pub async fn reload(&self, replacement: Option<Settings>) -> Result<String, String> {
        let _guard = self.reload_lock.lock().await;
        let current = self.settings();
        let settings = match replacement {
            Some(s) => s,
            None => {
                let source = current.source.clone();
                crate::config::load(source.as_deref()).map_err(|e| format!("config: {e}"))?
            }
        };
        if settings.policy_limits != current.policy_limits {
            return Err(
                "policy limits ([policy]) can't change on reload; restart the gateway".into(),
            );
        }
        if settings.proxy_addr != current.proxy_addr
            || settings.admin_addr != current.admin_addr
            || settings.proxy_tls.is_some() != current.proxy_tls.is_some()
            || settings.admin_tls.is_some() != current.admin_tls.is_some()
            || settings.storage != current.storage
        {
            return Err(
                "listen addresses, TLS on or off, and storage can't change on reload; restart the gateway"
                    .into(),
            );
        }
        if settings.proxy_tls != current.proxy_tls || settings.admin_tls != current.admin_tls {
            return Err(
                "listener certificate paths can't change on reload (their files are re-read); restart the gateway"
                    .into(),
            );
        }

        let engine = self.engine.clone();
        let (policies, settings) = tokio::task::spawn_blocking(move || {
            PolicySet::build(&engine, &settings).map(|p| (p, settings))
        })
        .await
        .map_err(|e| format!("reload task failed: {e}"))?
        .map_err(|e| e.to_string())?;
        let keep = policies.hashes();
        let summary = format!(
            "{}, {}, {}",
            crate::config::counted(settings.tenants.len(), "tenant"),
            crate::config::counted(settings.routes.len(), "route"),
            crate::config::counted(keep.len(), "policy module")
        );
        // The listeners' certificate files are re-read last, once the rest
        // of the reload is known good: a renewed certificate applies
        // without a restart.
        self.listener_certs.reload()?;
        register_metrics(&settings);
        self.ledger
            .set_event_subscriptions(subscriptions(&settings));
        self.runtime.store(Arc::new(Runtime { settings, policies }));
        self.engine.retain(&keep);
        tracing::info!(%summary, "configuration reloaded");
        self.settings().log_warnings();
        Ok(summary)
    }
}

/// This host's name, as the first part of the instance id the ledger
/// records as a lease's and a scan's owner (an indexed column): at most
/// 253 characters (a DNS name's limit, RFC 1035 §2.3.4, RFC 1123 §2.1),
/// without control characters; `effectgate` when there is none.
fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| {
            s.trim()
                .chars()
                .filter(|c| !c.is_control())
                .take(253)
                .collect::<String>()
        })
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "effectgate".into())
}

/// Body bytes this instance has admitted under a tenant's
/// `max_stored_bytes` quota but not yet reserved in the ledger. A quota
/// check counts them beside the ledger's total, so calls checked at once
/// can't all pass against the same total.
///
/// - A call's bytes are counted from its check until its reservation has
///   been written (or has failed): a check that reads the ledger's total
///   just after a reservation committed, before its hold ends, counts
///   those bytes twice and may refuse a call that fits (never admit one
///   that doesn't).
/// - One instance's view: instances sharing a PostgreSQL ledger don't see
///   each other's holds, so calls checked at once on two instances can
///   still pass the quota together.
#[derive(Debug, Default)]
pub struct QuotaHolds(Mutex<HashMap<String, u64>>);

impl QuotaHolds {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        // Each change is one map update, so a poisoned lock is consistent.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Holds `bytes` for `tenant` when `stored` (the ledger's total, bytes)
    /// plus the bytes already held plus `bytes` is at most `limit`.
    ///
    /// Errors: the bytes already held, when the call doesn't fit.
    pub fn hold(
        &self,
        tenant: &str,
        stored: u64,
        bytes: u64,
        limit: u64,
    ) -> Result<QuotaHold<'_>, u64> {
        let mut held = self.lock();
        let already = held.get(tenant).copied().unwrap_or(0);
        if stored.saturating_add(already).saturating_add(bytes) > limit {
            return Err(already);
        }
        *held.entry(tenant.to_owned()).or_insert(0) += bytes;
        Ok(QuotaHold {
            holds: self,
            tenant: tenant.to_owned(),
            bytes,
        })
    }

    /// Bytes held for `tenant` now.
    pub fn held(&self, tenant: &str) -> u64 {
        self.lock().get(tenant).copied().unwrap_or(0)
    }
}

/// One call's bytes in [`QuotaHolds`], given back when dropped.
#[derive(Debug)]
pub struct QuotaHold<'a> {
    holds: &'a QuotaHolds,
    tenant: String,
    bytes: u64,
}

impl Drop for QuotaHold<'_> {
    fn drop(&mut self) {
        let mut held = self.holds.lock();
        if let Some(n) = held.get_mut(&self.tenant) {
            *n = n.saturating_sub(self.bytes);
            if *n == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}
