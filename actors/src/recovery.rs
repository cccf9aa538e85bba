use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};

use std::sync::Arc;

use crate::Dispatcher;
use crate::ports::DurableInbox;

/// How soon a claim cut short by a full engine continues.
const CONTINUE_AFTER: Duration = Duration::from_millis(50);

/// How soon a node's first round, refused by the store, is tried again: the pause doubles
/// each time, up to the recovery interval.
const FIRST_ROUND_RETRY: Duration = Duration::from_millis(100);

/// What a round did.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    /// It took back what a previous run under this node's name left.
    released: bool,
    /// It stopped claiming because the engine had no free slot.
    limited: bool,
    /// The store refused a step (the release, the heartbeat, a claim): what the store holds
    /// may not all be resumed yet.
    failed: bool,
}

impl Round {
    /// A round the store refused, before or after its release.
    fn failed(released: bool) -> Self {
        Self {
            released,
            limited: false,
            failed: true,
        }
    }
}

/// Resumes this node's own unsettled rows that nothing in the process runs: an accept whose
/// commit succeeded although its caller saw an error, a cancelled publish. Only rows older
/// than the node timeout are looked at, and a delivery received but not started yet (waiting
/// for room, or for its worker) is listed as starting, so it is never taken for an orphan.
async fn resume_orphaned(dispatcher: &Dispatcher, inbox: &dyn DurableInbox, batch: usize) {
    let shared = &dispatcher.shared;
    let timeout = inbox.node_timeout();
    let before = chrono::Duration::from_std(timeout)
        .ok()
        .and_then(|timeout| shared.clock.now().checked_sub_signed(timeout))
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
    let slots = shared.capacity.take_free(batch);
    if slots.is_empty() {
        return;
    }
    let running = running_or_received_here(dispatcher);
    match inbox.orphaned(before, &running, slots.len()).await {
        Ok(orphans) => {
            if !orphans.is_empty() {
                tracing::info!(
                    resumed = orphans.len(),
                    "resumed this node's own deliveries that nothing was running"
                );
            }
            for (orphan, slot) in orphans.into_iter().zip(slots) {
                dispatcher.resume_on(orphan, slot);
            }
        }
        Err(error) => tracing::warn!(%error, "looking for orphaned deliveries failed"),
    }
}

/// What this node knows of its own heartbeat. After a gap in it longer than two thirds of the
/// node timeout (the store unreachable, the process paused), the other nodes' heartbeats may
/// have lapsed through no death of theirs — an outage stops theirs too, and theirs may have
/// been a beat older than its own when it began — so it claims none of their rows until they
/// have had a node timeout to beat again.
#[derive(Debug, Default)]
struct Liveness {
    /// When its last heartbeat was written.
    last_beat: Option<chrono::DateTime<chrono::Utc>>,
    /// A heartbeat failed since.
    failed: bool,
    /// Claims wait until then.
    claims_from: Option<chrono::DateTime<chrono::Utc>>,
}

impl Liveness {
    /// Notes a heartbeat written (`ok`) or failed at `now`.
    fn beat(&mut self, ok: bool, now: chrono::DateTime<chrono::Utc>, timeout: Duration) {
        if !ok {
            self.failed = true;
            return;
        }
        let timeout = chrono::Duration::from_std(timeout).unwrap_or(chrono::TimeDelta::MAX);
        // Another node's last beat may be up to a beat's interval (a third of the timeout)
        // older than this node's was when the outage began: a gap of two thirds of the timeout
        // may have let theirs lapse.
        let interrupted_after = timeout - timeout / 3;
        let gap = self
            .last_beat
            .and_then(|last| {
                now.signed_duration_since(last)
                    .checked_sub(&interrupted_after)
            })
            .is_some_and(|over| over > chrono::TimeDelta::zero());
        if self.failed || gap {
            tracing::warn!(
                "this node's heartbeat was interrupted: it claims no other node's deliveries for a node timeout, while theirs catch up"
            );
            self.claims_from = Some(
                now.checked_add_signed(timeout)
                    .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC),
            );
        }
        self.failed = false;
        self.last_beat = Some(now);
    }

    /// Whether other nodes' rows may be claimed at `now`: not while a heartbeat failed since
    /// the last one written, nor once that one is older than the node timeout (a round that
    /// writes none, continuing a claim, may come long after it), nor before `claims_from`.
    fn may_claim(&self, now: chrono::DateTime<chrono::Utc>, timeout: Duration) -> bool {
        let timeout = chrono::Duration::from_std(timeout).unwrap_or(chrono::TimeDelta::MAX);
        let fresh = self.last_beat.is_none_or(|last| {
            now.signed_duration_since(last)
                .checked_sub(&timeout)
                .is_none_or(|over| over <= chrono::TimeDelta::zero())
        });
        !self.failed && fresh && self.claims_from.is_none_or(|from| now >= from)
    }
}

