use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Recipient, WrapFuture};

use crate::clock::{Busy, Timers};

/// Schedules cooldown retries: nothing sleeps inside a handler or a supervisor.
///
/// It runs on the engine's [`Timers`]: under the test harness's virtual clock a 60 s cooldown
/// passes as soon as nothing else in the engine is working.
#[derive(Debug, Default)]
pub struct TimerActor {
    timers: Timers,
}

impl TimerActor {
    pub(crate) fn new(timers: Timers) -> Self {
        Self { timers }
    }
}

impl Actor for TimerActor {
    type Context = Context<Self>;
}

/// Tells a supervisor its cooldown is over, handing it the token of the work that resumes.
#[derive(Debug)]
pub(crate) struct RetryDue(pub(crate) Busy);

impl actix::Message for RetryDue {
    type Result = ();
}

/// Asks the timer to wake `target` after `delay`.
pub(crate) struct Schedule {
    pub(crate) delay: Duration,
    /// What the timer is for, which orders timers due together under a seeded clock.
    pub(crate) tie: u64,
    pub(crate) target: Recipient<RetryDue>,
    /// The supervisor's token, let go once the timer is set.
    pub(crate) busy: Option<Busy>,
}

impl actix::Message for Schedule {
    type Result = ();
}

impl actix::Handler<Schedule> for TimerActor {
    type Result = ();

    fn handle(
        &mut self,
        Schedule {
            delay,
            tie,
            target,
            busy,
        }: Schedule,
        ctx: &mut Context<Self>,
    ) {
        let due = self.timers.sleep_for(delay, Some(tie));
        drop(busy);
        ctx.spawn(due.into_actor(self).map(move |busy, _, _| {
            // A supervisor abandoned at shutdown no longer listens; nothing is lost, since the
            // shutdown report already handed its envelope back.
            target.do_send(RetryDue(busy));
        }));
    }
}
