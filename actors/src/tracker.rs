use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// The aggregate error of each failed attempt so far (the first and the latest 99).
    pub failures: Vec<AggregateError>,
}

#[derive(Debug)]
enum Live {
    /// Running its handlers.
    Active(Uuid),
    Cooling(Box<PendingRetry>),
}

/// The deliveries one worker supervises, in slots reused as deliveries settle. Only that
/// worker's thread touches it while the engine runs, so its lock is never contended on the
/// hot path.
#[derive(Debug, Default)]
struct Supervised {
    /// Each occupied slot carries the generation it was taken in, so a ticket of a settled
    /// delivery never reaches the delivery that reused its slot.
    slots: Vec<Option<(u64, Live)>>,
    free: Vec<usize>,
    generation: u64,
}

impl Supervised {
    fn insert(&mut self, live: Live) -> (usize, u64) {
        self.generation += 1;
        let entry = Some((self.generation, live));
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = entry;
                slot
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        };
        (slot, self.generation)
    }

    fn get_mut(&mut self, ticket: Ticket) -> Option<&mut Live> {
        match self.slots.get_mut(ticket.slot) {
            Some(Some((generation, live))) if *generation == ticket.generation => Some(live),
            _ => None,
        }
    }

    fn remove(&mut self, ticket: Ticket) -> Option<Live> {
        self.get_mut(ticket)?;
        let (_, live) = self.slots[ticket.slot].take()?;
        self.free.push(ticket.slot);
        Some(live)
    }

    fn live(&self, worker: usize) -> impl Iterator<Item = (Ticket, &Live)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(slot, entry)| {
                entry.as_ref().map(|(generation, live)| {
                    (
                        Ticket {
                            worker,
                            slot,
                            generation: *generation,
                        },
                        live,
                    )
                })
            })
    }
}

/// One unsettled delivery in [`Tracker::counts`]; active ones add 1 as well.
const LIVE: u64 = 1 << 32;
const ACTIVE: u64 = LIVE - 1;

/// Which delivery a worker supervises.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    worker: usize,
    slot: usize,
    generation: u64,
}

/// Counts every delivery the engine accepted and has not settled, so a shutdown can drain the
/// active ones and hand back those cooling down.
#[derive(Debug)]
pub(crate) struct Tracker {
    closing: AtomicBool,
    /// Set by a shutdown before it lists the deliveries still running, which it keeps as this
    /// node's while it releases the others: a supervisor that starts later runs nothing.
    frozen: AtomicBool,
    /// Deliveries not settled (high 32 bits) and, among them, those active (low 32 bits), in
    /// one word so that admitting or settling a delivery is a single atomic operation.
    counts: AtomicU64,
    workers: Box<[Mutex<Supervised>]>,
    changed: Notify,
}

