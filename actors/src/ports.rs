//! The traits through which the actors reach storage and the clock.
//!
//! Adapters live in the `reprise` crate; the actors only ever see these traits.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{AggregateError, DeadLetter, Envelope, Error};

/// What the inbox says of a received envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Receipt {
    /// First time seen: handle it.
    New,
    /// Already known (incoming, scheduled, or handled within the retention): discard it.
    Duplicate,
}

/// A delivery a durable inbox hands back after a restart: resume it where it stopped.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Resumable {
    /// The envelope; `attempts` counts the attempts already started.
    pub envelope: Envelope,
    /// When its next attempt is due (`None`: now).
    pub due_at: Option<DateTime<Utc>>,
    /// The aggregate error of every failed attempt so far.
    pub failures: Vec<AggregateError>,
    /// The handlers that already succeeded (`module/name`), which
    /// [`RetryScope::FailedHandlers`](crate::RetryScope::FailedHandlers) does not run again.
    pub succeeded: Vec<String>,
}

impl Resumable {
    /// A delivery to resume.
    pub fn new(
        envelope: Envelope,
        due_at: Option<DateTime<Utc>>,
        failures: Vec<AggregateError>,
        succeeded: Vec<String>,
    ) -> Self {
        Self {
            envelope,
            due_at,
            failures,
            succeeded,
        }
    }
}

/// Remembers envelope ids so that a redelivered envelope is discarded, not handled again.
///
/// The required methods are all an in-memory inbox needs. A durable inbox also persists the
/// state of each delivery (the provided methods), so that a restart resumes it.
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// Records `envelope` as incoming, or reports that its id is already known.
    ///
    /// The engine starts the first attempt right after, so a durable inbox records that attempt
    /// as started (`attempts + 1`): a crash from here on counts it.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer; the envelope must then not be acked.
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, Error>;

    /// Records `envelope` as incoming for any node to run — unowned, with no attempt started —
    /// or reports that its id is already known. Tools use it to hand work to running nodes
    /// (a dead letter replayed from the command line).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot record it, or cannot hand work to other nodes at
    /// all (an inbox in memory).
    async fn enqueue(&self, envelope: &Envelope) -> Result<Receipt, Error> {
        let _ = envelope;
        Err(Error::store(
            "this inbox cannot hand envelopes to other nodes",
        ))
    }

    /// Records that attempt `attempt` of envelope `id` starts, so a crash during it counts it.
    /// The first attempt is recorded by [`receive`](Inbox::receive).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn begin_attempt(&self, id: Uuid, attempt: u32) -> Result<(), Error> {
        let _ = (id, attempt);
        Ok(())
    }

    /// Records a failed attempt and when the next one is due, so a restart during the cooldown
    /// resumes at the right time with the right count.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    ///
    /// `succeeded` lists the handlers (`module/name`) that succeeded so far.
    async fn schedule_retry(
        &self,
        envelope: &Envelope,
        due_at: DateTime<Utc>,
        failures: &[AggregateError],
        succeeded: &[String],
    ) -> Result<(), Error> {
        let _ = (envelope, due_at, failures, succeeded);
        Ok(())
    }

    /// Claims for this node up to `limit` deliveries left unsettled by a runtime that stopped —
    /// released at a graceful shutdown, or owned by a node whose heartbeat expired — so they
    /// resume here.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn recover(&self, limit: usize) -> Result<Vec<Resumable>, Error> {
        let _ = limit;
        Ok(Vec::new())
    }

    /// Gives up this node's deliveries received before `started_at`: a previous run under
    /// the same node name left them, and [`recover`](Inbox::recover) then resumes them at
    /// once. Deliveries this run received are not touched.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn release_before(&self, started_at: DateTime<Utc>) -> Result<(), Error> {
        let _ = started_at;
        Ok(())
    }

    /// Records that this node is alive; other nodes recover the deliveries of a node that
    /// stops doing so.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn heartbeat(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Gives up this node's unsettled deliveries (at a graceful shutdown), so the next runtime
    /// on the store resumes them at once instead of waiting for the heartbeat to expire.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn release(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Deletes at most `limit` envelopes handled before `before`; returns how many it deleted.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn delete_handled_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error> {
        let _ = (before, limit);
        Ok(0)
    }

    /// Marks the envelope handled; it is remembered for the retention, then forgotten.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot record it.
    async fn mark_handled(&self, id: Uuid) -> Result<(), Error>;

    /// Forgets the envelope (dead-lettered or abandoned), so a replay of it is accepted.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot record it.
    async fn forget(&self, id: Uuid) -> Result<(), Error>;

    /// [`receive`](Inbox::receive) for stores that answer without waiting (in memory): `None`
    /// means "ask the async method". The engine tries it first to spare a future per envelope.
    fn receive_now(&self, envelope: &Envelope) -> Option<Result<Receipt, Error>> {
        let _ = envelope;
        None
    }

    /// [`mark_handled`](Inbox::mark_handled) for stores that answer without waiting; `None`
    /// means "ask the async method".
    fn mark_handled_now(&self, id: Uuid) -> Option<Result<(), Error>> {
        let _ = id;
        None
    }
}

/// Keeps messages the runtime gave up on.
#[async_trait]
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Stores a dead letter, replacing one with the same envelope id.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be stored.
    async fn put(&self, dead_letter: DeadLetter) -> Result<(), Error>;

    /// Every dead letter, oldest failure first.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn list(&self) -> Result<Vec<DeadLetter>, Error>;

    /// The dead letter of envelope `id`, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, Error>;

    /// Removes and returns the dead letter of envelope `id`.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, Error>;

    /// Removes every dead letter and says how many there were.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn purge(&self) -> Result<u64, Error>;
}

/// Wall-clock time as the engine sees it, so a harness can make it virtual.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}
