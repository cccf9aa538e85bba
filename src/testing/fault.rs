use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dacapo_actors::{Decoded, HandlerError, Invoke, Message, MessageContext};
use futures::FutureExt;
use uuid::Uuid;

type Predicate = Arc<dyn Fn(&Decoded) -> bool + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    Fail,
    FailPermanently,
    Panic,
    Hang,
}

/// A failure injected in front of one handler.
///
/// Counted faults (`fail_times`, `panic_times`, `hang_times`) strike the first N attempts of
/// *each message*, and then let the real handler run.
#[derive(Clone)]
pub struct Fault {
    effect: Effect,
    times: Option<u32>,
    only_when: Option<Predicate>,
    struck: Arc<Mutex<HashMap<Option<Uuid>, u32>>>,
}

impl std::fmt::Debug for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fault")
            .field("effect", &self.effect)
            .field("times", &self.times)
            .field("filtered", &self.only_when.is_some())
            .finish()
    }
}

impl Fault {
    fn new(effect: Effect, times: Option<u32>) -> Self {
        Self {
            effect,
            times,
            only_when: None,
            struck: Arc::default(),
        }
    }

    /// This fault with a count of its own: a clone shares its count with the original.
    pub(crate) fn counted_afresh(mut self) -> Self {
        self.struck = Arc::default();
        self
    }

    /// Fails the first `n` attempts of each message with a retryable error.
    pub fn fail_times(n: u32) -> Self {
        Self::new(Effect::Fail, Some(n))
    }

    /// Fails every attempt with a retryable error, until the message is dead-lettered.
    pub fn always_fail() -> Self {
        Self::new(Effect::Fail, None)
    }

    /// Fails with a permanent error: dead-lettered on the first attempt.
    pub fn fail_permanently() -> Self {
        Self::new(Effect::FailPermanently, None)
    }

    /// Panics in the first `n` attempts of each message.
    pub fn panic_times(n: u32) -> Self {
        Self::new(Effect::Panic, Some(n))
    }

    /// Panics on every attempt.
    pub fn always_panic() -> Self {
        Self::new(Effect::Panic, None)
    }

    /// Never finishes in the first `n` attempts of each message, so the handler's timeout
    /// fails them.
    pub fn hang_times(n: u32) -> Self {
        Self::new(Effect::Hang, Some(n))
    }

    /// Never finishes, on every attempt.
    pub fn always_hang() -> Self {
        Self::new(Effect::Hang, None)
    }

    /// Strikes only messages of type `M` for which `predicate` holds.
    #[must_use]
    pub fn only_when<M: Message>(
        mut self,
        predicate: impl Fn(&M) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.only_when = Some(Arc::new(move |decoded: &Decoded| {
            decoded.downcast_ref::<M>().is_some_and(&predicate)
        }));
        self
    }

    fn strikes(&self, decoded: &Decoded, message_id: Option<Uuid>) -> bool {
        if self
            .only_when
            .as_ref()
            .is_some_and(|matches| !matches(decoded))
        {
            return false;
        }
        let Some(limit) = self.times else { return true };
        let mut struck = self
            .struck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = struck.entry(message_id).or_insert(0);
        if *count < limit {
            *count += 1;
            true
        } else {
            false
        }
    }

    pub(crate) fn wrap(self, inner: Invoke) -> Invoke {
        let fault = Arc::new(self);
        Arc::new(
            move |route, index, decoded: Decoded, context: MessageContext| {
                let fault = Arc::clone(&fault);
                let inner = Arc::clone(&inner);
                async move {
                    if fault.strikes(&decoded, context.message_id()) {
                        let attempt = context.attempt();
                        match fault.effect {
                            Effect::Fail => {
                                return Err(HandlerError::retry(format!(
                                    "injected failure (attempt {attempt})"
                                )));
                            }
                            Effect::FailPermanently => {
                                return Err(HandlerError::permanent("injected permanent failure"));
                            }
                            Effect::Panic => panic!("injected panic (attempt {attempt})"),
                            Effect::Hang => context.hang().await,
                        }
                    }
                    inner(route, index, decoded, context).await
                }
                .boxed()
            },
        )
    }
}
