use std::time::Duration;

/// How long to pause after each store failure in a row: `first`, doubling, at most `max`.
/// Kept apart from what retries (it says *when*; the engine's own writes and a transport's
/// listener decide *whether*).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backoff {
    /// The pause after the first failure (default 50 ms).
    pub first: Duration,
    /// The longest pause (default 30 s).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(50),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// A backoff from `first`, doubling, capped at `max`.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max }
    }

    /// The pause after `failures` failures in a row (1 for the first); never overflows.
    pub fn pause(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.max, |pause| pause.min(self.max))
    }
}
