//! Exponential backoff, one formula for every retry loop: a provider call's
//! transient failure, a failed read-back, a webhook delivery.

/// The ceiling of retry `n` (1 = the first retry): `base_ms · 2^(n-1)`,
/// at most `max_ms` (ms; the exponent is capped at 30).
pub fn ceiling_ms(base_ms: u64, max_ms: u64, n: u32) -> u64 {
    base_ms
        .saturating_mul(1u64 << (n.max(1) - 1).min(30))
        .min(max_ms)
}

/// How a delay is drawn below its [`ceiling_ms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Exactly the ceiling.
    None,
    /// Uniform in `[0, ceiling]` ("full jitter").
    Full,
    /// Uniform in `[ceiling / 2, ceiling]` ("equal jitter").
    Equal,
}

/// The delay before retry `n` (ms): [`ceiling_ms`] with `jitter` applied.
pub fn delay_ms(base_ms: u64, max_ms: u64, n: u32, jitter: Jitter) -> u64 {
    let c = ceiling_ms(base_ms, max_ms, n);
    match jitter {
        _ if c == 0 => 0,
        Jitter::None => c,
        Jitter::Full => rand::random_range(0..=c),
        Jitter::Equal => rand::random_range(c / 2..=c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_double_up_to_the_cap() {
        assert_eq!(ceiling_ms(100, 10_000, 0), 100);
        assert_eq!(ceiling_ms(100, 10_000, 1), 100);
        assert_eq!(ceiling_ms(100, 10_000, 2), 200);
        assert_eq!(ceiling_ms(100, 10_000, 4), 800);
        assert_eq!(ceiling_ms(100, 10_000, 60), 10_000);
        assert_eq!(ceiling_ms(u64::MAX, u64::MAX, 40), u64::MAX);
    }

    #[test]
    fn jitter_stays_in_its_range() {
        for n in 1..20 {
            let c = ceiling_ms(50, 5_000, n);
            assert_eq!(delay_ms(50, 5_000, n, Jitter::None), c);
            assert!(delay_ms(50, 5_000, n, Jitter::Full) <= c);
            let e = delay_ms(50, 5_000, n, Jitter::Equal);
            assert!(e >= c / 2 && e <= c, "{e} of {c}");
        }
        assert_eq!(delay_ms(0, 0, 3, Jitter::Full), 0);
    }
}
