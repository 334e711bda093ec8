//! Replays from memory: a bounded LRU of terminal operations (COMPLETED or
//! FAILED), keyed by tenant, operation id and request fingerprint, with
//! the row version and last change they were read at.
//!
//! An entry is served only while the ledger still has the operation at
//! that version and last change (one indexed read of two integers instead
//! of the row with its bodies): a compensation, a forced replay, a
//! requeue, the retention sweeper or another instance sharing the ledger
//! changes or deletes the row, and the entry is dropped and the row read
//! afresh. On SQLite, where one gateway process holds the ledger file
//! ([`crate::ledger::Ledger::hold_exclusively`]), that read is skipped
//! while the writer's terminal epoch is still the one the entry was read
//! at: every commit that changes or deletes a COMPLETED or FAILED row
//! bumps it. An entry past its key retention (`expires_at`) is never
//! served.
//! A request with another fingerprint or of another tenant never finds
//! an entry that is not its own; the fingerprint check (422) runs on what
//! the ledger holds.
//!
//! Entries are filled when an outcome is recorded (the row the outcome's
//! compare-and-swap returned, as committed) and when a duplicate reads the
//! row from the ledger.
//!
//! The budget is `storage.replay_cache_bytes` (bodies, headers and
//! strings, approximately); 0 turns the cache off.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::{Operation, State};

/// (tenant, operation id, fingerprint).
type Key = (String, String, String);

struct Entry {
    op: Arc<Operation>,
    /// The writer's terminal epoch read before the row was.
    epoch: u64,
    tick: u64,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    map: HashMap<Key, Entry>,
    /// Least recently used first.
    order: BTreeMap<u64, Key>,
    tick: u64,
    bytes: usize,
}

/// The cache. Cheap to share (`Arc`).
pub(crate) struct ReplayCache {
    budget: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// About how many bytes the entry of `op` holds: the operation with its
/// strings, headers and bodies, and the two copies of its key (the map's
/// and the LRU order's) with their nodes.
fn size_of(op: &Operation) -> usize {
    let key = op.tenant_id.len()
        + op.operation_id.len()
        + op.fingerprint.len()
        + 3 * std::mem::size_of::<String>();
    let nodes = 2 * key + std::mem::size_of::<Entry>() + 64;
    let strings = [
        &op.tenant_id,
        &op.operation_id,
        &op.route,
        &op.method,
        &op.path,
        &op.fingerprint,
        &op.provider_key,
        &op.principal,
    ]
    .iter()
    .map(|s| s.len())
    .sum::<usize>();
    let headers = op
        .response_headers
        .iter()
        .chain(&op.request_headers)
        .map(|(n, v)| n.len() + v.len() + 48)
        .sum::<usize>();
    std::mem::size_of::<Operation>()
        + nodes
        + strings
        + headers
        + op.request_body.len()
        + op.response_body.as_ref().map_or(0, Vec::len)
        + op.error_detail.as_ref().map_or(0, String::len)
        + 128
}

impl ReplayCache {
    /// A cache of at most `budget` bytes (0: off).
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry of (`tenant`, `operation_id`, `fingerprint`), if any and
    /// still within its key retention at `now_ms`, with the terminal epoch
    /// it was read at; marks it used.
    pub(crate) fn get(
        &self,
        tenant: &str,
        operation_id: &str,
        fingerprint: &str,
        now_ms: i64,
    ) -> Option<(Arc<Operation>, u64)> {
        if self.budget == 0 {
            return None;
        }
        let key = (
            tenant.to_owned(),
            operation_id.to_owned(),
            fingerprint.to_owned(),
        );
        let mut inner = self.lock();
        let inner = &mut *inner;
        let entry = inner.map.get_mut(&key)?;
        if entry.op.expires_at <= now_ms {
            let gone = inner.map.remove(&key).expect("just found");
            inner.order.remove(&gone.tick);
            inner.bytes -= gone.bytes;
            return None;
        }
        inner.tick += 1;
        inner.order.remove(&entry.tick);
        entry.tick = inner.tick;
        inner.order.insert(entry.tick, key);
        Some((entry.op.clone(), entry.epoch))
    }

    /// Marks `op`, an entry [`ReplayCache::get`] returned, as checked
    /// against the ledger at terminal epoch `epoch` (read before the
    /// check). Nothing changes if the entry under its key is another one
    /// by now (replaced by a concurrent fill).
    pub(crate) fn checked(&self, op: &Arc<Operation>, epoch: u64) {
        let key = (
            op.tenant_id.clone(),
            op.operation_id.clone(),
            op.fingerprint.clone(),
        );
        if let Some(e) = self.lock().map.get_mut(&key)
            && Arc::ptr_eq(&e.op, op)
        {
            e.epoch = e.epoch.max(epoch);
        }
    }

