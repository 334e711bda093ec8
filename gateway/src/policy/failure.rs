//! Why a policy call failed, as the host reports it.

/// Why a policy call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyFailure {
    /// The CPU deadline passed.
    Timeout,
    /// The fuel ran out.
    OutOfFuel,
    /// The policy asked for more linear memory than `policy.memory_bytes`.
    OutOfMemory {
        /// `policy.memory_bytes`.
        limit: usize,
        /// The size the memory would have grown to, in bytes.
        requested: usize,
    },
    /// The policy trapped (panic, `unreachable`, …).
    Trap(String),
    /// The policy's output broke a rule (status, sizes, headers).
    InvalidOutput(String),
    /// The module could not be instantiated.
    Instantiate(String),
    /// Every slot of the instance pool was in use.
    PoolExhausted(String),
    /// No permit was free within `policy.permit_wait_ms`: the policy did
    /// not run.
    Busy {
        /// The limit that was full.
        limit: BusyLimit,
        /// `policy.permit_wait_ms`.
        wait_ms: u64,
    },
    /// The policy's circuit is open after failures in a row: it did not run.
    CircuitOpen {
        /// `policy.breaker_failures`.
        failures: u32,
        /// Time until a trial call is let through, in ms (0: one is running).
        retry_in_ms: u64,
    },
}

/// Text a policy had a hand in (an error its call ended with, a log
/// line), made safe to show and log: control characters escaped (a line
/// break can't start a forged log line, an escape sequence can't reach a
/// terminal), and at most `max_chars` characters kept (`…` marks a cut).
pub fn shown(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    for (n, c) in text.chars().enumerate() {
        if n == max_chars {
            out.push('…');
            break;
        }
        // Also the line and paragraph separators and the bidirectional
        // controls, which some readers show as a break or a reordering.
        let hidden = matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || hidden {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Most characters of an error's text a policy failure keeps.
pub const DETAIL_CHARS: usize = 512;

/// Which limit left a call without a permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyLimit {
    /// The tenant's calls in flight (`policy.max_concurrent_per_tenant`).
    Tenant(u32),
    /// Calls in flight across tenants (`policy.pool_instances`).
    Pool(u32),
}

impl PolicyFailure {
    /// Short kind for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PolicyFailure::Timeout => "timeout",
            PolicyFailure::OutOfFuel => "out-of-fuel",
            PolicyFailure::OutOfMemory { .. } => "out-of-memory",
            PolicyFailure::Trap(_) => "trap",
            PolicyFailure::InvalidOutput(_) => "invalid-output",
            PolicyFailure::Instantiate(_) => "instantiate",
            PolicyFailure::PoolExhausted(_) => "pool-exhausted",
            PolicyFailure::Busy { .. } => "busy",
            PolicyFailure::CircuitOpen { .. } => "circuit-open",
        }
    }

    /// Whether the policy itself failed (and the failure counts towards
    /// its circuit breaker), rather than the host having no room to run it.
    pub fn is_policy_fault(&self) -> bool {
        !matches!(
            self,
            PolicyFailure::PoolExhausted(_)
                | PolicyFailure::Busy { .. }
                | PolicyFailure::CircuitOpen { .. }
        )
    }
}

impl std::fmt::Display for PolicyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyFailure::Timeout => f.write_str("the policy exceeded its CPU deadline"),
            PolicyFailure::OutOfFuel => f.write_str("the policy ran out of fuel"),
            PolicyFailure::OutOfMemory { limit, requested } => write!(
                f,
                "the policy exceeded its memory limit: it asked for {requested} bytes of linear memory; policy.memory_bytes is {limit}"
            ),
            PolicyFailure::Trap(d) => write!(f, "the policy trapped: {d}"),
            PolicyFailure::InvalidOutput(d) => write!(f, "the policy returned invalid output: {d}"),
            PolicyFailure::Instantiate(d) => write!(f, "the policy could not be instantiated: {d}"),
            PolicyFailure::PoolExhausted(d) => {
                write!(f, "the policy did not run: the instance pool is full: {d}")
            }
            PolicyFailure::Busy {
                limit: BusyLimit::Tenant(n),
                wait_ms,
            } => write!(
                f,
                "the policy did not run (busy): the tenant already has {n} policy calls in flight (policy.max_concurrent_per_tenant) and none ended within {wait_ms} ms (policy.permit_wait_ms)"
            ),
            PolicyFailure::Busy {
                limit: BusyLimit::Pool(n),
                wait_ms,
            } => write!(
                f,
                "the policy did not run (busy): {n} policy calls are in flight (policy.pool_instances) and none ended within {wait_ms} ms (policy.permit_wait_ms)"
            ),
            PolicyFailure::CircuitOpen {
                failures,
                retry_in_ms,
            } => {
                write!(
                    f,
                    "the policy did not run (circuit open): it failed {failures} times in a row (policy.breaker_failures); "
                )?;
                if *retry_in_ms == 0 {
                    f.write_str("a trial call is running")
                } else {
                    write!(f, "a trial call is let through in {retry_in_ms} ms")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Line breaks, escape sequences and other control characters are
    /// escaped; the text is cut after `max_chars` characters, never inside
    /// one.
    #[test]
    fn policy_text_is_escaped_and_clipped() {
        assert_eq!(
            shown("ok\n2026-12-08 INFO forged\r\u{1b}[2J\0", 100),
            "ok\\n2026-12-08 INFO forged\\r\\u{1b}[2J\\u{0}"
        );
        assert_eq!(shown("a\u{2028}b\u{202e}c", 100), "a\\u{2028}b\\u{202e}c");
        assert_eq!(shown("ééé", 2), "éé…");
        assert_eq!(shown("abc", 3), "abc");
    }
}
