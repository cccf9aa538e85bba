use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorContext, ActorFutureExt, Addr, AsyncContext, Context, WrapFuture};
use futures::FutureExt;
use tracing::Instrument;

use crate::clock::{Busy, Running, TimedOut, Timers, within};
use crate::panics::{HandlerCode, drop_as_handler_code, error_text};
use crate::ports::{Claim, ClaimOutcome, Claims};
use crate::supervisor::persist;
use crate::{
    Conflicts, Decoded, DeliverySupervisor, Disposition, FailureKind, HandlerError, HandlerFailure,
    MessageContext, Route,
};

/// Runs one handler once, for one attempt, and reports to its supervisor.
///
/// A panic or an overrun of the timeout is this handler's failure and nobody else's: the
/// future is wrapped in `catch_unwind` (actix would otherwise lose the arbiter) and in a
/// timeout that drops it.
pub struct HandlerActor {
    route: Arc<Route>,
    index: usize,
    message: Decoded,
    context: MessageContext,
    timeout: Duration,
    supervisor: Addr<DeliverySupervisor>,
    span: tracing::Span,
    /// The logical id this handler must claim before it runs, if it deduplicates (boxed:
    /// most handlers do not, and every byte of the actor is moved when it starts).
    claim: Option<Box<PendingClaim>>,
    /// Its token of work for the engine's timers, handed on with its report.
    running: Running,
    /// The engine's timers, which its timeout runs on.
    timers: Timers,
}

/// A deduplicated handler's claim, and where to make it.
pub(crate) struct PendingClaim {
    pub(crate) claim: Claim,
    /// What a claim tried again is stamped with: it holds for `window` from when it lands.
    pub(crate) clock: Arc<dyn crate::ports::Clock>,
    pub(crate) window: Duration,
    /// `None` when the runtime has not enabled deduplication: the handler then fails.
    pub(crate) claims: Option<Arc<dyn Claims>>,
    pub(crate) conflicts: Conflicts,
    /// Where to count a duplicate intent: the engine's counters, and this worker's writer.
    pub(crate) stats: (Arc<crate::Stats>, usize),
}

/// A handler's failure, before it is put into words for its supervisor.
type Failure = Option<(FailureKind, String)>;

