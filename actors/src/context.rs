use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use actix::{Actor, ActorContext, Addr, Context};
use uuid::Uuid;

use crate::clock::Running;
use crate::dispatcher::Worker;
use crate::ports::Claim;
use crate::{Envelope, Error, HandlerId, Message, Route};

/// What one attempt at one delivery knows about its message.
#[derive(Debug)]
pub(crate) struct Scope {
    pub(crate) message_id: Uuid,
    pub(crate) message_type: std::borrow::Cow<'static, str>,
    pub(crate) attempt: u32,
    pub(crate) correlation_id: Option<Uuid>,
    pub(crate) causation_id: Option<Uuid>,
    pub(crate) deduplication_id: Option<String>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) max_envelope_size: usize,
    /// The supervisor's worker, on whose arbiter the context actor runs; `None` for a
    /// handler under a unit test ([`MessageContext::for_test`]).
    worker: Option<Arc<Worker>>,
    /// What a handler under a unit test published, in order.
    published: std::sync::Mutex<Vec<(HandlerId, Envelope)>>,
    /// Started on the first cascade: most attempts cascade nothing and need no actor.
    actor: OnceLock<Addr<ContextActor>>,
    /// Set when the attempt is over; cascading then fails.
    closed: std::sync::atomic::AtomicBool,
    /// Taken to start the context actor and to close the attempt: a cascade never starts an
    /// actor that the close did not see.
    starting: std::sync::Mutex<()>,
    /// What the attempt's handlers still hold that may write after they returned (a handler
    /// connection on PostgreSQL, on its way back to its pool): its end waits for them.
    holds: Holds,
}

/// A count of [`AttemptHold`]s, and a wake when it falls to zero.
#[derive(Debug, Default)]
struct Holds {
    count: std::sync::atomic::AtomicUsize,
    released: tokio::sync::Notify,
}

/// Something a handler took in its attempt that may still write once the handler returned:
/// while one is held, the attempt's end (and so its settle) waits, up to
/// [`HOLDS_WAITED`]. Dropped, it is released.
#[doc(hidden)]
#[derive(Debug)]
pub struct AttemptHold(Arc<Scope>);

impl Drop for AttemptHold {
    fn drop(&mut self) {
        let holds = &self.0.holds;
        if holds
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            holds.released.notify_waiters();
        }
    }
}

/// How long an attempt's end waits for what its handlers still hold (a statement left
/// running by a handler that gave up, a connection handed to a task of its own).
pub(crate) const HOLDS_WAITED: std::time::Duration = std::time::Duration::from_secs(5);

impl Scope {
    pub(crate) fn new(
        envelope: &Envelope,
        attempt: u32,
        max_envelope_size: usize,
        worker: Arc<Worker>,
    ) -> Self {
        Self {
            message_id: envelope.id,
            message_type: envelope.message_type.clone(),
            attempt,
            correlation_id: envelope.correlation_id,
            causation_id: envelope.causation_id,
            deduplication_id: envelope.deduplication_id.clone(),
            headers: envelope.headers.clone(),
            max_envelope_size,
            worker: Some(worker),
            published: std::sync::Mutex::default(),
            actor: OnceLock::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            starting: std::sync::Mutex::new(()),
            holds: Holds::default(),
        }
    }

