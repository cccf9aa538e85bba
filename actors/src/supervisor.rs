use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorContext, ActorFutureExt, AsyncContext, Context, WrapFuture};
use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use crate::capacity::Slot;
use tokio::time::Instant;
use tracing::field::Empty;

use crate::RetryScope;
use crate::context::{Scope, TakeCascaded};
use crate::dispatcher::{UnknownMessageTypes, Worker};
use crate::handler_actor::HandlerFinished;
use crate::handler_actor::PendingClaim;
use crate::ports::{Claim, Fenced, Handled, Resumable, RetryRecord};
use crate::report::DiscardReason;
use crate::stats::Counter;
use crate::timer::{RetryDue, Schedule};
use crate::tracker::{PendingRetry, Ticket};
use crate::{
    AggregateError, ContextActor, DeadLetter, DeadLetterReason, Decoded, DeliveryReport, Envelope,
    Error, FailureKind, HandlerActor, HandlerEntry, HandlerFailure, HandlerId, Outcome,
    RetryDecision, Route,
};

/// Owns one delivery from acceptance to settlement: runs every handler on each attempt,
/// aggregates their failures, asks the [`TimerActor`](crate::TimerActor) for the cooldown
/// before a retry, and dead-letters what the policy gives up on.
pub struct DeliverySupervisor {
    /// The worker (arbiter) this delivery runs on.
    worker: Arc<Worker>,
    /// Set once the supervisor runs on its worker.
    ticket: Option<Ticket>,
    /// How a delivery recovered from a durable inbox picks up again.
    resume: Option<Resume>,
    /// Whether it came back from a durable inbox (every attempt is then recorded first).
    recovered: bool,
    envelope: Envelope,
    route: Option<Arc<Route>>,
    message: Option<Decoded>,
    /// This attempt's failures with their handler's index (empty, unallocated, on success).
    results: Vec<(usize, HandlerFailure)>,
    /// Each handler's logical id (by index), when any handler deduplicates.
    deduplication_keys: Vec<Option<String>>,
    /// With [`RetryScope::FailedHandlers`]: which handlers (by index) already succeeded.
    succeeded: Vec<bool>,
    /// Handlers a durable inbox says succeeded before a restart (`module/name`).
    succeeded_before: Vec<String>,
    pending: usize,
    failures: Vec<AggregateError>,
    first_failure_at: Option<DateTime<Utc>>,
    started_at: Instant,
    /// When each retry started, from the first attempt's start.
    retry_offsets: Vec<Duration>,
    scope: Option<Arc<Scope>>,
    /// Messages cascaded by handlers in attempts where they succeeded, sent once the whole
    /// delivery succeeds.
    cascaded: Vec<Envelope>,
    reply: Option<oneshot::Sender<DeliveryReport>>,
    permit: Option<Slot>,
    span: tracing::Span,
}

impl std::fmt::Debug for DeliverySupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliverySupervisor")
            .field("message_id", &self.envelope.id)
            .field("attempts", &self.envelope.attempts)
            .finish_non_exhaustive()
    }
}

impl DeliverySupervisor {
    pub(crate) fn new(
        worker: Arc<Worker>,
        envelope: Envelope,
        permit: Slot,
        reply: Option<oneshot::Sender<DeliveryReport>>,
    ) -> Self {
        // Without a subscriber that wants INFO, even a disabled span costs a little per
        // delivery; skip building it.
        let span = if tracing::level_enabled!(tracing::Level::INFO) {
            tracing::info_span!(
                parent: None,
                "dacapo.delivery",
                messaging.system = "dacapo",
                messaging.operation.type = "process",
                messaging.message.id = %envelope.id,
                messaging.message.conversation_id = envelope.correlation_id.map(tracing::field::display),
                dacapo.message_type = %envelope.message_type,
                dacapo.deduplication_id = envelope.deduplication_id.as_deref(),
                dacapo.attempt = Empty,
            )
        } else {
            tracing::Span::none()
        };
        Self {
            worker,
            ticket: None,
            resume: None,
            recovered: false,
            envelope,
            route: None,
            message: None,
            results: Vec::new(),
            deduplication_keys: Vec::new(),
            succeeded: Vec::new(),
            succeeded_before: Vec::new(),
            pending: 0,
            failures: Vec::new(),
            first_failure_at: None,
            started_at: Instant::now(),
            retry_offsets: Vec::new(),
            scope: None,
            cascaded: Vec::new(),
            reply,
            permit: Some(permit),
            span,
        }
    }