impl HandlerActor {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        route: Arc<Route>,
        index: usize,
        message: Decoded,
        context: MessageContext,
        timeout: Duration,
        supervisor: Addr<DeliverySupervisor>,
        span: tracing::Span,
        claim: Option<Box<PendingClaim>>,
        running: Running,
        timers: Timers,
    ) -> Self {
        Self {
            route,
            index,
            message,
            context,
            timeout,
            supervisor,
            span,
            claim,
            running,
            timers,
        }
    }

    fn report(&self, result: HandlerResult) {
        self.send(failure_of(result, self.timeout));
    }

    fn send(&self, failure: Failure) {
        let failure = failure.map(|(kind, error)| {
            tracing::warn!(parent: &self.span, %error, ?kind, "handler failed");
            let id = &self.route.handlers()[self.index].id;
            HandlerFailure {
                module: id.module.to_string(),
                handler: id.name.to_string(),
                error,
                kind,
            }
        });
        self.supervisor.do_send(HandlerFinished {
            index: self.index,
            failure,
            busy: self.running.take(),
        });
    }

    /// Claims the logical id, runs the handler only if the claim is new, and releases the
    /// claim if the handler fails, so its retry gets through.
    fn run_deduplicated(&mut self, pending: Box<PendingClaim>, ctx: &mut Context<Self>) {
        let invoke = Arc::clone(&self.route.handlers()[self.index].invoke);
        let call = HandlerCode::new(invoke(
            Arc::clone(&self.route),
            self.index,
            self.message.clone(),
            self.context.clone(),
        ));
        let timeout = self.timeout;
        let tie = timeout_tie(&self.context, self.index);
        let span = self.span.clone();
        let message_id = self.context.message_id().unwrap_or_default();
        let (timers, running) = (self.timers(), self.running.clone());
        let context = self.context.clone();
        let work = async move {
            let PendingClaim {
                claim,
                clock,
                window,
                claims,
                conflicts,
                stats: (stats, writer),
            } = *pending;
            let count_duplicate = || {
                stats
                    .writer(writer)
                    .bump(crate::stats::Counter::DuplicateIntents);
            };
            let Some(claims) = claims else {
                return Some((
                    FailureKind::Permanent,
                    format!(
                        "{} asks for deduplication, which this runtime has not enabled",
                        claim.handler
                    ),
                ));
            };
            // Tried again while the store cannot answer (unreachable, failing over), as the
            // delivery's own writes are: no handler ran, so no attempt is spent, and an outage
            // longer than the retry policy's budget does not dead-letter the intent. Each try
            // is stamped anew: one that lands after an outage holds its whole window.
            let claimed = persist("deduplication claim", message_id, || {
                let (claims, stamped) = (Arc::clone(&claims), claim.stamped(clock.now(), window));
                async move { claims.claim(&stamped).await }
            })
            .await;
            match claimed {
                // The store refused the claim's data (a key PostgreSQL's text cannot hold):
                // every retry would meet the same refusal.
                Err(error @ crate::Error::Rejected(_)) => Some((
                    FailureKind::Permanent,
                    format!("deduplication claim refused by the store: {error}"),
                )),
                Err(error) => Some((
                    FailureKind::Error,
                    format!("deduplication claim failed: {error}"),
                )),
                // Not waited for here: that node's attempt may have ended without completing
                // or releasing the claim (its store refused it), and would hold this one for as
                // long as the node lives. The retry policy paces it instead.
                Ok(ClaimOutcome::RunningElsewhere) => Some((
                    FailureKind::Error,
                    format!(
                        "the deduplication claim of {} on {:?} is held by an attempt of this \
                         delivery still running on another node",
                        claim.handler, claim.key
                    ),
                )),
                Ok(ClaimOutcome::Completed) => {
                    tracing::debug!(parent: &span, dacapo.deduplication_id = %claim.key, "an earlier attempt completed this handler's work");
                    None
                }
                Ok(ClaimOutcome::Held { same_payload: true }) => {
                    count_duplicate();
                    tracing::info!(parent: &span, dacapo.deduplication_id = %claim.key, "duplicate intent discarded");
                    None
                }
                Ok(ClaimOutcome::Held {
                    same_payload: false,
                }) => {
                    if conflicts != Conflicts::DeadLetter {
                        count_duplicate();
                    }
                    tracing::warn!(
                        parent: &span,
                        dacapo.deduplication_id = %claim.key,
                        "deduplication id already claimed by a message with a different payload"
                    );
                    (conflicts == Conflicts::DeadLetter).then(|| {
                        (
                            FailureKind::Permanent,
                            format!(
                                "deduplication id {} was claimed by a different payload",
                                claim.key
                            ),
                        )
                    })
                }
                Ok(ClaimOutcome::Claimed) => {
                    let result = within(
                        timers.deadline(timeout, tie),
                        &running,
                        AssertUnwindSafe(call).catch_unwind(),
                        || context.give_up(),
                    )
                    .instrument(span)
                    .await;
                    let failure = failure_of(result, timeout);
                    // A refused write is logged by `persist`: the claim then waits for its window
                    // (released with the dead letter, if it comes to that).
                    if failure.is_some() {
                        let _ = persist("release deduplication claim", message_id, || {
                            claims.release(&claim)
                        })
                        .await;
                    } else {
                        // A later attempt skips this handler once its claim is completed, so
                        // what it cascaded cannot wait in memory for the delivery to settle.
                        // With the claims in the runtime's store, it goes to the outbox in
                        // the completion's own write. Claims kept elsewhere would enlist it
                        // into an outbox nothing relays: it goes to the runtime's outbox
                        // ahead of the completion, or, without one, is sent once the
                        // completion is recorded.
                        let in_store = context.deduplication_claim().is_some();
                        let cascaded = if in_store {
                            context.take_published().await
                        } else {
                            context.enlist_ahead().await;
                            Vec::new()
                        };
                        let enlisted = persist("complete deduplication claim", message_id, || {
                            claims.complete(&claim, &cascaded)
                        })
                        .await;
                        match enlisted {
                            Ok(true) if in_store => {
                                context.recorded_on_its_own();
                                if !cascaded.is_empty() {
                                    context.wake_outbox();
                                }
                            }
                            Ok(_) => {
                                context.restore_published(cascaded).await;
                                context.recorded_on_its_own();
                                context.send_recorded().await;
                            }
                            // Left to the attempt: a claim not completed is taken over by the
                            // next attempt of this delivery, which runs the handler again.
                            Err(_) => context.restore_published(cascaded).await,
                        }
                    }
                    failure
                }
            }
        };
        ctx.spawn(work.into_actor(self).map(|failure, actor, ctx| {
            actor.send(failure);
            ctx.stop();
        }));
    }
}

