//! Checking a [`ConfigFile`] field by field and converting it into the
//! runtime [`Settings`].

use super::checks::{check_policy, check_routes_and_reconcile};
use super::convert_route::route;
use super::telemetry::telemetry;
use super::*;

impl ConfigFile {
    /// Checks every field and builds the runtime [`Settings`]. Reads key
    /// and credential values from env or files named in the config.
    ///
    /// Errors: the first invalid field, by path.
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        self.into_settings_from(None)
    }

    /// [`ConfigFile::into_settings`] for a file at `source`: relative paths
    /// (policy modules, request schemas) resolve against its directory.
    pub fn into_settings_from(mut self, source: Option<&Path>) -> Result<Settings, ConfigError> {
        let base_dir = source
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let proxy_addr = parse_addr("listen.proxy", &self.listen.proxy)?;
        let storage = self.storage_from(source, &base_dir)?;
        let admin_addr = parse_addr("listen.admin", &self.listen.admin)?;
        // The same port on the same address, or on an unspecified one
        // (0.0.0.0 or ::, every address): the second bind would fail.
        if admin_addr.port() == proxy_addr.port()
            && admin_addr.port() != 0
            && (admin_addr.ip() == proxy_addr.ip()
                || admin_addr.ip().is_unspecified()
                || proxy_addr.ip().is_unspecified())
        {
            return Err(ConfigError::new(
                "listen.admin",
                format!(
                    "{admin_addr} takes the proxy's port ({proxy_addr}): the two listeners need their own"
                ),
            ));
        }
        self.check_pools_and_limits()?;
        let (tenants, keys) = self.tenants_and_keys(&base_dir)?;
        let mut routes = Vec::new();
        let mut names = BTreeSet::new();
        let lease_ms = self.reconcile.lease_ms;
        for (ri, r) in std::mem::take(&mut self.routes).into_iter().enumerate() {
            routes.push(route(ri, r, &mut names, &tenants, &base_dir, lease_ms)?);
        }
        let policy_bindings = self.policy_bindings(&names, &base_dir)?;
        let tenant_limits = self.tenant_limits()?;
        let (webhooks, self_approval, mcp_tools) = self.tenant_extras(&base_dir)?;
        check_policy(&mut self.policy, source, &base_dir)?;
        check_routes_and_reconcile(&mut routes, &self.reconcile)?;
        let proxy_tls = super::egress::listener_tls(
            "listen.proxy_tls",
            self.listen.proxy_tls.as_ref(),
            &base_dir,
        )?;
        let admin_tls = super::egress::listener_tls(
            "listen.admin_tls",
            self.listen.admin_tls.as_ref(),
            &base_dir,
        )?;
        let telemetry = telemetry(&self.telemetry, |k| std::env::var(k).ok())?;
        let mut inbox = std::collections::BTreeMap::new();
        let mut warnings = Vec::new();
        for (i, spec) in self.inbox.iter().enumerate() {
            let mut src = super::inbox::inbox_source(i, spec, &tenants, &routes, &base_dir)?;
            if src.deliver && !webhooks.contains_key(&src.tenant) {
                // Nothing to deliver to: the events stay in the inbox and no
                // delivery is queued (README "Inbox").
                warnings.push(format!(
                    "inbox[{i}].deliver: tenant {:?} has no webhook, so the events of {:?} are kept in the inbox and not delivered; set the tenant's webhook, or deliver = false",
                    src.tenant, src.name
                ));
                src.deliver = false;
            }
            if let Some(w) = super::inbox::unsigned_event_id(i, &src) {
                warnings.push(w);
            }
            if inbox.contains_key(&src.name) {
                return Err(ConfigError::new(
                    format!("inbox[{i}].name"),
                    format!("{:?} names another source too", src.name),
                ));
            }
            inbox.insert(src.name.clone(), std::sync::Arc::new(src));
        }
        if self.shutdown.drain_ms == 0 {
            return Err(ConfigError::new("shutdown.drain_ms", "must be at least 1"));
        }
        Ok(Settings {
            proxy_addr,
            admin_addr,
            proxy_tls,
            admin_tls,
            storage,
            limits: self.limits,
            keys,
            tenants,
            routes,
            reconcile: self.reconcile,
            policy_limits: self.policy,
            policy_bindings,
            source: source.map(Path::to_path_buf),
            webhooks,
            tenant_limits,
            self_approval,
            mcp_tools,
            telemetry,
            shutdown: self.shutdown,
            inbox,
            warnings,
        })
    }

    /// Only `[storage]` (and the outbox limits of `[reconcile]`), checked
    /// and with relative paths resolved as [`ConfigFile::into_settings_from`]
    /// resolves them: what the ledger commands need. Tenants, keys, routes
    /// and policy modules are neither converted nor checked, so an operator
    /// can read the ledger without the gateway's secrets or policy builds.
    ///
    /// Errors: a [`ConfigError`] naming the `storage.*` field.
    pub fn storage_settings_from(&self, source: Option<&Path>) -> Result<StorageSpec, ConfigError> {
        let base_dir = source
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        self.storage_from(source, &base_dir)
    }

    /// `[storage]` with relative paths resolved next to the file (and the
    /// outbox limits of `[reconcile]` checked, in the order errors are
    /// reported).
    fn storage_from(
        &self,
        source: Option<&Path>,
        base_dir: &Path,
    ) -> Result<StorageSpec, ConfigError> {
        // Relative paths in a config file mean "next to the file".
        let mut storage = self.storage.clone();
        // Where the SQLite file was named, for an error about it (a
        // `sqlite://` URL becomes `storage.path` below).
        let path_field = if storage.url.as_deref().is_some_and(|u| !u.trim().is_empty()) {
            "storage.url"
        } else {
            "storage.path"
        };
        // An empty URL (an unset environment variable, say) means "no URL".
        if storage.url.as_deref().is_some_and(|u| u.trim().is_empty()) {
            storage.url = None;
        }
        if storage.path.is_relative() && source.is_some() {
            storage.path = base_dir.join(&storage.path);
        }
        match storage.backend() {
            Err(e) => return Err(ConfigError::new("storage.url", &e)),
            Ok(super::Backend::Postgres(u)) => {
                if let Err(e) = u.parse::<sqlx::postgres::PgConnectOptions>() {
                    return Err(ConfigError::new(
                        "storage.url",
                        format!(
                            "{} is not a valid PostgreSQL URL: {e}",
                            super::redact_url(&u)
                        ),
                    ));
                }
            }
            // `sqlite://<path>`: the path, resolved like `storage.path`.
            Ok(super::Backend::Sqlite(p)) if storage.url.is_some() => {
                if p.as_os_str().is_empty() {
                    return Err(ConfigError::new(
                        "storage.url",
                        "the sqlite:// URL names no file",
                    ));
                }
                storage.path = if p.is_relative() && source.is_some() {
                    base_dir.join(p)
                } else {
                    p
                };
                storage.url = None;
            }
            Ok(_) => {}
        }
        for (field, value) in [
            (
                "storage.max_connections",
                u64::from(storage.max_connections),
            ),
            ("storage.acquire_timeout_ms", storage.acquire_timeout_ms),
            ("storage.statement_timeout_ms", storage.statement_timeout_ms),
            ("storage.call_timeout_ms", storage.call_timeout_ms),
            (
                "storage.write_batch_max",
                u64::from(storage.write_batch_max),
            ),
            ("storage.write_batch_bytes", storage.write_batch_bytes),
            (
                "storage.write_connections",
                u64::from(storage.write_connections),
            ),
            (
                "storage.wal_checkpoint_pages",
                u64::from(storage.wal_checkpoint_pages),
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::new(field, "must be at least 1"));
            }
        }
        // SQLite takes its busy timeout as a C int of milliseconds, and
        // PostgreSQL its `statement_timeout` as an int of milliseconds
        // (at most 2147483647).
        for (field, value) in [
            ("storage.busy_timeout_ms", storage.busy_timeout_ms),
            ("storage.statement_timeout_ms", storage.statement_timeout_ms),
        ] {
            if value > i32::MAX as u64 {
                return Err(ConfigError::new(
                    field,
                    format!("must be at most {} (about 24 days)", i32::MAX),
                ));
            }
        }
        if self.reconcile.outbox_max_attempts == 0 {
            return Err(ConfigError::new(
                "reconcile.outbox_max_attempts",
                "must be at least 1",
            ));
        }
        if self.reconcile.outbox_lease_ms < 100 {
            return Err(ConfigError::new(
                "reconcile.outbox_lease_ms",
                "must be at least 100 (a webhook delivery times out at two thirds of it)",
            ));
        }
        if storage.min_connections > storage.max_connections {
            return Err(ConfigError::new(
                "storage.min_connections",
                "must not exceed storage.max_connections",
            ));
        }
        if let Some(schema) = &storage.schema {
            let plain = schema.len() <= 63
                && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && schema
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !plain {
                return Err(ConfigError::new(
                    "storage.schema",
                    "must be 1 to 63 of a-z, 0-9 and _, not starting with a digit",
                ));
            }
            if schema.starts_with("pg_") || schema == "information_schema" {
                return Err(ConfigError::new(
                    "storage.schema",
                    "names a PostgreSQL system schema; choose another",
                ));
            }
        }
        if matches!(storage.backend(), Ok(super::Backend::Sqlite(_))) {
            if storage.path.is_dir() {
                return Err(ConfigError::new(
                    path_field,
                    format!(
                        "{} is a directory: name the ledger file, e.g. {}",
                        storage.path.display(),
                        storage.path.join("effectgate.db").display()
                    ),
                ));
            }
            // Said here, the error names the field the path came from
            // (`storage.url` for a `sqlite://` URL).
            if let Some(folder) = super::missing_folder(&storage.path) {
                return Err(ConfigError::new(
                    path_field,
                    super::missing_folder_text(&storage.path, folder),
                ));
            }
        }
        Ok(storage)
    }

    /// The tenants' ids and every key's digest with its principal; a key's
    /// `file` is relative to `base_dir` (the config file's folder).
    fn tenants_and_keys(
        &self,
        base_dir: &Path,
    ) -> Result<(BTreeSet<String>, KeyTable), ConfigError> {
        let mut tenants = BTreeSet::new();
        let mut keys = HashMap::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            let tp = format!("tenants[{ti}]");
            if !valid_id(&t.id) {
                return Err(ConfigError::new(
                    format!("{tp}.id"),
                    "must be 1..=64 characters of [A-Za-z0-9._-]",
                ));
            }
            if !tenants.insert(t.id.clone()) {
                return Err(ConfigError::new(
                    format!("{tp}.id"),
                    format!("duplicate tenant {:?}", t.id),
                ));
            }
            for (ki, k) in t.keys.iter().enumerate() {
                let kp = format!("{tp}.keys[{ki}]");
                let digest = match (&k.sha256, &k.env, &k.file) {
                    (Some(h), None, None) => {
                        let bytes = hex::decode(h.trim())
                            .ok()
                            .filter(|b| b.len() == 32)
                            .ok_or_else(|| {
                                ConfigError::new(
                                    format!("{kp}.sha256"),
                                    "must be 64 hex characters",
                                )
                            })?;
                        let mut d = [0u8; 32];
                        d.copy_from_slice(&bytes);
                        d
                    }
                    (None, Some(var), None) => {
                        let v = std::env::var(var).map_err(|_| {
                            ConfigError::new(
                                format!("{kp}.env"),
                                format!("environment variable {var} is not set"),
                            )
                        })?;
                        if v.is_empty() {
                            return Err(ConfigError::new(
                                format!("{kp}.env"),
                                format!("{var} is empty"),
                            ));
                        }
                        key_digest(&v)
                    }
                    (None, None, Some(file)) => {
                        let file = base_dir.join(file);
                        let v = std::fs::read_to_string(&file).map_err(|e| {
                            ConfigError::new(
                                format!("{kp}.file"),
                                format!("cannot read {}: {e}", file.display()),
                            )
                        })?;
                        let v = v.trim();
                        if v.is_empty() {
                            return Err(ConfigError::new(
                                format!("{kp}.file"),
                                "key file is empty",
                            ));
                        }
                        key_digest(v)
                    }
                    _ => {
                        return Err(ConfigError::new(
                            kp,
                            "exactly one of `sha256`, `env`, `file` must be set",
                        ));
                    }
                };
                let principal = Principal {
                    tenant: t.id.clone(),
                    name: k
                        .name
                        .clone()
                        .unwrap_or_else(|| format!("{}:{}", t.id, k.role.as_str())),
                    role: k.role,
                };
                if keys.insert(digest, principal).is_some() {
                    return Err(ConfigError::new(kp, "the same key is configured twice"));
                }
            }
        }

        Ok((tenants, keys))
    }

    /// Every tenant's policy bindings, modules resolved next to the file.
    fn policy_bindings(
        &self,
        names: &BTreeSet<String>,
        base_dir: &Path,
    ) -> Result<Vec<(String, PolicyBindingSpec)>, ConfigError> {
        let mut policy_bindings = Vec::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            for (pi, b) in t.policies.iter().enumerate() {
                if b.route != "*" && !names.contains(&b.route) {
                    return Err(ConfigError::new(
                        format!("tenants[{ti}].policies[{pi}].route"),
                        format!("unknown route {:?}", b.route),
                    ));
                }
                let mut b = b.clone();
                b.module = base_dir.join(&b.module);
                if !b.module.is_file() {
                    return Err(ConfigError::new(
                        format!("tenants[{ti}].policies[{pi}].module"),
                        missing_module(&b.module),
                    ));
                }
                policy_bindings.push((t.id.clone(), b));
            }
        }
        Ok(policy_bindings)
    }

    /// Each tenant's rate and in-flight limits.
    fn tenant_limits(&self) -> Result<HashMap<String, TenantLimits>, ConfigError> {
        let mut tenant_limits = HashMap::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            if t.max_in_flight == Some(0) {
                return Err(ConfigError::new(
                    format!("tenants[{ti}].max_in_flight"),
                    "must be at least 1",
                ));
            }
            if t.max_stored_bytes == Some(0) {
                return Err(ConfigError::new(
                    format!("tenants[{ti}].max_stored_bytes"),
                    "must be at least 1",
                ));
            }
            if let Some(r) = &t.rate_limit {
                if r.per_second == 0 {
                    return Err(ConfigError::new(
                        format!("tenants[{ti}].rate_limit.per_second"),
                        "must be at least 1",
                    ));
                }
                if r.burst == Some(0) {
                    return Err(ConfigError::new(
                        format!("tenants[{ti}].rate_limit.burst"),
                        "must be at least 1",
                    ));
                }
            }
            if t.max_in_flight.is_some() || t.rate_limit.is_some() || t.max_stored_bytes.is_some() {
                let mut limits = TenantLimits::new(t.rate_limit.as_ref(), t.max_in_flight);
                limits.max_stored_bytes = t.max_stored_bytes;
                tenant_limits.insert(t.id.clone(), limits);
            }
        }
        Ok(tenant_limits)
    }

    /// Each tenant's webhook, self-approval and MCP tool overrides.
    fn tenant_extras(&self, base_dir: &Path) -> Result<TenantExtras, ConfigError> {
        let mut webhooks = HashMap::new();
        let mut self_approval = BTreeSet::new();
        let mut mcp_tools = HashMap::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            if t.allow_self_approval {
                self_approval.insert(t.id.clone());
            }
            if !t.mcp_tools.is_empty() {
                mcp_tools.insert(t.id.clone(), t.mcp_tools.clone());
            }
            if let Some(w) = &t.webhook {
                let wp = format!("tenants[{ti}].webhook");
                let url: http::Uri = w
                    .url
                    .parse()
                    .map_err(|_| ConfigError::new(format!("{wp}.url"), "not a URL"))?;
                let https = url.scheme_str() == Some("https");
                if !(https || url.scheme_str() == Some("http")) || url.host().is_none() {
                    return Err(ConfigError::new(
                        format!("{wp}.url"),
                        "must be an https:// or http:// URL",
                    ));
                }
                let client = super::egress::outbound_client(
                    super::egress::ClientSpec {
                        path: &wp,
                        tls: w.tls.as_ref(),
                        proxy: w.proxy.as_deref(),
                        proxy_credentials_env: w.proxy_credentials_env.as_deref(),
                        connect_timeout_ms: 2_000,
                        idle_timeout_ms: crate::egress::DEFAULT_IDLE_TIMEOUT_MS,
                        https,
                    },
                    base_dir,
                )?;
                let secret = std::env::var(&w.secret_env).map_err(|_| {
                    ConfigError::new(
                        format!("{wp}.secret_env"),
                        format!("environment variable {} is not set", w.secret_env),
                    )
                })?;
                let events = match &w.events {
                    None => DEFAULT_OPERATION_EVENTS
                        .iter()
                        .map(|e| (*e).to_owned())
                        .collect(),
                    Some(list) => {
                        for e in list {
                            if !OPERATION_EVENTS.contains(&e.as_str()) {
                                return Err(ConfigError::new(
                                    format!("{wp}.events"),
                                    format!(
                                        "unknown event {e:?}; expected any of {}",
                                        OPERATION_EVENTS.join(", ")
                                    ),
                                ));
                            }
                        }
                        list.iter().cloned().collect()
                    }
                };
                webhooks.insert(
                    t.id.clone(),
                    Webhook {
                        url,
                        secret: secret.into_bytes(),
                        client,
                        events,
                    },
                );
            }
        }
        Ok((webhooks, self_approval, mcp_tools))
    }
}

