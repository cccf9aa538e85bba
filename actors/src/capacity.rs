use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Bounds the deliveries in flight, with hysteresis: once full, waiting publishers are woken
/// only after a quarter of the slots freed up, so a saturated engine wakes them once per
/// batch rather than once per settled delivery (a wake is a syscall and a context switch).
///
/// While anyone waits, newcomers wait too, so a steady stream of new publishers cannot keep
/// the engine just under full and starve those already waiting.
#[derive(Debug)]
pub(crate) struct Capacity {
    in_flight: AtomicUsize,
    waiting: AtomicUsize,
    max: usize,
    resume_at: usize,
    resumed: Notify,
}

/// One slot; freed when dropped.
#[derive(Debug)]
pub(crate) struct Slot(Arc<Capacity>);

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
        let max = max.max(1);
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max,
            resume_at: (max - max / 4).min(max - 1),
            resumed: Notify::new(),
        })
    }

    /// Takes a slot if the bound allows it now. A newcomer also lets those already waiting go
    /// first, until the engine has drained to the point where they are woken.
    fn try_take(&self, waiter: bool) -> bool {
        let mut current = self.in_flight.load(Ordering::Acquire);
        loop {
            let yields = !waiter && self.waiting.load(Ordering::Acquire) > 0;
            let allowed = current < self.max && (!yields || current <= self.resume_at);
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

    /// Takes up to `count` slots that are free now, without waiting.
    pub(crate) fn take_free(self: &Arc<Self>, count: usize) -> Vec<Slot> {
        let mut slots = Vec::new();
        while slots.len() < count && self.try_take(false) {
            slots.push(Slot(Arc::clone(self)));
        }
        slots
    }

    /// A slot if one is free now.
    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        self.try_take(false).then(|| Slot(Arc::clone(self)))
    }

    /// Takes a slot, waiting while the engine is full.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled wait takes no slot.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Slot {
        if self.try_take(false) {
            return Slot(Arc::clone(self));
        }
        let _waiting = Waiting::new(&self.waiting);
        loop {
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            // Registered before this check, so a release in between is not missed.
            if self.try_take(true) {
                return Slot(Arc::clone(self));
            }
            resumed.await;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let before = self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        if before > self.0.resume_at && before - 1 <= self.0.resume_at {
            self.0.resumed.notify_waiters();
        }
    }
}