    /// A supervisor for a delivery a durable inbox handed back after a restart.
    pub(crate) fn resumed(worker: Arc<Worker>, resumable: Resumable, permit: Slot) -> Self {
        let Resumable {
            envelope,
            due_at,
            failures,
            succeeded: resumable_succeeded,
            cascaded,
            ..
        } = resumable;
        let resume = match due_at {
            Some(at) => Resume::Due(at),
            // An attempt was started and never recorded as failed: it ran when the runtime stopped.
            None if envelope.attempts as usize > failures.len() => Resume::Interrupted,
            None => Resume::Due(worker.shared.clock.now()),
        };
        let mut supervisor = Self::new(worker, envelope, permit, None);
        supervisor.first_failure_at = failures.first().map(|f| f.failed_at);
        supervisor.failures = failures;
        supervisor.succeeded_before = resumable_succeeded;
        supervisor.cascaded = cascaded;
        supervisor.resume = Some(resume);
        supervisor.recovered = true;
        supervisor
    }

    fn now(&self) -> DateTime<Utc> {
        self.worker.shared.clock.now()
    }

    /// Starts the next attempt; a retry is first recorded as started, so that a crash while
    /// it runs counts it (the inbox records the first attempt when it receives the envelope,
    /// except for one enqueued for any node, which is resumed).
    fn start_attempt(&mut self, ctx: &mut Context<Self>) {
        self.envelope.attempts += 1;
        let attempt = self.envelope.attempts;
        if attempt == 1 && !self.recovered {
            self.run_attempt(ctx);
            return;
        }
        let worker = Arc::clone(&self.worker);
        let id = self.envelope.id;
        let begin = async move {
            persist("record attempt", id, || {
                worker.inbox.begin_attempt(id, attempt)
            })
            .await
        };
        ctx.spawn(
            begin
                .into_actor(self)
                .map(|fenced, actor, ctx| match fenced {
                    Ok(Fenced::Written) => actor.run_attempt(ctx),
                    Err(error) => actor.store_rejected(&error, ctx),
                    // Running it would do the work twice: the owner runs it now.
                    Ok(_) => actor.owned_elsewhere(ctx),
                }),
        );
    }

    /// Dead-letters a delivery whose next state the store refuses to record: nothing else
    /// could settle it.
    fn store_rejected(&mut self, error: &Error, ctx: &mut Context<Self>) {
        let now = self.now();
        let dead_letter = DeadLetter::failed(
            self.envelope.clone(),
            DeadLetterReason::StoreRejected(error.to_string()),
            self.failures.clone(),
            self.first_failure_at.unwrap_or(now),
            now,
        );
        self.cascaded.clear();
        self.dead_letter(dead_letter, ctx);
    }

    /// Stops a delivery whose row another node owns now (or that was settled meanwhile):
    /// this node writes nothing more of it.
    fn owned_elsewhere(&mut self, ctx: &mut Context<Self>) {
        tracing::info!(
            parent: &self.span,
            attempt = self.envelope.attempts,
            "delivery owned by another node now; this node stops it"
        );
        self.settle(
            Outcome::Discarded(DiscardReason::OwnedElsewhere),
            Vec::new(),
            ctx,
        );
    }

