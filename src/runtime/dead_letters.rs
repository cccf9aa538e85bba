use dacapo_actors::ports::{Replay, ReplayTo, Resumable};
use dacapo_actors::{DeadLetter, DeadLetterFilter};
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
        self.list_matching(&DeadLetterFilter::all()).await
    }

    /// The dead letters `filter` takes (by message type, time, count), oldest failure first.
    ///
    /// # Errors
    ///
    /// The store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn list_matching(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, Error> {
        Ok(self.runtime.dead_letters.list(filter).await?)
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
    /// fresh attempt count, and runs it on this node. A letter the broker refused on its way
    /// out ([`DeadLetterReason::Undeliverable`](crate::DeadLetterReason::Undeliverable)) goes
    /// back to the outbox instead, at its end, and the relay sends it again: to the service it
    /// was routed to, not to this node's handlers.
    ///
    /// The move is one transition of the inbox: the dead letter is removed and the inbox row
    /// rewritten together, or neither. A replay that fails again at once therefore leaves its
    /// new dead letter, and a replay while the envelope is being delivered (a second replay of
    /// the same letter) is refused and changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::DeadLetterNotFound`], [`Error::ReplayInProgress`],
    /// [`Error::UnreadableReplay`] (the letter stays), or the store's failure, in
    /// which case the dead letter stays: nothing is lost. [`Error::ShuttingDown`] when the
    /// runtime is closing: before the move the dead letter stays; if the shutdown began while
    /// the move committed, the envelope is in the inbox, this node's, and runs at its next
    /// start (nothing is lost either way, but the letter may be gone).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the move either committed (the envelope is in the inbox, owned by this node,
    /// and runs now or at this node's next start) or did not (the dead letter stays).
    pub async fn replay(&self, id: Uuid) -> Result<(), Error> {
        let runtime = self.runtime;
        let dispatcher = runtime.engine.dispatcher();
        if dispatcher.is_closing() {
            let letter = runtime.dead_letters.get(id).await?;
            let letter = letter.ok_or(Error::DeadLetterNotFound(id))?;
            return Err(Error::ShuttingDown(Box::new(letter.envelope)));
        }
        // From before the write, which may wait longer than the node timeout to commit: the
        // row it makes this node's must not look orphaned until its resume lists it.
        let _receiving = dispatcher.receiving(id);
        match runtime.inbox.replay(id, ReplayTo::ThisNode).await? {
            // Refused only by a shutdown that began meanwhile: the row is this node's, and its
            // next start runs it.
            Replay::Replayed(envelope) => dispatcher.resume(Resumable::new(
                envelope,
                None,
                Vec::new(),
                Vec::new(),
                Vec::new(),
            ))?,
            Replay::Enlisted(_) => dispatcher.wake_outbox(),
            Replay::InProgress => return Err(Error::ReplayInProgress(id)),
            Replay::Unreadable => return Err(Error::UnreadableReplay(id)),
            _ => return Err(Error::DeadLetterNotFound(id)),
        }
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
        self.purge_matching(&DeadLetterFilter::all()).await
    }

    /// Removes the dead letters `filter` takes; returns how many there were.
    ///
    /// # Errors
    ///
    /// The store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, some or all of them may be gone.
    pub async fn purge_matching(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        Ok(self.runtime.dead_letters.purge(filter).await?)
    }
}
