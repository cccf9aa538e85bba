use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};

use crate::batches::delete_in_batches;
use crate::ports::{Claims, Clock};
use crate::recovery::Heartbeats;

/// Provisions the deduplication claims when the runtime starts, then deletes expired claims on
/// its own timer, in bounded batches, each in its own transaction, and logs how many it
/// removed: a count that keeps climbing says the window is too long or the volume higher than
/// planned.
pub struct ReaperActor {
    claims: Arc<dyn Claims>,
    clock: Arc<dyn Clock>,
    heartbeats: Arc<Heartbeats>,
    interval: Duration,
    batch: usize,
    /// The engine's timers, which its rounds run on.
    timers: crate::Timers,
    busy: bool,
    /// A heartbeat is under way: the next waits for it, as a store that hangs must not pile
    /// them up.
    beating: bool,
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
        heartbeats: Arc<Heartbeats>,
        interval: Duration,
        batch: usize,
        timers: crate::Timers,
        beats: bool,
    ) -> Self {
        Self {
            claims,
            clock,
            heartbeats,
            interval,
            batch,
            busy: false,
            beating: false,
            timers,
            beats,
        }
    }

    fn beat(&mut self, ctx: &mut Context<Self>) {
        if self.beating {
            return;
        }
        self.beating = true;
        let claims = Arc::clone(&self.claims);
        let heartbeats = Arc::clone(&self.heartbeats);
        let beat = async move {
            let written = heartbeats.beat(claims.keep_alive()).await;
            if let Some(Err(error)) = written {
                tracing::warn!(%error, "the deduplication claims' heartbeat failed; retrying at the next");
            }
        };
        let busy = self.timers.busy();
        ctx.spawn(beat.into_actor(self).map(move |(), actor, _| {
            actor.beating = false;
            drop(busy);
        }));
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let claims = Arc::clone(&self.claims);
        let now = self.clock.now();
        let batch = self.batch;
        // The nodes this reaper beats for live in a store no cleanup looks after.
        let forget_nodes = self.beats;
        let round = async move {
            let (removed, error) = delete_in_batches(batch, |limit| claims.reap(now, limit)).await;
            if let Some(error) = error {
                tracing::warn!(%error, "reaping deduplication claims failed; retrying on the next round");
            }
            tracing::info!(removed, "reaped expired deduplication claims");
            if forget_nodes && let Err(error) = claims.forget_silent_nodes().await {
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
            // A store whose node timeout is zero would otherwise beat in a loop.
            let every = every.max(std::time::Duration::from_millis(1));
            self.timers.every(every, ctx, Self::beat);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use actix::Actor;
    use async_trait::async_trait;

    use super::*;
    use crate::Error;

    /// Claims whose heartbeat is due every `every`, counting each, and never answering when
    /// `hangs`.
    struct Beating {
        every: Duration,
        hangs: bool,
        beats: Arc<AtomicUsize>,
    }

    #[async_trait]
    impl Claims for Beating {
        async fn provision(&self) -> Result<(), Error> {
            Ok(())
        }
        fn keep_alive_interval(&self) -> Option<Duration> {
            Some(self.every)
        }
        async fn keep_alive(&self) -> Result<(), Error> {
            self.beats.fetch_add(1, Ordering::SeqCst);
            if self.hangs {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }

    /// How many beats `claims` got in 200 ms of a reaper that beats for them.
    fn beats_in_200_ms(every: Duration, hangs: bool) -> usize {
        let beats = Arc::new(AtomicUsize::new(0));
        let claims = Beating {
            every,
            hangs,
            beats: Arc::clone(&beats),
        };
        actix::System::new().block_on(async {
            let _reaper = ReaperActor::new(
                Arc::new(claims),
                Arc::new(crate::ports::SystemClock),
                Arc::default(),
                Duration::from_secs(3600),
                10,
                crate::Timers::Real,
                true,
            )
            .start();
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        beats.load(Ordering::SeqCst)
    }

    #[test]
    fn a_heartbeat_that_hangs_is_not_joined_by_more() {
        assert_eq!(beats_in_200_ms(Duration::from_millis(10), true), 1);
    }

    #[test]
    fn a_node_timeout_of_zero_beats_once_a_millisecond_at_most() {
        let beats = beats_in_200_ms(Duration::ZERO, false);
        assert!((1..=201).contains(&beats), "{beats} beats in 200 ms");
    }
}
