//! Two arms compared in alternating cycles, for the targets whose arms
//! would otherwise run minutes apart (PostgreSQL against SQLite,
//! pass-through against nginx): this machine's speed drifts by tens of
//! percent within a minute, so one round of each arm gives a ratio that
//! swings with the moment it was taken. Each cycle runs both arms back to
//! back, `a` first in even cycles and `b` first in odd ones, so a drift
//! falls on both alike; the ratio is taken within each cycle and the
//! median of the cycles' ratios is printed with the lowest and highest.

use crate::{HttpClient, Stats, run};

/// One arm: where its requests go, whether they carry the bench's API key,
/// and, for effectful calls, the prefix of their unique idempotency keys.
pub struct Arm {
    /// What the arm is, for the printed table (e.g. `"(e') PostgreSQL"`).
    pub name: &'static str,
    /// The URL every request of the arm is sent to.
    pub url: String,
    /// Whether requests carry `authorization: Bearer <bench key>`.
    pub auth: bool,
    /// `Some(prefix)`: request `i` of cycle `k` carries idempotency key
    /// `prefix-k-i`; `None`: no key.
    pub keys: Option<&'static str>,
}

/// Per-cycle comparison of `b` against `a`: medians over the cycles.
#[derive(Debug, Clone, Copy)]
pub struct Paired {
    /// Median of the per-cycle throughput ratios `b / a`.
    pub ratio: f64,
    /// Lowest per-cycle ratio.
    pub lowest: f64,
    /// Highest per-cycle ratio.
    pub highest: f64,
    /// Median p99 latency of `a`'s rounds, µs.
    pub a_p99_us: u128,
    /// Median p99 latency of `b`'s rounds, µs.
    pub b_p99_us: u128,
}

/// Runs `cycles` (at least 1) cycles of `requests` requests per arm,
/// `concurrency` at a time, and prints one line per round and the medians.
pub async fn compare(
    client: &HttpClient,
    a: &Arm,
    b: &Arm,
    requests: usize,
    concurrency: usize,
    cycles: usize,
) -> Paired {
    let cycles = cycles.max(1);
    let mut ratios = Vec::with_capacity(cycles);
    let (mut a_p99, mut b_p99) = (Vec::new(), Vec::new());
    for k in 0..cycles {
        let order = if k % 2 == 0 { [a, b] } else { [b, a] };
        let mut rounds: Vec<Stats> = Vec::with_capacity(2);
        for arm in order {
            let prefix = arm.keys;
            let s = run(
                arm.name,
                client,
                arm.url.clone(),
                requests,
                concurrency,
                move |i| prefix.map(|p| format!("{p}-{k}-{i}")),
                arm.auth,
            )
            .await;
            println!(
                "  cycle {k}: {:<38} {:>10.0} req/s {:>10} µs p99 {:>5} errors",
                s.name, s.rps, s.p99_us, s.errors
            );
            rounds.push(s);
        }
        let (ra, rb) = if k % 2 == 0 {
            (&rounds[0], &rounds[1])
        } else {
            (&rounds[1], &rounds[0])
        };
        if ra.rps > 0.0 {
            ratios.push(rb.rps / ra.rps);
        }
        a_p99.push(ra.p99_us);
        b_p99.push(rb.p99_us);
    }
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(0.0, f64::max);
    let paired = Paired {
        ratio: if ratios.is_empty() {
            0.0
        } else {
            crate::tracing_cost::median(ratios)
        },
        lowest,
        highest,
        a_p99_us: median_u(a_p99),
        b_p99_us: median_u(b_p99),
    };
    println!(
        "  {} / {}: median of {cycles} per-cycle throughput ratios {:.3} ({:.2}–{:.2}); median p99 {} vs {} µs",
        b.name,
        a.name,
        paired.ratio,
        paired.lowest,
        paired.highest,
        paired.b_p99_us,
        paired.a_p99_us
    );
    paired
}

/// The median of `xs` (0 when empty; the lower middle of an even count).
fn median_u(mut xs: Vec<u128>) -> u128 {
    xs.sort_unstable();
    xs.get(xs.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(crate::tracing_cost::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(crate::tracing_cost::median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_u(vec![30, 10, 20, 40]), 20);
        assert_eq!(median_u(Vec::new()), 0);
    }
}
