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
    /// Whether it heartbeats the claims' store: no recovery does (the claims kept apart from
    /// the inbox, or an inbox in memory), and that store takes over the claims of nodes
    /// whose heartbeat expired — those of every node, were none written.
    beats: bool,
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
        beats: bool,
    ) -> Self {
        Self {
            claims,
            clock,
            interval,
            batch,
            busy: false,
            timers,
            beats,
        }
    }

    fn beat(&mut self, ctx: &mut Context<Self>) {
        let claims = Arc::clone(&self.claims);
        let beat = async move {
            if let Err(error) = claims.keep_alive().await {
                tracing::warn!(%error, "the deduplication claims' heartbeat failed; retrying at the next");
            }
        };
        let busy = self.timers.busy();
        ctx.spawn(beat.into_actor(self).map(move |(), _, _| drop(busy)));
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let claims = Arc::clone(&self.claims);
        let now = self.clock.now();
        let batch = self.batch;
        // The nodes this reaper beats for, in a store no cleanup looks after.
        let node_timeout = self
            .claims
            .keep_alive_interval()
            .map(|every| every.saturating_mul(3));
        let forget_nodes = self
            .beats
            .then(|| crate::cleanup::nodes_silent_since(now, node_timeout));
        let round = async move {
            let (removed, error) = delete_in_batches(batch, |limit| claims.reap(now, limit)).await;
            if let Some(error) = error {
                tracing::warn!(%error, "reaping deduplication claims failed; retrying on the next round");
            }
            tracing::info!(removed, "reaped expired deduplication claims");
            if let Some(before) = forget_nodes
                && let Err(error) = claims.forget_silent_nodes(before).await
            {
                tracing::warn!(%error, "forgetting silent nodes failed; retrying on the next round");
            }
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
        if self.beats
            && let Some(every) = self.claims.keep_alive_interval()
        {
            self.beat(ctx);
            self.timers.every(every, ctx, Self::beat);
        }
    }
}
