//! Assembling and running the gateway: shared state, both listeners,
//! graceful shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderMap;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{Principal, Role, Settings};
use crate::error::ApiError;
use arc_swap::ArcSwap;

use crate::ledger::{Clock, Ledger, SystemClock};
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

/// State shared by every request handler. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
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
    pub sessions: crate::console::Sessions,
    /// MCP tool annotations seen in `tools/list` answers.
    pub mcp_tools: crate::mcp::ToolCache,
    /// Certificates of the TLS listeners, re-read on reload.
    pub listener_certs: Arc<ListenerCerts>,
}

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
        let ledger = Ledger::open_storage(&settings.storage, clock).await?;
        let secret = ledger.provider_key_secret().await?;
        crate::metrics::handle();
        let instance_id = format!(
            "{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        Ok(Self {
            runtime: Arc::new(ArcSwap::from_pointee(Runtime { settings, policies })),
            engine,
            ledger,
            provider_key_secret: Arc::new(secret),
            instance_id: instance_id.into(),
            reload_lock: Arc::new(tokio::sync::Mutex::new(())),
            sessions: Default::default(),
            mcp_tools: Default::default(),
            listener_certs,
        })
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
        self.runtime.store(Arc::new(Runtime { settings, policies }));
        self.engine.retain(&keep);
        tracing::info!(%summary, "configuration reloaded");
        Ok(summary)
    }

    /// Authenticates `Authorization: Bearer <key>` against the key table.
    ///
    /// Errors: 401 when the header is missing, malformed or unknown.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let value = headers
            .get(http::header::AUTHORIZATION)
            .ok_or(ApiError::Unauthenticated)?;
        let value = value.to_str().map_err(|_| ApiError::Unauthenticated)?;
        let (scheme, key) = value.split_once(' ').ok_or(ApiError::Unauthenticated)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(ApiError::Unauthenticated);
        }
        self.settings()
            .keys
            .get(&crate::config::key_digest(key.trim()))
            .cloned()
            .ok_or(ApiError::Unauthenticated)
    }

    /// Authenticates an admin-listener caller for tenant `tenant`.
    ///
    /// Errors: 401 for a bad key; 403 for a `client` key or a role not in
    /// `roles`; 404 when the key belongs to another tenant (another tenant's
    /// data is answered as not found, never as forbidden).
    pub fn authorize_admin(
        &self,
        headers: &HeaderMap,
        tenant: &str,
        roles: &[Role],
    ) -> Result<Principal, ApiError> {
        let p = self.authenticate(headers)?;
        if p.role == Role::Client {
            return Err(ApiError::Forbidden {
                role: "client",
                action: "use the admin API",
            });
        }
        if p.tenant != tenant {
            return Err(ApiError::NotFound(format!("no tenant {tenant:?}")));
        }
        if !roles.contains(&p.role) {
            return Err(ApiError::Forbidden {
                role: p.role.as_str(),
                action: "do this",
            });
        }
        Ok(p)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "effectgate".into())
}

/// A running gateway: both listeners bound, serving until shut down.
pub struct Gateway {
    /// Address the proxy listener is bound to.
    pub proxy_addr: SocketAddr,
    /// Address the admin listener is bound to.
    pub admin_addr: SocketAddr,
    /// The shared state (tests read the ledger through it).
    pub state: AppState,
    shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Gateway {
    /// Opens the ledger, binds both listeners (port 0 picks a free port) and
    /// starts serving in the background.
    ///
    /// Errors: the ledger can't be opened, or an address can't be bound.
    pub async fn start(settings: Settings) -> anyhow::Result<Self> {
        Self::start_with_clock(settings, Arc::new(SystemClock)).await
    }

    /// [`Gateway::start`] with an injected clock.
    pub async fn start_with_clock(
        settings: Settings,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Self> {
        let proxy_listener = TcpListener::bind(settings.proxy_addr).await?;
        let admin_listener = TcpListener::bind(settings.admin_addr).await?;
        let state = AppState::new(settings, clock).await?;
        let proxy_addr = proxy_listener.local_addr()?;
        let admin_addr = admin_listener.local_addr()?;
        let (shutdown, rx) = watch::channel(false);
        let proxy_app = crate::proxy::router(state.clone());
        let admin_app = crate::admin::router(state.clone());
        let mut tasks = Vec::new();
        let certs = state.listener_certs.clone();
        let (proxy_limits, admin_limits) = {
            let l = &state.settings().settings.limits;
            let nofile = crate::listener::raise_nofile_limit();
            let limits = |max_connections| crate::listener::ConnLimits {
                max_connections,
                header_read_timeout_ms: l.header_read_timeout_ms,
                idle_timeout_ms: l.idle_timeout_ms,
            };
            (
                limits(
                    l.max_connections
                        .unwrap_or_else(|| crate::listener::default_max_connections(nofile)),
                ),
                limits(l.max_admin_connections),
            )
        };
        for (listener, app, cert, limits, name) in [
            (
                proxy_listener,
                proxy_app,
                certs.proxy.clone(),
                proxy_limits,
                "proxy",
            ),
            (
                admin_listener,
                admin_app,
                certs.admin.clone(),
                admin_limits,
                "admin",
            ),
        ] {
            tasks.push(tokio::spawn(crate::listener::serve(
                listener,
                cert,
                app,
                limits,
                name,
                rx.clone(),
            )));
        }
        {
            let (app, rx) = (state.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                crate::outbox::relay(app, rx).await;
                Ok(())
            }));
        }
        if state.settings().reconcile.enabled {
            let (app, rx) = (state.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                crate::reconcile::run(app, rx).await;
                Ok(())
            }));
        }
        tracing::info!(
            %proxy_addr, %admin_addr, instance = %state.instance_id,
            proxy_tls = certs.proxy.is_some(), admin_tls = certs.admin.is_some(),
            max_connections = proxy_limits.max_connections,
            ledger = %state.settings().settings.storage.display_name(),
            backend = state.ledger.backend_name(),
            "effectgate serving"
        );
        Ok(Self {
            proxy_addr,
            admin_addr,
            state,
            shutdown,
            tasks,
        })
    }

    /// Stops accepting connections, lets in-flight requests finish, and
    /// waits for both listeners to close.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Serves until SIGINT or SIGTERM, then shuts down gracefully. SIGHUP
    /// reloads the configuration and policies.
    pub async fn run_until_signal(self) -> anyhow::Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut int = signal(SignalKind::interrupt())?;
        loop {
            tokio::select! {
                _ = int.recv() => break,
                _ = term.recv() => break,
                _ = hup.recv() => match self.state.reload(None).await {
                    Ok(s) => tracing::info!(summary = %s, "SIGHUP: reloaded"),
                    Err(e) => tracing::error!(error = %e, "SIGHUP: reload refused; the old configuration stays"),
                },
            }
        }
        tracing::info!("shutting down");
        self.shutdown().await;
        Ok(())
    }
}
