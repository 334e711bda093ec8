//! The read-back settle windows on the monotonic clock: the in-memory
//! complement of an UNKNOWN operation's `settle_until`.
//!
//! `settle_until` is on the ledger's clock (wall time; the database clock
//! on PostgreSQL). A step of that clock forward past the settle delay
//! would let an "absent" read-back be trusted before the provider could
//! show the effect, and a new attempt would duplicate it. So "absent" is
//! trusted only once the delay has also passed on the monotonic clock
//! ([`super::Clock::monotonic_ms`]), measured in this process:
//!
//! - the process that moves an operation to UNKNOWN (its attempt's
//!   outcome, or an expired lease) opens the window at that moment;
//! - a process that knows no window for the operation's current
//!   `settle_until` (it restarted, another instance moved the operation,
//!   or the window was dropped) opens one when its first "absent"
//!   read-back is sent: that read-back and any sent within the delay after
//!   it are not trusted. A missing window costs one settle delay, never
//!   an early trust.
//!
//! A window is keyed by the operation and the `settle_until` value it
//! belongs to, so a later UNKNOWN (a new attempt's) never uses an older
//! window. It is dropped when the operation ends in this process, or an
//! hour after it closed ([`SettleWindows::open`] sweeps those).

use std::collections::HashMap;
use std::sync::Mutex;

/// A closed window is kept this long (ms) after its end: a read-back
/// within it still finds it passed (dropped, it would open a fresh one).
const KEEP_AFTER_END_MS: i64 = 3_600_000;

/// Fewest windows kept before a sweep runs.
const SWEEP_FROM: usize = 1024;

/// One window: which `settle_until` it belongs to and when it ends.
#[derive(Debug, Clone, Copy)]
struct Window {
    settle_until: i64,
    /// End of the window, monotonic ms.
    ends_at: i64,
}

/// The settle windows of this process, by (tenant, operation id).
#[derive(Debug)]
pub struct SettleWindows {
    windows: Mutex<Windows>,
}

#[derive(Debug)]
struct Windows {
    by_op: HashMap<(String, String), Window>,
    /// Sweep when the map reaches this size.
    sweep_at: usize,
}

impl Default for SettleWindows {
    fn default() -> Self {
        Self {
            windows: Mutex::new(Windows {
                by_op: HashMap::new(),
                sweep_at: SWEEP_FROM,
            }),
        }
    }
}

/// What a window says of an "absent" read-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleVerdict {
    /// Sent after the settle delay passed on the monotonic clock.
    Passed,
    /// Sent within it: the window ends this many ms after now.
    Settling {
        /// ms from now (monotonic) to the end of the window, ≥ 0.
        left_ms: i64,
    },
}

impl SettleWindows {
    /// Opens the window of `tenant`/`operation_id` entering UNKNOWN with
    /// the ledger's `settle_until`: it ends `delay_ms` after `now`
    /// (monotonic ms). Replaces any older window of the operation.
    pub fn open(
        &self,
        tenant: &str,
        operation_id: &str,
        settle_until: i64,
        now: i64,
        delay_ms: i64,
    ) {
        let mut w = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        w.by_op.insert(
            (tenant.to_owned(), operation_id.to_owned()),
            Window {
                settle_until,
                ends_at: now.saturating_add(delay_ms.max(0)),
            },
        );
        if w.by_op.len() >= w.sweep_at {
            w.by_op
                .retain(|_, win| win.ends_at.saturating_add(KEEP_AFTER_END_MS) > now);
            w.sweep_at = (w.by_op.len() * 2).max(SWEEP_FROM);
        }
    }

    /// Drops the operation's window (it ended).
    pub fn close(&self, tenant: &str, operation_id: &str) {
        let mut w = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        w.by_op
            .remove(&(tenant.to_owned(), operation_id.to_owned()));
    }

    /// Judges an "absent" read-back of `tenant`/`operation_id` (whose row
    /// says `settle_until`) sent at monotonic `sent`, `now` being the
    /// monotonic time of the judgement. Without a window for that
    /// `settle_until`, one opens at `sent`, `delay_ms` long (0: passed at
    /// once).
    pub fn judge(
        &self,
        (tenant, operation_id): (&str, &str),
        settle_until: i64,
        sent: i64,
        now: i64,
        delay_ms: i64,
    ) -> SettleVerdict {
        let mut w = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        let key = (tenant.to_owned(), operation_id.to_owned());
        let ends_at = match w.by_op.get(&key) {
            Some(win) if win.settle_until == settle_until => win.ends_at,
            _ => {
                let ends_at = sent.saturating_add(delay_ms.max(0));
                w.by_op.insert(
                    key,
                    Window {
                        settle_until,
                        ends_at,
                    },
                );
                ends_at
            }
        };
        if sent >= ends_at {
            SettleVerdict::Passed
        } else {
            SettleVerdict::Settling {
                left_ms: ends_at.saturating_sub(now).max(0),
            }
        }
    }

