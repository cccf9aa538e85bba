use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};

use crate::batches::delete_in_batches;
use crate::ports::{Claims, Clock};

/// Provisions the deduplication claims when the runtime starts, then deletes expired claims on
/// its own timer, in bounded batches, each in its own transaction, and logs how many it
/// removed: a count that keeps climbing says the window is too long or the volume higher than
/// planned.
pub struct ReaperActor {
    claims: Arc<dyn Claims>,
    clock: Arc<dyn Clock>,
    interval: Duration,
    batch: usize,
    /// The engine's timers, which its rounds run on.
    timers: crate::Timers,
    busy: bool,
}

impl std::fmt::Debug for ReaperActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaperActor")
            .field("interval", &self.interval)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl ReaperActor {
    pub(crate) fn new(
        claims: Arc<dyn Claims>,
        clock: Arc<dyn Clock>,
        interval: Duration,
        batch: usize,
        timers: crate::Timers,
    ) -> Self {
        Self {
            claims,
            clock,
            interval,
            batch,
            busy: false,
            timers,
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let claims = Arc::clone(&self.claims);
        let now = self.clock.now();
        let batch = self.batch;
        let round = async move {
            let (removed, error) = delete_in_batches(batch, |limit| claims.reap(now, limit)).await;
            if let Some(error) = error {
                tracing::warn!(%error, "reaping deduplication claims failed; retrying on the next round");
            }
            tracing::info!(removed, "reaped expired deduplication claims");
        };
        // The round holds a virtual clock until it is done: an `advance` past its tick returns
        // with the round's deletes made, and the next tick finds it finished.
        let busy = self.timers.busy();
        ctx.spawn(round.into_actor(self).map(move |(), actor, _| {
            actor.busy = false;
            drop(busy);
        }));
    }
}

impl Actor for ReaperActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let claims = Arc::clone(&self.claims);
        let provision = async move {
            if let Err(error) = claims.provision().await {
                tracing::error!(%error, "deduplication claims could not be provisioned; deduplicated handlers will fail");
            }
        };
        ctx.spawn(provision.into_actor(self));
        self.timers.every(self.interval, ctx, Self::tick);
    }
}