fn failure_of(result: HandlerResult, timeout: Duration) -> Failure {
    match result {
        Ok(Ok(Ok(()))) => None,
        Ok(Ok(Err(error))) => {
            let kind = match error.disposition() {
                Disposition::Permanent => FailureKind::Permanent,
                Disposition::RetryAfter(delay) => FailureKind::RetryAfter(delay),
                Disposition::Retry => FailureKind::Error,
            };
            Some((kind, error_text(error)))
        }
        Ok(Err(panic)) => {
            let text = panic_text(&*panic);
            drop_as_handler_code(panic);
            Some((FailureKind::Panicked, text))
        }
        Err(_) => Some((
            FailureKind::TimedOut(timeout),
            format!("did not finish within {timeout:?}"),
        )),
    }
}

type HandlerResult =
    Result<Result<Result<(), HandlerError>, Box<dyn std::any::Any + Send>>, TimedOut>;

impl HandlerActor {
    fn timers(&self) -> Timers {
        self.timers.clone()
    }
}

impl std::fmt::Debug for HandlerActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerActor")
            .field("handler", &self.route.handlers()[self.index].id)
            .finish_non_exhaustive()
    }
}

/// A handler's result for one attempt.
#[derive(Debug)]
pub(crate) struct HandlerFinished {
    pub(crate) index: usize,
    pub(crate) failure: Option<HandlerFailure>,
    /// The handler's token of work, which the supervisor takes over with its last report.
    pub(crate) busy: Option<Busy>,
}

impl actix::Message for HandlerFinished {
    type Result = ();
}

impl Actor for HandlerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(pending) = self.claim.take() {
            self.run_deduplicated(pending, ctx);
            return;
        }
        let invoke = &self.route.handlers()[self.index].invoke;
        let mut call = HandlerCode::new(invoke(
            Arc::clone(&self.route),
            self.index,
            self.message.clone(),
            self.context.clone(),
        ));
        // The timeout runs from before the first poll: a handler that gives its token up at
        // once (an injected hang) must find its deadline already set.
        let deadline = self
            .timers
            .deadline(self.timeout, timeout_tie(&self.context, self.index));
        // Many handlers finish without waiting on anything: poll once here, and arm the
        // actor's future machinery only for those that have to wait.
        let first = {
            let _entered = self.span.enter();
            std::panic::catch_unwind(AssertUnwindSafe(|| (&mut call).now_or_never()))
        };
        match first {
            Ok(Some(result)) => {
                self.report(Ok(Ok(result)));
                ctx.stop();
                return;
            }
            Err(panic) => {
                self.report(Ok(Err(panic)));
                ctx.stop();
                return;
            }
            Ok(None) => {}
        }
        let running = self.running.clone();
        let context = self.context.clone();
        let guarded = async move {
            within(
                deadline,
                &running,
                AssertUnwindSafe(call).catch_unwind(),
                || context.give_up(),
            )
            .await
        };
        let guarded: futures::future::BoxFuture<'static, HandlerResult> = if self.span.is_disabled()
        {
            Box::pin(guarded)
        } else {
            Box::pin(guarded.instrument(self.span.clone()))
        };
        ctx.spawn(guarded.into_actor(self).map(|result, actor, ctx| {
            actor.report(result);
            ctx.stop();
        }));
    }
}

/// What a handler's timeout is for: its delivery's attempt and the handler, so that under a
/// seeded virtual clock the timeouts due at one instant expire in the same order in every run,
/// not in the order the workers' threads happened to set them.
fn timeout_tie(context: &MessageContext, index: usize) -> u64 {
    let (high, low) = context.message_id().unwrap_or_default().as_u64_pair();
    high ^ low.rotate_left(17)
        ^ u64::from(context.attempt()).rotate_left(32)
        ^ (index as u64).rotate_left(48)
}

/// The panic's message; the failure's kind already says it panicked.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(a payload that is not text)".to_owned()
    }
}
