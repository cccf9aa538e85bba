use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Bounds the deliveries in flight, with hysteresis: once full, waiting publishers are woken
/// only after a quarter of the slots freed up, so a saturated engine wakes them once per
/// batch rather than once per settled delivery (a wake is a syscall and a context switch).
#[derive(Debug)]
pub(crate) struct Capacity {
    in_flight: AtomicUsize,
    max: usize,
    resume_at: usize,
    resumed: Notify,
}

/// One slot; freed when dropped.
#[derive(Debug)]
pub(crate) struct Slot(Arc<Capacity>);

impl Capacity {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            max,
            resume_at: (max - max / 4).min(max - 1),
            resumed: Notify::new(),
        })
    }

    /// Takes a slot, waiting while every slot is taken.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled wait takes no slot.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Slot {
        loop {
            let current = self.in_flight.load(Ordering::Acquire);
            if current < self.max {
                if self
                    .in_flight
                    .compare_exchange_weak(
                        current,
                        current + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    return Slot(Arc::clone(self));
                }
                continue;
            }
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            // A release between the load above and `enable` would otherwise go unnoticed.
            if self.in_flight.load(Ordering::Acquire) < self.max {
                continue;
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