    /// Waits, up to [`HOLDS_WAITED`], until nothing taken in this closed attempt is held;
    /// whether something still was.
    pub(crate) async fn released(&self) -> bool {
        let all_released = async {
            loop {
                let released = self.holds.released.notified();
                if self.holds.count.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    return;
                }
                released.await;
            }
        };
        tokio::time::timeout(HOLDS_WAITED, all_released)
            .await
            .is_err()
    }

    /// Whether anything taken in this attempt is still held.
    pub(crate) fn held(&self) -> bool {
        self.holds.count.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    /// Ends the attempt: no more cascades. Returns the context actor, if a handler cascaded
    /// anything, to collect them from.
    pub(crate) fn close(&self) -> Option<&Addr<ContextActor>> {
        let _starting = self
            .starting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SeqCst, as `hold` reads it after counting itself: one of the two sees the other.
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.actor.get()
    }

    /// Keeps what a handler under a unit test published, with the id a delivery would give it.
    fn keep_published(&self, handler: HandlerId, mut envelope: Envelope) -> Uuid {
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let occurrence = published
            .iter()
            .filter(|(h, e)| {
                *h == handler
                    && e.message_type == envelope.message_type
                    && e.payload == envelope.payload
            })
            .count();
        envelope.id = cascade_id(self.message_id, &handler, &envelope, occurrence);
        let id = envelope.id;
        published.push((handler, envelope));
        id
    }

    /// The context actor, started on the worker's arbiter by the first cascade; `None` under
    /// a unit test, which keeps cascades in `published`.
    ///
    /// # Errors
    ///
    /// [`Error::Detached`] once the attempt is closed.
    fn actor_or_start(&self) -> Result<Option<&Addr<ContextActor>>, Error> {
        let Some(worker) = self.worker.as_ref() else {
            return Ok(None);
        };
        let _starting = self
            .starting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Detached);
        }
        let message_id = self.message_id;
        Ok(Some(self.actor.get_or_init(|| {
            ContextActor::start_in_arbiter(&worker.arbiter, move |_| ContextActor::new(message_id))
        })))
    }
}

/// The actor scoped to one attempt at one delivery: it holds the message's id and collects
/// the messages its handlers cascade, for the supervisor to release or drop. It is started on
/// the supervisor's arbiter by the attempt's first cascade, so attempts that cascade nothing
/// cost no actor.
///
/// Cascaded envelopes get deterministic ids: a UUID v5 of the message id, the handler, the
/// cascaded message's type and payload, and how many identical ones the handler cascaded
/// before in the attempt. A handler that cascades the same message again on a retry produces
/// the same envelope, sent once; a different message gets a different id, and both are sent.
#[derive(Debug)]
pub struct ContextActor {
    message_id: Uuid,
    cascaded: Vec<(HandlerId, Envelope)>,
    /// Cascades a handler transaction took to commit with its work; they still count for the
    /// ids of later identical cascades.
    committed: Vec<(HandlerId, Envelope)>,
}

impl ContextActor {
    fn new(message_id: Uuid) -> Self {
        Self {
            message_id,
            cascaded: Vec::new(),
            committed: Vec::new(),
        }
    }

    /// A context for the handler at `handler` in `route`, for the attempt `scope` describes.
    /// `claim` is the deduplication claim the handler holds while it runs, if any.
    pub(crate) fn handle_for(
        scope: Arc<Scope>,
        route: Arc<Route>,
        handler: usize,
        running: Running,
        claim: Option<Claim>,
    ) -> MessageContext {
        MessageContext {
            scope: Some(Attached {
                scope,
                handler: HandlerRef::InRoute(route, handler),
                claim: claim.map(Arc::new),
                running,
                given_up: Arc::default(),
                recorded: Arc::default(),
            }),
        }
    }
}

impl Actor for ContextActor {
    type Context = Context<Self>;
}

/// A cascaded message, kept until the attempt settles; answers with its envelope id.
pub(crate) struct Cascade(pub(crate) HandlerId, pub(crate) Envelope);

impl actix::Message for Cascade {
    type Result = Uuid;
}

impl actix::Handler<Cascade> for ContextActor {
    type Result = actix::MessageResult<Cascade>;

    fn handle(
        &mut self,
        Cascade(handler, mut envelope): Cascade,
        _: &mut Context<Self>,
    ) -> Self::Result {
        let same = |(h, e): &&(HandlerId, Envelope)| {
            *h == handler
                && e.message_type == envelope.message_type
                && e.payload == envelope.payload
        };
        let occurrence = self
            .cascaded
            .iter()
            .chain(&self.committed)
            .filter(same)
            .count();
        envelope.id = cascade_id(self.message_id, &handler, &envelope, occurrence);
        let id = envelope.id;
        self.cascaded.push((handler, envelope));
        actix::MessageResult(id)
    }
}

/// The id of a cascaded envelope: a UUID v5 of the message id, the handler, the cascaded
/// type and payload, and how many identical ones the handler cascaded before.
fn cascade_id(
    message_id: Uuid,
    handler: &HandlerId,
    envelope: &Envelope,
    occurrence: usize,
) -> Uuid {
    let mut name = format!(
        "dacapo.cascade:{}/{}:{}:{occurrence}:",
        handler.module, handler.name, envelope.message_type
    )
    .into_bytes();
    name.extend_from_slice(&envelope.payload);
    Uuid::new_v5(&message_id, &name)
}