impl Tracker {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            closing: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            counts: AtomicU64::new(0),
            workers: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
            changed: Notify::new(),
        }
    }

    fn worker(&self, worker: usize) -> MutexGuard<'_, Supervised> {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always left consistent, so keep going rather than take the runtime down.
        self.workers[worker % self.workers.len()]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Subtracts `delta` from the packed counts, waking waiters when either count hits zero.
    fn leave(&self, delta: u64) {
        let before = self.counts.fetch_sub(delta, Ordering::AcqRel);
        let after = before - delta;
        if (after & ACTIVE == 0 && before & ACTIVE != 0) || (after >> 32 == 0 && before >> 32 != 0)
        {
            self.changed.notify_waiters();
        }
    }

    /// Counts a delivery in; refuses new external work once closing. Cascaded messages of
    /// deliveries being drained are still accepted, since they are part of that work.
    pub(crate) fn admit(&self, external: bool) -> bool {
        // Counted before the look, both sequentially consistent, as `close` sets the flag
        // before the drain reads the count: either the drain waits for this delivery or this
        // sees the close. Looked at first, a delivery could be counted after the drain found
        // none, and run while the engine stopped under it.
        self.counts.fetch_add(LIVE + 1, Ordering::SeqCst);
        if external && self.closing.load(Ordering::SeqCst) {
            self.leave(LIVE + 1);
            return false;
        }
        true
    }

    /// Counts out an admitted delivery that never reached a supervisor.
    pub(crate) fn release(&self) {
        self.leave(LIVE + 1);
    }

    /// Records that `worker` supervises the admitted delivery of envelope `id`.
    /// `None` once the tracker is [frozen](Self::freeze): the delivery must not start.
    pub(crate) fn supervise(&self, worker: usize, id: Uuid) -> Option<Ticket> {
        let mut supervised = self.worker(worker);
        // Read under the worker's lock, which `freeze` passes through after setting it: a
        // supervisor is either listed before the shutdown looks, or sees the freeze.
        if self.frozen.load(Ordering::Acquire) {
            return None;
        }
        let (slot, generation) = supervised.insert(Live::Active(id));
        Some(Ticket {
            worker,
            slot,
            generation,
        })
    }

    /// Lets no more deliveries start: those [`still_active`](Self::still_active) lists from
    /// now on are all that run.
    pub(crate) fn freeze(&self) {
        self.frozen.store(true, Ordering::Release);
        for worker in 0..self.workers.len() {
            drop(self.worker(worker));
        }
    }

    pub(crate) fn cooling(&self, ticket: Ticket, pending: PendingRetry) {
        let mut supervised = self.worker(ticket.worker);
        let Some(live) = supervised.get_mut(ticket) else {
            return;
        };
        if matches!(
            std::mem::replace(live, Live::Cooling(Box::new(pending))),
            Live::Active(_)
        ) {
            self.leave(1);
        }
    }

    /// Marks a cooled-down delivery active again; false once a shutdown began (the shutdown
    /// report hands it back) or took it back already.
    pub(crate) fn resume(&self, ticket: Ticket) -> bool {
        // Read under the worker's lock, which `close` passes through after setting it: a
        // resume either counts itself active before the shutdown's drain looks, or sees the
        // close and stays cooling for the report. Read before it, a resume could do neither
        // and run in no list until the engine stopped under it.
        let mut supervised = self.worker(ticket.worker);
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        let Some(live) = supervised.get_mut(ticket) else {
            return false;
        };
        if let Live::Cooling(pending) = &*live {
            *live = Live::Active(pending.envelope.id);
            self.counts.fetch_add(1, Ordering::AcqRel);
        }
        true
    }

    pub(crate) fn finish(&self, ticket: Ticket) {
        let removed = self.worker(ticket.worker).remove(ticket);
        match removed {
            Some(Live::Active(_)) => self.leave(LIVE + 1),
            Some(Live::Cooling(_)) => self.leave(LIVE),
            None => {}
        }
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        // Through each worker's lock: a resume under way there ends (counted active) first.
        for worker in 0..self.workers.len() {
            drop(self.worker(worker));
        }
        self.changed.notify_waiters();
    }

    /// Waits until [`close`](Self::close) was called.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn closed(&self) {
        crate::told::until(&self.changed, || self.is_closing()).await;
    }

    async fn wait_until_zero(&self, mask: u64) {
        crate::told::until(&self.changed, || {
            self.counts.load(Ordering::SeqCst) & mask == 0
        })
        .await;
    }

    /// Waits until no delivery is active (cooling ones may remain).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn drained(&self) {
        self.wait_until_zero(ACTIVE).await;
    }

    /// Waits until every accepted delivery has settled, cooling ones included.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn settled(&self) {
        self.wait_until_zero(!0).await;
    }

    /// Ids of the deliveries whose handlers are still running.
    pub(crate) fn still_active(&self) -> Vec<Uuid> {
        (0..self.workers.len())
            .flat_map(|worker| {
                self.worker(worker)
                    .live(worker)
                    .filter_map(|(_, l)| match l {
                        Live::Active(id) => Some(*id),
                        Live::Cooling(_) => None,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Ids of every delivery a supervisor holds, running or cooling down.
    pub(crate) fn supervised(&self) -> std::collections::HashSet<Uuid> {
        (0..self.workers.len())
            .flat_map(|worker| {
                self.worker(worker)
                    .live(worker)
                    .map(|(_, l)| match l {
                        Live::Active(id) => *id,
                        Live::Cooling(pending) => pending.envelope.id,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Takes back every delivery waiting for a cooldown.
    pub(crate) fn take_cooling(&self) -> Vec<PendingRetry> {
        let mut pending = Vec::new();
        for worker in 0..self.workers.len() {
            let mut supervised = self.worker(worker);
            let cooling: Vec<Ticket> = supervised
                .live(worker)
                .filter(|(_, l)| matches!(l, Live::Cooling(_)))
                .map(|(ticket, _)| ticket)
                .collect();
            for ticket in cooling {
                if let Some(Live::Cooling(p)) = supervised.remove(ticket) {
                    pending.push(*p);
                    self.leave(LIVE);
                }
            }
        }
        pending.sort_by_key(|p| p.due_at);
        pending
    }
}
