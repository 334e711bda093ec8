//! [`Ledger`]'s reads: one operation (and a duplicate's, through the
//! replay cache), its history, and the lists the workers and the admin API
//! scan.

use super::{Db, Ledger};
use crate::ledger::{Attempt, LedgerError, Operation, State, TenantCounts, Transition};

impl Ledger {
    /// Reads one operation of `tenant`. Another tenant's operation is `None`.
    pub async fn get(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        dispatch!(self, get(tenant, operation_id))
    }

    /// [`Ledger::get`] for a duplicate request with fingerprint
    /// `fingerprint`: a COMPLETED or FAILED operation of `tenant` with that
    /// fingerprint is served from the replay cache while the ledger still
    /// has it at the version and last change it was cached at (one read of
    /// two integers, not of the row and its bodies; none at all on a SQLite
    /// ledger this process holds, [`Ledger::hold_exclusively`], while no
    /// commit changed or deleted a terminal row since); anything else is read
    /// from the ledger, and a terminal answer read is cached
    /// (`storage.replay_cache_bytes`). The caller still compares
    /// fingerprints: a miss returns whatever the ledger holds.
    ///
    /// Errors: the ledger can't be read.
    pub async fn get_for_duplicate(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        // Read before the ledger is: a change committed after it bumps it.
        let epoch = self.terminal_epoch();
        if let Some(op) = self
            .cached(tenant, operation_id, fingerprint, epoch)
            .await?
        {
            return Ok(Some(op));
        }
        let op = self.get(tenant, operation_id).await?;
        if let Some(op) = &op
            && op.fingerprint == fingerprint
        {
            self.replay.put(op, epoch);
        }
        Ok(op)
    }

    /// The replay cache's part of [`Ledger::get_for_duplicate`] alone: the
    /// COMPLETED or FAILED operation of `tenant` with `fingerprint` under
    /// `operation_id` when the cache holds it and the ledger still has it
    /// at that version (checked as there), else `None` without reading the
    /// operation from the ledger. For a call whose reservation would find
    /// the operation anyway ([`Ledger::reserve_and_claim`] caches a
    /// terminal one it finds).
    ///
    /// Errors: the ledger can't be read.
    pub async fn cached_for_duplicate(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        let epoch = self.terminal_epoch();
        self.cached(tenant, operation_id, fingerprint, epoch).await
    }

    /// The replay cache's entry for the key, while the ledger still has it
    /// at its version (`epoch`: [`Ledger::terminal_epoch`] read before).
    async fn cached(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
        epoch: u64,
    ) -> Result<Option<Operation>, LedgerError> {
        let now = self.clock.now_ms();
        let Some((op, at)) = self.replay.get(tenant, operation_id, fingerprint, now) else {
            return Ok(None);
        };
        if at == epoch && self.exclusive.held() {
            // The only writer of this file has changed no terminal row
            // since the entry was read.
            return Ok(Some(Operation::clone(&op)));
        }
        let current = dispatch!(self, version_of(tenant, operation_id))?;
        if current == Some((op.version, op.updated_at)) {
            self.replay.checked(&op, epoch);
            return Ok(Some(Operation::clone(&op)));
        }
        self.replay.remove(tenant, operation_id, fingerprint);
        Ok(None)
    }

    /// The attempts log of one operation, oldest first.
    pub async fn attempts(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Attempt>, LedgerError> {
        dispatch!(self, attempts(tenant, operation_id))
    }

    /// Policy decisions recorded for an operation id, oldest first, as JSON
    /// objects (policy, content_hash, decision, reason, duration_us,
    /// fingerprint, at).
    pub async fn decisions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<serde_json::Value>, LedgerError> {
        dispatch!(self, decisions(tenant, operation_id))
    }

    /// The transition history of one operation, oldest first.
    pub async fn transitions(
        &self,
        tenant: &str,
        operation_id: &str,
    ) -> Result<Vec<Transition>, LedgerError> {
        dispatch!(self, transitions(tenant, operation_id))
    }

    /// Claims, for `owner`'s scan, the operations the reconciler should
    /// look at now, oldest change first, at most `limit`: UNKNOWN ones that
    /// are due (a NULL `next_reconcile_at` means "operator only": the route
    /// has no read-back) and not leased, EXECUTING ones whose lease expired,
    /// and RESERVED ones untouched for `reserved_grace_ms`. Rows another
    /// scan holds are skipped (`FOR UPDATE SKIP LOCKED` on PostgreSQL); the
    /// claim lasts `scan_ms` or until [`Ledger::release_scan`]. The claim
    /// changes no state and no version: each step is still a
    /// compare-and-swap.
    pub async fn due_for_reconciliation(
        &self,
        owner: &str,
        reserved_grace_ms: i64,
        scan_ms: i64,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        dispatch!(
            self,
            due_for_reconciliation(owner, reserved_grace_ms, scan_ms, limit)
        )
    }

    /// Dead letters of `tenant`, oldest first, at most `limit`.
    pub async fn dead_letters(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        dispatch!(self, dead_letters(tenant, limit))
    }

    /// Per-tenant counts of UNKNOWN operations and dead letters (tenants
    /// with neither are absent).
    pub async fn tenant_counts(&self) -> Result<Vec<TenantCounts>, LedgerError> {
        dispatch!(self, tenant_counts())
    }

    /// Bytes of request and response bodies `tenant`'s operations hold in
    /// the ledger (read pool).
    ///
    /// Errors: the ledger can't be read.
    pub async fn stored_bytes(&self, tenant: &str) -> Result<i64, LedgerError> {
        dispatch!(self, stored_bytes(tenant))
    }

    /// Lists operations, newest change first, optionally filtered by tenant
    /// and state, at most `limit` rows.
    pub async fn list(
        &self,
        tenant: Option<&str>,
        state: Option<State>,
        limit: u32,
    ) -> Result<Vec<Operation>, LedgerError> {
        dispatch!(self, list(tenant, state, limit))
    }
}