/// Hands one handler's cascades so far to its handler transaction, which commits them.
pub(crate) struct TakePublished(pub(crate) HandlerId);

impl actix::Message for TakePublished {
    type Result = Vec<Envelope>;
}

impl actix::Handler<TakePublished> for ContextActor {
    type Result = actix::MessageResult<TakePublished>;

    fn handle(
        &mut self,
        TakePublished(handler): TakePublished,
        _: &mut Context<Self>,
    ) -> Self::Result {
        let (taken, kept) = std::mem::take(&mut self.cascaded)
            .into_iter()
            .partition(|(h, _)| *h == handler);
        self.cascaded = kept;
        let envelopes = taken.iter().map(|(_, e)| e.clone()).collect();
        self.committed.extend(taken);
        actix::MessageResult(envelopes)
    }
}

/// Gives back cascades whose handler transaction did not commit.
pub(crate) struct RestorePublished(pub(crate) HandlerId, pub(crate) Vec<Envelope>);

impl actix::Message for RestorePublished {
    type Result = ();
}

impl actix::Handler<RestorePublished> for ContextActor {
    type Result = ();

    fn handle(
        &mut self,
        RestorePublished(handler, envelopes): RestorePublished,
        _: &mut Context<Self>,
    ) {
        for envelope in envelopes {
            self.committed
                .retain(|(h, e)| !(*h == handler && e.id == envelope.id));
            self.cascaded.push((handler.clone(), envelope));
        }
    }
}

/// Hands over the messages cascaded during the attempt, with the handler that cascaded each.
pub(crate) struct TakeCascaded;

impl actix::Message for TakeCascaded {
    type Result = Vec<(HandlerId, Envelope)>;
}

impl actix::Handler<TakeCascaded> for ContextActor {
    type Result = actix::MessageResult<TakeCascaded>;

    fn handle(&mut self, _: TakeCascaded, ctx: &mut Context<Self>) -> Self::Result {
        tracing::trace!(
            message_id = %self.message_id,
            cascaded = self.cascaded.len(),
            "attempt over; handing over its cascaded messages"
        );
        // The attempt is over: a late cascade must fail rather than vanish (a stopping actor
        // takes nothing more from its mailbox, and the sender sees it closed).
        ctx.stop();
        actix::MessageResult(std::mem::take(&mut self.cascaded))
    }
}

#[derive(Clone, Debug)]
struct Attached {
    scope: Arc<Scope>,
    handler: HandlerRef,
    claim: Option<Arc<Claim>>,
    /// The handler's token of work for the engine's timers.
    running: Running,
    /// Set when the runtime gives up on the handler's run (its timeout), before it drops it.
    given_up: Arc<std::sync::atomic::AtomicBool>,
    /// Set once the handler's work is recorded on its own (its handler transaction
    /// committed): a rerun skips that work, so what it cascades from then on cannot wait for
    /// the delivery to settle.
    recorded: Arc<std::sync::atomic::AtomicBool>,
}

/// Which handler a context was given to.
#[derive(Clone, Debug)]
enum HandlerRef {
    /// The handler at this index of a route, in a delivery.
    InRoute(Arc<Route>, usize),
    /// A handler under a unit test.
    Named(HandlerId),
}

impl HandlerRef {
    fn id(&self) -> &HandlerId {
        match self {
            Self::InRoute(route, index) => &route.handlers()[*index].id,
            Self::Named(id) => id,
        }
    }
}

/// What a handler knows about the message it handles, and how it cascades new messages.
///
/// Inside a consumer, [`message_id`](Self::message_id) is `Some`: the envelope id, the same on
/// every retry and redelivery, from which handlers derive deterministic row ids. A context made
/// with [`MessageContext::detached`] (a controller, a job) has no message: `message_id` is
/// `None` and publishing fails with [`Error::Detached`].
#[derive(Clone, Debug)]
pub struct MessageContext {
    scope: Option<Attached>,
}

static NO_HEADERS: BTreeMap<String, String> = BTreeMap::new();

impl MessageContext {
    /// A context outside any delivery.
    pub fn detached() -> Self {
        Self { scope: None }
    }

