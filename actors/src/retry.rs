use std::time::Duration;

use crate::{AggregateError, FailureKind};

/// When to retry a failed delivery, and how many times.
///
/// The pause before retry *k* (k = 0 .. `retry_limit`) is
/// `min_retry_interval + retry_interval_delta * (2^k - 1)`, capped at `max_retry_interval`:
/// with the defaults, 1 s, 6 s, 16 s, 36 s and 60 s. A message is therefore handled at most
/// `retry_limit + 1` times before it is dead-lettered.
///
/// ```
/// use std::time::Duration;
/// use dacapo::RetryPolicy;
///
/// let seconds: Vec<u64> = RetryPolicy::default().intervals().iter().map(Duration::as_secs).collect();
/// assert_eq!(seconds, [1, 6, 16, 36, 60]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (default 5).
    pub retry_limit: u32,
    /// Pause before the first retry (default 1 s).
    pub min_retry_interval: Duration,
    /// Growth unit of the pause (default 5 s).
    pub retry_interval_delta: Duration,
    /// Longest pause (default 60 s).
    pub max_retry_interval: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retry_limit: 5,
            min_retry_interval: Duration::from_secs(1),
            retry_interval_delta: Duration::from_secs(5),
            max_retry_interval: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries: the first failure dead-letters.
    pub fn no_retries() -> Self {
        Self {
            retry_limit: 0,
            ..Self::default()
        }
    }

    /// The pause before retry `k` (0-based); saturates at `max_retry_interval` instead of
    /// overflowing, whatever `k` is.
    pub fn interval(&self, k: u32) -> Duration {
        let growth = 1u32
            .checked_shl(k)
            .and_then(|power| self.retry_interval_delta.checked_mul(power - 1))
            .and_then(|growth| self.min_retry_interval.checked_add(growth));
        growth.map_or(self.max_retry_interval, |pause| {
            pause.min(self.max_retry_interval)
        })
    }

    /// Every pause, in order: one per retry.
    ///
    /// This allocates `retry_limit` entries; the engine itself asks [`RetryPolicy::interval`]
    /// one retry at a time.
    pub fn intervals(&self) -> Vec<Duration> {
        (0..self.retry_limit).map(|k| self.interval(k)).collect()
    }

    /// Decides what follows a failed attempt (`attempt` is 1-based).
    ///
    /// A permanent failure dead-letters at once; an exhausted policy dead-letters; otherwise the
    /// retry waits for the policy's pause, or longer if a handler asked for it.
    pub fn decide(&self, attempt: u32, failure: &AggregateError) -> RetryDecision {
        if failure.failures.iter().any(|f| f.is_permanent()) {
            return RetryDecision::DeadLetter { exhausted: false };
        }
        if attempt > self.retry_limit {
            return RetryDecision::DeadLetter { exhausted: true };
        }
        let requested = failure
            .failures
            .iter()
            .filter_map(|f| match f.kind {
                FailureKind::RetryAfter(delay) => Some(delay),
                _ => None,
            })
            .max()
            .unwrap_or_default();
        RetryDecision::RetryIn(self.interval(attempt - 1).max(requested))
    }
}

/// Which handlers a retry runs again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryScope {
    /// Every handler of the message, as Wolverine, MassTransit and NServiceBus do: handlers
    /// must tolerate having run already (the default).
    #[default]
    AllHandlers,
    /// Only the handlers that failed. Which handlers succeeded is recorded with each failed
    /// attempt's retry record (durably, with a durable store), so a handler that succeeded is
    /// not run again, even after a restart during the cooldown. An attempt a crash cut short
    /// records nothing: all its handlers run again.
    FailedHandlers,
}

/// What follows a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryDecision {
    /// Run every handler again after this pause.
    RetryIn(Duration),
    /// Give up: `exhausted` tells a spent policy from a permanent failure.
    DeadLetter {
        /// True when the retry limit was reached, false for a permanent failure.
        exhausted: bool,
    },
}
