use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};

use crate::batches::delete_in_batches;
use crate::ports::{Clock, DurableInbox};

/// Removes handled envelopes, and idempotency keys, once their retention is over, in bounded
/// batches, on its own timer, and logs how many it removed.
pub struct CleanupActor {
    inbox: Arc<dyn DurableInbox>,
    clock: Arc<dyn Clock>,
    keep_after_handling: Duration,
    key_retention: Duration,
    interval: Duration,
    batch: usize,
    /// The engine's timers, which its rounds run on.
    timers: crate::Timers,
    busy: bool,
}

impl std::fmt::Debug for CleanupActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CleanupActor")
            .field("keep_after_handling", &self.keep_after_handling)
            .field("interval", &self.interval)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl CleanupActor {
    pub(crate) fn new(
        inbox: Arc<dyn DurableInbox>,
        clock: Arc<dyn Clock>,
        keep_after_handling: Duration,
        key_retention: Duration,
        interval: Duration,
        batch: usize,
        timers: crate::Timers,
    ) -> Self {
        Self {
            inbox,
            clock,
            keep_after_handling,
            key_retention,
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
        let inbox = Arc::clone(&self.inbox);
        let now = self.clock.now();
        let (handled_before, keys_before) = (
            earlier(now, self.keep_after_handling),
            earlier(now, self.key_retention),
        );
        let nodes_before = nodes_silent_since(now, inbox.node_timeout());
        let batch = self.batch;
        let round = async move {
            let (removed, error) = delete_in_batches(batch, |limit| {
                inbox.delete_handled_before(handled_before, limit)
            })
            .await;
            if let Some(error) = error {
                tracing::warn!(%error, "inbox cleanup failed; retrying on the next round");
            }
            if removed > 0 {
                tracing::info!(removed, "removed handled envelopes past their retention");
            }
            let (removed, error) = delete_in_batches(batch, |limit| {
                inbox.delete_idempotency_keys_before(keys_before, limit)
            })
            .await;
            if let Some(error) = error {
                tracing::warn!(%error, "idempotency key cleanup failed; retrying on the next round");
            }
            if removed > 0 {
                tracing::info!(removed, "removed idempotency keys past their retention");
            }
            match inbox.forget_nodes_before(nodes_before).await {
                Ok(0) => {}
                Ok(forgotten) => {
                    tracing::info!(forgotten, "forgot nodes silent for a day");
                }
                Err(error) => {
                    tracing::warn!(%error, "forgetting silent nodes failed; retrying on the next round");
                }
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

/// How long a node stays known after its last heartbeat.
const NODES_FORGOTTEN_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Before when a node's last heartbeat makes it forgotten, for a store whose nodes time out
/// after `node_timeout`: a day, or twice `node_timeout` if that is longer — long past any node
/// timeout, such a node is stopped whether its row is there or not.
#[must_use]
pub fn nodes_silent_since(
    now: chrono::DateTime<chrono::Utc>,
    node_timeout: Duration,
) -> chrono::DateTime<chrono::Utc> {
    earlier(
        now,
        NODES_FORGOTTEN_AFTER.max(node_timeout.saturating_mul(2)),
    )
}

/// `ago` before `now`, saturating at the calendar's start.
fn earlier(now: chrono::DateTime<chrono::Utc>, ago: Duration) -> chrono::DateTime<chrono::Utc> {
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| now.checked_sub_signed(ago))
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
}

impl Actor for CleanupActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.timers.every(self.interval, ctx, Self::tick);
    }
}
