use std::sync::atomic::{AtomicU64, Ordering};

/// A counter on its own cache line.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Cell(AtomicU64);

/// One writer's counters. Each worker thread, and the dispatching side, has its own set, so
/// that counting never makes two threads fight over a cache line.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    received: Cell,
    attempts: Cell,
    handled: Cell,
    retried: Cell,
    dead_lettered: Cell,
    deduplicated: Cell,
    discarded: Cell,
    duplicate_intents: Cell,
    relay_wakes_deferred: Cell,
}

/// Counters of what the engine did since it started.
#[derive(Debug)]
pub struct Stats {
    writers: Box<[Counters]>,
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
    /// Handler runs skipped because their logical deduplication id was already claimed by
    /// another message within the window: duplicate intents (and conflicts, unless
    /// dead-lettered), counted once per attempt that skipped a handler. A retry of the message
    /// that completed the claim is not counted.
    pub duplicate_intents: u64,
    /// Wakes of the outbox relay (an enlist here, or one another node told of) that it left
    /// to the node holding the outbox lease, without asking for the lease: on a fleet, the
    /// enlists of every node but the relaying one.
    pub relay_wakes_deferred: u64,
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
    DuplicateIntents,
    RelayWakeDeferred,
}

impl Counters {
    pub(crate) fn bump(&self, counter: Counter) {
        self.add(counter, 1);
    }

    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let cell = match counter {
            Counter::Received => &self.received,
            Counter::Attempts => &self.attempts,
            Counter::Handled => &self.handled,
            Counter::Retried => &self.retried,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::Deduplicated => &self.deduplicated,
            Counter::Discarded => &self.discarded,
            Counter::DuplicateIntents => &self.duplicate_intents,
            Counter::RelayWakeDeferred => &self.relay_wakes_deferred,
        };
        // Atomic: the dispatching counters are bumped by every publishing thread.
        cell.0.fetch_add(n, Ordering::Relaxed);
    }
}

impl Stats {
    pub(crate) fn new(writers: usize) -> Self {
        Self {
            writers: (0..writers.max(1)).map(|_| Counters::default()).collect(),
        }
    }

    /// The counters of writer `index`.
    pub(crate) fn writer(&self, index: usize) -> &Counters {
        &self.writers[index % self.writers.len()]
    }

    /// The counters of the dispatching side (the last writer).
    pub(crate) fn dispatching(&self) -> &Counters {
        &self.writers[self.writers.len() - 1]
    }

    /// Adds up every writer's counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut total = StatsSnapshot::default();
        for w in self.writers.iter() {
            let read = |c: &Cell| c.0.load(Ordering::Relaxed);
            total.received += read(&w.received);
            total.attempts += read(&w.attempts);
            total.handled += read(&w.handled);
            total.retried += read(&w.retried);
            total.dead_lettered += read(&w.dead_lettered);
            total.deduplicated += read(&w.deduplicated);
            total.discarded += read(&w.discarded);
            total.duplicate_intents += read(&w.duplicate_intents);
            total.relay_wakes_deferred += read(&w.relay_wakes_deferred);
        }
        total
    }
}
