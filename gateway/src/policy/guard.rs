//! What a policy call must pass before it runs.
//!
//! - [`Permits`]: each tenant has `policy.max_concurrent_per_tenant`
//!   permits, and every call also takes one of `policy.pool_instances`
//!   slots, so one tenant's burst can neither take another tenant's share
//!   nor exhaust the instance pool. A call that finds none free within
//!   `policy.permit_wait_ms` fails as `busy`.
//! - [`Breakers`]: a circuit breaker per tenant (and principal, for a caller's
//!   request) and policy. After
//!   `policy.breaker_failures` failures in a row the circuit opens: for
//!   `policy.breaker_cooldown_ms` the policy's calls fail at once
//!   (`circuit-open`) without an instance; then one trial call runs
//!   (half-open), and its success closes the circuit while its failure
//!   opens it again. Time is passed in by the caller, so the state machine
//!   runs on any clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::engine::{BusyLimit, PolicyFailure};
use crate::config::PolicyLimitsSpec;

/// Per-tenant permits and the pool's slots.
pub(super) struct Permits {
    per_tenant: u32,
    pool: u32,
    wait: Duration,
    slots: Arc<Semaphore>,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A tenant's permit and a pool slot, held while the call runs.
#[derive(Debug)]
pub struct Permit {
    _tenant: OwnedSemaphorePermit,
    _slot: OwnedSemaphorePermit,
}

impl Permits {
    pub(super) fn new(limits: &PolicyLimitsSpec) -> Self {
        let pool = limits.pool_instances.max(1);
        Self {
            per_tenant: limits.max_concurrent_per_tenant.clamp(1, pool),
            pool,
            wait: Duration::from_millis(limits.permit_wait_ms),
            slots: Arc::new(Semaphore::new(pool as usize)),
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// The permits of `tenant` (created at its first call; tenants come
    /// from the config, so the map stays bounded by it).
    fn tenant(&self, tenant: &str) -> Arc<Semaphore> {
        let mut tenants = self.tenants.lock().unwrap();
        if let Some(s) = tenants.get(tenant) {
            return s.clone();
        }
        let s = Arc::new(Semaphore::new(self.per_tenant as usize));
        tenants.insert(tenant.to_owned(), s.clone());
        s
    }

    /// Waits up to `policy.permit_wait_ms` for one of `tenant`'s permits,
    /// then for a pool slot (within the same bound).
    ///
    /// Errors: [`PolicyFailure::Busy`], naming the limit that was full.
    pub(super) async fn acquire(&self, tenant: &str) -> Result<Permit, PolicyFailure> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let wait_ms = self.wait.as_millis() as u64;
        let busy = |limit| PolicyFailure::Busy { limit, wait_ms };
        let tenant_permit = tokio::time::timeout_at(deadline, self.tenant(tenant).acquire_owned())
            .await
            .ok()
            .and_then(Result::ok)
            .ok_or_else(|| busy(BusyLimit::Tenant(self.per_tenant)))?;
        let slot = tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned())
            .await
            .ok()
            .and_then(Result::ok)
            .ok_or_else(|| busy(BusyLimit::Pool(self.pool)))?;
        Ok(Permit {
            _tenant: tenant_permit,
            _slot: slot,
        })
    }

    /// Permits of `tenant` free now.
    pub(super) fn available(&self, tenant: &str) -> usize {
        self.tenant(tenant).available_permits()
    }
}

/// A circuit's state. A closed circuit without failures has no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Calls run; `failures` in a row so far.
    Closed { failures: u32 },
    /// Calls are refused until `until`.
    Open { until: Instant },
    /// One trial call is running; the others are refused.
    HalfOpen,
}

/// How a call that passed the breaker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The policy answered.
    Success,
    /// The policy failed (trap, deadline, memory, fuel, invalid output,
    /// instantiation).
    Failure,
    /// Nothing is known of the policy (the host could not run it).
    Abandoned,
}

impl Outcome {
    /// The outcome of a call that returned `r`.
    pub(super) fn of<R>(r: &Result<R, PolicyFailure>) -> Self {
        match r {
            Ok(_) => Outcome::Success,
            Err(f) if f.is_policy_fault() => Outcome::Failure,
            Err(_) => Outcome::Abandoned,
        }
    }
}

/// A change of a circuit, for the log and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// The circuit opened (after `failures` in a row, or a failed trial).
    Opened,
    /// A trial call succeeded: the circuit is closed.
    Closed,
}

/// Circuit breakers per tenant and policy.
#[derive(Debug)]
pub(super) struct Breakers {
    /// Failures in a row that open a circuit; 0: never.
    threshold: u32,
    cooldown: Duration,
    /// tenant → policy name → state.
    circuits: Mutex<HashMap<String, HashMap<String, State>>>,
}

/// A call let through by [`Breakers::admit`]. Resolve it with the call's
/// [`Outcome`]; dropped unresolved (a panic in the host), a trial leaves
/// the circuit open with the next call as the trial.
#[derive(Debug)]
pub(super) struct Pass<'a> {
    breakers: &'a Breakers,
    tenant: &'a str,
    policy: &'a str,
    trial: bool,
    resolved: bool,
}