    /// A context for calling a handler directly in a unit test, outside any runtime: the
    /// message id, attempt, headers, correlation and deduplication ids are the test's (by
    /// default a random message id, attempt 1, handler `test/handler`), and what the handler
    /// publishes is kept for [`published`](Self::published) — with the ids a delivery would
    /// give it.
    ///
    /// ```
    /// use dacapo::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize)] struct OrderPlaced { order: u64 }
    /// # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
    /// # #[derive(Serialize, Deserialize)] struct InvoiceDue { order: u64 }
    /// # impl Message for InvoiceDue { const TYPE: &'static str = "billing.invoice_due"; }
    /// struct Bill;
    ///
    /// impl Handler<OrderPlaced> for Bill {
    ///     async fn handle(&self, event: &OrderPlaced, ctx: &MessageContext) -> Result<(), HandlerError> {
    ///         ctx.publish(&InvoiceDue { order: event.order }).await?;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let ctx = MessageContext::for_test().attempt(2).header("tenant", "acme").build();
    /// Bill.handle(&OrderPlaced { order: 7 }, &ctx).await.unwrap();
    /// let published = ctx.published();
    /// assert_eq!(published[0].message_type, "billing.invoice_due");
    /// assert_eq!(published[0].causation_id, ctx.message_id());
    /// # }
    /// ```
    pub fn for_test() -> TestContext {
        TestContext {
            message_id: Uuid::new_v4(),
            message_type: "test.message".to_owned(),
            attempt: 1,
            correlation_id: None,
            causation_id: None,
            deduplication_id: None,
            headers: BTreeMap::new(),
            handler: HandlerId {
                module: Arc::from("test"),
                name: Arc::from("handler"),
            },
        }
    }

    /// What the handler published through this context, in order: for a context made with
    /// [`for_test`](Self::for_test); empty for any other.
    pub fn published(&self) -> Vec<Envelope> {
        self.scope().map_or_else(Vec::new, |scope| {
            scope
                .published
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .map(|(_, envelope)| envelope.clone())
                .collect()
        })
    }

    fn scope(&self) -> Option<&Scope> {
        self.scope.as_ref().map(|a| &*a.scope)
    }

    /// The id of the message being handled; `None` outside a consumer.
    pub fn message_id(&self) -> Option<Uuid> {
        self.scope().map(|s| s.message_id)
    }

    /// The type name of the message being handled.
    pub fn message_type(&self) -> Option<&str> {
        self.scope().map(|s| &*s.message_type)
    }

    /// The attempt number, 1 for the first; 0 outside a consumer.
    pub fn attempt(&self) -> u32 {
        self.scope().map_or(0, |s| s.attempt)
    }

    /// The conversation's correlation id.
    pub fn correlation_id(&self) -> Option<Uuid> {
        self.scope().and_then(|s| s.correlation_id)
    }

    /// The id of the message that caused this one.
    pub fn causation_id(&self) -> Option<Uuid> {
        self.scope().and_then(|s| s.causation_id)
    }

    /// The message's logical deduplication id.
    pub fn deduplication_id(&self) -> Option<&str> {
        self.scope().and_then(|s| s.deduplication_id.as_deref())
    }

    /// The message's headers (empty outside a consumer).
    pub fn headers(&self) -> &BTreeMap<String, String> {
        self.scope().map_or(&NO_HEADERS, |s| &s.headers)
    }

    /// Whether the attempt this context was given for still runs: once it is over, a copy of
    /// the context kept past the handler opens no handler connection (the adapter asks;
    /// handlers do not).
    #[doc(hidden)]
    pub fn attempt_running(&self) -> bool {
        self.scope.as_ref().is_some_and(|attached| {
            !attached
                .scope
                .closed
                .load(std::sync::atomic::Ordering::Acquire)
        })
    }

    /// A hold on the attempt this context was given for, which its end waits for (up to 5 s)
    /// until it is dropped; `None` once the attempt is over, and outside a delivery (the
    /// adapter takes one for what may write after the handler returned; handlers do not).
    #[doc(hidden)]
    pub fn hold_attempt(&self) -> Option<AttemptHold> {
        let attached = self.scope.as_ref()?;
        let scope = &attached.scope;
        scope
            .holds
            .count
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let hold = AttemptHold(Arc::clone(scope));
        if scope.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        Some(hold)
    }

