use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorContext, ActorFutureExt, AsyncContext, Context, WrapFuture};
use chrono::{DateTime, Utc};
use tokio::sync::oneshot;
use tracing::field::Empty;

use crate::RetryScope;
use crate::capacity::Slot;
use crate::clock::{Busy, Mark, Running};
use crate::context::{Scope, TakeCascaded};
use crate::delivery::{Delivery, Effect, Event, FAILURES_KEPT, Phase, Rules, Start};
use crate::dispatcher::{UnknownMessageTypes, Worker};
use crate::handler_actor::{HandlerFinished, PendingClaim};
use crate::ports::{Claim, Handled, Resumable, RetryRecord};
use crate::report::DiscardReason;
use crate::stats::Counter;
use crate::timer::{RetryDue, Schedule};
use crate::tracker::{PendingRetry, Ticket};
use crate::{
    AggregateError, ContextActor, DeadLetter, DeadLetterReason, Decoded, DeliveryReport, Envelope,
    Error, HandlerActor, HandlerEntry, HandlerFailure, Outcome, RetryPolicy, Route,
};

/// Owns one delivery from acceptance to settlement. The decisions are the `Delivery` state
/// machine's; this actor is the shell that runs what it decides: it starts a handler actor per
/// handler on each attempt and collects their failures, writes each transition to the store,
/// asks the [`TimerActor`](crate::TimerActor) for cooldowns, and reports the outcome.
pub struct DeliverySupervisor {
    /// The worker (arbiter) this delivery runs on.
    worker: Arc<Worker>,
    /// Set once the supervisor runs on its worker.
    ticket: Option<Ticket>,
    /// The delivery's state, moved only by its transitions.
    delivery: Delivery,
    /// How a delivery recovered from a durable inbox picks up again.
    resume: Option<Resume>,
    /// Whether it came back from a durable inbox (every attempt is then recorded first).
    recovered: bool,
    route: Option<Arc<Route>>,
    message: Option<Decoded>,
    /// This attempt's failures with their handler's index (empty, unallocated, on success).
    results: Vec<(usize, HandlerFailure)>,
    /// Each handler's logical id (by index), when any handler deduplicates.
    deduplication_keys: Vec<Option<String>>,
    /// Handlers a durable inbox says succeeded before a restart (`module/name`).
    succeeded_before: Vec<String>,
    pending: usize,
    started_at: Mark,
    /// Held while the supervisor works (not while it waits for its handlers or its timer), so
    /// the harness's virtual clock waits for it; nothing on real timers.
    busy: Option<Busy>,
    /// When the state machine last decided, on the wall clock and on the engine's timers: a
    /// cooldown runs from then, however long the store took to record it.
    stepped_at: (DateTime<Utc>, Mark),
    /// When the retry now being recorded was decided: its cooldown runs from then.
    cooldown_from: Option<(DateTime<Utc>, Mark)>,
    /// When each retry started, from the first attempt's start: the latest
    /// [`FAILURES_KEPT`] - 1.
    retry_offsets: Vec<Duration>,
    /// When the cooldown under way began (the failure decided), on the engine's timers.
    cooling_since: Option<Mark>,
    /// Each pause between an attempt's end and the next one's start: the latest
    /// [`FAILURES_KEPT`] - 1.
    pauses: Vec<Duration>,
    scope: Option<Arc<Scope>>,
    reply: Option<oneshot::Sender<DeliveryReport>>,
    permit: Option<Slot>,
    span: tracing::Span,
    /// The supervisor's own address, held from start to finish. Actix stops an actor whose
    /// addresses are all gone once nothing of its own is pending — even with a message queued:
    /// a cooldown timer that fires at once and drops its address would otherwise stop the
    /// supervisor with the `RetryDue` it just sent still in its mailbox, and the delivery would
    /// never settle. It stops by `finish` (or a shutdown's hand-back) only.
    me: Option<actix::Addr<Self>>,
}

impl std::fmt::Debug for DeliverySupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliverySupervisor")
            .field("message_id", &self.delivery.envelope.id)
            .field("attempts", &self.delivery.envelope.attempts)
            .field("phase", self.delivery.phase())
            .finish_non_exhaustive()
    }
}