    /// Keeps `op`, read at terminal epoch `epoch`, if it is COMPLETED or
    /// FAILED and fits the budget, evicting the least recently used
    /// entries to make room.
    pub(crate) fn put(&self, op: &Operation, epoch: u64) {
        if self.budget == 0 || !matches!(op.state, State::Completed | State::Failed) {
            return;
        }
        let bytes = size_of(op);
        if bytes > self.budget / 8 {
            // One huge answer must not empty the cache.
            return;
        }
        let key = (
            op.tenant_id.clone(),
            op.operation_id.clone(),
            op.fingerprint.clone(),
        );
        let mut inner = self.lock();
        let inner = &mut *inner;
        if let Some(old) = inner.map.get(&key)
            && (old.op.version, old.op.updated_at) > (op.version, op.updated_at)
        {
            // A fill that read the row before a later one did: the newer
            // entry stays.
            return;
        }
        if let Some(old) = inner.map.remove(&key) {
            inner.order.remove(&old.tick);
            inner.bytes -= old.bytes;
        }
        while inner.bytes + bytes > self.budget {
            let Some((_, lru)) = inner.order.pop_first() else {
                break;
            };
            if let Some(gone) = inner.map.remove(&lru) {
                inner.bytes -= gone.bytes;
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order.insert(tick, key.clone());
        inner.bytes += bytes;
        inner.map.insert(
            key,
            Entry {
                op: Arc::new(op.clone()),
                epoch,
                tick,
                bytes,
            },
        );
    }

    /// Drops the entry of (`tenant`, `operation_id`, `fingerprint`).
    pub(crate) fn remove(&self, tenant: &str, operation_id: &str, fingerprint: &str) {
        let key = (
            tenant.to_owned(),
            operation_id.to_owned(),
            fingerprint.to_owned(),
        );
        let mut inner = self.lock();
        if let Some(gone) = inner.map.remove(&key) {
            inner.order.remove(&gone.tick);
            inner.bytes -= gone.bytes;
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(tenant: &str, id: &str, fp: &str, body: usize) -> Operation {
        Operation {
            tenant_id: tenant.into(),
            operation_id: id.into(),
            route: "pay".into(),
            method: "POST".into(),
            path: "v1".into(),
            query: None,
            fingerprint: fp.into(),
            provider_key: "pk".into(),
            effect_class: None,
            state: State::Completed,
            version: 3,
            attempts: 1,
            lease_owner: None,
            lease_expires_at: None,
            fence: 1,
            request_content_type: None,
            request_body: Vec::new(),
            principal: "p".into(),
            response_status: Some(201),
            response_headers: Vec::new(),
            response_body: Some(vec![0; body]),
            response_body_bytes: None,
            response_body_omitted: false,
            error_kind: None,
            error_detail: None,
            created_at: 0,
            updated_at: 0,
            expires_at: 1_000,
            request_headers: Vec::new(),
            trace_context: None,
            reconcile_attempts: 0,
            next_reconcile_at: None,
            dead_letter: false,
            dead_letter_reason: None,
            operator_check: None,
            provider_reference: None,
            requeues: 0,
            settle_until: None,
        }
    }

    #[test]
    fn serves_only_its_own_tenant_and_fingerprint() {
        let c = ReplayCache::new(1 << 20);
        c.put(&op("t1", "k", "fp-a", 10), 0);
        assert!(c.get("t1", "k", "fp-a", 0).is_some());
        assert!(c.get("t2", "k", "fp-a", 0).is_none(), "another tenant");
        assert!(c.get("t1", "k", "fp-b", 0).is_none(), "another fingerprint");
    }

    #[test]
    fn never_serves_past_retention_or_a_state_that_can_change() {
        let c = ReplayCache::new(1 << 20);
        c.put(&op("t", "k", "fp", 10), 0);
        assert!(c.get("t", "k", "fp", 1_000).is_none(), "expired");
        assert_eq!(c.bytes(), 0, "and dropped");
        for state in [State::Compensated, State::Unknown, State::Executing] {
            let mut o = op("t", "k", "fp", 10);
            o.state = state;
            c.put(&o, 0);
            assert!(c.get("t", "k", "fp", 0).is_none(), "{state}");
        }
    }

    /// A fill that read an older row than the entry's (it stalled while
    /// the row changed and another fill cached the new one) keeps the
    /// newer entry; a check retags only the entry it checked.
    #[test]
    fn an_older_fill_never_replaces_a_newer_entry() {
        let c = ReplayCache::new(1 << 20);
        let mut newer = op("t", "k", "fp", 10);
        newer.version = 6;
        c.put(&newer, 1);
        let (got, _) = c.get("t", "k", "fp", 0).unwrap();
        let older = op("t", "k", "fp", 10);
        c.put(&older, 0);
        assert_eq!(c.get("t", "k", "fp", 0).unwrap().0.version, 6);
        // The entry checked is the one under the key: retagged.
        c.checked(&got, 5);
        assert_eq!(c.get("t", "k", "fp", 0).unwrap().1, 5);
        // Another entry took its place: a check of the old one changes nothing.
        let mut newest = op("t", "k", "fp", 10);
        newest.version = 8;
        c.put(&newest, 5);
        c.checked(&got, 9);
        let (now, epoch) = c.get("t", "k", "fp", 0).unwrap();
        assert_eq!((now.version, epoch), (8, 5));
    }

    #[test]
    fn stays_within_its_budget_evicting_the_least_recently_used() {
        let one = size_of(&op("t", "k0", "fp", 1_000));
        let c = ReplayCache::new(one * 8 + one / 2);
        for i in 0..8 {
            c.put(&op("t", &format!("k{i}"), "fp", 1_000), 0);
        }
        // k0 used last: k1 is the one to go.
        assert!(c.get("t", "k0", "fp", 0).is_some());
        c.put(&op("t", "k8", "fp", 1_000), 0);
        assert!(c.bytes() <= one * 8 + one / 2);
        assert!(c.get("t", "k1", "fp", 0).is_none());
        assert!(c.get("t", "k0", "fp", 0).is_some());
        assert!(c.get("t", "k8", "fp", 0).is_some());
    }
}