    fn run_attempt(&mut self, ctx: &mut Context<Self>) {
        let (Some(route), Some(message)) = (self.route.clone(), self.message.clone()) else {
            return;
        };
        let shared = &*self.worker.shared;
        let attempt = self.envelope.attempts;
        shared
            .stats
            .writer(self.worker.index)
            .bump(Counter::Attempts);
        if attempt > 1 {
            self.retry_offsets.push(self.started_at.elapsed());
        }
        if !self.span.is_disabled() {
            self.span.record("dacapo.attempt", attempt);
        }

        let scope = Arc::new(Scope::new(
            &self.envelope,
            attempt,
            shared.max_envelope_size,
            Arc::clone(&self.worker),
        ));
        self.scope = Some(Arc::clone(&scope));
        let succeeded = std::mem::take(&mut self.succeeded);
        let already = |index: usize| succeeded.get(index).copied().unwrap_or(false);
        self.pending = (0..route.handlers().len()).filter(|i| !already(*i)).count();
        let me = ctx.address();
        for (index, entry) in route.handlers().iter().enumerate() {
            if already(index) {
                continue;
            }
            // Nobody listens to the delivery's span, so nobody would listen to its children.
            let span = if self.span.is_disabled() {
                tracing::Span::none()
            } else {
                tracing::info_span!(
                    parent: &self.span,
                    "dacapo.handler",
                    dacapo.module = %entry.id.module,
                    dacapo.handler = %entry.id.name,
                    dacapo.attempt = attempt,
                )
            };
            let claim = self.pending_claim(index, entry);
            let handle = ContextActor::handle_for(
                Arc::clone(&scope),
                Arc::clone(&route),
                index,
                // A handler transaction completes the claim with its work only where the
                // claim lives: in the runtime's store.
                claim
                    .as_ref()
                    .filter(|_| shared.claims_in_store)
                    .map(|pending| pending.claim.clone()),
            );
            HandlerActor::new(
                Arc::clone(&route),
                index,
                message.clone(),
                handle,
                self.worker.registry.timeout_of(entry),
                me.clone(),
                span,
                claim,
            )
            .start();
        }
        self.succeeded = succeeded;
    }

    /// The claim handler `index` makes before it runs, if it deduplicates and the message has
    /// a logical id for it.
    fn pending_claim(&self, index: usize, entry: &HandlerEntry) -> Option<Box<PendingClaim>> {
        let deduplication = entry.deduplication.as_ref()?;
        let key = self.deduplication_keys.get(index)?.clone()?;
        let claim = Claim::new(
            entry.id.to_string(),
            key,
            self.envelope.id,
            &self.envelope.payload,
            self.now(),
            self.worker.deduplication_window,
        );
        Some(Box::new(PendingClaim {
            claim,
            claims: self.worker.claims.clone(),
            conflicts: deduplication.conflicts(),
            stats: (Arc::clone(&self.worker.shared.stats), self.worker.index),
        }))
    }

    /// Reads every deduplicating handler's logical id once per delivery; names the first
    /// handler that requires one the message lacks.
    fn read_deduplication_keys(&mut self, route: &Route, message: &Decoded) -> Result<(), String> {
        if route.handlers().iter().all(|h| h.deduplication.is_none()) {
            return Ok(());
        }
        let mut keys = Vec::with_capacity(route.handlers().len());
        for entry in route.handlers() {
            let key = entry.deduplication.as_ref().and_then(|d| {
                let key = d.key(&self.envelope, message);
                (key.is_some() || !d.is_required()).then_some(key)
            });
            match (key, &entry.deduplication) {
                (None, Some(_)) => return Err(entry.id.to_string()),
                (key, _) => keys.push(key.flatten()),
            }
        }
        self.deduplication_keys = keys;
        Ok(())
    }

    fn finish_attempt(&mut self, ctx: &mut Context<Self>) {
        let Some(scope) = self.scope.take() else {
            return;
        };
        let Some(context) = scope.close().cloned() else {
            self.conclude_attempt(Vec::new(), ctx);
            return;
        };
        let take = async move { context.send(TakeCascaded).await.unwrap_or_default() };
        ctx.spawn(
            take.into_actor(self)
                .map(|cascaded, actor, ctx| actor.conclude_attempt(cascaded, ctx)),
        );
    }

