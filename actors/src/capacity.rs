use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Bounds the deliveries in flight, with hysteresis: once full, waiting publishers are woken
/// only after a quarter of the slots at work freed up, so a saturated engine wakes them once
/// per batch rather than once per settled delivery (a wake is a syscall and a context switch).
///
/// A slot whose delivery waits on a timer (a cooldown, a scheduled delivery) is *parked*: it
/// frees nothing until its timer fires, which may be an hour away, so the quarter counts only
/// the slots that are not parked. Otherwise an engine mostly full of cooling retries would keep
/// its waiters asleep beside free slots until enough of those retries ended.
///
/// While anyone waits, newcomers wait too, so a steady stream of new publishers cannot keep
/// the engine just under full and starve those already waiting.
#[derive(Debug)]
pub(crate) struct Capacity {
    in_flight: AtomicUsize,
    parked: AtomicUsize,
    waiting: AtomicUsize,
    max: usize,
    resumed: Notify,
}

/// Who looks for a slot.
#[derive(Clone, Copy, Debug)]
enum Looker {
    /// Not waiting.
    Newcomer,
    /// A waiter, not woken yet.
    FirstLook,
    /// A waiter that was woken.
    Woken,
}

/// One slot; freed when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    capacity: Arc<Capacity>,
    parked: bool,
}

/// Counts a waiting publisher for as long as it waits, cancelled or not.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::AcqRel);
        Self(waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Capacity {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max: max.max(1),
            resumed: Notify::new(),
        })
    }

    /// How many slots must be free before waiters are woken: a quarter of those not parked,
    /// and at least one.
    fn resume_after(&self) -> usize {
        let at_work = self.max.saturating_sub(self.parked.load(Ordering::Acquire));
        (at_work / 4).max(1)
    }

    /// Takes a slot if the bound allows it now. One that has not been woken yet (a newcomer,
    /// or a waiter on its first look) lets those already waiting go first, until enough slots
    /// are free for them to be woken.
    fn try_take(&self, looker: Looker) -> bool {
        let mut current = self.in_flight.load(Ordering::Acquire);
        loop {
            let waiting = self.waiting.load(Ordering::Acquire);
            let yields = match looker {
                Looker::Newcomer => waiting > 0,
                // Counted among them already: alone, it lets nobody go first.
                Looker::FirstLook => waiting > 1,
                Looker::Woken => false,
            };
            let free = self.max.saturating_sub(current);
            let allowed = free > 0 && (!yields || free >= self.resume_after());
            if !allowed {
                return false;
            }
            match self.in_flight.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }

    /// Wakes the waiters if enough slots are free for them.
    fn wake_if_room(&self) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let free = self
            .max
            .saturating_sub(self.in_flight.load(Ordering::Acquire));
        if free >= self.resume_after() {
            self.resumed.notify_waiters();
        }
    }

    fn slot(self: &Arc<Self>) -> Slot {
        Slot {
            capacity: Arc::clone(self),
            parked: false,
        }
    }

    /// Takes up to `count` slots that are free now, without waiting.
    pub(crate) fn take_free(self: &Arc<Self>, count: usize) -> Vec<Slot> {
        let mut slots = Vec::new();
        while slots.len() < count && self.try_take(Looker::Newcomer) {
            slots.push(self.slot());
        }
        slots
    }

    /// A slot if one is free now.
    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        self.try_take(Looker::Newcomer).then(|| self.slot())
    }

    /// Takes a slot, waiting while the engine is full.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled wait takes no slot.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Slot {
        if self.try_take(Looker::Newcomer) {
            return self.slot();
        }
        let _waiting = Waiting::new(&self.waiting);
        let mut looker = Looker::FirstLook;
        loop {
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            // Registered before this check, so a release in between is not missed.
            if self.try_take(looker) {
                return self.slot();
            }
            resumed.await;
            looker = Looker::Woken;
        }
    }
}

