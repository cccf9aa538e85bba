use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};

use crate::Dispatcher;

/// Keeps this node's heartbeat, and resumes the deliveries a stopped runtime left unsettled in
/// a durable inbox: at start, then on its own timer (to take over from nodes that died).
///
/// The heartbeat also has a timer of its own, a third of the store's node timeout, whenever
/// that is shorter than the recovery interval: a live node is never taken for dead because
/// its recovery rounds are far apart.
#[derive(Debug)]
pub struct RecoveryActor {
    dispatcher: Dispatcher,
    interval: Duration,
    batch: usize,
    busy: bool,
    beating: bool,
    /// When this run started, until its first round took back what a previous run under the
    /// same node name left unsettled.
    started_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl RecoveryActor {
    pub(crate) fn new(dispatcher: Dispatcher, interval: Duration, batch: usize) -> Self {
        let started_at = Some(dispatcher.shared.clock.now());
        Self {
            dispatcher,
            interval,
            batch: batch.max(1),
            busy: false,
            beating: false,
            started_at,
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        // A slow store must not stack up rounds; a closing runtime must not take back what its
        // shutdown is releasing.
        if self.busy || self.dispatcher.shared.tracker.is_closing() {
            return;
        }
        self.busy = true;
        let dispatcher = self.dispatcher.clone();
        let batch = self.batch;
        let started_at = self.started_at;
        let round = async move {
            let _recovering = dispatcher.shared.recovering.lock().await;
            if dispatcher.shared.tracker.is_closing() {
                return false;
            }
            let inbox = &dispatcher.shared.inbox;
            if let Some(started_at) = started_at
                && let Err(error) = inbox.release_before(started_at).await
            {
                tracing::warn!(%error, "could not take back an earlier run's deliveries; retrying");
                return false;
            }
            // Without a fresh heartbeat this node could look dead to itself: claim nothing.
            if let Err(error) = inbox.heartbeat().await {
                tracing::warn!(%error, "heartbeat failed; retrying on the next round");
                return true;
            }
            let mut resumed = 0usize;
            loop {
                match inbox.recover(batch).await {
                    Ok(deliveries) => {
                        let count = deliveries.len();
                        resumed += count;
                        for delivery in deliveries {
                            // Refused only by a shutdown, which leaves the row to the next start.
                            let _ = dispatcher.resume(delivery);
                        }
                        if count < batch {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "recovery failed; retrying on the next round");
                        break;
                    }
                }
            }
            if resumed > 0 {
                tracing::info!(
                    resumed,
                    "resumed deliveries left unsettled by a stopped runtime"
                );
            }
            true
        };
        ctx.spawn(round.into_actor(self).map(|released, actor, _| {
            actor.busy = false;
            if released {
                actor.started_at = None;
            }
        }));
    }

    fn beat(&mut self, ctx: &mut Context<Self>) {
        if self.beating || self.dispatcher.shared.tracker.is_closing() {
            return;
        }
        self.beating = true;
        let dispatcher = self.dispatcher.clone();
        let beat = async move {
            if let Err(error) = dispatcher.shared.inbox.heartbeat().await {
                tracing::warn!(%error, "heartbeat failed; retrying");
            }
        };
        ctx.spawn(
            beat.into_actor(self)
                .map(|(), actor, _| actor.beating = false),
        );
    }
}

impl Actor for RecoveryActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.tick(ctx);
        ctx.run_interval(self.interval, Self::tick);
        if let Some(timeout) = self.dispatcher.shared.inbox.node_timeout()
            && timeout / 3 < self.interval
        {
            ctx.run_interval(timeout / 3, Self::beat);
        }
    }
}