    /// Windows held (the sweep's test).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.windows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_op
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Clock, ManualClock, SystemClock};

    #[test]
    fn a_window_passes_only_after_its_delay_on_the_monotonic_clock() {
        let w = SettleWindows::default();
        w.open("t", "op", 5_000, 100, 1_000);
        // However far the ledger's clock went, the window is 1000 ms of
        // monotonic time from 100.
        assert_eq!(
            w.judge(("t", "op"), 5_000, 600, 700, 1_000),
            SettleVerdict::Settling { left_ms: 400 }
        );
        assert_eq!(
            w.judge(("t", "op"), 5_000, 1_099, 1_099, 1_000),
            SettleVerdict::Settling { left_ms: 1 }
        );
        assert_eq!(
            w.judge(("t", "op"), 5_000, 1_100, 1_100, 1_000),
            SettleVerdict::Passed
        );
        // Another tenant's operation of the same id has no window yet.
        assert_eq!(
            w.judge(("u", "op"), 5_000, 1_100, 1_100, 1_000),
            SettleVerdict::Settling { left_ms: 1_000 }
        );
    }

    #[test]
    fn without_a_window_the_first_absent_read_back_opens_one() {
        let w = SettleWindows::default();
        // After a restart: no window. The read-back sent at 50 is not trusted.
        assert_eq!(
            w.judge(("t", "op"), 7, 50, 80, 1_000),
            SettleVerdict::Settling { left_ms: 970 }
        );
        // One sent within the delay after it isn't either; one after it is.
        assert_eq!(
            w.judge(("t", "op"), 7, 1_049, 1_060, 1_000),
            SettleVerdict::Settling { left_ms: 0 }
        );
        assert_eq!(
            w.judge(("t", "op"), 7, 1_050, 1_060, 1_000),
            SettleVerdict::Passed
        );
        // A settle delay of 0 trusts the first one.
        assert_eq!(w.judge(("t", "zero"), 7, 50, 50, 0), SettleVerdict::Passed);
    }

    #[test]
    fn a_new_unknown_never_uses_an_older_window() {
        let w = SettleWindows::default();
        w.open("t", "op", 1_000, 0, 1_000);
        assert_eq!(
            w.judge(("t", "op"), 1_000, 2_000, 2_000, 1_000),
            SettleVerdict::Passed
        );
        // A new attempt ended UNKNOWN again (another settle_until), and
        // this process didn't see it happen: a fresh window.
        assert_eq!(
            w.judge(("t", "op"), 9_000, 2_000, 2_000, 1_000),
            SettleVerdict::Settling { left_ms: 1_000 }
        );
        w.close("t", "op");
        assert_eq!(w.len(), 0);
    }

    #[test]
    fn windows_long_closed_are_swept() {
        let w = SettleWindows::default();
        for i in 0..SWEEP_FROM - 1 {
            w.open("t", &format!("old-{i}"), 1, 0, 10);
        }
        assert_eq!(w.len(), SWEEP_FROM - 1);
        // An hour and more after they closed, the next window sweeps them.
        w.open("t", "new", 1, KEEP_AFTER_END_MS + 10, 10);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn a_manual_clock_moves_both_readings_and_a_step_moves_only_the_wall() {
        let base = ManualClock::new(1_000);
        let clock = super::super::LedgerClock::new(base.clone());
        clock.shift(60_000);
        assert_eq!(clock.now_ms(), 61_000);
        assert_eq!(clock.monotonic_ms(), 1_000);
        clock.shift(-90_000);
        assert_eq!(clock.now_ms(), -29_000);
        assert_eq!(clock.monotonic_ms(), 1_000);
        base.advance(5);
        assert_eq!(clock.monotonic_ms(), 1_005);
        let sys = super::super::LedgerClock::new(std::sync::Arc::new(SystemClock));
        let before = sys.monotonic_ms();
        sys.shift(i64::MAX);
        sys.shift(i64::MAX);
        assert!(sys.now_ms() > 0, "the offset saturates");
        assert!(sys.monotonic_ms() >= before);
    }
}