    /// Whether the runtime gave up on the run of the handler this context was given to (its
    /// timeout passed): told before the handler's future is dropped, so what the handler holds
    /// can tell, when it is dropped, that what it left running was abandoned (the adapter asks;
    /// handlers do not).
    #[doc(hidden)]
    pub fn given_up(&self) -> bool {
        self.scope
            .as_ref()
            .is_some_and(|attached| attached.given_up.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Marks the handler's run given up, before its future is dropped.
    pub(crate) fn give_up(&self) {
        if let Some(attached) = &self.scope {
            attached
                .given_up
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// The handler this context was given to.
    pub fn handler(&self) -> Option<&HandlerId> {
        self.scope.as_ref().map(|a| a.handler.id())
    }

    /// The deduplication claim this handler holds on the message's logical id while it runs,
    /// if it deduplicates and the claims live in the runtime's store. A handler transaction
    /// completes it in the handler's own transaction, so the claim and the handler's effects
    /// commit together (claims kept elsewhere are completed after the handler returns).
    #[doc(hidden)]
    pub fn deduplication_claim(&self) -> Option<&Claim> {
        self.scope.as_ref().and_then(|a| a.claim.as_deref())
    }

    /// Waits forever, as a handler that hangs — without holding the harness's virtual clock,
    /// so the handler's timeout comes at its exact virtual time. For fault injection; a
    /// handler of your own never needs it.
    #[doc(hidden)]
    pub async fn hang(&self) {
        if let Some(attached) = &self.scope {
            attached.running.give_up();
        }
        std::future::pending::<()>().await;
    }

    /// The runtime's store (a `dacapo::store::SqliteStore`, a `dacapo::store::PostgresStore`,
    /// …), for adapters that open a transaction on it; `None` outside a consumer or without a
    /// store. Handlers use `dacapo::transaction` instead.
    #[doc(hidden)]
    pub fn store(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        self.scope
            .as_ref()
            .and_then(|a| a.scope.worker.as_ref()?.shared.store.as_deref())
    }

    /// Takes what this handler published so far in this attempt, for its handler transaction
    /// to commit with its work (the transaction's adapter calls it; handlers do not).
    #[doc(hidden)]
    pub async fn take_published(&self) -> Vec<Envelope> {
        let Some(attached) = &self.scope else {
            return Vec::new();
        };
        let Some(actor) = attached.scope.actor.get() else {
            return Vec::new();
        };
        let handler = attached.handler.id().clone();
        actor.send(TakePublished(handler)).await.unwrap_or_default()
    }

    /// Gives back what [`take_published`](Self::take_published) took, when the transaction did
    /// not commit.
    #[doc(hidden)]
    pub async fn restore_published(&self, envelopes: Vec<Envelope>) {
        if envelopes.is_empty() {
            return;
        }
        let Some(attached) = &self.scope else {
            return;
        };
        if let Some(actor) = attached.scope.actor.get() {
            let handler = attached.handler.id().clone();
            let _ = actor.send(RestorePublished(handler, envelopes)).await;
        }
    }

    /// Tells the runtime's outbox relay that this handler just committed envelopes to the
    /// outbox in a transaction of its own, so they are published now rather than at the
    /// relay's next poll. Does nothing outside a consumer.
    #[doc(hidden)]
    pub fn wake_outbox(&self) {
        if let Some(worker) = self.scope.as_ref().and_then(|a| a.scope.worker.as_ref()) {
            worker.shared.outbox_enlisted.notify_one();
        }
    }

    /// The envelope a message this handler sends travels in: this message as its causation,
    /// its conversation's correlation id, `options`, the runtime's deduplication rules, and
    /// the runtime's size limit. [`publish`](Self::publish) sends such an envelope; a handler
    /// transaction enlists one in the outbox.
    ///
    /// # Errors
    ///
    /// [`Error::Detached`] outside a consumer, [`Error::Serialize`] and [`Error::TooLarge`] for
    /// a message that cannot be sent.
    pub fn envelope<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Envelope, Error> {
        let attached = self.scope.as_ref().ok_or(Error::Detached)?;
        let scope = &attached.scope;
        let mut envelope = Envelope::for_message(message)?;
        envelope.correlation_id = scope.correlation_id.or(Some(scope.message_id));
        envelope.causation_id = Some(scope.message_id);
        options.apply(&mut envelope);
        match &scope.worker {
            Some(worker) => worker.rules.apply(message, &mut envelope),
            // A unit test has no runtime: the message type's own declaration gives the id.
            None => crate::DeduplicationRules::default().apply(message, &mut envelope),
        }
        let size = envelope.size();
        if size > scope.max_envelope_size {
            return Err(Error::TooLarge {
                envelope: Box::new(envelope),
                size,
                limit: scope.max_envelope_size,
            });
        }
        Ok(envelope)
    }

    /// Cascades `message`: it is published once the whole delivery succeeds, and carries this
    /// message's id as its causation id. Returns the new envelope's id.
    ///
    /// What a handler cascades in an attempt where *it* succeeded is kept even if a sibling
    /// handler failed that attempt, since its effects are done; what it cascades in an attempt
    /// where it failed is dropped. Cascaded ids are derived from this message's id and what is
    /// cascaded (the n-th message of a type from this handler), so the
    /// same message cascaded again on a retry is sent once, and a handler that finds its work
    /// already done on a retry may cascade nothing without losing what it cascaded before.
    /// What a handler cascaded is sent right away, without waiting for the delivery, when the
    /// handler's work is recorded as done on its own — its handler transaction committed, or
    /// its deduplication claim completed — since a later attempt skips that handler: enlisted
    /// in the outbox (with that record, when the store allows), or, on a runtime without a
    /// durable inbox, delivered at once.
    ///
    /// # Errors
    ///
    /// [`Error::Detached`] outside a consumer or once the attempt is over,
    /// [`Error::Serialize`] and [`Error::TooLarge`] for a message that cannot be sent.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the message may or may not have been cascaded.
    pub async fn publish<M: Message>(&self, message: &M) -> Result<Uuid, Error> {
        self.publish_with(message, SendOptions::default()).await
    }

    /// Like [`publish`](Self::publish), but fails at once when no handler of this runtime
    /// handles the type and no transport of it routes the type to a broker, instead of the
    /// message being dead-lettered at receive.
    ///
    /// # Errors
    ///
    /// [`Error::NoRoute`] with the envelope, and the errors of [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn send<M: Message>(&self, message: &M) -> Result<Uuid, Error> {
        if let Some(worker) = self.scope.as_ref().and_then(|a| a.scope.worker.as_ref())
            && !worker.registry.handles(M::TYPE)
            && !worker
                .shared
                .outbound
                .as_ref()
                .is_some_and(|outbound| outbound.carries(M::TYPE))
        {
            return Err(Error::NoRoute(Box::new(Envelope::for_message(message)?)));
        }
        self.publish(message).await
    }

    /// [`publish`](Self::publish) with a deduplication id, headers or correlation id.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_with<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let envelope = self.envelope(message, options)?;
        let attached = self.scope.as_ref().ok_or(Error::Detached)?;
        let scope = &attached.scope;
        if scope.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Detached);
        }
        let handler = attached.handler.id().clone();
        let Some(actor) = scope.actor_or_start()? else {
            return Ok(scope.keep_published(handler, envelope));
        };
        let id = actor
            .send(Cascade(handler, envelope))
            .await
            .map_err(|_| Error::Detached)?;
        if attached.recorded.load(std::sync::atomic::Ordering::Acquire) {
            self.send_recorded().await;
        }
        Ok(id)
    }

