//! The thread that advances the policy engine's epoch, one tick a
//! millisecond, while a policy call runs: a call's CPU deadline
//! (`policy.deadline_ms`) is that many ticks. With no call running the
//! thread parks, so an idle gateway (and every gateway without policies)
//! is not woken a thousand times a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::Duration;

/// Time between two ticks.
const TICK: Duration = Duration::from_millis(1);

/// What the ticking thread and the calls share.
#[derive(Debug, Default)]
struct Shared {
    /// Calls running now ([`Ticking`] guards alive).
    running: AtomicUsize,
    /// Set when the [`EpochTicker`] is dropped: the thread ends.
    closed: AtomicBool,
    /// Set by the thread just before it parks for want of a call, cleared
    /// when it wakes.
    parked: AtomicBool,
}

/// The ticking thread's handle, owned by the policy engine. Dropping it
/// ends the thread.
#[derive(Debug)]
pub(super) struct EpochTicker {
    shared: Arc<Shared>,
    thread: Thread,
}

impl EpochTicker {
    /// Starts the thread (named `name`). It calls `tick` once a
    /// millisecond while at least one [`Ticking`] guard is alive; `tick`
    /// returns `false` when there is nothing left to tick (the engine is
    /// gone), which ends the thread.
    ///
    /// Errors: the thread can't be spawned.
    pub(super) fn start(
        name: &str,
        tick: impl Fn() -> bool + Send + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let theirs = shared.clone();
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !theirs.closed.load(Ordering::Acquire) {
                    if theirs.running.load(Ordering::Acquire) == 0 {
                        theirs.parked.store(true, Ordering::Release);
                        // A call that starts between the check and here
                        // has unparked the thread already: `park`
                        // returns at once.
                        std::thread::park();
                        theirs.parked.store(false, Ordering::Release);
                        continue;
                    }
                    if !tick() {
                        break;
                    }
                    std::thread::sleep(TICK);
                }
            })?;
        Ok(Self {
            shared,
            thread: handle.thread().clone(),
        })
    }

    /// Marks a call as running until the guard is dropped; the first one
    /// wakes the thread.
    pub(super) fn running(&self) -> Ticking {
        if self.shared.running.fetch_add(1, Ordering::AcqRel) == 0 {
            self.thread.unpark();
        }
        Ticking {
            shared: self.shared.clone(),
        }
    }

    /// Whether the thread is parked, with no call to time.
    #[cfg(test)]
    fn parked(&self) -> bool {
        self.shared.parked.load(Ordering::Acquire)
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A running call: the epoch advances while one is alive.
#[derive(Debug)]
pub(super) struct Ticking {
    shared: Arc<Shared>,
}

impl Drop for Ticking {
    fn drop(&mut self) {
        self.shared.running.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::time::Instant;

    use super::*;

    /// Waits (at most 10 s) until `done` holds.
    fn until(what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn the_epoch_advances_only_while_a_call_runs() {
        let ticks = Arc::new(AtomicU64::new(0));
        let counted = ticks.clone();
        let ticker = EpochTicker::start("test-epoch", move || {
            counted.fetch_add(1, Ordering::Relaxed);
            true
        })
        .unwrap();
        until("parked with no call", || ticker.parked());
        assert_eq!(ticks.load(Ordering::Relaxed), 0, "no tick before a call");

        let call = ticker.running();
        until("a tick during the call", || {
            ticks.load(Ordering::Relaxed) >= 3
        });
        drop(call);
        until("parked after the call", || ticker.parked());
        let idle = ticks.load(Ordering::Relaxed);
        assert!(ticker.parked(), "still parked");
        assert_eq!(ticks.load(Ordering::Relaxed), idle, "no tick while parked");

        // Two calls at once, then one: it goes on ticking for the other.
        let (a, b) = (ticker.running(), ticker.running());
        drop(a);
        let before = ticks.load(Ordering::Relaxed);
        until("ticks for the call still running", || {
            ticks.load(Ordering::Relaxed) >= before + 2
        });
        drop(b);
        until("parked again", || ticker.parked());
    }

    #[test]
    fn the_thread_ends_when_the_ticker_or_the_engine_goes() {
        let ended = Arc::new(AtomicBool::new(false));
        let ticker = EpochTicker::start("test-epoch", || true).unwrap();
        let shared = ticker.shared.clone();
        until("parked", || ticker.parked());
        drop(ticker);
        until("ended after the drop", || Arc::strong_count(&shared) == 1);

        let gone = ended.clone();
        let ticker = EpochTicker::start("test-epoch", move || {
            gone.store(true, Ordering::Release);
            false
        })
        .unwrap();
        let shared = ticker.shared.clone();
        let _call = ticker.running();
        until("ended when tick says the engine is gone", || {
            Arc::strong_count(&shared) == 3 && ended.load(Ordering::Acquire)
        });
    }
}
