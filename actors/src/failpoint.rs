//! Named points in the durable path where a test crashes the runtime, and the fence that keeps
//! a crashed runtime from doing anything more.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio::sync::watch;

/// A point in the life of a delivery where the test harness can crash the runtime: the process
/// dies there, and nothing after it runs — no drain, no release of the node's deliveries.
///
/// dacapo acknowledges a transport once the inbox recorded the envelope, before any handler
/// runs, so the window "persisted but not acknowledged" is [`BeforeAcknowledge`]; the settle's
/// windows are [`BeforeSettle`] and [`AfterSettle`].
///
/// [`BeforeAcknowledge`]: Failpoint::BeforeAcknowledge
/// [`BeforeSettle`]: Failpoint::BeforeSettle
/// [`AfterSettle`]: Failpoint::AfterSettle
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Failpoint {
    /// The inbox committed the envelope; the transport has not been told. A broker would
    /// deliver it again, and the inbox discards that copy while recovery runs the recorded one.
    BeforeAcknowledge,
    /// Every handler of the attempt ran (their transactions committed); the settle that marks
    /// the delivery handled, with its outbox rows, has not committed.
    BeforeSettle,
    /// The settle committed; nothing after it ran (no report, no wake of the relay).
    AfterSettle,
    /// A failed attempt's retry is recorded and its cooldown has begun.
    DuringCooldown,
    /// Inside the dead-letter transaction: the inbox row is marked, the dead letter is
    /// written, the commit has not run.
    DeadLetterMove,
    /// The outbox relay published a batch; it has not marked the rows published.
    BeforeOutboxMark,
}

impl std::fmt::Display for Failpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Self::BeforeAcknowledge => "before the transport is acknowledged",
            Self::BeforeSettle => "after the handlers ran, before the settle commits",
            Self::AfterSettle => "after the settle committed",
            Self::DuringCooldown => "during a cooldown",
            Self::DeadLetterMove => "in the middle of a dead-letter move",
            Self::BeforeOutboxMark => "after the outbox published, before it marked",
        };
        f.write_str(name)
    }
}

/// The failpoint a test armed, and whether the runtime crashed: shared by the engine, the
/// store and the harness. Once crashed, every point and every fenced step waits forever, as
/// in a process that is gone, until the engine's threads are stopped.
#[doc(hidden)]
#[derive(Debug)]
pub struct Failpoints {
    /// The point armed, and the message type it is armed for (`None`: any).
    armed: Mutex<Option<(Failpoint, Option<String>)>>,
    crashed: watch::Sender<Option<Failpoint>>,
    /// Counts the runtimes started after a crash: what a crashed one still runs (a thread
    /// of its store's, which its stop did not take) tells it is gone by an older count.
    run: AtomicU64,
}

impl Default for Failpoints {
    fn default() -> Self {
        Self {
            armed: Mutex::new(None),
            crashed: watch::Sender::new(None),
            run: AtomicU64::new(0),
        }
    }
}

impl Failpoints {
    /// Crashes the runtime the next time a delivery reaches `point` — a delivery of
    /// `message_type` only, when one is given.
    pub fn arm(&self, point: Failpoint, message_type: Option<String>) {
        *self.armed.lock().unwrap_or_else(PoisonError::into_inner) = Some((point, message_type));
    }

    /// Whether the runtime reached `point` armed (it crashes now), or crashed earlier: either
    /// way the caller must not go on. `message_type` is that of the delivery at the point
    /// (`None` where several pass together, which only a point armed for any type strikes).
    pub fn reached(&self, point: Failpoint, message_type: Option<&str>) -> bool {
        if self.crashed().is_some() {
            return true;
        }
        let mut armed = self.armed.lock().unwrap_or_else(PoisonError::into_inner);
        let strikes = armed.as_ref().is_some_and(|(armed, only)| {
            *armed == point
                && only
                    .as_deref()
                    .is_none_or(|only| message_type == Some(only))
        });
        if !strikes {
            return false;
        }
        *armed = None;
        self.crashed.send_replace(Some(point));
        tracing::warn!(failpoint = %point, "test harness: the runtime crashes here");
        true
    }

    /// Passes `point`, or never returns if the runtime crashes there (or crashed before).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn pass(&self, point: Failpoint, message_type: Option<&str>) {
        if self.reached(point, message_type) {
            std::future::pending::<()>().await;
        }
    }

    /// Never returns once the runtime crashed: a fenced step of a process that is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn fence(&self) {
        if self.crashed().is_some() {
            std::future::pending::<()>().await;
        }
    }

    /// Where the runtime crashed, if it did.
    pub fn crashed(&self) -> Option<Failpoint> {
        *self.crashed.borrow()
    }

    /// Returns once the runtime crashed, with where.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn until_crashed(&self) -> Failpoint {
        let mut crashed = self.crashed.subscribe();
        let point = crashed.wait_for(Option::is_some).await.map(|point| *point);
        match point {
            Ok(Some(point)) => point,
            // The sender lives in `self`, which outlives this borrow; `wait_for` returned a
            // crash, so there is a point.
            _ => std::future::pending().await,
        }
    }

    /// Forgets the crash and the armed point, for a runtime started after the crashed one
    /// stopped, and counts a new [`run`](Self::run) before it does.
    pub fn reset(&self) {
        self.run.fetch_add(1, Ordering::SeqCst);
        *self.armed.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.crashed.send_replace(None);
    }

    /// Which runtime is the live one: 0 for the first, one more at each [`reset`](Self::reset).
    pub fn run(&self) -> u64 {
        self.run.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_point_crashes_once_and_fences_every_point_after() {
        let points = Failpoints::default();
        assert!(!points.reached(Failpoint::BeforeSettle, None));
        points.arm(Failpoint::BeforeSettle, None);
        assert!(!points.reached(Failpoint::AfterSettle, Some("a")));
        assert!(points.reached(Failpoint::BeforeSettle, Some("a")));
        assert_eq!(points.crashed(), Some(Failpoint::BeforeSettle));
        assert!(points.reached(Failpoint::AfterSettle, None));
        assert_eq!(points.run(), 0);
        points.reset();
        assert!(!points.reached(Failpoint::BeforeSettle, None));
        assert_eq!(
            points.run(),
            1,
            "the next runtime is told apart from the crashed one"
        );
    }

    #[test]
    fn a_point_armed_for_a_message_type_spares_the_others() {
        let points = Failpoints::default();
        points.arm(Failpoint::AfterSettle, Some("orders.placed".into()));
        assert!(!points.reached(Failpoint::AfterSettle, Some("billing.invoiced")));
        assert!(!points.reached(Failpoint::AfterSettle, None));
        assert!(points.reached(Failpoint::AfterSettle, Some("orders.placed")));
    }

    #[tokio::test]
    async fn a_waiter_learns_where_the_runtime_crashed() {
        let points = std::sync::Arc::new(Failpoints::default());
        points.arm(Failpoint::DuringCooldown, None);
        let waiter = tokio::spawn({
            let points = std::sync::Arc::clone(&points);
            async move { points.until_crashed().await }
        });
        tokio::task::yield_now().await;
        assert!(points.reached(Failpoint::DuringCooldown, None));
        assert_eq!(waiter.await.unwrap(), Failpoint::DuringCooldown);
    }
}
