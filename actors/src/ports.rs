//! The traits through which the actors reach storage and the clock.
//!
//! Adapters live in the `reprise` crate; the actors only ever see these traits.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{DeadLetter, Envelope, Error};

/// What the inbox says of a received envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Receipt {
    /// First time seen: handle it.
    New,
    /// Already known (incoming, scheduled, or handled within the retention): discard it.
    Duplicate,
}

/// Remembers envelope ids so that a redelivered envelope is discarded, not handled again.
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// Records `envelope` as incoming, or reports that its id is already known.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer; the envelope must then not be acked.
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, Error>;

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
