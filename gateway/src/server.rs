//! Assembling and running the gateway: binds both listeners, builds the
//! routers with their layers, starts the background workers, and shuts
//! all of it down gracefully. The only module that names every layer.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Settings;
use crate::ledger::{Clock, SystemClock};
use crate::state::AppState;

/// A running gateway: both listeners bound, serving until shut down.
pub struct Gateway {
    /// Address the proxy listener is bound to.
    pub proxy_addr: SocketAddr,
    /// Address the admin listener is bound to.
    pub admin_addr: SocketAddr,
    /// The shared state (tests read the ledger through it).
    pub state: AppState,
    shutdown: watch::Sender<bool>,
    admin_shutdown: watch::Sender<bool>,
    admin_task: tokio::task::JoinHandle<std::io::Result<()>>,
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
        settings.log_warnings();
        let (proxy_at, admin_at) = (settings.proxy_addr, settings.admin_addr);
        // The ledger first: a second gateway on a SQLite ledger another one
        // serves is told so, not that the other one's ports are taken.
        let state = AppState::new(settings, clock).await?;
        let proxy_listener = TcpListener::bind(proxy_at)
            .await
            .map_err(|e| anyhow::anyhow!("listen.proxy: cannot listen on {proxy_at}: {e}"))?;
        let admin_listener = TcpListener::bind(admin_at)
            .await
            .map_err(|e| anyhow::anyhow!("listen.admin: cannot listen on {admin_at}: {e}"))?;
        let proxy_addr = proxy_listener.local_addr()?;
        let admin_addr = admin_listener.local_addr()?;
        let (shutdown, rx) = watch::channel(false);
        // The admin listener serves on through the drain (`/readyz` says 503
        // there, `/metrics` shows it) and closes last.
        let (admin_shutdown, admin_rx) = watch::channel(false);
        let proxy_app =
            crate::http::observe::observe(crate::http::proxy::service(state.clone()), "proxy");
        let admin_app =
            crate::http::observe::observe(crate::http::admin::router(state.clone()), "admin");
        let mut tasks = Vec::new();
        let certs = state.listener_certs.clone();
        let (proxy_limits, admin_limits) = {
            let l = &state.settings().settings.limits;
            let nofile = crate::http::listener::raise_nofile_limit();
            let drain_ms = state.settings().settings.shutdown.drain_ms;
            let limits = |max_connections| crate::http::listener::ConnLimits {
                max_connections,
                header_read_timeout_ms: l.header_read_timeout_ms,
                idle_timeout_ms: l.idle_timeout_ms,
                drain_ms,
            };
            (
                limits(
                    l.max_connections
                        .unwrap_or_else(|| crate::http::listener::default_max_connections(nofile)),
                ),
                limits(l.max_admin_connections),
            )
        };
        tasks.push(tokio::spawn(crate::http::listener::serve(
            proxy_listener,
            certs.proxy.clone(),
            proxy_app,
            proxy_limits,
            "proxy",
            rx.clone(),
        )));
        let admin_task = tokio::spawn(crate::http::listener::serve(
            admin_listener,
            certs.admin.clone(),
            admin_app,
            admin_limits,
            "admin",
            admin_rx,
        ));
        {
            let (app, rx) = (state.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                crate::workers::outbox::relay(app, rx).await;
                Ok(())
            }));
        }
        if state.settings().reconcile.enabled {
            let (app, rx) = (state.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                crate::workers::reconciler::run(app, rx).await;
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
            admin_shutdown,
            admin_task,
            tasks,
        })
    }

    /// Graceful shutdown with the `shutdown.drain_ms` deadline: `/readyz`
    /// answers 503 at once, the proxy listener stops accepting, the workers
    /// stop scanning, and calls in flight and the executions running in the
    /// background get until the deadline to finish. A connection still open
    /// then is cut; an execution still running keeps its lease (the next
    /// owner reconciles it) and is counted in the log line. The admin
    /// listener serves until the drain ends, then closes the same way.
    pub async fn shutdown(self) {
        let drain_ms = self.state.settings().settings.shutdown.drain_ms;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(drain_ms);
        self.state.lifecycle.start_draining();
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        let (calls, executions) = (
            &self.state.lifecycle.calls,
            &self.state.lifecycle.executions,
        );
        calls.close();
        executions.close();
        let drained = tokio::time::timeout_at(deadline, async {
            calls.wait().await;
            executions.wait().await;
        })
        .await
        .is_ok();
        if drained {
            tracing::info!("drained: every call and execution finished");
        } else {
            tracing::warn!(
                executions = executions.len(),
                calls = calls.len(),
                drain_ms,
                "drain deadline passed: executions still running keep their lease; the next owner reconciles them"
            );
        }
        let _ = self.admin_shutdown.send(true);
        let _ = self.admin_task.await;
        if drained {
            // Nothing of this gateway writes any more: one started next in
            // this process may take a SQLite ledger. (Executions still
            // running keep it until they end, or the process does.)
            self.state.ledger.release_exclusive();
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
