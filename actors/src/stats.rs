use std::sync::atomic::{AtomicU64, Ordering};

/// A counter on its own cache line: the publishing thread and every worker bump counters, and
/// sharing a line would make them wait on each other.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Cell(AtomicU64);

impl std::ops::Deref for Cell {
    type Target = AtomicU64;

    fn deref(&self) -> &AtomicU64 {
        &self.0
    }
}

/// Counters of what the engine did since it started.
#[derive(Debug, Default)]
pub struct Stats {
    received: Cell,
    attempts: Cell,
    handled: Cell,
    retried: Cell,
    dead_lettered: Cell,
    deduplicated: Cell,
    discarded: Cell,
}

/// A copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Envelopes received (including duplicates).
    pub received: u64,
    /// Attempts run (each runs every handler of the message).
    pub attempts: u64,
    /// Deliveries whose handlers all succeeded.
    pub handled: u64,
    /// Failed attempts scheduled for a retry.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Envelopes discarded as duplicates by the inbox.
    pub deduplicated: u64,
    /// Envelopes discarded for having no handler (when so configured).
    pub discarded: u64,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Received,
    Attempts,
    Handled,
    Retried,
    DeadLettered,
    Deduplicated,
    Discarded,
}

impl Stats {
    pub(crate) fn bump(&self, counter: Counter) {
        let cell = match counter {
            Counter::Received => &self.received,
            Counter::Attempts => &self.attempts,
            Counter::Handled => &self.handled,
            Counter::Retried => &self.retried,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::Deduplicated => &self.deduplicated,
            Counter::Discarded => &self.discarded,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let read = |c: &Cell| c.load(Ordering::Relaxed);
        StatsSnapshot {
            received: read(&self.received),
            attempts: read(&self.attempts),
            handled: read(&self.handled),
            retried: read(&self.retried),
            dead_lettered: read(&self.dead_lettered),
            deduplicated: read(&self.deduplicated),
            discarded: read(&self.discarded),
        }
    }
}