    fn conclude_attempt(&mut self, cascaded: Vec<(HandlerId, Envelope)>, ctx: &mut Context<Self>) {
        let mut results = std::mem::take(&mut self.results);
        results.sort_by_key(|(index, _)| *index);
        // Every handler that ran this attempt and is not among the failures succeeded.
        for (index, done) in self.succeeded.iter_mut().enumerate() {
            *done = *done || !results.iter().any(|(failed, _)| *failed == index);
        }
        let failures: Vec<HandlerFailure> =
            results.into_iter().map(|(_, failure)| failure).collect();
        for (handler, envelope) in cascaded {
            let failed = failures
                .iter()
                .any(|f| *f.module == *handler.module && *f.handler == *handler.name);
            if failed {
                continue;
            }
            // The same id cascaded again on a retry is the same message: keep one, the latest.
            match self.cascaded.iter_mut().find(|kept| kept.id == envelope.id) {
                Some(kept) => *kept = envelope,
                None => self.cascaded.push(envelope),
            }
        }
        if failures.is_empty() {
            self.succeed(ctx);
            return;
        }
        let failure = AggregateError {
            message_type: self.envelope.message_type.to_string(),
            message_id: self.envelope.id,
            attempt: self.envelope.attempts,
            failures,
            failed_at: self.now(),
        };
        self.attempt_failed(failure, ctx);
    }

    /// Decides what follows a failed attempt: a cooldown and a retry, or the dead letters.
    fn attempt_failed(&mut self, failure: AggregateError, ctx: &mut Context<Self>) {
        tracing::warn!(parent: &self.span, error = %failure, "attempt failed");
        let now = failure.failed_at;
        self.first_failure_at.get_or_insert(now);
        let shared = &*self.worker.shared;
        let registry = &self.worker.registry;
        let policy = match &self.route {
            Some(route) => registry.policy_for(route, &failure),
            None => registry.default_policy(),
        };
        let decision = policy.decide(failure.attempt, &failure);
        self.failures.push(failure);
        match decision {
            RetryDecision::RetryIn(delay) => {
                shared
                    .stats
                    .writer(self.worker.index)
                    .bump(Counter::Retried);
                let due_at = later(now, delay);
                tracing::info!(parent: &self.span, ?delay, "retry scheduled");
                let worker = Arc::clone(&self.worker);
                let (envelope, failures) = (self.envelope.clone(), self.failures.clone());
                let (succeeded, cascaded) = (self.succeeded_handlers(), self.cascaded.clone());
                let record = async move {
                    let id = envelope.id;
                    persist("record retry", id, || {
                        worker.inbox.schedule_retry(RetryRecord {
                            envelope: &envelope,
                            due_at,
                            failures: &failures,
                            succeeded: &succeeded,
                            cascaded: &cascaded,
                        })
                    })
                    .await
                };
                ctx.spawn(
                    record
                        .into_actor(self)
                        .map(move |fenced, actor, ctx| match fenced {
                            Ok(Fenced::Written) => actor.cool_down(due_at, delay, ctx),
                            Err(error) => actor.store_rejected(&error, ctx),
                            Ok(_) => actor.owned_elsewhere(ctx),
                        }),
                );
            }
            RetryDecision::DeadLetter { exhausted } => {
                let reason = if exhausted {
                    DeadLetterReason::RetriesExhausted
                } else {
                    DeadLetterReason::Permanent
                };
                let dead_letter = DeadLetter::failed(
                    self.envelope.clone(),
                    reason,
                    self.failures.clone(),
                    self.first_failure_at.unwrap_or(now),
                    now,
                );
                self.dead_letter(dead_letter, ctx);
            }
        }
    }

