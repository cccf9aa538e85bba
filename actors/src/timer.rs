use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Recipient};

/// Schedules cooldown retries: nothing sleeps inside a handler or a supervisor.
///
/// It runs on tokio's clock, so under the test harness's paused clock a 60 s cooldown passes
/// as soon as the engine is otherwise idle.
#[derive(Debug, Default)]
pub struct TimerActor;

impl Actor for TimerActor {
    type Context = Context<Self>;
}

/// Tells a supervisor its cooldown is over.
#[derive(Debug)]
pub(crate) struct RetryDue;

impl actix::Message for RetryDue {
    type Result = ();
}

/// Asks the timer to wake `target` after `delay`.
pub(crate) struct Schedule {
    pub(crate) delay: Duration,
    pub(crate) target: Recipient<RetryDue>,
}

impl actix::Message for Schedule {
    type Result = ();
}

impl actix::Handler<Schedule> for TimerActor {
    type Result = ();

    fn handle(&mut self, Schedule { delay, target }: Schedule, ctx: &mut Context<Self>) {
        ctx.run_later(delay, move |_, _| {
            // A supervisor abandoned at shutdown no longer listens; nothing is lost, since the
            // shutdown report already handed its envelope back.
            target.do_send(RetryDue);
        });
    }
}