/// Keys by sha256 digest.
type KeyTable = HashMap<[u8; 32], Principal>;

/// Webhooks, tenants allowing self-approval and MCP tool overrides.
type TenantExtras = (
    HashMap<String, Webhook>,
    BTreeSet<String>,
    HashMap<String, std::collections::BTreeMap<String, ToolOverride>>,
);

/// What to say about a policy module that isn't there: the path it was
/// resolved to and, for this repository's policies, the command that
/// builds them.
fn missing_module(module: &Path) -> String {
    let absolute = std::path::absolute(module).unwrap_or_else(|_| module.to_path_buf());
    // `examples/../policies/…` reads better as `policies/…`.
    let mut resolved = PathBuf::new();
    for c in absolute.components() {
        match c {
            std::path::Component::ParentDir if resolved.parent().is_some() => {
                resolved.pop();
            }
            std::path::Component::CurDir => {}
            c => resolved.push(c),
        }
    }
    let mut s = format!("no policy module at {}", resolved.display());
    if module
        .components()
        .any(|c| c.as_os_str() == "wasm32-wasip2")
    {
        s.push_str(
            "; build the policy components with `cargo build --manifest-path policies/Cargo.toml --target wasm32-wasip2 --release --target-dir policies/target` (from the repository root; `rustup target add wasm32-wasip2` first); a relative module path is taken from the config file's folder, so a copied config keeps its folder or names the module by an absolute path",
        );
    }
    s
}
