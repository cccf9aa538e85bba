use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::{AggregateError, Envelope};

/// A delivery waiting for its cooldown when the runtime shut down: handed back, never dropped.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PendingRetry {
    /// The envelope, with the attempts made so far.
    pub envelope: Envelope,
    /// When the next attempt was due.
    pub due_at: DateTime<Utc>,
    /// The aggregate error of every failed attempt so far.
    pub failures: Vec<AggregateError>,
}

#[derive(Debug)]
enum Live {
    /// Accepted, waiting for capacity or running its handlers.
    Active(Uuid),
    Cooling(PendingRetry),
}

#[derive(Debug, Default)]
struct State {
    closing: bool,
    next: u64,
    live: HashMap<u64, Live>,
}

/// Knows every delivery the engine accepted and has not settled, so a shutdown can drain the
/// active ones and hand back those cooling down.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    state: Mutex<State>,
    changed: Notify,
}

impl Tracker {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always left consistent, so keep going rather than take the runtime down.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Accepts a delivery; refuses new external work once closing. Cascaded messages of
    /// deliveries being drained are still accepted, since they are part of that work.
    pub(crate) fn admit(&self, id: Uuid, external: bool) -> Option<u64> {
        let mut state = self.lock();
        if state.closing && external {
            return None;
        }
        state.next += 1;
        let seq = state.next;
        state.live.insert(seq, Live::Active(id));
        Some(seq)
    }

    pub(crate) fn cooling(&self, seq: u64, pending: PendingRetry) {
        self.lock().live.insert(seq, Live::Cooling(pending));
        self.changed.notify_waiters();
    }

    /// Marks a cooled-down delivery active again; false if a shutdown took it back meanwhile.
    pub(crate) fn resume(&self, seq: u64) -> bool {
        let mut state = self.lock();
        let Some(live) = state.live.get_mut(&seq) else { return false };
        if let Live::Cooling(pending) = &*live {
            *live = Live::Active(pending.envelope.id);
        }
        true
    }

    pub(crate) fn finish(&self, seq: u64) {
        self.lock().live.remove(&seq);
        self.changed.notify_waiters();
    }

    pub(crate) fn close(&self) {
        self.lock().closing = true;
    }

    /// Ids of the deliveries still active.
    pub(crate) fn still_active(&self) -> Vec<Uuid> {
        self.lock()
            .live
            .values()
            .filter_map(|l| match l {
                Live::Active(id) => Some(*id),
                Live::Cooling(_) => None,
            })
            .collect()
    }

    async fn wait_until(&self, done: impl Fn(&State) -> bool) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(&self.lock()) {
                return;
            }
            notified.await;
        }
    }

    /// Waits until no delivery is active (cooling ones may remain).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn drained(&self) {
        self.wait_until(|state| !state.live.values().any(|l| matches!(l, Live::Active(_)))).await;
    }

    /// Waits until every accepted delivery has settled, cooling ones included.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn settled(&self) {
        self.wait_until(|state| state.live.is_empty()).await;
    }

    /// Takes back every delivery waiting for a cooldown.
    pub(crate) fn take_cooling(&self) -> Vec<PendingRetry> {
        let mut state = self.lock();
        let seqs: Vec<u64> = state
            .live
            .iter()
            .filter(|(_, l)| matches!(l, Live::Cooling(_)))
            .map(|(seq, _)| *seq)
            .collect();
        let mut pending: Vec<PendingRetry> = seqs
            .into_iter()
            .filter_map(|seq| match state.live.remove(&seq) {
                Some(Live::Cooling(p)) => Some(p),
                _ => None,
            })
            .collect();
        pending.sort_by_key(|p| p.due_at);
        pending
    }
}
