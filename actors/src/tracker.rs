use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    Cooling(Box<PendingRetry>),
}

/// Deliveries are spread over shards so that the publishing thread and the workers rarely
/// wait for the same lock.
const SHARDS: usize = 16;

/// Knows every delivery the engine accepted and has not settled, so a shutdown can drain the
/// active ones and hand back those cooling down.
#[derive(Debug)]
pub(crate) struct Tracker {
    closing: AtomicBool,
    next: AtomicU64,
    active: AtomicUsize,
    live: AtomicUsize,
    shards: [Mutex<HashMap<u64, Live, foldhash::fast::RandomState>>; SHARDS],
    changed: Notify,
}

impl Default for Tracker {
    fn default() -> Self {
        Self {
            closing: AtomicBool::new(false),
            next: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            shards: std::array::from_fn(|_| Mutex::default()),
            changed: Notify::new(),
        }
    }
}

impl Tracker {
    fn shard(&self, seq: u64) -> MutexGuard<'_, HashMap<u64, Live, foldhash::fast::RandomState>> {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always left consistent, so keep going rather than take the runtime down.
        self.shards[seq as usize % SHARDS].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn leave(counter: &AtomicUsize, changed: &Notify) {
        if counter.fetch_sub(1, Ordering::AcqRel) == 1 {
            changed.notify_waiters();
        }
    }

    /// Accepts a delivery; refuses new external work once closing. Cascaded messages of
    /// deliveries being drained are still accepted, since they are part of that work.
    pub(crate) fn admit(&self, id: Uuid, external: bool) -> Option<u64> {
        if external && self.closing.load(Ordering::Acquire) {
            return None;
        }
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        self.live.fetch_add(1, Ordering::AcqRel);
        self.active.fetch_add(1, Ordering::AcqRel);
        self.shard(seq).insert(seq, Live::Active(id));
        Some(seq)
    }

    pub(crate) fn cooling(&self, seq: u64, pending: PendingRetry) {
        let previous = self.shard(seq).insert(seq, Live::Cooling(Box::new(pending)));
        if matches!(previous, Some(Live::Active(_))) {
            Self::leave(&self.active, &self.changed);
        }
    }

    /// Marks a cooled-down delivery active again; false if a shutdown took it back meanwhile.
    pub(crate) fn resume(&self, seq: u64) -> bool {
        let mut shard = self.shard(seq);
        let Some(live) = shard.get_mut(&seq) else { return false };
        if let Live::Cooling(pending) = &*live {
            *live = Live::Active(pending.envelope.id);
            self.active.fetch_add(1, Ordering::AcqRel);
        }
        true
    }

    pub(crate) fn finish(&self, seq: u64) {
        let removed = self.shard(seq).remove(&seq);
        match removed {
            Some(Live::Active(_)) => {
                Self::leave(&self.active, &self.changed);
                Self::leave(&self.live, &self.changed);
            }
            Some(Live::Cooling(_)) => Self::leave(&self.live, &self.changed),
            None => {}
        }
    }

    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    async fn wait_until_zero(&self, counter: &AtomicUsize) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if counter.load(Ordering::Acquire) == 0 {
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
        self.wait_until_zero(&self.active).await;
    }

    /// Waits until every accepted delivery has settled, cooling ones included.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn settled(&self) {
        self.wait_until_zero(&self.live).await;
    }

    /// Ids of the deliveries still active.
    pub(crate) fn still_active(&self) -> Vec<Uuid> {
        (0..SHARDS as u64)
            .flat_map(|shard| {
                self.shard(shard)
                    .values()
                    .filter_map(|l| match l {
                        Live::Active(id) => Some(*id),
                        Live::Cooling(_) => None,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Takes back every delivery waiting for a cooldown.
    pub(crate) fn take_cooling(&self) -> Vec<PendingRetry> {
        let mut pending = Vec::new();
        for shard in 0..SHARDS as u64 {
            let mut shard = self.shard(shard);
            let cooling: Vec<u64> =
                shard.iter().filter(|(_, l)| matches!(l, Live::Cooling(_))).map(|(seq, _)| *seq).collect();
            for seq in cooling {
                if let Some(Live::Cooling(p)) = shard.remove(&seq) {
                    pending.push(*p);
                    Self::leave(&self.live, &self.changed);
                }
            }
        }
        pending.sort_by_key(|p| p.due_at);
        pending
    }
}
