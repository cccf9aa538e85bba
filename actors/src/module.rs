use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::{Deduplication, Handler, HandlerError, Message, MessageContext, RetryPolicy, Route};

/// A decoded message, shared by every handler of one delivery.
pub type Decoded = Arc<dyn Any + Send + Sync>;

/// A type-erased handler call: what the engine runs for the
/// handler at `index` in the route, with the decoded message and its context.
///
/// The call reaches its handler through the route rather than through a handle of its own,
/// so that running a handler touches no reference count shared between worker threads.
pub type Invoke = Arc<
    dyn Fn(
            Arc<Route>,
            usize,
            Decoded,
            MessageContext,
        ) -> BoxFuture<'static, Result<(), HandlerError>>
        + Send
        + Sync,
>;

/// Turns a payload into a [`Decoded`] message of the registered type.
pub(crate) type Decode = fn(&[u8]) -> Result<Decoded, serde_json::Error>;

/// Names a handler: the module that registered it and its name there.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandlerId {
    /// The module's name.
    pub module: Arc<str>,
    /// The handler's name within the module.
    pub name: Arc<str>,
}

impl std::fmt::Display for HandlerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.module, self.name)
    }
}

/// One handler of one message type, ready to be run by the engine.
#[derive(Clone)]
pub struct HandlerEntry {
    /// Who this handler is.
    pub id: HandlerId,
    /// The message type it handles.
    pub message_type: &'static str,
    /// Runs the handler.
    pub invoke: Invoke,
    /// The handler itself, as registered.
    pub(crate) handler: Arc<dyn Any + Send + Sync>,
    /// The module's retry policy, if it set one.
    pub module_policy: Option<RetryPolicy>,
    /// The module's handler timeout, if it set one.
    pub module_timeout: Option<Duration>,
    pub(crate) decode: Decode,
    /// The Rust type the payload decodes into.
    pub(crate) rust_type: (std::any::TypeId, &'static str),
    /// Its logical deduplication, if it opted in.
    pub deduplication: Option<Deduplication>,
}

impl std::fmt::Debug for HandlerEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerEntry")
            .field("id", &self.id)
            .field("message_type", &self.message_type)
            .finish_non_exhaustive()
    }
}

/// A group of handlers owned by one part of the application (a module of the monolith).
///
/// Several modules may handle the same message type; every one of their handlers runs for
/// every delivery of it.
///
/// ```
/// use dacapo::{Handler, HandlerError, Message, MessageContext, Module, RetryPolicy};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct MemberRemoved { member_id: u64 }
/// # impl Message for MemberRemoved { const TYPE: &'static str = "organization.member_removed"; }
/// # struct QueueDeliveries;
/// # impl Handler<MemberRemoved> for QueueDeliveries {
/// #     async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> { Ok(()) }
/// # }
///
/// let webhooks = Module::new("webhooks")
///     .retry_policy(RetryPolicy { retry_limit: 3, ..RetryPolicy::default() })
///     .handle::<MemberRemoved, _>(QueueDeliveries);
/// assert_eq!(webhooks.handlers().len(), 1);
/// ```
#[derive(Debug)]
pub struct Module {
    name: Arc<str>,
    policy: Option<RetryPolicy>,
    timeout: Option<Duration>,
    handlers: Vec<HandlerEntry>,
    /// Handler names `deduplicate` was given that no handler of this module has.
    unknown_deduplications: Vec<String>,
}