    /// The handlers (`module/name`) that succeeded so far, under
    /// [`RetryScope::FailedHandlers`].
    fn succeeded_handlers(&self) -> Vec<String> {
        let Some(route) = &self.route else {
            return Vec::new();
        };
        route
            .handlers()
            .iter()
            .zip(&self.succeeded)
            .filter(|(_, done)| **done)
            .map(|(h, _)| h.id.to_string())
            .collect()
    }

    /// Waits on the timer actor until the next attempt is due.
    fn cool_down(&mut self, due_at: DateTime<Utc>, delay: Duration, ctx: &mut Context<Self>) {
        let shared = &*self.worker.shared;
        if let Some(ticket) = self.ticket {
            let pending = PendingRetry {
                envelope: self.envelope.clone(),
                due_at,
                failures: self.failures.clone(),
            };
            shared.tracker.cooling(ticket, pending);
        }
        shared.timer.do_send(Schedule {
            delay,
            target: ctx.address().recipient(),
        });
    }

    fn succeed(&mut self, ctx: &mut Context<Self>) {
        let worker = &self.worker;
        let id = self.envelope.id;
        // An in-memory inbox answers at once; only a store that waits needs the actor future.
        if self.cascaded.is_empty()
            && let Some(Ok(())) = worker.inbox.mark_handled_now(id)
        {
            self.handled(false, ctx);
            return;
        }
        let worker = Arc::clone(worker);
        let cascaded = self.cascaded.clone();
        let work = async move {
            persist("mark handled", id, || {
                worker.inbox.settle_handled(id, &cascaded)
            })
            .await
        };
        ctx.spawn(
            work.into_actor(self)
                .map(|handled, actor, ctx| match handled {
                    Ok(Handled::Written { in_outbox }) => {
                        if in_outbox {
                            actor.worker.shared.outbox_enlisted.notify_one();
                        }
                        actor.handled(in_outbox, ctx);
                    }
                    Err(error) => actor.store_rejected(&error, ctx),
                    Ok(_) => actor.owned_elsewhere(ctx),
                }),
        );
    }

    /// Settles a handled delivery; its cascaded messages are sent from here unless the store
    /// already wrote them to its outbox, for the relay.
    fn handled(&mut self, in_outbox: bool, ctx: &mut Context<Self>) {
        let cascaded = std::mem::take(&mut self.cascaded);
        self.worker
            .shared
            .stats
            .writer(self.worker.index)
            .bump(Counter::Handled);
        tracing::info!(parent: &self.span, cascaded = cascaded.len(), "delivery handled");
        if !in_outbox {
            self.worker.forward(cascaded.clone());
        }
        self.settle(Outcome::Handled, cascaded, ctx);
    }

    /// Dead-letters the delivery: in one transaction of the inbox's store (the dead letter,
    /// the row settled, the envelope's uncompleted claims released), or — dead letters kept
    /// apart — the dead letter first, then the row.
    fn dead_letter(&mut self, dead_letter: DeadLetter, ctx: &mut Context<Self>) {
        let worker = Arc::clone(&self.worker);
        let id = self.envelope.id;
        let reason = dead_letter.reason.clone();
        tracing::error!(parent: &self.span, %reason, "message dead-lettered");
        let release_claims = worker.claims.is_some() && worker.shared.claims_in_store;
        let work = async move {
            if !worker.shared.dead_letters_apart {
                return persist("dead letter", id, || {
                    worker.inbox.dead_letter(&dead_letter, release_claims)
                })
                .await;
            }
            persist("dead letter", id, || {
                worker.dead_letters.put(dead_letter.clone())
            })
            .await?;
            match persist("mark handled", id, || worker.inbox.settle_handled(id, &[])).await? {
                Handled::Written { .. } => Ok(Fenced::Written),
                _ => Ok(Fenced::OwnedElsewhere),
            }
        };
        ctx.spawn(work.into_actor(self).map(move |fenced, actor, ctx| match fenced {
            Ok(Fenced::Written) => {
                actor
                    .worker
                    .shared
                    .stats
                    .writer(actor.worker.index)
                    .bump(Counter::DeadLettered);
                actor.settle(Outcome::DeadLettered(reason), Vec::new(), ctx);
            }
            Ok(_) => actor.owned_elsewhere(ctx),
            // The letter with its failures was refused: try the bare envelope once.
            Err(error) if !matches!(reason, DeadLetterReason::StoreRejected(_)) => {
                let now = actor.now();
                let bare = DeadLetter::rejected(
                    actor.envelope.clone(),
                    DeadLetterReason::StoreRejected(error.to_string()),
                    now,
                );
                actor.dead_letter(bare, ctx);
            }
            Err(error) => {
                // Nothing of it can be stored: say so loudly and free its slot. Its row stays
                // unsettled for an operator to see.
                tracing::error!(
                    parent: &actor.span,
                    %error,
                    "the store refuses even the dead letter of this delivery; it is given up"
                );
                actor.settle(
                    Outcome::Discarded(DiscardReason::StoreRejected),
                    Vec::new(),
                    ctx,
                );
            }
        }));
    }