impl Pass<'_> {
    /// Whether this is the trial call of a half-open circuit.
    pub(super) fn is_trial(&self) -> bool {
        self.trial
    }

    /// Records how the call ended, at `now`.
    pub(super) fn resolve(mut self, outcome: Outcome, now: Instant) -> Option<Change> {
        self.resolved = true;
        self.breakers
            .record(self.tenant, self.policy, self.trial, outcome, now)
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if !self.resolved && self.trial {
            self.breakers.record(
                self.tenant,
                self.policy,
                true,
                Outcome::Abandoned,
                Instant::now(),
            );
        }
    }
}

impl Breakers {
    pub(super) fn new(limits: &PolicyLimitsSpec) -> Self {
        Self {
            threshold: limits.breaker_failures,
            cooldown: Duration::from_millis(limits.breaker_cooldown_ms),
            circuits: Mutex::new(HashMap::new()),
        }
    }

    /// Lets a call of `tenant`'s `policy` through at `now`, unless its
    /// circuit is open (or half-open with its trial running).
    ///
    /// Errors: [`PolicyFailure::CircuitOpen`], with the time until a trial.
    pub(super) fn admit<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a str,
        now: Instant,
    ) -> Result<Pass<'a>, PolicyFailure> {
        let pass = |trial| Pass {
            breakers: self,
            tenant,
            policy,
            trial,
            resolved: false,
        };
        if self.threshold == 0 {
            return Ok(pass(false));
        }
        let mut circuits = self.circuits.lock().unwrap();
        let Some(state) = circuits.get_mut(tenant).and_then(|p| p.get_mut(policy)) else {
            return Ok(pass(false));
        };
        let refused = |retry_in: Duration| PolicyFailure::CircuitOpen {
            failures: self.threshold,
            retry_in_ms: retry_in.as_millis() as u64,
        };
        match *state {
            State::Closed { .. } => Ok(pass(false)),
            State::Open { until } if now >= until => {
                *state = State::HalfOpen;
                Ok(pass(true))
            }
            State::Open { until } => Err(refused(until - now)),
            State::HalfOpen => Err(refused(Duration::ZERO)),
        }
    }

    fn record(
        &self,
        tenant: &str,
        policy: &str,
        trial: bool,
        outcome: Outcome,
        now: Instant,
    ) -> Option<Change> {
        if self.threshold == 0 || (!trial && outcome == Outcome::Abandoned) {
            return None;
        }
        let mut circuits = self.circuits.lock().unwrap();
        let current = circuits
            .get(tenant)
            .and_then(|p| p.get(policy))
            .copied()
            .unwrap_or(State::Closed { failures: 0 });
        let open = State::Open {
            until: now + self.cooldown,
        };
        let (next, change) = match (current, trial, outcome) {
            // A trial decides for the circuit.
            (_, true, Outcome::Success) => (None, Some(Change::Closed)),
            (_, true, Outcome::Failure) => (Some(open), Some(Change::Opened)),
            (_, true, Outcome::Abandoned) => (Some(State::Open { until: now }), None),
            // Calls let through before the circuit opened don't change it.
            (State::Open { .. } | State::HalfOpen, false, _) => return None,
            (State::Closed { failures: 0 }, false, Outcome::Success) => return None,
            (State::Closed { .. }, false, Outcome::Success) => (None, None),
            (State::Closed { failures }, false, _) => {
                let failures = failures + 1;
                if failures >= self.threshold {
                    (Some(open), Some(Change::Opened))
                } else {
                    (Some(State::Closed { failures }), None)
                }
            }
        };
        match next {
            Some(state) => {
                circuits
                    .entry(tenant.to_owned())
                    .or_default()
                    .insert(policy.to_owned(), state);
            }
            None => {
                if let Some(p) = circuits.get_mut(tenant) {
                    p.remove(policy);
                    if p.is_empty() {
                        circuits.remove(tenant);
                    }
                }
            }
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers(threshold: u32, cooldown_ms: u64) -> Breakers {
        Breakers::new(&PolicyLimitsSpec {
            breaker_failures: threshold,
            breaker_cooldown_ms: cooldown_ms,
            ..Default::default()
        })
    }

    /// One call of tenant `t`'s policy `p` at `now`, ending with `outcome`.
    fn call(b: &Breakers, now: Instant, outcome: Outcome) -> Result<Option<Change>, u64> {
        match b.admit("t", "p", now) {
            Ok(pass) => Ok(pass.resolve(outcome, now)),
            Err(PolicyFailure::CircuitOpen { retry_in_ms, .. }) => Err(retry_in_ms),
            Err(e) => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn opens_after_the_threshold_in_a_row_and_refuses_until_the_cooldown() {
        let b = breakers(3, 1000);
        let t0 = Instant::now();
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
        assert_eq!(call(&b, t0, Outcome::Success), Err(1000));
        let later = t0 + Duration::from_millis(400);
        assert_eq!(call(&b, later, Outcome::Success), Err(600));
        // Another policy and another tenant are not affected.
        assert!(b.admit("t", "q", later).is_ok());
        assert!(b.admit("u", "p", later).is_ok());
    }

    #[test]
    fn a_success_resets_the_count() {
        let b = breakers(2, 1000);
        let t0 = Instant::now();
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Success), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
    }

    #[test]
    fn abandoned_calls_do_not_count() {
        let b = breakers(2, 1000);
        let t0 = Instant::now();
        for _ in 0..10 {
            assert_eq!(call(&b, t0, Outcome::Abandoned), Ok(None));
        }
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Abandoned), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
    }

    #[test]
    fn after_the_cooldown_one_trial_runs_and_decides() {
        let b = breakers(1, 100);
        let t0 = Instant::now();
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
        let t1 = t0 + Duration::from_millis(100);
        // Half-open: the trial runs, every other call is refused meanwhile.
        let trial = b.admit("t", "p", t1).unwrap();
        assert!(trial.is_trial());
        assert!(matches!(
            b.admit("t", "p", t1),
            Err(PolicyFailure::CircuitOpen { .. })
        ));
        // A failed trial opens the circuit for another cool-down.
        assert_eq!(trial.resolve(Outcome::Failure, t1), Some(Change::Opened));
        assert_eq!(
            call(&b, t1 + Duration::from_millis(50), Outcome::Success),
            Err(50)
        );
        // A successful one closes it.
        let t2 = t1 + Duration::from_millis(100);
        let trial = b.admit("t", "p", t2).unwrap();
        assert!(trial.is_trial());
        assert_eq!(trial.resolve(Outcome::Success, t2), Some(Change::Closed));
        let pass = b.admit("t", "p", t2).unwrap();
        assert!(!pass.is_trial());
        assert_eq!(pass.resolve(Outcome::Success, t2), None);
        assert!(b.circuits.lock().unwrap().is_empty());
    }

    #[test]
    fn a_trial_dropped_unresolved_lets_the_next_call_try() {
        let b = breakers(1, 100);
        let t0 = Instant::now();
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
        let t1 = t0 + Duration::from_millis(100);
        drop(b.admit("t", "p", t1).unwrap());
        let trial = b.admit("t", "p", t1).unwrap();
        assert!(trial.is_trial());
        let t2 = t1 + Duration::from_millis(1);
        assert_eq!(trial.resolve(Outcome::Abandoned, t2), None);
        assert!(b.admit("t", "p", t2).unwrap().is_trial());
    }

    #[test]
    fn calls_let_through_before_the_circuit_opened_do_not_change_it() {
        let b = breakers(2, 100);
        let t0 = Instant::now();
        let early = b.admit("t", "p", t0).unwrap();
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        assert_eq!(call(&b, t0, Outcome::Failure), Ok(Some(Change::Opened)));
        assert_eq!(early.resolve(Outcome::Success, t0), None);
        assert_eq!(call(&b, t0, Outcome::Success), Err(100));
    }

    #[test]
    fn a_threshold_of_zero_never_opens() {
        let b = breakers(0, 100);
        let t0 = Instant::now();
        for _ in 0..100 {
            assert_eq!(call(&b, t0, Outcome::Failure), Ok(None));
        }
        assert!(b.circuits.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn permits_are_per_tenant_and_bounded_by_the_pool() {
        let p = Permits::new(&PolicyLimitsSpec {
            pool_instances: 3,
            max_concurrent_per_tenant: 2,
            permit_wait_ms: 0,
            ..Default::default()
        });
        let a1 = p.acquire("a").await.unwrap();
        let _a2 = p.acquire("a").await.unwrap();
        assert_eq!(p.available("a"), 0);
        assert_eq!(
            p.acquire("a").await.unwrap_err(),
            PolicyFailure::Busy {
                limit: BusyLimit::Tenant(2),
                wait_ms: 0
            }
        );
        // Tenant b has its own permits, but only one pool slot is left.
        let _b1 = p.acquire("b").await.unwrap();
        assert_eq!(p.available("b"), 1);
        assert_eq!(
            p.acquire("b").await.unwrap_err(),
            PolicyFailure::Busy {
                limit: BusyLimit::Pool(3),
                wait_ms: 0
            }
        );
        // A refused call gave its tenant permit back.
        assert_eq!(p.available("b"), 1);
        drop(a1);
        assert!(p.acquire("b").await.is_ok());
    }

    #[tokio::test]
    async fn a_permit_freed_within_the_wait_is_taken() {
        let p = Arc::new(Permits::new(&PolicyLimitsSpec {
            max_concurrent_per_tenant: 1,
            permit_wait_ms: 10_000,
            ..Default::default()
        }));
        let held = p.acquire("a").await.unwrap();
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.acquire("a").await.map(drop) })
        };
        tokio::task::yield_now().await;
        drop(held);
        waiter.await.unwrap().unwrap();
    }

    #[test]
    fn the_tenant_share_is_at_most_the_pool() {
        let p = Permits::new(&PolicyLimitsSpec {
            pool_instances: 4,
            max_concurrent_per_tenant: 32,
            ..Default::default()
        });
        assert_eq!(p.available("a"), 4);
    }
}