impl Module {
    /// An empty module called `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self {
            name: name.into(),
            policy: None,
            timeout: None,
            handlers: Vec::new(),
            unknown_deduplications: Vec::new(),
        }
    }

    /// The module's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The retry policy for failures of this module's handlers (unless the message type has
    /// its own).
    #[must_use]
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = Some(policy);
        for entry in &mut self.handlers {
            entry.module_policy = Some(policy);
        }
        self
    }

    /// How long each of this module's handlers may run before it counts as failed.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        for entry in &mut self.handlers {
            entry.module_timeout = Some(timeout);
        }
        self
    }

    /// Registers `handler` for messages of type `M`, named after its Rust type: the last
    /// segment of its path, without generic parameters (`billing::ChargeCard<Live>` is
    /// `ChargeCard`). The handler's id is then `module/ChargeCard`: the name stored with its
    /// completions and claims, shown in failures and reports, and given to
    /// [`TestHarness`](https://docs.rs/dacapo/latest/dacapo/testing/struct.TestHarness.html)
    /// faults. Renaming the type renames the handler, so a handler whose stored state must
    /// survive refactoring takes [`handle_named`](Self::handle_named) instead.
    ///
    /// Two handlers of one type in one module need `handle_named`; the build refuses the
    /// duplicate name.
    #[must_use]
    pub fn handle<M: Message, H: Handler<M>>(self, handler: H) -> Self {
        let name = short_type_name::<H>();
        self.handle_named::<M, H>(name, handler)
    }

    /// Registers `handler` for messages of type `M` under an explicit name.
    #[must_use]
    pub fn handle_named<M: Message, H: Handler<M>>(
        mut self,
        name: impl Into<Arc<str>>,
        handler: H,
    ) -> Self {
        let invoke: Invoke = Arc::new(|route: Arc<Route>, index, decoded: Decoded, context| {
            async move {
                let handler = route.handlers()[index]
                    .handler
                    .downcast_ref::<H>()
                    .ok_or_else(|| {
                        HandlerError::permanent("registered handler has the wrong type")
                    })?;
                let message = decoded
                    .downcast_ref::<M>()
                    .ok_or_else(|| HandlerError::permanent("decoded message has the wrong type"))?;
                handler.handle(message, &context).await
            }
            .boxed()
        });
        self.handlers.push(HandlerEntry {
            id: HandlerId {
                module: Arc::clone(&self.name),
                name: name.into(),
            },
            message_type: M::TYPE,
            invoke,
            handler: Arc::new(handler),
            module_policy: self.policy,
            module_timeout: self.timeout,
            decode: decode::<M>,
            rust_type: (std::any::TypeId::of::<M>(), std::any::type_name::<M>()),
            deduplication: None,
        });
        self
    }

    /// Opts the handler `name`, registered before, in to logical deduplication (see
    /// [`Deduplication`]). A name no handler of this module has is refused when the runtime is
    /// built.
    #[must_use]
    pub fn deduplicate(mut self, name: &str, deduplication: Deduplication) -> Self {
        let mut found = false;
        for entry in self.handlers.iter_mut().filter(|h| *h.id.name == *name) {
            entry.deduplication = Some(deduplication.clone());
            found = true;
        }
        if !found {
            self.unknown_deduplications.push(name.to_owned());
        }
        self
    }

    /// Handler names given to [`deduplicate`](Self::deduplicate) that no handler has.
    #[doc(hidden)]
    pub fn unknown_deduplications(&self) -> &[String] {
        &self.unknown_deduplications
    }

    /// The message types this module's handlers handle, in registration order (a type with
    /// several handlers once per handler).
    pub fn message_types(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.handlers.iter().map(|entry| entry.message_type)
    }

    /// The registered handlers, in registration order.
    #[doc(hidden)]
    pub fn handlers(&self) -> &[HandlerEntry] {
        &self.handlers
    }

    /// Takes the registered handlers out of the module.
    #[doc(hidden)]
    pub fn into_handlers(self) -> Vec<HandlerEntry> {
        self.handlers
    }
}

fn decode<M: Message>(payload: &[u8]) -> Result<Decoded, serde_json::Error> {
    Ok(Arc::new(serde_json::from_slice::<M>(payload)?))
}

fn short_type_name<T>() -> String {
    let full = std::any::type_name::<T>();
    // Generic parameters would make names long and unstable; keep the outer path's last segment.
    let outer = full.split('<').next().unwrap_or(full);
    outer.rsplit("::").next().unwrap_or(outer).to_owned()
}