impl Slot {
    /// Marks the slot as held by a delivery that waits on a timer, until [`Slot::unpark`].
    pub(crate) fn park(&mut self) {
        if !self.parked {
            self.parked = true;
            self.capacity.parked.fetch_add(1, Ordering::AcqRel);
            // Fewer slots at work: fewer need to free up before the waiters are woken.
            self.capacity.wake_if_room();
        }
    }

    /// Marks the slot as at work again.
    pub(crate) fn unpark(&mut self) {
        if self.parked {
            self.parked = false;
            self.capacity.parked.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.unpark();
        self.capacity.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.capacity.wake_if_room();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A task waiting in `acquire`, once it is counted among the waiters.
    async fn waiter(capacity: &Arc<Capacity>) -> tokio::task::JoinHandle<Slot> {
        let waiter = tokio::spawn({
            let capacity = Arc::clone(capacity);
            async move { capacity.acquire().await }
        });
        while capacity.waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        waiter
    }

    /// Whether `acquire` gets a slot without any further release.
    async fn gets_a_slot(waiter: &mut tokio::task::JoinHandle<Slot>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_waiter_is_woken_once_a_quarter_of_the_slots_is_free() {
        let capacity = Capacity::new(8);
        let mut held = capacity.take_free(8);
        assert_eq!(held.len(), 8);
        let mut waiter = waiter(&capacity).await;
        held.pop();
        assert!(
            capacity.try_acquire().is_none(),
            "a newcomer waits behind the waiter until two slots are free"
        );
        held.pop();
        assert!(gets_a_slot(&mut waiter).await);
    }

    #[tokio::test]
    async fn slots_held_by_timers_do_not_keep_a_waiter_asleep_beside_a_free_slot() {
        let capacity = Capacity::new(8);
        let mut held = capacity.take_free(8);
        // Seven deliveries cool down for an hour; the eighth is at work.
        for slot in &mut held[..7] {
            slot.park();
        }
        let mut waiter = waiter(&capacity).await;
        held.pop();
        assert!(
            gets_a_slot(&mut waiter).await,
            "the one slot at work freed up, and nothing else will for an hour"
        );
    }

    #[tokio::test]
    async fn a_slot_parked_after_the_waiter_slept_wakes_it_if_that_leaves_room() {
        let capacity = Capacity::new(8);
        let mut held = capacity.take_free(8);
        let mut waiter = waiter(&capacity).await;
        // One slot frees: not a quarter of eight. Then the other seven start cooling down.
        held.pop();
        for slot in &mut held {
            slot.park();
        }
        assert!(gets_a_slot(&mut waiter).await);
    }

    #[test]
    fn a_waiter_on_its_first_look_yields_to_the_others_only() {
        let capacity = Capacity::new(8);
        let _held = capacity.take_free(7);
        // One slot free, fewer than the two a wake needs.
        let _me = Waiting::new(&capacity.waiting);
        assert!(
            !capacity.try_take(Looker::Newcomer),
            "a newcomer yields to the waiter"
        );
        assert!(
            capacity.try_take(Looker::FirstLook),
            "the waiter alone takes the slot freed before it was counted"
        );
        let _other = Waiting::new(&capacity.waiting);
        capacity.in_flight.fetch_sub(1, Ordering::AcqRel);
        assert!(
            !capacity.try_take(Looker::FirstLook),
            "one of two waiters lets the other, woken, go first"
        );
        assert!(capacity.try_take(Looker::Woken));
    }

    #[test]
    fn parking_is_undone_when_the_slot_is_unparked_or_dropped() {
        let capacity = Capacity::new(8);
        let mut slots = capacity.take_free(2);
        for slot in &mut slots {
            slot.park();
            slot.park();
        }
        assert_eq!(capacity.parked.load(Ordering::Acquire), 2);
        slots[0].unpark();
        assert_eq!(capacity.parked.load(Ordering::Acquire), 1);
        drop(slots);
        assert_eq!(capacity.parked.load(Ordering::Acquire), 0);
        assert_eq!(capacity.in_flight.load(Ordering::Acquire), 0);
    }
}
