use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dacapo_actors::ports::{Clock, DeadLetterStore};
use dacapo_actors::{Backoff, DeadLetter, DeadLetterReason, Envelope, Persisted};

use super::InProcess;
use crate::Error;

/// What a transport's listener does with each envelope it receives: hand it to the runtime,
/// and acknowledge it to the broker only once this returns `Ok` — the inbox recorded it, or
/// discarded it as a duplicate.
///
/// When the store cannot record the envelope (the database is unreachable, a connection was
/// killed), the listener pauses with [`Backoff`] and tries the same envelope again, logging each
/// failure, until the store takes it: handling resumes by itself, and nothing is acknowledged
/// that is not persisted. An envelope whose data the store refuses (a value a column cannot
/// hold), which no redelivery can cure, goes to the dead letters instead, and `Ok` says it can
/// be acknowledged. Errors that waiting cannot cure (the runtime is shutting down) are
/// returned with the envelope: leave it unacknowledged, and the broker redelivers it.
///
/// ```no_run
/// # async fn pump(runtime: &dacapo::Runtime, incoming: Vec<dacapo::Envelope>) -> Result<(), dacapo::Error> {
/// let listener = runtime.listener();
/// for envelope in incoming {
///     listener.accept(envelope).await?;
///     // … acknowledge it to the broker here …
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Listener {
    transport: InProcess,
    backoff: Backoff,
    pauses: Arc<AtomicU64>,
    /// Where an envelope the store refuses goes, stamped on this clock.
    dead_letters: Arc<dyn DeadLetterStore>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("backoff", &self.backoff)
            .field("pauses", &self.pauses())
            .finish_non_exhaustive()
    }
}

