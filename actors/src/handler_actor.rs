use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorContext, ActorFutureExt, Addr, AsyncContext, Context, WrapFuture};
use futures::FutureExt;
use tracing::Instrument;

use crate::{
    Decoded, DeliverySupervisor, Disposition, FailureKind, HandlerError, HandlerFailure,
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
}

impl HandlerActor {
    pub(crate) fn new(
        route: Arc<Route>,
        index: usize,
        message: Decoded,
        context: MessageContext,
        timeout: Duration,
        supervisor: Addr<DeliverySupervisor>,
        span: tracing::Span,
    ) -> Self {
        Self {
            route,
            index,
            message,
            context,
            timeout,
            supervisor,
            span,
        }
    }

    fn report(&self, result: HandlerResult) {
        let failure = match result {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(error))) => {
                let kind = match error.disposition() {
                    Disposition::Permanent => FailureKind::Permanent,
                    Disposition::RetryAfter(delay) => FailureKind::RetryAfter(delay),
                    Disposition::Retry => FailureKind::Error,
                };
                Some((kind, error.to_string()))
            }
            Ok(Err(panic)) => Some((FailureKind::Panicked, panic_text(&*panic))),
            Err(_) => Some((
                FailureKind::TimedOut(self.timeout),
                format!("did not finish within {:?}", self.timeout),
            )),
        };
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
        });
    }
}

type HandlerResult = Result<
    Result<Result<(), HandlerError>, Box<dyn std::any::Any + Send>>,
    tokio::time::error::Elapsed,
>;

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
}

impl actix::Message for HandlerFinished {
    type Result = ();
}

impl Actor for HandlerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let invoke = &self.route.handlers()[self.index].invoke;
        let mut call = invoke(
            Arc::clone(&self.route),
            self.index,
            self.message.clone(),
            self.context.clone(),
        );
        // Many handlers finish without waiting on anything: poll once here, and arm the
        // timeout and the actor's future machinery only for those that have to wait.
        let first = {
            let _entered = self.span.enter();
            std::panic::catch_unwind(AssertUnwindSafe(|| call.as_mut().now_or_never()))
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
        let guarded = tokio::time::timeout(self.timeout, AssertUnwindSafe(call).catch_unwind());
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

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        format!("panicked: {text}")
    } else if let Some(text) = panic.downcast_ref::<String>() {
        format!("panicked: {text}")
    } else {
        "panicked with a non-text payload".to_owned()
    }
}