/// A [`Liveness`] shared by the rounds and the heartbeat's timer.
type SharedLiveness = Arc<std::sync::Mutex<Liveness>>;

/// Where a node's heartbeats end: they go on through a shutdown's drain, since a node whose
/// heartbeat lapses while its handlers still run has its deliveries and claims taken over by
/// another, and stop before the shutdown releases the node, since a beat written after that
/// makes the stopped node look alive for a node timeout.
#[derive(Debug, Default)]
pub(crate) struct Heartbeats {
    over: std::sync::atomic::AtomicBool,
    /// Held, shared, by each beat for as long as it writes, so that the end can wait for the
    /// beats under way; one store that hangs holds up no other's beats.
    writing: tokio::sync::RwLock<()>,
}

impl Heartbeats {
    /// Runs `beat` unless the heartbeats ended: its output, or `None`.
    pub(crate) async fn beat<T>(&self, beat: impl std::future::Future<Output = T>) -> Option<T> {
        let _writing = self.writing.read().await;
        if self.over.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        Some(beat.await)
    }

    /// Ends them, then waits for the beats under way to be written.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped while it waits, the heartbeats are ended all the same, and only
    /// a beat already under way may still be written.
    pub(crate) async fn end(&self) {
        self.over.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(self.writing.write().await);
    }
}

/// Writes this node's heartbeat and notes it in `liveness`; whether it was written.
async fn heartbeat(
    inbox: &dyn DurableInbox,
    liveness: &SharedLiveness,
    clock: &dyn crate::ports::Clock,
) -> bool {
    let written = inbox.heartbeat().await;
    if let Err(error) = &written {
        tracing::warn!(%error, "heartbeat failed; retrying");
    }
    liveness
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .beat(written.is_ok(), clock.now(), inbox.node_timeout());
    written.is_ok()
}

/// The deliveries this node runs: starting, running or cooling down.
fn running_here(dispatcher: &Dispatcher) -> std::collections::HashSet<uuid::Uuid> {
    let shared = &dispatcher.shared;
    // `starting` first: a supervisor moves from it to the tracker (listed there before it
    // leaves `starting`), so read in this order it is in one set or the other, never neither.
    let mut running = listed(&shared.starting);
    running.extend(shared.tracker.supervised());
    running
}

/// The deliveries this node runs, and the envelopes whose write as this node's is under way:
/// what its own unsettled rows may belong to without being orphans.
fn running_or_received_here(dispatcher: &Dispatcher) -> std::collections::HashSet<uuid::Uuid> {
    // `receiving` first, for the same reason: a new delivery is listed as starting before it
    // leaves `receiving`.
    let mut running = listed(&dispatcher.shared.receiving);
    running.extend(running_here(dispatcher));
    running
}

fn listed(
    counted: &std::sync::Mutex<std::collections::HashMap<uuid::Uuid, usize>>,
) -> std::collections::HashSet<uuid::Uuid> {
    counted
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .keys()
        .copied()
        .collect()
}

/// Keeps this node's heartbeat, and resumes the deliveries a stopped runtime left unsettled in
/// a durable inbox: at start, then on its own timer (to take over from nodes that died).
///
/// The heartbeat also has a timer of its own, a third of the store's node timeout: a live node
/// is never taken for dead because its recovery rounds are far apart, or one of them is slow.
pub struct RecoveryActor {
    dispatcher: Dispatcher,
    inbox: Arc<dyn DurableInbox>,
    interval: Duration,
    batch: usize,
    busy: bool,
    beating: bool,
    liveness: SharedLiveness,
    /// When this run started, until its first round took back what a previous run under the
    /// same node name left unsettled.
    started_at: Option<chrono::DateTime<chrono::Utc>>,
    /// How soon a first round the store refused is tried again: `first_recovery` waits for
    /// one that got through, and should not wait a whole interval for it.
    first_retry: Duration,
}

