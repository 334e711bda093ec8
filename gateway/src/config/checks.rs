//! The checks of a [`ConfigFile`] that convert nothing: the read pool and
//! `[limits]`, `[policy]`, the routes' prefixes and `[reconcile]`. Each
//! names the field it refuses.

use super::*;

impl ConfigFile {
    /// The read pool and `[limits]`.
    pub(super) fn check_pools_and_limits(&self) -> Result<(), ConfigError> {
        if self.storage.path.as_os_str().is_empty() {
            return Err(ConfigError::new("storage.path", "must not be empty"));
        }
        if self.storage.max_read_connections == 0 {
            return Err(ConfigError::new(
                "storage.max_read_connections",
                "must be at least 1",
            ));
        }
        for (field, value) in [
            (
                "limits.header_read_timeout_ms",
                self.limits.header_read_timeout_ms,
            ),
            (
                "limits.body_read_timeout_ms",
                self.limits.body_read_timeout_ms,
            ),
            ("limits.idle_timeout_ms", self.limits.idle_timeout_ms),
            ("limits.console_session_ms", self.limits.console_session_ms),
            (
                "limits.max_connections",
                self.limits.max_connections.map_or(1, |n| n as u64),
            ),
            (
                "limits.max_admin_connections",
                self.limits.max_admin_connections as u64,
            ),
            (
                "limits.max_admin_body_bytes",
                self.limits.max_admin_body_bytes as u64,
            ),
            (
                "limits.max_reason_chars",
                self.limits.max_reason_chars as u64,
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::new(field, "must be at least 1"));
            }
        }
        // A lease is extended every third of itself while a call runs: a
        // lease of a few ms would be lost between two extensions, and each
        // call would end "outcome unknown" while it spins on extensions.
        for (field, value) in [
            ("limits.lease_ms", self.limits.lease_ms),
            ("reconcile.lease_ms", self.reconcile.lease_ms),
        ] {
            if value < 100 {
                return Err(ConfigError::new(
                    field,
                    "must be at least 100 (a lease is extended every third of it while a provider call runs)",
                ));
            }
        }
        // Below this no ordinary request head fits (each would get 431).
        if self.limits.max_header_bytes < 1024 {
            return Err(ConfigError::new(
                "limits.max_header_bytes",
                "must be at least 1024",
            ));
        }
        if self.limits.max_decoded_replay_bytes == 0 {
            return Err(ConfigError::new(
                "limits.max_decoded_replay_bytes",
                "must be at least 1",
            ));
        }
        if !(1..=1024).contains(&self.limits.max_concurrent_replay_decodes) {
            return Err(ConfigError::new(
                "limits.max_concurrent_replay_decodes",
                "must be 1 to 1024",
            ));
        }
        if !(1..=255).contains(&self.limits.max_idempotency_key_len) {
            return Err(ConfigError::new(
                "limits.max_idempotency_key_len",
                "must be in 1..=255",
            ));
        }
        if self.limits.max_list_limit == 0 {
            return Err(ConfigError::new(
                "limits.max_list_limit",
                "must be at least 1",
            ));
        }
        // Indexed columns: PostgreSQL refuses an index entry much longer.
        for (field, value, what) in [
            (
                "limits.max_provider_reference_bytes",
                self.limits.max_provider_reference_bytes,
                "the reference is indexed",
            ),
            (
                "limits.max_inbox_id_bytes",
                self.limits.max_inbox_id_bytes,
                "event ids and sequence keys are indexed",
            ),
        ] {
            if !(1..=2048).contains(&value) {
                return Err(ConfigError::new(
                    field,
                    format!("must be in 1..=2048 ({what})"),
                ));
            }
        }
        for (field, value) in [
            (
                "limits.console_sessions_per_key",
                self.limits.console_sessions_per_key,
            ),
            ("limits.mcp_tool_endpoints", self.limits.mcp_tool_endpoints),
        ] {
            if value == 0 {
                return Err(ConfigError::new(field, "must be at least 1"));
            }
        }

        Ok(())
    }
}

/// `[policy]`: its limits, and the compile cache folder resolved next to
/// the file.
pub(super) fn check_policy(
    policy: &mut PolicyLimitsSpec,
    source: Option<&Path>,
    base_dir: &Path,
) -> Result<(), ConfigError> {
    if policy.memory_bytes < 64 * 1024 {
        return Err(ConfigError::new(
            "policy.memory_bytes",
            "must be at least 65536 (one wasm page)",
        ));
    }
    if policy.deadline_ms == 0 {
        return Err(ConfigError::new("policy.deadline_ms", "must be at least 1"));
    }
    if policy.pool_instances == 0 {
        return Err(ConfigError::new(
            "policy.pool_instances",
            "must be at least 1",
        ));
    }
    if policy.max_concurrent_per_tenant == 0 {
        return Err(ConfigError::new(
            "policy.max_concurrent_per_tenant",
            "must be at least 1",
        ));
    }
    if policy.breaker_failures > 0 && policy.breaker_cooldown_ms == 0 {
        return Err(ConfigError::new(
            "policy.breaker_cooldown_ms",
            "must be at least 1 (set policy.breaker_failures = 0 to turn the breaker off)",
        ));
    }
    if let Some(dir) = &mut policy.cache_dir {
        if dir.as_os_str().is_empty() {
            return Err(ConfigError::new(
                "policy.cache_dir",
                "must not be empty (leave it unset to compile policies in memory)",
            ));
        }
        if dir.is_relative() && source.is_some() {
            *dir = base_dir.join(&*dir);
        }
        if dir.exists() && !dir.is_dir() {
            return Err(ConfigError::new(
                "policy.cache_dir",
                format!("{} exists and is not a directory", dir.display()),
            ));
        }
    }
    Ok(())
}

/// Unique route prefixes (longest first afterwards) and `[reconcile]`.
pub(super) fn check_routes_and_reconcile(
    routes: &mut [Route],
    reconcile: &ReconcileSpec,
) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for (ri, r) in routes.iter().enumerate() {
        if !seen.insert(r.prefix.clone()) {
            return Err(ConfigError::new(
                format!("routes[{ri}].prefix"),
                format!("duplicate prefix {:?}", r.prefix),
            ));
        }
    }
    routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
    if reconcile.interval_ms == 0 {
        return Err(ConfigError::new(
            "reconcile.interval_ms",
            "must be at least 1",
        ));
    }
    if reconcile.batch == 0 {
        return Err(ConfigError::new("reconcile.batch", "must be at least 1"));
    }
    Ok(())
}
