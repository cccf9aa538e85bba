use dacapo_actors::DeadLetter;
use uuid::Uuid;

use crate::{Error, Runtime};

/// The runtime's dead letters: messages it gave up on, kept to be inspected and replayed.
#[derive(Debug)]
pub struct DeadLetters<'a> {
    runtime: &'a Runtime,
}

impl<'a> DeadLetters<'a> {
    pub(super) fn new(runtime: &'a Runtime) -> Self {
        Self { runtime }
    }

    /// Every dead letter, oldest failure first.
    ///
    /// # Errors
    ///
    /// The store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn list(&self) -> Result<Vec<DeadLetter>, Error> {
        Ok(self.runtime.dead_letters.list().await?)
    }

    /// The dead letter of envelope `id`.
    ///
    /// # Errors
    ///
    /// [`Error::DeadLetterNotFound`], or the store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn inspect(&self, id: Uuid) -> Result<DeadLetter, Error> {
        self.runtime
            .dead_letters
            .get(id)
            .await?
            .ok_or(Error::DeadLetterNotFound(id))
    }

    /// Sends the dead letter's envelope back to the inbox with the same envelope id and a
    /// fresh attempt count, and removes it from the dead letters.
    ///
    /// # Errors
    ///
    /// [`Error::DeadLetterNotFound`], or a failure to redeliver, in which case the dead
    /// letter stays: nothing is lost.
    ///
    /// # Cancel safety
    ///
    /// Cancelled midway, the envelope may be redelivered while its dead letter stays; replaying
    /// it again is then discarded by the inbox.
    pub async fn replay(&self, id: Uuid) -> Result<(), Error> {
        let store = &self.runtime.dead_letters;
        let dead_letter = store.get(id).await?.ok_or(Error::DeadLetterNotFound(id))?;
        let mut envelope = dead_letter.envelope.clone();
        envelope.attempts = 0;
        // Redelivered first, removed after: a crash in between leaves the dead letter (its
        // envelope, once handled, is discarded if replayed again), never loses it.
        self.runtime.inbox.forget(id).await?;
        self.runtime.receive(envelope).await?;
        store
            .remove_if_unchanged(id, dead_letter.last_failure_at)
            .await?;
        tracing::info!(messaging.message.id = %id, "dead letter replayed");
        Ok(())
    }

    /// Removes every dead letter; returns how many there were.
    ///
    /// # Errors
    ///
    /// The store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, some or all dead letters may be gone.
    pub async fn purge(&self) -> Result<u64, Error> {
        Ok(self.runtime.dead_letters.purge().await?)
    }
}