    fn settle(&mut self, outcome: Outcome, cascaded: Vec<Envelope>, ctx: &mut Context<Self>) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(DeliveryReport {
                envelope_id: self.envelope.id,
                message_type: self.envelope.message_type.to_string(),
                outcome,
                attempts: self.envelope.attempts,
                failures: std::mem::take(&mut self.failures),
                attempt_offsets: if self.envelope.attempts == 0 {
                    Vec::new()
                } else {
                    std::iter::once(Duration::ZERO)
                        .chain(self.retry_offsets.drain(..))
                        .collect()
                },
                cascaded,
            });
        }
        self.permit.take();
        match self.ticket {
            Some(ticket) => self.worker.shared.tracker.finish(ticket),
            None => self.worker.shared.tracker.release(),
        }
        ctx.stop();
    }
}

/// `delay` after `now`, saturating instead of overflowing the calendar.
fn later(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(delay)
        .ok()
        .and_then(|delay| now.checked_add_signed(delay))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// How a recovered delivery picks up again.
#[derive(Debug, Clone, Copy)]
enum Resume {
    /// It was cooling down: the next attempt is due then.
    Due(DateTime<Utc>),
    /// An attempt was running when the runtime stopped: that attempt counts as failed.
    Interrupted,
}

/// Retries a store write until it succeeds: a settled delivery must be recorded, and giving up
/// would lose it. Backs off to 30 s between attempts and logs every failure. A write the store
/// rejects (the data itself, not the connection) is returned at once: no retry can cure it,
/// and it must not hold the delivery's capacity slot forever.
pub(crate) async fn persist<T, F, Fut>(
    what: &'static str,
    id: uuid::Uuid,
    mut write: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let backoff = crate::Backoff::default();
    let mut failures = 0u32;
    loop {
        match write().await {
            Ok(value) => return Ok(value),
            Err(error) if error.is_retryable() => {
                failures = failures.saturating_add(1);
                let pause = backoff.pause(failures);
                tracing::error!(message_id = %id, %error, ?pause, "{what} failed; retrying");
                tokio::time::sleep(pause).await;
            }
            Err(error) => {
                tracing::error!(message_id = %id, %error, "{what} rejected by the store; not retried");
                return Err(error);
            }
        }
    }
}

impl Actor for DeliverySupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Read on the engine's own clock (virtual under the harness), not the dispatching
        // caller's.
        self.started_at = Instant::now();
        let shared = &*self.worker.shared;
        self.ticket = Some(
            shared
                .tracker
                .supervise(self.worker.index, self.envelope.id),
        );
        if self.recovered {
            shared
                .resuming
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&self.envelope.id);
        }
        let size = self.envelope.size();
        let rejected = if size > shared.max_envelope_size {
            Some(DeadLetterReason::TooLarge {
                size,
                limit: shared.max_envelope_size,
            })
        } else {
            match self.worker.registry.route(&self.envelope.message_type) {
                None if shared.unknown_message_types == UnknownMessageTypes::Discard => {
                    tracing::warn!(parent: &self.span, "no handler for this message type; discarded");
                    shared
                        .stats
                        .writer(self.worker.index)
                        .bump(Counter::Discarded);
                    let id = self.envelope.id;
                    let worker = Arc::clone(&self.worker);
                    let work = async move {
                        persist("mark handled", id, || worker.inbox.settle_handled(id, &[])).await
                    };
                    ctx.spawn(work.into_actor(self).map(|handled, actor, ctx| {
                        if let Ok(Handled::Written { .. }) = handled {
                            actor.settle(
                                Outcome::Discarded(DiscardReason::NoHandler),
                                Vec::new(),
                                ctx,
                            );
                        } else {
                            actor.owned_elsewhere(ctx);
                        }
                    }));
                    return;
                }
                None => Some(DeadLetterReason::NoHandler(
                    self.envelope.message_type.to_string(),
                )),
                Some(route) => match route.decode(&self.envelope.payload) {
                    Ok(message) => {
                        if shared.retry_scope == RetryScope::FailedHandlers {
                            self.succeeded = route
                                .handlers()
                                .iter()
                                .map(|h| self.succeeded_before.contains(&h.id.to_string()))
                                .collect();
                        }
                        self.route = Some(Arc::clone(route));
                        self.message = Some(message);
                        None
                    }
                    Err(error) => Some(DeadLetterReason::MalformedPayload(error.to_string())),
                },
            }
        };
        let rejected = rejected.or_else(|| {
            let (route, message) = (self.route.clone()?, self.message.clone()?);
            self.read_deduplication_keys(&route, &message)
                .err()
                .map(DeadLetterReason::MissingDeduplicationId)
        });
        match rejected {
            None => match self.resume.take() {
                // Scheduled for later, in an inbox that keeps no schedule (in memory): its
                // delivery waits on the timer, holding its slot.
                None => match self.envelope.scheduled_for.filter(|at| *at > self.now()) {
                    Some(due_at) => {
                        let delay = (due_at - self.now()).to_std().unwrap_or_default();
                        self.cool_down(due_at, delay, ctx);
                    }
                    None => self.start_attempt(ctx),
                },
                Some(Resume::Due(due_at)) => {
                    let delay = (due_at - self.now()).to_std().unwrap_or_default();
                    self.cool_down(due_at, delay, ctx);
                }
                Some(Resume::Interrupted) => {
                    let failure = AggregateError {
                        message_type: self.envelope.message_type.to_string(),
                        message_id: self.envelope.id,
                        attempt: self.envelope.attempts,
                        failures: vec![HandlerFailure {
                            module: "dacapo".into(),
                            handler: "runtime".into(),
                            error: "the runtime stopped while this attempt ran".into(),
                            kind: FailureKind::Error,
                        }],
                        failed_at: self.now(),
                    };
                    self.attempt_failed(failure, ctx);
                }
            },
            Some(reason) => {
                let dead_letter = DeadLetter::rejected(self.envelope.clone(), reason, self.now());
                self.dead_letter(dead_letter, ctx);
            }
        }
    }
}

impl actix::Handler<HandlerFinished> for DeliverySupervisor {
    type Result = ();

    fn handle(&mut self, finished: HandlerFinished, ctx: &mut Context<Self>) {
        if let Some(failure) = finished.failure {
            self.results.push((finished.index, failure));
        }
        self.pending = self.pending.saturating_sub(1);
        if self.pending == 0 {
            self.finish_attempt(ctx);
        }
    }
}

impl actix::Handler<RetryDue> for DeliverySupervisor {
    type Result = ();

    fn handle(&mut self, _: RetryDue, ctx: &mut Context<Self>) {
        if self
            .ticket
            .is_some_and(|ticket| self.worker.shared.tracker.resume(ticket))
        {
            self.start_attempt(ctx);
        } else {
            // Handed back by a shutdown while cooling down: the report owns it now.
            ctx.stop();
        }
    }
}