impl Listener {
    pub(crate) fn new(
        transport: InProcess,
        dead_letters: Arc<dyn DeadLetterStore>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            transport,
            backoff: Backoff::default(),
            pauses: Arc::default(),
            dead_letters,
            clock,
        }
    }

    /// Pauses after store failures with `backoff` instead of the default.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How many times this listener (and its clones) paused for the store so far.
    pub fn pauses(&self) -> u64 {
        self.pauses.load(Ordering::Relaxed)
    }

    /// Hands `envelope` to the runtime, waiting out store failures; `Ok` once the runtime
    /// accepted it (persisted, or discarded as a duplicate), or, where the store refuses its
    /// data, once it is a dead letter ([`DeadLetterReason::StoreRejected`]): acknowledge it
    /// then.
    ///
    /// # Errors
    ///
    /// [`Error::ShuttingDown`] (the envelope handed back) and the other refusals that
    /// waiting cannot cure; [`Error::Rejected`] when the store refuses even its dead letter;
    /// never a store failure, which it waits out.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the envelope may or may not have been recorded: do not acknowledge it. Its
    /// redelivery is then handled, or discarded by the inbox if it was recorded.
    pub async fn accept(&self, envelope: Envelope) -> Result<(), Error> {
        let id = envelope.id;
        match self
            .waiting_out_the_store(id, || self.transport.send(envelope.clone(), None))
            .await
        {
            Err(Error::Rejected(error)) => self.dead_letter(envelope, &*error).await,
            accepted => accepted,
        }
    }

    /// Keeps an envelope the store refused as a dead letter, waiting out store failures.
    async fn dead_letter(
        &self,
        envelope: Envelope,
        refusal: &(dyn std::error::Error + Send + Sync),
    ) -> Result<(), Error> {
        let id = envelope.id;
        tracing::warn!(messaging.message.id = %id, error = %refusal, "the store refuses a received envelope's data; it goes to the dead letters");
        let letter = DeadLetter::rejected(
            envelope,
            DeadLetterReason::StoreRejected(refusal.to_string()),
            self.clock.now(),
        );
        self.waiting_out_the_store(id, || async {
            self.dead_letters
                .put(letter.clone())
                .await
                .map_err(Error::from)
        })
        .await
        // Named, for a transport to single out among a batch's.
        .map_err(|error| match error {
            Error::Rejected(refusal) => Error::Rejected(
                format!("envelope {id} cannot be kept, not even as a dead letter: {refusal}")
                    .into(),
            ),
            other => other,
        })
    }

    /// [`accept`](Self::accept) for the envelopes a transport received together (a prefetch):
    /// one store transaction for all of them, waiting out store failures; `Ok` once every one
    /// is accepted: acknowledge them all then (a multiple ack). A batch the store refuses for
    /// one envelope's data is accepted one envelope at a time, the refused ones dead-lettered.
    ///
    /// # Errors
    ///
    /// As [`accept`](Self::accept); none of them is recorded then, unless the error came one
    /// envelope at a time: a store failure stops there (those before it are recorded), and an
    /// envelope the store refuses even as a dead letter is the error, which names its id, once
    /// every other one was recorded: hand that one to the broker's own dead-lettering (nack it
    /// alone without requeue) and acknowledge the others.
    ///
    /// # Cancel safety
    ///
    /// As [`accept`](Self::accept), for every envelope of the batch.
    pub async fn accept_batch(&self, envelopes: Vec<Envelope>) -> Result<(), Error> {
        let Some(first) = envelopes.first().map(|envelope| envelope.id) else {
            return Ok(());
        };
        match self
            .waiting_out_the_store(first, || self.transport.send_batch(envelopes.clone()))
            .await
        {
            Err(Error::Rejected(_)) => {
                // Every envelope is offered, one refused even as a dead letter included: what
                // follows it is recorded all the same, and the refusal comes back at the end.
                let mut refused = None;
                for envelope in envelopes {
                    match self.accept(envelope).await {
                        Ok(()) => {}
                        Err(error @ Error::Rejected(_)) => {
                            refused.get_or_insert(error);
                        }
                        Err(error) => return Err(error),
                    }
                }
                refused.map_or(Ok(()), Err)
            }
            accepted => accepted,
        }
    }

    /// [`accept_batch`](Self::accept_batch) in two halves: `Ok` once the batch is
    /// persisted (acknowledge it then), with its deliveries still to start
    /// ([`Persisted::start`]: before the next batch is taken, which keeps the transport's pace
    /// to the engine's). Nothing of the broker's is held while they wait for room.
    ///
    /// # Errors
    ///
    /// As [`accept_batch`](Self::accept_batch).
    ///
    /// # Cancel safety
    ///
    /// As [`accept_batch`](Self::accept_batch); dropped unstarted, the deliveries are resumed
    /// by this node's orphan sweep.
    pub(crate) async fn persist_batch(
        &self,
        envelopes: Vec<Envelope>,
    ) -> Result<Option<Persisted>, Error> {
        let Some(first) = envelopes.first().map(|envelope| envelope.id) else {
            return Ok(None);
        };
        self.waiting_out_the_store(first, || self.transport.persist_batch(envelopes.clone()))
            .await
            .map(Some)
    }

    /// Runs `accept` until the store takes it, pausing after each store failure.
    async fn waiting_out_the_store<T, F, Fut>(
        &self,
        id: uuid::Uuid,
        mut accept: F,
    ) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        let mut failures = 0u32;
        loop {
            match accept().await {
                // A store down, or this node held by another process until it ends.
                Err(error @ (Error::Store(_) | Error::NodeHeld { .. })) => {
                    failures = failures.saturating_add(1);
                    let pause = self.backoff.pause(failures);
                    self.pauses.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        messaging.message.id = %id,
                        %error,
                        failures,
                        ?pause,
                        "the store cannot record a received envelope; pausing before trying again"
                    );
                    tokio::time::sleep(pause).await;
                }
                accepted => {
                    if failures > 0 {
                        tracing::info!(
                            messaging.message.id = %id,
                            failures,
                            "the store records received envelopes again; listening resumed"
                        );
                    }
                    return accepted;
                }
            }
        }
    }
}
