use std::sync::{Arc, Mutex};

use dacapo_actors::{Handler, HandlerError, Message, MessageContext};
use uuid::Uuid;

/// One call a [`Recorder`] saw.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Call<M> {
    /// The message handled.
    pub message: M,
    /// Its envelope id.
    pub message_id: Option<Uuid>,
    /// The attempt number.
    pub attempt: u32,
}

/// A handler that succeeds and remembers every call, for assertions.
///
/// Clones share the same record, so keep one and register another.
pub struct Recorder<M> {
    calls: Arc<Mutex<Vec<Call<M>>>>,
}

impl<M> Clone for Recorder<M> {
    fn clone(&self) -> Self {
        Self {
            calls: Arc::clone(&self.calls),
        }
    }
}

impl<M> std::fmt::Debug for Recorder<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("calls", &self.count())
            .finish()
    }
}

impl<M> Default for Recorder<M> {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
        }
    }
}

impl<M> Recorder<M> {
    /// A recorder that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Call<M>>> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many calls it saw.
    pub fn count(&self) -> usize {
        self.lock().len()
    }
}

impl<M: Clone> Recorder<M> {
    /// Every call, in order.
    pub fn calls(&self) -> Vec<Call<M>> {
        self.lock().clone()
    }
}

impl<M: Message + Clone> Handler<M> for Recorder<M> {
    async fn handle(&self, message: &M, context: &MessageContext) -> Result<(), HandlerError> {
        self.lock().push(Call {
            message: message.clone(),
            message_id: context.message_id(),
            attempt: context.attempt(),
        });
        Ok(())
    }
}