impl DeliverySupervisor {
    pub(crate) fn new(
        worker: Arc<Worker>,
        envelope: Envelope,
        permit: Slot,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        busy: Busy,
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
            delivery: Delivery::new(envelope, Vec::new(), Vec::new(), Vec::new()),
            resume: None,
            recovered: false,
            route: None,
            message: None,
            results: Vec::new(),
            deduplication_keys: Vec::new(),
            succeeded_before: Vec::new(),
            pending: 0,
            started_at: Mark::Virtual(Duration::ZERO),
            busy: Some(busy),
            stepped_at: (DateTime::<Utc>::MIN_UTC, Mark::Virtual(Duration::ZERO)),
            cooldown_from: None,
            retry_offsets: Vec::new(),
            cooling_since: None,
            pauses: Vec::new(),
            scope: None,
            reply,
            permit: Some(permit),
            span,
            me: None,
        }
    }

    /// A supervisor for a delivery a durable inbox handed back after a restart.
    pub(crate) fn resumed(
        worker: Arc<Worker>,
        resumable: Resumable,
        permit: Slot,
        busy: Busy,
    ) -> Self {
        let Resumable {
            envelope,
            due_at,
            failures,
            succeeded,
            cascaded,
            ..
        } = resumable;
        let resume = match due_at {
            Some(at) => Resume::Due(at),
            // An attempt was started and never recorded as failed: it ran when the runtime stopped.
            None if envelope.attempts as usize > failures.len() => Resume::Interrupted,
            None => Resume::Due(worker.shared.clock.now()),
        };
        let mut supervisor = Self::new(worker, envelope, permit, None, busy);
        let envelope = supervisor.delivery.envelope.clone();
        supervisor.delivery = Delivery::new(envelope, failures, Vec::new(), cascaded);
        supervisor.succeeded_before = succeeded;
        supervisor.resume = Some(resume);
        supervisor.recovered = true;
        supervisor
    }

    fn now(&self) -> DateTime<Utc> {
        self.worker.shared.clock.now()
    }

    /// Gives up a delivery that got its room only once a shutdown's drain was over: the
    /// shutdown releases this node's rows, and another node may claim it and run it at once.
    /// It is handed back in the shutdown report, due now, and stays in a durable store.
    fn hand_back_unstarted(&mut self, ctx: &mut Context<Self>) {
        let shared = &*self.worker.shared;
        let envelope = self.delivery.envelope.clone();
        let due_at = match self.resume {
            Some(Resume::Due(at)) => at,
            _ => self.now(),
        };
        if !self.recovered {
            // Its receive counted the first attempt, which never ran: taken back before the
            // release, or the next node would record it as interrupted.
            shared
                .unstarted_fresh
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(envelope.id);
        }
        tracing::warn!(
            messaging.message.id = %envelope.id,
            "shutdown: a delivery that got room after the drain did not start; handed back in the shutdown report"
        );
        shared
            .unstarted_resumes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(PendingRetry {
                envelope,
                due_at,
                failures: std::mem::take(&mut self.delivery.failures),
            });
        self.permit.take();
        self.me = None;
        self.busy = None;
        shared.tracker.release();
        ctx.stop();
    }

    /// Moves the delivery on by `event` and runs what it decides.
    fn apply(&mut self, event: Event, ctx: &mut Context<Self>) {
        let route = self.route.clone();
        let registry = &self.worker.registry;
        let policy = |failure: &AggregateError| -> RetryPolicy {
            match &route {
                Some(route) => registry.policy_for(route, failure),
                None => registry.default_policy(),
            }
        };
        let clock = || self.worker.shared.clock.now();
        let rules = Rules {
            clock: &clock,
            first_attempt_recorded: !self.recovered,
            policy: &policy,
            read: std::cell::Cell::new(None),
        };
        let effect = self.delivery.step(event, &rules);
        // A cooldown counts from the step that decided it; no other step needs the time.
        if let Some(Effect::RecordRetry { .. } | Effect::Wait { .. }) = effect {
            self.stepped_at = (rules.now(), self.worker.shared.timers.mark());
        }
        if let Some(effect) = effect {
            self.run(effect, ctx);
        }
    }

    fn run(&mut self, effect: Effect, ctx: &mut Context<Self>) {
        match effect {
            Effect::RecordAttempt(attempt) => self.record_attempt(attempt, ctx),
            Effect::RunHandlers { attempt } => self.run_attempt(attempt, ctx),
            Effect::RecordRetry { due_at } => self.record_retry(due_at, ctx),
            Effect::Wait { due_at } => self.cool_down(due_at, ctx),
            Effect::RecordHandled => self.record_handled(ctx),
            Effect::RecordDeadLetter(letter) => self.record_dead_letter(*letter, ctx),
            Effect::RecordDiscard => self.record_discard(ctx),
            Effect::Finish(outcome) => self.finish(outcome, ctx),
        }
    }

    /// Records that the attempt starts, so that a crash while it runs counts it.
    fn record_attempt(&mut self, attempt: u32, ctx: &mut Context<Self>) {
        let worker = Arc::clone(&self.worker);
        let id = self.delivery.envelope.id;
        let begin = async move {
            persist("record attempt", id, || {
                worker.inbox.begin_attempt(id, attempt)
            })
            .await
        };
        ctx.spawn(begin.into_actor(self).map(|answer, actor, ctx| {
            actor.apply(Event::AttemptRecorded(answer), ctx);
        }));
    }

    fn run_attempt(&mut self, attempt: u32, ctx: &mut Context<Self>) {
        let (Some(route), Some(message)) = (self.route.clone(), self.message.clone()) else {
            return;
        };
        let shared = &*self.worker.shared;
        shared
            .stats
            .writer(self.worker.index)
            .bump(Counter::Attempts);
        if attempt > 1 {
            let timers = &self.worker.shared.timers;
            push_latest(&mut self.retry_offsets, timers.since(self.started_at));
            // A resumed delivery's cooldown began in the runtime that stopped: what was left of
            // it ran from this supervisor's start.
            let cooled_from = self.cooling_since.take().unwrap_or(self.started_at);
            push_latest(&mut self.pauses, timers.since(cooled_from));
        }
        if !self.span.is_disabled() {
            self.span.record("dacapo.attempt", attempt);
        }

        let scope = Arc::new(Scope::new(
            &self.delivery.envelope,
            attempt,
            shared.max_envelope_size,
            Arc::clone(&self.worker),
        ));
        self.scope = Some(Arc::clone(&scope));
        self.pending = (0..route.handlers().len())
            .filter(|i| !self.delivery.skips(*i))
            .count();
        let me = ctx.address();
        for (index, entry) in route.handlers().iter().enumerate() {
            if self.delivery.skips(index) {
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
            let running = Running::new(shared.timers.busy());
            let handle = ContextActor::handle_for(
                Arc::clone(&scope),
                Arc::clone(&route),
                index,
                running.clone(),
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
                running,
                shared.timers.clone(),
            )
            .start();
        }
        // Every handler already succeeded (a resume under RetryScope::FailedHandlers): the
        // attempt is over at once. Otherwise the handlers work now, and the supervisor waits.
        if self.pending == 0 {
            self.finish_attempt(ctx);
        } else {
            self.busy = None;
        }
    }

    /// The claim handler `index` makes before it runs, if it deduplicates and the message has
    /// a logical id for it.
    fn pending_claim(&self, index: usize, entry: &HandlerEntry) -> Option<Box<PendingClaim>> {
        let deduplication = entry.deduplication.as_ref()?;
        let key = self.deduplication_keys.get(index)?.clone()?;
        let claim = Claim::new(
            entry.id.to_string(),
            key,
            self.delivery.envelope.id,
            &self.delivery.envelope.payload,
            self.now(),
            self.worker.deduplication_window,
        );
        Some(Box::new(PendingClaim {
            claim,
            clock: Arc::clone(&self.worker.shared.clock),
            window: self.worker.deduplication_window,
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
                let key = d.key(&self.delivery.envelope, message);
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
        let failed = std::mem::take(&mut self.results);
        let context = scope.close().cloned();
        if context.is_none() && !scope.held() {
            let ended = Event::AttemptEnded {
                failed,
                cascaded: Vec::new(),
            };
            self.apply(ended, ctx);
            return;
        }
        let span = self.span.clone();
        let take = async move {
            // What a handler still holds may write yet (a statement it left running, a
            // connection it handed on): the settle comes after, so that it covers that too.
            if scope.released().await {
                tracing::warn!(parent: &span, "a handler still held a connection 5 s after its attempt ended; settling without waiting further");
            }
            match context {
                Some(context) => context.send(TakeCascaded).await.unwrap_or_default(),
                None => Vec::new(),
            }
        };
        ctx.spawn(take.into_actor(self).map(|cascaded, actor, ctx| {
            actor.apply(Event::AttemptEnded { failed, cascaded }, ctx);
        }));
    }

    /// Records the failed attempt, with everything a resume needs, before the cooldown.
    fn record_retry(&mut self, due_at: DateTime<Utc>, ctx: &mut Context<Self>) {
        self.cooldown_from = Some(self.stepped_at);
        if let Some(failure) = self.delivery.failures.last() {
            tracing::warn!(parent: &self.span, error = %failure, "attempt failed");
        }
        self.worker
            .shared
            .stats
            .writer(self.worker.index)
            .bump(Counter::Retried);
        let delay = (due_at - self.now()).to_std().unwrap_or_default();
        tracing::info!(parent: &self.span, ?delay, %due_at, "retry scheduled");
        let worker = Arc::clone(&self.worker);
        let delivery = &self.delivery;
        let (envelope, failures) = (delivery.envelope.clone(), delivery.failures.clone());
        let succeeded = match &self.route {
            Some(route) => {
                let ids: Vec<_> = route.handlers().iter().map(|h| h.id.clone()).collect();
                delivery.succeeded_handlers(&ids)
            }
            None => Vec::new(),
        };
        let cascaded = delivery.cascaded.clone();
        let record = async move {
            persist("record retry", envelope.id, || {
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
        ctx.spawn(record.into_actor(self).map(|answer, actor, ctx| {
            actor.apply(Event::RetryRecorded(answer), ctx);
        }));
    }

    /// Waits on the timer actor until the next attempt is due.
    fn cool_down(&mut self, due_at: DateTime<Utc>, ctx: &mut Context<Self>) {
        let shared = &*self.worker.shared;
        if shared.crashes_at(
            crate::Failpoint::DuringCooldown,
            &self.delivery.envelope.message_type,
        ) {
            return;
        }
        if let Some(ticket) = self.ticket {
            let pending = PendingRetry {
                envelope: self.delivery.envelope.clone(),
                due_at,
                failures: self.delivery.failures.clone(),
            };
            shared.tracker.cooling(ticket, pending);
        }
        if let Some(permit) = &mut self.permit {
            permit.park();
        }
        let (decided_at, mark) = self.cooldown_from.take().unwrap_or(self.stepped_at);
        self.cooling_since = Some(mark);
        let delay = (due_at - decided_at)
            .to_std()
            .unwrap_or_default()
            .saturating_sub(shared.timers.since(mark));
        let (high, low) = self.delivery.envelope.id.as_u64_pair();
        shared.timer.do_send(Schedule {
            delay,
            tie: high ^ low.rotate_left(17) ^ u64::from(self.delivery.envelope.attempts),
            target: ctx.address().recipient(),
            busy: self.busy.take(),
        });
    }

    /// Settles the delivery as handled, with what its handlers published.
    fn record_handled(&mut self, ctx: &mut Context<Self>) {
        let worker = &self.worker;
        if worker.shared.crashes_at(
            crate::Failpoint::BeforeSettle,
            &self.delivery.envelope.message_type,
        ) {
            return;
        }
        let id = self.delivery.envelope.id;
        // An in-memory inbox answers at once; only a store that waits needs the actor future.
        if self.delivery.cascaded.is_empty()
            && let Some(Ok(())) = worker.inbox.mark_handled_now(id)
        {
            let answer = Ok(Handled::Written { in_outbox: false });
            self.apply(Event::HandledRecorded(answer), ctx);
            return;
        }
        let worker = Arc::clone(worker);
        let cascaded = self.delivery.cascaded.clone();
        let attempts = self.delivery.envelope.attempts;
        let work = async move {
            persist("mark handled", id, || {
                worker.inbox.settle_handled(id, attempts, &cascaded)
            })
            .await
        };
        ctx.spawn(work.into_actor(self).map(|answer, actor, ctx| {
            if answer.is_ok()
                && actor.worker.shared.crashes_at(
                    crate::Failpoint::AfterSettle,
                    &actor.delivery.envelope.message_type,
                )
            {
                return;
            }
            if let Ok(Handled::Written { in_outbox }) = answer {
                let cascaded = &actor.delivery.cascaded;
                if in_outbox {
                    if !cascaded.is_empty() {
                        actor.worker.shared.outbox_enlisted.notify_one();
                    }
                } else {
                    // A store without an outbox: the engine delivers them itself.
                    actor.worker.forward(cascaded.clone());
                }
            }
            actor.apply(Event::HandledRecorded(answer), ctx);
        }));
    }

    /// Dead-letters the delivery in one transaction of the inbox's store: the dead letter, the
    /// row settled, the envelope's uncompleted claims released.
    fn record_dead_letter(&mut self, dead_letter: DeadLetter, ctx: &mut Context<Self>) {
        if let (DeadLetterReason::RetriesExhausted | DeadLetterReason::Permanent, Some(failure)) =
            (&dead_letter.reason, self.delivery.failures.last())
        {
            tracing::warn!(parent: &self.span, error = %failure, "attempt failed");
        }
        tracing::error!(parent: &self.span, reason = %dead_letter.reason, "message dead-lettered");
        let worker = Arc::clone(&self.worker);
        let id = self.delivery.envelope.id;
        let release_claims = worker.claims.is_some() && worker.shared.claims_in_store;
        let work = async move {
            persist("dead letter", id, || {
                worker.inbox.dead_letter(&dead_letter, release_claims)
            })
            .await
        };
        ctx.spawn(work.into_actor(self).map(|answer, actor, ctx| {
            actor.apply(Event::DeadLetterRecorded(answer), ctx);
        }));
    }

    /// Settles a delivery without running it: a type nobody handles, configured to be
    /// discarded, or one whose every record the store refused.
    fn record_discard(&mut self, ctx: &mut Context<Self>) {
        if matches!(
            self.delivery.phase(),
            Phase::Discarding(DiscardReason::StoreRejected)
        ) {
            tracing::error!(
                parent: &self.span,
                messaging.message.id = %self.delivery.envelope.id,
                dacapo.message_type = %self.delivery.envelope.message_type,
                "the store refuses even the dead letter of this delivery; it is settled without one"
            );
        } else {
            tracing::warn!(parent: &self.span, "no handler for this message type; discarded");
        }
        let worker = Arc::clone(&self.worker);
        let id = self.delivery.envelope.id;
        let attempts = self.delivery.envelope.attempts;
        let work = async move {
            persist("mark handled", id, || {
                worker.inbox.settle_handled(id, attempts, &[])
            })
            .await
        };
        ctx.spawn(work.into_actor(self).map(|answer, actor, ctx| {
            actor.apply(Event::HandledRecorded(answer), ctx);
        }));
    }

    /// Reports the outcome, frees the delivery's slot and stops.
    fn finish(&mut self, outcome: Outcome, ctx: &mut Context<Self>) {
        let counters = self.worker.shared.stats.writer(self.worker.index);
        let mut cascaded = Vec::new();
        match &outcome {
            Outcome::Handled => {
                counters.bump(Counter::Handled);
                cascaded = std::mem::take(&mut self.delivery.cascaded);
                tracing::info!(parent: &self.span, cascaded = cascaded.len(), "delivery handled");
            }
            Outcome::DeadLettered(_) => counters.bump(Counter::DeadLettered),
            Outcome::Discarded(DiscardReason::NoHandler) => counters.bump(Counter::Discarded),
            Outcome::Discarded(DiscardReason::OwnedElsewhere) => {
                tracing::info!(
                    parent: &self.span,
                    attempt = self.delivery.envelope.attempts,
                    "delivery owned by another node now; this node stops it"
                );
            }
            _ => {}
        }
        let envelope = &self.delivery.envelope;
        let shared = &*self.worker.shared;
        if shared.wants_report(self.reply.as_ref()) {
            let report = DeliveryReport {
                envelope_id: envelope.id,
                message_type: envelope.message_type.to_string(),
                outcome,
                attempts: envelope.attempts,
                failures: std::mem::take(&mut self.delivery.failures),
                attempt_offsets: if envelope.attempts == 0 {
                    Vec::new()
                } else {
                    std::iter::once(Duration::ZERO)
                        .chain(self.retry_offsets.drain(..))
                        .collect()
                },
                cascaded,
                pauses: std::mem::take(&mut self.pauses),
            };
            shared.report(self.reply.take(), report);
        }
        self.permit.take();
        self.me = None;
        self.busy = None;
        match self.ticket {
            Some(ticket) => self.worker.shared.tracker.finish(ticket),
            None => self.worker.shared.tracker.release(),
        }
        ctx.stop();
    }

    /// Checks the envelope before anything runs: how the delivery starts.
    fn check(&mut self) -> Start {
        let shared = &*self.worker.shared;
        let size = self.delivery.envelope.size();
        if size > shared.max_envelope_size {
            return Start::Reject(DeadLetterReason::TooLarge {
                size,
                limit: shared.max_envelope_size,
            });
        }
        let message_type = self.delivery.envelope.message_type.clone();
        let route = match self.worker.registry.route(&message_type) {
            None if shared.unknown_message_types == UnknownMessageTypes::Discard => {
                return Start::Discard;
            }
            None => return Start::Reject(DeadLetterReason::NoHandler(message_type.to_string())),
            Some(route) => Arc::clone(route),
        };
        let message = match route.decode(&self.delivery.envelope.payload) {
            Ok(message) => message,
            Err(error) => {
                return Start::Reject(DeadLetterReason::MalformedPayload(error.to_string()));
            }
        };
        if shared.retry_scope == RetryScope::FailedHandlers {
            self.delivery.succeeded = route
                .handlers()
                .iter()
                .map(|h| self.succeeded_before.contains(&h.id.to_string()))
                .collect();
        }
        if let Err(handler) = self.read_deduplication_keys(&route, &message) {
            return Start::Reject(DeadLetterReason::MissingDeduplicationId(handler));
        }
        self.route = Some(route);
        self.message = Some(message);
        match self.resume.take() {
            Some(Resume::Due(due_at)) => Start::At(due_at),
            Some(Resume::Interrupted) => Start::Interrupted,
            // Scheduled for later, in an inbox that keeps no schedule (in memory): its
            // delivery waits on the timer, holding its slot.
            None => match self.delivery.envelope.scheduled_for {
                Some(due_at) if due_at > self.now() => Start::At(due_at),
                _ => Start::Now,
            },
        }
    }
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
        // Read on the engine's own timers (virtual under the harness).
        self.started_at = self.worker.shared.timers.mark();
        self.me = Some(ctx.address());
        let shared = &*self.worker.shared;
        self.ticket = shared
            .tracker
            .supervise(self.worker.index, self.delivery.envelope.id);
        shared.unlist_starting(self.delivery.envelope.id);
        if self.ticket.is_none() {
            self.hand_back_unstarted(ctx);
            return;
        }
        // The check runs the application's code (the payload's deserializer, deduplication key
        // functions): a panic there must not unwind through the supervisor, which would leave
        // its delivery unsettled for good. No retry reads the message differently.
        let start = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.check()))
            .unwrap_or_else(|panic| {
                Start::Reject(DeadLetterReason::MalformedPayload(format!(
                    "reading it panicked: {}",
                    crate::handler_actor::panic_text(&*panic)
                )))
            });
        self.apply(Event::Started(start), ctx);
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
            // The last handler's token passes to the supervisor's work (a fresh one if the
            // handler gave its own up and finished anyway).
            self.busy = Some(
                finished
                    .busy
                    .unwrap_or_else(|| self.worker.shared.timers.busy()),
            );
            self.finish_attempt(ctx);
        }
    }
}

impl actix::Handler<RetryDue> for DeliverySupervisor {
    type Result = ();

    fn handle(&mut self, RetryDue(busy): RetryDue, ctx: &mut Context<Self>) {
        self.busy = Some(busy);
        if let Some(permit) = &mut self.permit {
            permit.unpark();
        }
        if self
            .ticket
            .is_some_and(|ticket| self.worker.shared.tracker.resume(ticket))
        {
            self.apply(Event::Due, ctx);
        } else {
            // Handed back by a shutdown while cooling down: the report owns it now.
            ctx.stop();
        }
    }
}

/// Pushes `item`, keeping the latest [`FAILURES_KEPT`] - 1 only: a delivery retried without end
/// would otherwise grow the list by one per attempt for as long as it keeps failing.
fn push_latest(list: &mut Vec<Duration>, item: Duration) {
    list.push(item);
    if let Some(excess) = list.len().checked_sub(FAILURES_KEPT - 1).filter(|n| *n > 0) {
        list.drain(..excess);
    }
}