impl std::fmt::Debug for RecoveryActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryActor")
            .field("interval", &self.interval)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl RecoveryActor {
    pub(crate) fn new(
        dispatcher: Dispatcher,
        inbox: Arc<dyn DurableInbox>,
        interval: Duration,
        batch: usize,
    ) -> Self {
        let started_at = Some(dispatcher.shared.clock.now());
        Self {
            dispatcher,
            inbox,
            interval,
            batch: batch.max(1),
            busy: false,
            beating: false,
            liveness: SharedLiveness::default(),
            started_at,
            first_retry: FIRST_ROUND_RETRY,
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        self.round(true, ctx);
    }

    /// One recovery round. A full round heartbeats, resumes this node's own orphaned rows and
    /// claims others'; a round that only continues a claim cut short by capacity just claims.
    ///
    /// A round claims no more than the engine has free slots for, and hands each claimed
    /// delivery its slot: a large orphaned backlog is taken a capacity's worth at a time, the
    /// rest staying in the store for later rounds or other live nodes, so memory stays flat.
    fn round(&mut self, full: bool, ctx: &mut Context<Self>) {
        // A slow store must not stack up rounds; a closing runtime must not take back what its
        // shutdown is releasing.
        if self.busy || self.dispatcher.shared.tracker.is_closing() {
            return;
        }
        self.busy = true;
        let dispatcher = self.dispatcher.clone();
        let inbox = Arc::clone(&self.inbox);
        let (batch, interval) = (self.batch, self.interval);
        let started_at = self.started_at;
        let liveness = Arc::clone(&self.liveness);
        // The round holds a virtual clock until it has handed over what it resumed: advancing
        // past its tick must not outrun it.
        let busy = dispatcher.shared.timers.busy();
        let round = async move {
            let _busy = busy;
            let _recovering = dispatcher.shared.recovering.lock().await;
            let shared = &dispatcher.shared;
            if shared.tracker.is_closing() {
                return Round::default();
            }
            if let Some(started_at) = started_at
                && let Err(error) = inbox.release_before(started_at).await
            {
                tracing::warn!(%error, "could not take back an earlier run's deliveries; retrying");
                return Round::failed(false);
            }
            if full {
                // Without a fresh heartbeat this node could look dead to itself: claim nothing.
                // Gated like the timer's beats: a round the shutdown stopped waiting for must
                // not make the released node look alive.
                let beat = heartbeat(&*inbox, &liveness, shared.clock.as_ref());
                if shared.heartbeats.beat(beat).await != Some(true) {
                    return Round::failed(true);
                }
                resume_orphaned(&dispatcher, &*inbox, batch).await;
            }
            let mut resumed = 0usize;
            let (mut limited, mut failed) = (false, false);
            while !shared.tracker.is_closing() {
                // Rows no node owns (released, scheduled) are claimed whatever this node's
                // heartbeat; others' only while it is fresh, asked again before each claim (the
                // last one may have waited out an outage).
                let lapsed = liveness
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .may_claim(shared.clock.now(), inbox.node_timeout());
                let slots = shared.capacity.take_free(batch);
                if slots.is_empty() {
                    limited = true;
                    break;
                }
                let wanted = slots.len();
                // What falls due before the next round is claimed now and waits on the timer,
                // so a scheduled envelope runs on time, not up to an interval late.
                let due_before = chrono::Duration::from_std(interval)
                    .ok()
                    .and_then(|interval| shared.clock.now().checked_add_signed(interval))
                    .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
                match inbox.recover(wanted, due_before, lapsed).await {
                    Ok(mut deliveries) => {
                        let count = deliveries.len();
                        // Claimed back from a node that claimed them while this one was taken
                        // for dead (paused past its heartbeat), then died: the supervisor still
                        // running one here goes on with it, and a second would run it again.
                        let running = running_here(&dispatcher);
                        deliveries.retain(|delivery| {
                            let here = running.contains(&delivery.envelope.id);
                            if here {
                                tracing::warn!(messaging.message.id = %delivery.envelope.id, "claimed back a delivery this node still runs (another node took it while this one was taken for dead); left to the supervisor it has here");
                            }
                            !here
                        });
                        shared
                            .timers
                            .shuffle(&mut deliveries, |delivery| delivery.envelope.id);
                        resumed += deliveries.len();
                        for (delivery, slot) in deliveries.into_iter().zip(slots) {
                            dispatcher.resume_on(delivery, slot);
                        }
                        if count < wanted {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "recovery failed; retrying on the next round");
                        failed = true;
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
            Round {
                released: true,
                limited,
                failed,
            }
        };
        ctx.spawn(round.into_actor(self).map(|round, actor, ctx| {
            actor.busy = false;
            // A round the engine's capacity cut short goes on shortly: what the store held is
            // only all resumed once a round ends without that limit, and without a refusal
            // (the next round tries again).
            let shared = &actor.dispatcher.shared;
            if !round.limited && !round.failed {
                shared.recovery_rounds.send_modify(|rounds| *rounds += 1);
            } else if round.failed && *shared.recovery_rounds.borrow() == 0 {
                let pause = actor.first_retry;
                actor.first_retry = pause
                    .saturating_mul(2)
                    .min(actor.interval.max(FIRST_ROUND_RETRY));
                ctx.run_later(pause, |actor, ctx| actor.round(true, ctx));
            }
            if round.released {
                actor.started_at = None;
            }
            if round.limited {
                // The engine was full: claim the rest as soon as slots free up, not a whole
                // interval later.
                ctx.run_later(CONTINUE_AFTER, |actor, ctx| actor.round(false, ctx));
            }
        }));
    }

    fn beat(&mut self, ctx: &mut Context<Self>) {
        if self.beating {
            return;
        }
        self.beating = true;
        let inbox = Arc::clone(&self.inbox);
        let liveness = Arc::clone(&self.liveness);
        let shared = Arc::clone(&self.dispatcher.shared);
        let beat = async move {
            let beat = heartbeat(&*inbox, &liveness, shared.clock.as_ref());
            shared.heartbeats.beat(beat).await;
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
        let timers = self.dispatcher.shared.timers.clone();
        timers.every(self.interval, ctx, Self::tick);
        // Whatever the rounds do: a round that runs long (a slow claim, the store's lock held
        // by another process) skips the ticks that come meanwhile, and its heartbeat with them.
        // A millisecond at least: a timer of zero would beat without pause.
        let beat = (self.inbox.node_timeout() / 3).max(Duration::from_millis(1));
        timers.every(beat, ctx, Self::beat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    fn at(seconds: i64) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::<chrono::Utc>::UNIX_EPOCH + chrono::Duration::seconds(seconds)
    }

    #[test]
    fn a_gap_of_two_thirds_of_the_timeout_holds_claims_back() {
        // Another node beat last 8 s before this one's outage of 25 s began: by now its beat
        // is 33 s old, though it beats again as soon as the store is back.
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        liveness.beat(true, at(25), TIMEOUT);
        assert!(!liveness.may_claim(at(25), TIMEOUT));
        assert!(liveness.may_claim(at(55), TIMEOUT));
        // A gap of a beat's interval and a little more is no outage.
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        liveness.beat(true, at(19), TIMEOUT);
        assert!(liveness.may_claim(at(19), TIMEOUT));
    }

    #[test]
    fn heartbeats_within_the_node_timeout_leave_claims_free() {
        let mut liveness = Liveness::default();
        for second in [0, 10, 20, 30, 40] {
            liveness.beat(true, at(second), TIMEOUT);
            assert!(liveness.may_claim(at(second), TIMEOUT));
        }
    }

    #[test]
    fn a_failed_heartbeat_holds_claims_back_a_node_timeout_after_the_next_one_written() {
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        liveness.beat(false, at(10), TIMEOUT);
        // Not written: the round claims nothing anyway.
        liveness.beat(true, at(12), TIMEOUT);
        assert!(!liveness.may_claim(at(12), TIMEOUT));
        assert!(!liveness.may_claim(at(41), TIMEOUT));
        assert!(liveness.may_claim(at(42), TIMEOUT));
        // Beats on time after that hold nothing back again.
        for second in [22, 32, 42] {
            liveness.beat(true, at(second), TIMEOUT);
        }
        assert!(liveness.may_claim(at(42), TIMEOUT));
    }

    #[test]
    fn no_claims_while_a_heartbeat_failed_nor_once_the_last_one_is_older_than_the_timeout() {
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        // A round that continues a claim writes no heartbeat: the last one is what it has.
        assert!(liveness.may_claim(at(30), TIMEOUT));
        assert!(!liveness.may_claim(at(31), TIMEOUT));
        liveness.beat(false, at(10), TIMEOUT);
        assert!(!liveness.may_claim(at(11), TIMEOUT));
    }

    #[test]
    fn a_gap_longer_than_the_node_timeout_holds_claims_back() {
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        // The process paused for a minute: no beat failed, none was written.
        liveness.beat(true, at(60), TIMEOUT);
        assert!(!liveness.may_claim(at(60), TIMEOUT));
        assert!(liveness.may_claim(at(90), TIMEOUT));
    }

    #[test]
    fn the_first_heartbeat_claims_at_once_unless_one_failed_before_it() {
        let mut liveness = Liveness::default();
        liveness.beat(true, at(0), TIMEOUT);
        assert!(liveness.may_claim(at(0), TIMEOUT));
        let mut liveness = Liveness::default();
        liveness.beat(false, at(0), TIMEOUT);
        liveness.beat(true, at(5), TIMEOUT);
        assert!(!liveness.may_claim(at(5), TIMEOUT));
        assert!(liveness.may_claim(at(35), TIMEOUT));
    }

    #[test]
    fn a_node_timeout_too_long_to_add_holds_claims_back_for_good() {
        let mut liveness = Liveness::default();
        liveness.beat(false, at(0), Duration::MAX);
        liveness.beat(true, at(1), Duration::MAX);
        assert!(!liveness.may_claim(at(1_000_000), Duration::MAX));
    }
}