    /// Enlists what this handler cascaded so far in the runtime's outbox, waiting out store
    /// failures, ahead of a record of its work kept elsewhere (a deduplication claim in a
    /// store of its own): a crash between the two finds the work unrecorded and runs the
    /// handler again, whose cascades have the same ids, which the outbox keeps once. Without
    /// an outbox, or if the outbox rejects them, they stay with the attempt.
    pub(crate) async fn enlist_ahead(&self) {
        let Some(worker) = self.scope.as_ref().and_then(|a| a.scope.worker.as_ref()) else {
            return;
        };
        let Some(outbox) = &worker.shared.outbox else {
            return;
        };
        let cascaded = self.take_published().await;
        if cascaded.is_empty() {
            return;
        }
        let id = self.message_id().unwrap_or_default();
        match crate::supervisor::persist("enlist cascades", id, || outbox.enlist(&cascaded)).await {
            Ok(()) => worker.shared.outbox_enlisted.notify_one(),
            Err(_) => self.restore_published(cascaded).await,
        }
    }

    /// Sends what this handler cascaded so far on its own, since its work is recorded (a rerun
    /// skips it and would cascade nothing): enlisted in the runtime's outbox, or, on a runtime
    /// without a durable inbox, delivered now. If the outbox refuses it — or the runtime has a
    /// durable inbox but no outbox — it is left to settle with the delivery.
    pub(crate) async fn send_recorded(&self) {
        let Some(worker) = self.scope.as_ref().and_then(|a| a.scope.worker.as_ref()) else {
            return;
        };
        let shared = &worker.shared;
        if shared.outbox.is_none() && shared.durable.is_some() {
            return;
        }
        let cascaded = self.take_published().await;
        if cascaded.is_empty() {
            return;
        }
        let Some(outbox) = &shared.outbox else {
            // Nothing outlives the process here, and a later attempt (a replay of its dead
            // letter, say) skips this handler: its cascades leave now or never.
            worker.forward(cascaded);
            return;
        };
        match outbox.enlist(&cascaded).await {
            Ok(()) => shared.outbox_enlisted.notify_one(),
            Err(error) => {
                tracing::warn!(%error, "a message cascaded after its handler's work was recorded could not be enlisted; it settles with the delivery");
                self.restore_published(cascaded).await;
            }
        }
    }

