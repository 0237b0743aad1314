//! The proxy's retry policy as data: how many attempts a request gets and
//! how long it waits before asking the controller again. [`Policy::delay`]
//! is a pure function of the retry number and a jitter draw, so the
//! schedule is tested without a runtime.

use std::time::Duration;

/// Attempts per request and the back-off between them
/// (`--max-round-trip-attempts`, `--round-trip-retry-min-timeout`,
/// `--round-trip-retry-max-timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Attempts in total, the first included.
    pub max_attempts: u32,
    /// Back-off before the first retry (before jitter).
    pub min: Duration,
    /// Cap on any back-off.
    pub max: Duration,
}

impl Policy {
    /// The wait before retry `retry` (1 = before the second attempt):
    /// `min × 2^(retry−1) × (1 + jitter)`, capped at `max`; `jitter` is a
    /// uniform draw in `[0, 1)` (clamped into it).
    #[must_use]
    pub fn delay(&self, retry: u32, jitter: f64) -> Duration {
        let doublings = retry.saturating_sub(1).min(30);
        self.min
            .saturating_mul(1 << doublings)
            .mul_f64(1.0 + jitter.clamp(0.0, 1.0))
            .min(self.max)
    }

    /// Whether attempt `attempt` (1-based) is allowed.
    #[must_use]
    pub fn allows(&self, attempt: u32) -> bool {
        attempt <= self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT: Policy = Policy {
        max_attempts: 6,
        min: Duration::from_millis(100),
        max: Duration::from_secs(5),
    };

    #[test]
    fn delays_double_with_jitter_up_to_the_cap() {
        let ms = |retry, jitter| DEFAULT.delay(retry, jitter).as_millis();
        let table: &[(u32, f64, u128)] = &[
            (1, 0.0, 100),
            (1, 0.5, 150),
            (1, 0.999, 199),
            (2, 0.0, 200),
            (2, 0.999, 399),
            (3, 0.25, 500),
            (6, 0.0, 3200),
            (6, 0.9, 5000),
            (7, 0.0, 5000),
            (u32::MAX, 0.5, 5000),
        ];
        for &(retry, jitter, want) in table {
            assert_eq!(ms(retry, jitter), want, "retry {retry} jitter {jitter}");
        }
        // Out-of-range draws are clamped into [0, 1].
        assert_eq!(ms(1, -3.0), 100);
        assert_eq!(ms(1, 7.0), 200);
        let flat = Policy {
            max_attempts: 3,
            min: Duration::from_millis(10),
            max: Duration::from_millis(10),
        };
        assert!((1..10).all(|r| flat.delay(r, 0.7) == Duration::from_millis(10)));
    }

    #[test]
    fn attempts_are_bounded() {
        assert!(DEFAULT.allows(1));
        assert!(DEFAULT.allows(6));
        assert!(!DEFAULT.allows(7));
    }
}
