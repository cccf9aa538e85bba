use dacapo_actors::{DeliveryReport, Dispatcher, Envelope, Persisted};
use tokio::sync::oneshot;

use crate::Error;

/// Delivers envelopes to the engine of the same process, with no broker in between.
///
/// It has the same contract as a broker listener: an envelope counts as sent once the engine
/// accepted it (the inbox recorded it), never before.
#[derive(Clone, Debug)]
pub(crate) struct InProcess {
    dispatcher: Dispatcher,
}

impl InProcess {
    pub(crate) fn new(dispatcher: Dispatcher) -> Self {
        Self { dispatcher }
    }

    /// Accepts a batch of envelopes in one store transaction, all or nothing, and starts
    /// their deliveries.
    pub(crate) async fn send_batch(&self, envelopes: Vec<Envelope>) -> Result<(), Error> {
        Ok(self.dispatcher.dispatch_batch(envelopes).await?)
    }

    /// Persists a batch of envelopes in one store transaction, all or nothing; their
    /// deliveries start once what it returns is started.
    pub(crate) async fn persist_batch(&self, envelopes: Vec<Envelope>) -> Result<Persisted, Error> {
        Ok(self.dispatcher.persist_batch(envelopes).await?)
    }

    /// [`send`](Self::send) while the caller holds `held` on the virtual clock.
    #[cfg(feature = "testing")]
    pub(crate) async fn send_holding(
        &self,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        held: &mut Option<dacapo_actors::Busy>,
    ) -> Result<(), Error> {
        Ok(self
            .dispatcher
            .dispatch_holding(envelope, reply, held)
            .await?)
    }

    /// Sends `envelope` to the local engine; `reply` gets the report once it settles.
    ///
    /// # Errors
    ///
    /// The engine's refusal (shutting down, inbox failure), with the envelope handed back
    /// where the error has it.
    ///
    /// # Cancel safety
    ///
    /// Cancelled while waiting for capacity, nothing happened. Cancelled while the inbox
    /// records the envelope, it may be recorded but not handled: a durable inbox resumes it
    /// after a restart (or once this node's heartbeat expires), the in-memory one never does.
    pub(crate) async fn send(
        &self,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
    ) -> Result<(), Error> {
        Ok(self.dispatcher.dispatch(envelope, reply).await?)
    }
}
