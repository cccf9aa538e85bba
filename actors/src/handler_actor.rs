use std::panic::AssertUnwindSafe;
use std::time::Duration;

use actix::{Actor, ActorContext, ActorFutureExt, Addr, AsyncContext, Context, WrapFuture};
use futures::FutureExt;
use tracing::Instrument;

use crate::{
    Decoded, DeliverySupervisor, Disposition, FailureKind, HandlerEntry, HandlerFailure, MessageContext,
};

/// Runs one handler once, for one attempt, and reports to its supervisor.
///
/// A panic or an overrun of the timeout is this handler's failure and nobody else's: the
/// future is wrapped in `catch_unwind` (actix would otherwise lose the arbiter) and in a
/// timeout that drops it.
pub struct HandlerActor {
    entry: HandlerEntry,
    index: usize,
    message: Decoded,
    context: MessageContext,
    timeout: Duration,
    supervisor: Addr<DeliverySupervisor>,
    span: tracing::Span,
}

impl HandlerActor {
    pub(crate) fn new(
        entry: HandlerEntry,
        index: usize,
        message: Decoded,
        context: MessageContext,
        timeout: Duration,
        supervisor: Addr<DeliverySupervisor>,
        span: tracing::Span,
    ) -> Self {
        Self { entry, index, message, context, timeout, supervisor, span }
    }
}

impl std::fmt::Debug for HandlerActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerActor").field("handler", &self.entry.id).finish_non_exhaustive()
    }
}

/// A handler's result for one attempt.
#[derive(Debug)]
pub(crate) struct HandlerFinished {
    pub(crate) index: usize,
    pub(crate) failure: Option<HandlerFailure>,
}

impl actix::Message for HandlerFinished {
    type Result = ();
}

impl Actor for HandlerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let call = (self.entry.invoke)(self.message.clone(), self.context.clone());
        let timeout = self.timeout;
        let guarded = tokio::time::timeout(timeout, AssertUnwindSafe(call).catch_unwind())
            .instrument(self.span.clone());
        ctx.spawn(guarded.into_actor(self).map(move |result, actor, ctx| {
            let failure = match result {
                Ok(Ok(Ok(()))) => None,
                Ok(Ok(Err(error))) => {
                    let kind = match error.disposition() {
                        Disposition::Permanent => FailureKind::Permanent,
                        Disposition::RetryAfter(delay) => FailureKind::RetryAfter(delay),
                        _ => FailureKind::Error,
                    };
                    Some((kind, error.to_string()))
                }
                Ok(Err(panic)) => Some((FailureKind::Panicked, panic_text(&*panic))),
                Err(_) => Some((
                    FailureKind::TimedOut(timeout),
                    format!("did not finish within {timeout:?}"),
                )),
            };
            let failure = failure.map(|(kind, error)| {
                actor.span.in_scope(|| tracing::warn!(%error, ?kind, "handler failed"));
                HandlerFailure {
                    module: actor.entry.id.module.to_string(),
                    handler: actor.entry.id.name.to_string(),
                    error,
                    kind,
                }
            });
            actor.supervisor.do_send(HandlerFinished { index: actor.index, failure });
            ctx.stop();
        }));
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        format!("panicked: {text}")
    } else if let Some(text) = panic.downcast_ref::<String>() {
        format!("panicked: {text}")
    } else {
        "panicked with a non-text payload".to_owned()
    }
}