    /// Tells the runtime that this handler's work is recorded on its own (its handler
    /// transaction committed, with what it cascaded so far): what it cascades from now on is
    /// enlisted in the outbox at once, since a rerun finds the work done and skips it.
    #[doc(hidden)]
    pub fn recorded_on_its_own(&self) {
        if let Some(attached) = &self.scope {
            attached
                .recorded
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

/// Per-send settings: deduplication id, headers, correlation id.
///
/// ```
/// use dacapo::SendOptions;
///
/// let options = SendOptions::new()
///     .deduplication_id("rebuild|2026-11-30T03:00:00Z")
///     .header("tenant", "acme");
/// # let _ = options;
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendOptions {
    /// The intent's id; an explicit one always wins over derived ones.
    pub deduplication_id: Option<String>,
    /// Headers to add.
    pub headers: BTreeMap<String, String>,
    /// The conversation to join, instead of a new one (or the causing message's).
    pub correlation_id: Option<Uuid>,
    /// When the message is to be handled, instead of at once: a durable store keeps it until
    /// then (across restarts), and any node runs it when due.
    pub deliver_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl SendOptions {
    /// No options.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the deduplication id.
    #[must_use]
    pub fn deduplication_id(mut self, id: impl Into<String>) -> Self {
        self.deduplication_id = Some(id.into());
        self
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the correlation id.
    #[must_use]
    pub fn correlation_id(mut self, id: Uuid) -> Self {
        self.correlation_id = Some(id);
        self
    }

    /// Schedules the message for `at` instead of handling it at once.
    #[must_use]
    pub fn deliver_at(mut self, at: chrono::DateTime<chrono::Utc>) -> Self {
        self.deliver_at = Some(at);
        self
    }

    /// Writes these options into `envelope`.
    #[doc(hidden)]
    pub fn apply(self, envelope: &mut Envelope) {
        if let Some(at) = self.deliver_at {
            envelope.scheduled_for = Some(at);
        }
        if let Some(id) = self.deduplication_id {
            envelope.deduplication_id = Some(id);
        }
        if let Some(id) = self.correlation_id {
            envelope.correlation_id = Some(id);
        }
        envelope.headers.extend(self.headers);
    }
}

/// Builds a [`MessageContext`] for a unit test; see [`MessageContext::for_test`].
#[derive(Clone, Debug)]
pub struct TestContext {
    message_id: Uuid,
    message_type: String,
    attempt: u32,
    correlation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    deduplication_id: Option<String>,
    headers: BTreeMap<String, String>,
    handler: HandlerId,
}

impl TestContext {
    /// The message's id (default: a random one).
    #[must_use]
    pub fn message_id(mut self, id: Uuid) -> Self {
        self.message_id = id;
        self
    }

    /// The message's type name (default `test.message`).
    #[must_use]
    pub fn message_type(mut self, message_type: impl Into<String>) -> Self {
        self.message_type = message_type.into();
        self
    }

    /// The attempt the handler runs in (default 1).
    #[must_use]
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }

    /// The conversation's id (default: none, so published messages take the message id).
    #[must_use]
    pub fn correlation_id(mut self, id: Uuid) -> Self {
        self.correlation_id = Some(id);
        self
    }

    /// The id of the message that caused this one.
    #[must_use]
    pub fn causation_id(mut self, id: Uuid) -> Self {
        self.causation_id = Some(id);
        self
    }

    /// The message's deduplication id.
    #[must_use]
    pub fn deduplication_id(mut self, id: impl Into<String>) -> Self {
        self.deduplication_id = Some(id.into());
        self
    }

    /// A header of the message.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The handler the context is given to (default `test/handler`).
    #[must_use]
    pub fn handler(mut self, module: &str, name: &str) -> Self {
        self.handler = HandlerId {
            module: Arc::from(module),
            name: Arc::from(name),
        };
        self
    }

    /// The context.
    pub fn build(self) -> MessageContext {
        let scope = Scope {
            message_id: self.message_id,
            message_type: std::borrow::Cow::Owned(self.message_type),
            attempt: self.attempt,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            deduplication_id: self.deduplication_id,
            headers: self.headers,
            max_envelope_size: usize::MAX,
            worker: None,
            published: std::sync::Mutex::default(),
            actor: OnceLock::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            starting: std::sync::Mutex::new(()),
            holds: Holds::default(),
        };
        MessageContext {
            scope: Some(Attached {
                scope: Arc::new(scope),
                handler: HandlerRef::Named(self.handler),
                claim: None,
                running: Running::default(),
                given_up: Arc::default(),
                recorded: Arc::default(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MessageContext;

    /// A cascade that reaches the context actor right behind the supervisor's take fails: the
    /// take stops the actor, which handles nothing more, so nothing is kept where nobody
    /// collects it.
    #[test]
    fn a_cascade_queued_behind_the_take_is_refused() {
        use actix::Actor;
        actix::System::new().block_on(async {
            let message_id = uuid::Uuid::now_v7();
            let actor = super::ContextActor::new(message_id).start();
            let handler = crate::HandlerId {
                module: "m".into(),
                name: "h".into(),
            };
            let envelope = |n: u8| crate::Envelope::new("t", vec![n]);
            let kept = actor.send(super::Cascade(handler.clone(), envelope(1)));
            let taken = actor.send(super::TakeCascaded);
            let late = actor.send(super::Cascade(handler, envelope(2)));
            let (kept, taken, late) = futures::join!(kept, taken, late);
            let kept = kept.expect("cascaded during the attempt");
            let taken: Vec<_> = taken.unwrap().into_iter().map(|(_, e)| e.id).collect();
            assert_eq!(taken, [kept]);
            assert!(late.is_err(), "a late cascade fails: {late:?}");
        });
    }

    /// An attempt's end waits for what was taken in it, and once it ended nothing more is
    /// taken: the one check a handler connection on PostgreSQL relies on.
    #[tokio::test(start_paused = true)]
    async fn an_attempt_ends_once_its_holds_are_released_and_takes_none_after() {
        let ctx = MessageContext::for_test().build();
        let scope = std::sync::Arc::clone(&ctx.scope.as_ref().unwrap().scope);
        let hold = ctx.hold_attempt().expect("the attempt runs");
        scope.close();
        assert!(
            ctx.hold_attempt().is_none(),
            "taken after the attempt ended"
        );
        assert!(scope.held());
        let ending = tokio::spawn({
            let scope = std::sync::Arc::clone(&scope);
            async move { scope.released().await }
        });
        tokio::task::yield_now().await;
        assert!(!ending.is_finished(), "ended with a hold still taken");
        drop(hold);
        assert!(!ending.await.unwrap(), "released, not given up on");
        assert!(!scope.held());
        // Never released: given up on after a bounded wait.
        let kept = MessageContext::for_test().build();
        let kept_scope = std::sync::Arc::clone(&kept.scope.as_ref().unwrap().scope);
        let _hold = kept.hold_attempt().unwrap();
        kept_scope.close();
        assert!(kept_scope.released().await, "given up on after its bound");
    }
}
