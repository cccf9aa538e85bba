use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use actix::{Actor, Addr, ArbiterHandle};
use tokio::sync::oneshot;

use crate::capacity::Capacity;

use crate::ports::{Claims, Clock, Inbox, Receipt, Resumable};
use crate::report::DiscardReason;
use crate::stats::Counter;
use crate::tracker::Tracker;
use crate::{
    DeliveryReport, DeliverySupervisor, Envelope, Error, Outcome, Registry, RetryScope, Stats,
    TimerActor,
};

/// What to do with a message of a type no handler handles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnknownMessageTypes {
    /// Dead-letter it with the reason `no handler for TYPE` (the default).
    #[default]
    DeadLetter,
    /// Discard it and log a warning.
    Discard,
}

/// Everything the engine's actors share.
pub(crate) struct Shared {
    /// The inbox as a durable one, when it is (its rows are released at shutdown).
    pub(crate) durable: Option<Arc<dyn crate::ports::DurableInbox>>,
    pub(crate) clock: Arc<dyn Clock>,
    /// The engine's own timers (virtual under the test harness).
    pub(crate) timers: crate::Timers,
    /// Told of every settled delivery's report (the test harness's record).
    pub(crate) reports: Option<crate::engine::ReportSink>,
    pub(crate) timer: Addr<TimerActor>,
    pub(crate) tracker: Tracker,
    /// One set of counters per worker, then one for dispatching.
    pub(crate) stats: Arc<Stats>,
    pub(crate) capacity: Arc<Capacity>,
    pub(crate) next_worker: AtomicUsize,
    pub(crate) max_envelope_size: usize,
    pub(crate) unknown_message_types: UnknownMessageTypes,
    pub(crate) retry_scope: RetryScope,
    /// Wakes the outbox relay when a delivery wrote cascaded messages to the outbox.
    pub(crate) outbox_enlisted: tokio::sync::Notify,
    /// Held by a recovery round while it claims; a shutdown takes it before releasing this
    /// node's rows, so that no round still in flight claims them again behind the release.
    pub(crate) recovering: tokio::sync::Mutex<()>,
    /// This node's heartbeats, to its durable store and to a claims store apart: a shutdown
    /// ends them before it releases the node.
    pub(crate) heartbeats: Arc<crate::recovery::Heartbeats>,
    /// Set once a shutdown's drain is over: cascades that get room from then on do not start.
    pub(crate) drain_over: std::sync::atomic::AtomicBool,
    /// Told once `drain_over` is set.
    pub(crate) drain_ends: tokio::sync::Notify,
    /// Persisted batches whose deliveries wait for room, on their callers' tasks: a shutdown
    /// waits for them to hand back what did not start before it reports.
    pub(crate) batches_waiting: BatchesWaiting,
    /// Cascaded messages whose delivery never started, the engine stopping while they waited
    /// for room: handed back in the shutdown report.
    pub(crate) unstarted_cascades: std::sync::Mutex<Vec<Envelope>>,
    /// Resumed deliveries (a replayed dead letter) that a shutdown found waiting for room, and
    /// deliveries that got their room only after its drain: handed back in the shutdown report,
    /// as due now.
    pub(crate) unstarted_resumes: std::sync::Mutex<Vec<crate::PendingRetry>>,
    /// Among those, the received ones whose first attempt (counted by their receive) never
    /// ran: the shutdown takes that attempt back before it releases them.
    pub(crate) unstarted_fresh: std::sync::Mutex<Vec<uuid::Uuid>>,
    /// The runtime's store, which handlers may open transactions on.
    pub(crate) store: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Whether the deduplication claims live in that store.
    pub(crate) claims_in_store: bool,
    /// Deliveries recorded as this node's whose supervisor has not started yet (recovered,
    /// replayed, or received and waiting for room or for their worker): running, for the
    /// orphan sweep and for recovery, though the tracker does not list them yet. Counted per
    /// id: a replay's resume may overlap a batch's wait.
    pub(crate) starting: std::sync::Mutex<std::collections::HashMap<uuid::Uuid, usize>>,
    /// Envelopes whose write as this node's is under way (a receive, a replay), from before
    /// the write — whose commit can wait longer than the node timeout — until their delivery
    /// is listed as starting, or turned out to start none: kept off the orphan sweep, which
    /// would take the row for one nothing runs. Not off recovery: a row it claims existed
    /// before (released, or a dead node's), so such a receive finds a duplicate, and the
    /// claim is what runs it. Counted per id: two receives of one envelope may overlap, and
    /// the duplicate's end must not unlist the other.
    pub(crate) receiving: std::sync::Mutex<std::collections::HashMap<uuid::Uuid, usize>>,
    /// The outbox the relay publishes from, if any: cascades that cannot wait for their
    /// delivery to settle are enlisted there on their own.
    pub(crate) outbox: Option<Arc<dyn crate::ports::OutboxStore>>,
    /// The brokers the relay sends to: a type they carry has a route without a handler here.
    pub(crate) outbound: Option<Arc<dyn crate::ports::Outbound>>,
    /// Where a test crashes the engine.
    pub(crate) failpoints: Option<Arc<crate::Failpoints>>,
    /// Recovery rounds finished so far.
    pub(crate) recovery_rounds: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    /// Lists a delivery as starting, until its supervisor starts. Only a durable inbox has
    /// an orphan sweep to keep off it.
    pub(crate) fn list_starting(&self, id: uuid::Uuid) {
        if self.durable.is_some() {
            count_in(&self.starting, id);
        }
    }

    /// Lists `ids` as being received until the returned guard is dropped. Only a durable
    /// inbox has an orphan sweep to keep off them.
    fn receiving(self: &Arc<Self>, ids: Vec<uuid::Uuid>) -> Receiving {
        if self.durable.is_none() {
            return Receiving {
                shared: None,
                ids: Vec::new(),
            };
        }
        for id in &ids {
            count_in(&self.receiving, *id);
        }
        Receiving {
            shared: Some(Arc::clone(self)),
            ids,
        }
    }

    /// Returns once a shutdown's drain is over.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub(crate) async fn drain_ended(&self) {
        crate::told::until(&self.drain_ends, || {
            self.drain_over.load(std::sync::atomic::Ordering::SeqCst)
        })
        .await;
    }

    /// Takes a delivery off the starting list: its supervisor started, or never will here.
    pub(crate) fn unlist_starting(&self, id: uuid::Uuid) {
        if self.durable.is_some() {
            count_out(&self.starting, id);
        }
    }

    /// Whether the engine crashes at `point` (or crashed before): the caller stops there.
    pub(crate) fn crashes_at(&self, point: crate::Failpoint, message_type: &str) -> bool {
        self.failpoints
            .as_ref()
            .is_some_and(|failpoints| failpoints.reached(point, Some(message_type)))
    }

    /// Passes `point`, or never returns if the engine crashes there.
    pub(crate) async fn pass(&self, point: crate::Failpoint, message_type: Option<&str>) {
        if let Some(failpoints) = &self.failpoints {
            failpoints.pass(point, message_type).await;
        }
    }

    /// Whether anyone is told of a report: the caller that asked, or the report sink.
    pub(crate) fn wants_report(&self, reply: Option<&oneshot::Sender<DeliveryReport>>) -> bool {
        reply.is_some() || self.reports.is_some()
    }

    /// Tells the report sink and the caller that asked.
    pub(crate) fn report(
        &self,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        report: DeliveryReport,
    ) {
        if let Some(sink) = &self.reports {
            (sink.0)(&report);
        }
        if let Some(reply) = reply {
            let _ = reply.send(report);
        }
    }
}

/// A delivery counted in by the tracker and not yet handed to a supervisor. Dropped — the
/// dispatch failed, found a duplicate, or was cancelled — it is counted out again, so a
/// shutdown or `idle` never waits for it.
struct Admission<'a>(&'a Tracker);

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Cascaded messages admitted and not yet taken up by their delivery. Dropped with them — its
/// task refused by an arbiter that stopped, or dropped unfinished as it stops — it hands them
/// back for the shutdown's report and counts them out, so that nothing waits for them. (The
/// one being delivered, `current`, counts itself out if dropped; once its supervisor is on its
/// way, the supervisor accounts for it.)
struct Unstarted {
    worker: Arc<Worker>,
    envelopes: std::collections::VecDeque<Envelope>,
    current: Option<Envelope>,
}

impl Drop for Unstarted {
    fn drop(&mut self) {
        if self.envelopes.is_empty() && self.current.is_none() {
            return;
        }
        let ids: Vec<_> = self
            .current
            .iter()
            .chain(&self.envelopes)
            .map(|envelope| envelope.id)
            .collect();
        tracing::warn!(
            message_ids = ?ids,
            "cascaded messages not started as the runtime stopped: handed back in the shutdown report"
        );
        for _ in &self.envelopes {
            drop(Admission(&self.worker.shared.tracker));
        }
        let current = self.current.take();
        let waiting = std::mem::take(&mut self.envelopes);
        self.worker
            .shared
            .unstarted_cascades
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(current.into_iter().chain(waiting));
    }
}

type Counted = std::sync::Mutex<std::collections::HashMap<uuid::Uuid, usize>>;

fn count_in(listed: &Counted, id: uuid::Uuid) {
    *listed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(id)
        .or_default() += 1;
}

fn count_out(listed: &Counted, id: uuid::Uuid) {
    let mut listed = listed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let std::collections::hash_map::Entry::Occupied(mut count) = listed.entry(id) {
        *count.get_mut() -= 1;
        if *count.get() == 0 {
            count.remove();
        }
    }
}

/// Envelopes listed as being received, from before their write as this node's (a receive, a
/// replay): this node's orphan sweep leaves their rows alone, however long the commit waited,
/// until the guard is dropped — once a delivery that starts is listed as starting, or the
/// envelope turned out a duplicate, scheduled, refused, or its caller gave up (a row
/// committed all the same is then the sweep's).
#[must_use = "the envelopes are listed only while the guard lives"]
pub struct Receiving {
    shared: Option<Arc<Shared>>,
    ids: Vec<uuid::Uuid>,
}

impl std::fmt::Debug for Receiving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiving").field("ids", &self.ids).finish()
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            for id in &self.ids {
                count_out(&shared.receiving, *id);
            }
        }
    }
}

/// An envelope on its way to its supervisor's worker. Dropped before it starts — the worker
/// stopped first — a cascade's goes to the shutdown's report.
struct Queued {
    envelope: Option<Envelope>,
    hand_back: Option<Arc<Shared>>,
}

impl Queued {
    fn start(mut self) -> Envelope {
        self.hand_back = None;
        self.envelope
            .take()
            .unwrap_or_else(|| Envelope::new("", Vec::new()))
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let (Some(envelope), Some(shared)) = (self.envelope.take(), self.hand_back.take()) {
            tracing::warn!(messaging.message.id = %envelope.id, "a cascaded message not started as the runtime stopped: handed back in the shutdown report");
            shared
                .unstarted_cascades
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(envelope);
        }
    }
}

/// One worker thread (an arbiter) and its own handles on the routes and the stores.
///
/// A delivery's supervisor holds its worker, not the engine: the reference counts it touches
/// are then only touched by that worker and by whoever dispatches to it, never by the other
/// workers.
pub(crate) struct Worker {
    pub(crate) index: usize,
    pub(crate) shared: Arc<Shared>,
    pub(crate) arbiter: ArbiterHandle,
    pub(crate) registry: Registry,
    pub(crate) inbox: Arc<dyn Inbox>,
    /// Publisher-side sources of logical ids, for cascaded messages.
    pub(crate) rules: crate::DeduplicationRules,
    /// Logical deduplication claims, when the runtime enabled them.
    pub(crate) claims: Option<Arc<dyn Claims>>,
    pub(crate) deduplication_window: std::time::Duration,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("index", &self.index)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Asks the inbox, waits for capacity, and starts a supervisor on this worker.
    ///
    /// `held` is a caller's token on the virtual clock: given up if the delivery must wait for
    /// capacity, which only time (a cooldown ending) may free.
    ///
    /// A caller's envelope (`from_caller`) still waiting for capacity when the engine begins
    /// to close is handed back with [`Error::ShuttingDown`], nothing of it recorded: the slots
    /// may be held by retries cooling down, which only the end of the shutdown frees, and it
    /// would then start on a worker that has stopped. A cascaded one waits: its parent is
    /// settled already; but once the drain is over, it too is handed back (the slot it got
    /// may be one the engine's stop freed).
    async fn deliver(
        self: &Arc<Self>,
        admission: Admission<'_>,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        held: &mut Option<crate::Busy>,
        from_caller: bool,
        room: Option<crate::capacity::Slot>,
    ) -> Result<(), Error> {
        let shared = &self.shared;
        let counters = shared.stats.dispatching();
        counters.bump(Counter::Received);
        let permit = match room.or_else(|| shared.capacity.try_acquire()) {
            Some(permit) => permit,
            None if from_caller => {
                held.take();
                tokio::select! {
                    biased;
                    () = shared.tracker.closed() => {
                        return Err(Error::ShuttingDown(Box::new(envelope)));
                    }
                    permit = shared.capacity.acquire() => permit,
                }
            }
            None => {
                held.take();
                shared.capacity.acquire().await
            }
        };
        if !from_caller && shared.drain_over.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::ShuttingDown(Box::new(envelope)));
        }
        // Work from here on holds the virtual clock (not while waiting for capacity, which a
        // delivery cooling down may hold).
        let busy = shared.timers.busy();
        // The attempts another system counted are not this runtime's: a received envelope
        // starts its own count here.
        let mut envelope = envelope;
        envelope.attempts = 0;
        // Listed before the write: its commit may wait longer than the node timeout, and the
        // row it writes must not look orphaned to this node's sweep before the delivery starts.
        let receiving = self.shared.receiving(vec![envelope.id]);
        let receipt = match self.inbox.receive_now(&envelope) {
            Some(receipt) => receipt?,
            None => self.inbox.receive(&envelope).await?,
        };
        shared
            .pass(
                crate::Failpoint::BeforeAcknowledge,
                Some(&envelope.message_type),
            )
            .await;
        // Listed as starting before it leaves the receiving list: its supervisor unlists it.
        if receipt == Receipt::New {
            shared.list_starting(envelope.id);
        }
        drop(receiving);
        // A cascade (from no caller) whose worker stops before its supervisor starts is
        // handed back for the shutdown's report; a caller's is answered by its dropped reply.
        let hand_back = (!from_caller).then(|| Arc::clone(&self.shared));
        self.start_received(admission, envelope, receipt, permit, busy, reply, hand_back);
        Ok(())
    }

    /// Reports an envelope that starts no delivery — scheduled for later, or a duplicate —
    /// and says whether `receipt` was such.
    fn answered_without_starting(
        &self,
        envelope: &Envelope,
        receipt: Receipt,
        reply: &mut Option<oneshot::Sender<DeliveryReport>>,
    ) -> bool {
        let shared = &self.shared;
        match receipt {
            Receipt::Scheduled => {
                let due_at = envelope.scheduled_for.unwrap_or_else(|| shared.clock.now());
                tracing::debug!(
                    messaging.message.id = %envelope.id,
                    %due_at,
                    "envelope scheduled for later"
                );
                shared.report(
                    reply.take(),
                    DeliveryReport::accepted(envelope, Outcome::Scheduled(due_at)),
                );
                true
            }
            Receipt::Duplicate => {
                shared.stats.dispatching().bump(Counter::Deduplicated);
                tracing::info!(
                    messaging.message.id = %envelope.id,
                    dacapo.message_type = %envelope.message_type,
                    "duplicate envelope discarded"
                );
                shared.report(
                    reply.take(),
                    DeliveryReport::discarded(envelope, DiscardReason::DuplicateEnvelope),
                );
                true
            }
            _ => false,
        }
    }

    /// Starts the delivery of an envelope the inbox answered for with `receipt`: reports a
    /// scheduled or duplicate one, and starts a supervisor for a new one — handing its
    /// envelope to `hand_back`'s report if the worker stops before the supervisor starts. A
    /// new one is listed as starting by the caller; its supervisor unlists it as it starts.
    #[allow(clippy::too_many_arguments)]
    fn start_received(
        self: &Arc<Self>,
        admission: Admission<'_>,
        envelope: Envelope,
        receipt: Receipt,
        permit: crate::capacity::Slot,
        busy: crate::Busy,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        hand_back: Option<Arc<Shared>>,
    ) {
        let mut reply = reply;
        if self.answered_without_starting(&envelope, receipt, &mut reply) {
            return;
        }
        // From here the supervisor accounts for the delivery.
        std::mem::forget(admission);
        let worker = Arc::clone(self);
        let queued = Queued {
            envelope: Some(envelope),
            hand_back,
        };
        // Built on its worker: only the parts travel, not the whole supervisor.
        DeliverySupervisor::start_in_arbiter(&self.arbiter, move |_| {
            DeliverySupervisor::new(worker, queued.start(), permit, reply, busy)
        });
    }

    /// Delivers the messages cascaded by a successful delivery, on this worker, in the
    /// background.
    pub(crate) fn forward(self: &Arc<Self>, envelopes: Vec<Envelope>) {
        if envelopes.is_empty() {
            return;
        }
        // Admitted now, before the parent settles, so a draining shutdown waits for them too.
        for _ in &envelopes {
            self.shared.tracker.admit(false);
        }
        let mut unstarted = Unstarted {
            worker: Arc::clone(self),
            envelopes: envelopes.into(),
            current: None,
        };
        // Taken now, while the parent still holds its own: a virtual clock must not move to
        // the next timer between the parent's settle and its cascades' start. Let go while a
        // cascade waits for room (a delivery cooling down may hold it).
        let mut held = Some(self.shared.timers.busy());
        // On the worker's arbiter, from wherever it is called: a handler's own task may
        // publish once its work is recorded.
        self.arbiter.spawn(async move {
            let worker = Arc::clone(&unstarted.worker);
            while let Some(envelope) = unstarted.envelopes.pop_front() {
                let id = envelope.id;
                unstarted.current = Some(envelope.clone());
                let admission = Admission(&worker.shared.tracker);
                let delivered = worker
                    .deliver(admission, envelope, None, &mut held, false, None)
                    .await;
                unstarted.current = None;
                match delivered {
                    Ok(()) => {}
                    Err(Error::ShuttingDown(envelope)) => {
                        // Counted out as its delivery gave up; the rest are handed back, and
                        // counted out, as `unstarted` drops.
                        worker
                            .shared
                            .unstarted_cascades
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push(*envelope);
                        return;
                    }
                    Err(error) => {
                        tracing::error!(message_id = %id, %error, "cascaded message could not be delivered");
                    }
                }
            }
        });
    }
}

/// Starts the supervisor of a resumed delivery on its worker.
fn start_resumed(worker: Arc<Worker>, resumable: Resumable, permit: crate::capacity::Slot) {
    let on = worker.arbiter.clone();
    let busy = worker.shared.timers.busy();
    DeliverySupervisor::start_in_arbiter(&on, move |_| {
        DeliverySupervisor::resumed(worker, resumable, permit, busy)
    });
}

/// The new deliveries of a persisted batch still waiting for room, listed as starting; those
/// not started when it is dropped (the batch's caller gave up) go back to the orphan sweep.
struct Waiting {
    shared: Arc<Shared>,
    /// In the batch's order.
    ids: Vec<uuid::Uuid>,
    /// How many of `ids` have their supervisor on its way.
    started: usize,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        for id in self.ids.iter().skip(self.started) {
            self.shared.unlist_starting(*id);
        }
    }
}

/// A batch [`Dispatcher::persist_batch`] persisted, whose deliveries are still to start.
/// Dropped unstarted, they are counted out and left in the inbox, their first attempt counted
/// (a durable inbox resumes them as interrupted attempts; an in-memory one loses them):
/// [`start`](Self::start) them, or [`leave`](Self::leave) them to a durable inbox.
#[must_use = "the deliveries start only once `start` is awaited"]
pub struct Persisted {
    dispatcher: Dispatcher,
    waiting: Waiting,
    /// In the batch's order, each with its receipt; each holds an admission until started.
    to_start: std::collections::VecDeque<(Envelope, Receipt)>,
    /// Counted in [`Shared::batches_waiting`] until it started or handed back its deliveries.
    counted: bool,
}

/// How many persisted batches wait for room; told when none does.
#[derive(Debug, Default)]
pub(crate) struct BatchesWaiting {
    count: AtomicUsize,
    none_left: tokio::sync::Notify,
}

impl BatchesWaiting {
    fn enter(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    fn leave(&self) {
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.none_left.notify_waiters();
        }
    }

    /// Returns once no batch waits.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn none(&self) {
        crate::told::until(&self.none_left, || self.count.load(Ordering::SeqCst) == 0).await;
    }
}

impl std::fmt::Debug for Persisted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persisted")
            .field("to_start", &self.to_start.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Persisted {
    fn drop(&mut self) {
        for _ in &self.to_start {
            self.dispatcher.shared.tracker.release();
        }
        self.counted_out();
    }
}

impl Persisted {
    /// Starts the batch's deliveries, each once the engine has room for it; returns once
    /// every one is on its way.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: those not started yet stay, to start (or [`leave`](Self::leave)) later.
    pub async fn start(&mut self) {
        let shared = Arc::clone(&self.dispatcher.shared);
        if self.to_start.is_empty() {
            self.counted_out();
        }
        while !self.to_start.is_empty() {
            let permit = tokio::select! {
                // Looked at first: the shutdown frees the slots of the retries it hands back,
                // and a delivery started on that room after the drain would go with the
                // stopping workers, in no report.
                biased;
                // No room came before a shutdown's drain ended: none starts here any more.
                () = shared.drain_ended() => {
                    self.hand_back().await;
                    return;
                }
                permit = shared.capacity.acquire() => permit,
            };
            let Some((envelope, receipt)) = self.to_start.pop_front() else {
                break;
            };
            // Its admission, held since the batch was persisted.
            let admission = Admission(&shared.tracker);
            let busy = shared.timers.busy();
            let new = receipt == Receipt::New;
            // Listed as starting since the batch was persisted: the supervisor unlists it.
            self.dispatcher
                .next_worker()
                .start_received(admission, envelope, receipt, permit, busy, None, None);
            if new {
                self.waiting.started += 1;
            }
            if self.to_start.is_empty() {
                self.counted_out();
            }
        }
    }

    /// No longer waiting for room: every delivery started, or went back.
    fn counted_out(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.dispatcher.shared.batches_waiting.leave();
        }
    }

    /// Hands back the deliveries not started when a shutdown's drain ended: in the shutdown's
    /// report, as due now, and left in a durable inbox with their first attempt taken back,
    /// as [`leave`](Self::leave) does.
    async fn hand_back(&mut self) {
        let shared = Arc::clone(&self.dispatcher.shared);
        let rest: Vec<(Envelope, Receipt)> = self.to_start.drain(..).collect();
        let now = shared.clock.now();
        let mut ids = Vec::new();
        {
            let mut handed_back = shared
                .unstarted_resumes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (envelope, receipt) in rest {
                // Its admission, held since the batch was persisted.
                shared.tracker.release();
                if receipt == Receipt::New {
                    ids.push(envelope.id);
                    handed_back.push(crate::PendingRetry {
                        envelope,
                        due_at: now,
                        failures: Vec::new(),
                    });
                }
            }
        }
        if ids.is_empty() {
            self.counted_out();
            return;
        }
        tracing::warn!(
            deliveries = ids.len(),
            "shutdown: deliveries of a batch still waiting for room when the drain ended did not start; handed back in the shutdown report"
        );
        // Still listed as starting meanwhile: this node's orphan sweep leaves them alone.
        let inbox = Arc::clone(&self.dispatcher.next_worker().inbox);
        take_back_first_attempts(&*inbox, &ids).await;
        self.counted_out();
    }

    /// Leaves the deliveries not started yet in the inbox, for whoever resumes it next (this
    /// node's next start, or another node), their first attempt taken back
    /// ([`Inbox::never_started`](crate::ports::Inbox::never_started)): for a runtime that
    /// stops while they wait for room. A store that cannot take it back is logged; they then
    /// resume as interrupted attempts.
    pub async fn leave(self) {
        let ids: Vec<uuid::Uuid> = self
            .to_start
            .iter()
            .filter(|(_, receipt)| *receipt == Receipt::New)
            .map(|(envelope, _)| envelope.id)
            .collect();
        // Still listed as starting meanwhile: this node's orphan sweep leaves them alone.
        let inbox = Arc::clone(&self.dispatcher.next_worker().inbox);
        take_back_first_attempts(&*inbox, &ids).await;
    }
}

/// Takes back the first attempt their receive counted of deliveries that never started
/// ([`Inbox::never_started`](crate::ports::Inbox::never_started)); a store that cannot is
/// logged, and they resume as interrupted attempts.
pub(crate) async fn take_back_first_attempts<I: crate::ports::Inbox + ?Sized>(
    inbox: &I,
    ids: &[uuid::Uuid],
) {
    if ids.is_empty() {
        return;
    }
    if let Err(error) = inbox.never_started(ids).await {
        tracing::warn!(%error, deliveries = ids.len(), "could not take back the first attempt of deliveries that did not start; they resume as interrupted attempts");
    }
}

/// The entry point of received envelopes: it asks the inbox, waits for capacity, and starts a
/// [`DeliverySupervisor`] on one of the engine's workers.
#[derive(Clone)]
pub struct Dispatcher {
    pub(crate) shared: Arc<Shared>,
    pub(crate) workers: Arc<[Arc<Worker>]>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// Tells the outbox relay that envelopes were just committed to the outbox, so that it
    /// publishes them now instead of at its next poll.
    pub fn wake_outbox(&self) {
        self.shared.outbox_enlisted.notify_one();
    }

    fn next_worker(&self) -> &Arc<Worker> {
        let index = self.shared.next_worker.fetch_add(1, Ordering::Relaxed);
        &self.workers[index % self.workers.len()]
    }

    /// Delivers a received envelope. Returns once the envelope is accepted (recorded by the
    /// inbox and handed to a supervisor) or discarded as a duplicate, not when it is handled;
    /// `reply`, if given, receives the report when the delivery settles.
    ///
    /// Waits while the configured number of deliveries is already in flight.
    ///
    /// # Errors
    ///
    /// [`Error::ShuttingDown`] once a shutdown began, and [`Error::Store`] when the inbox
    /// cannot record the envelope; in both cases the envelope was not accepted and must not be
    /// acknowledged to its transport.
    ///
    /// # Cancel safety
    ///
    /// Cancelled while waiting for capacity, nothing happened. Cancelled while the inbox
    /// records the envelope, the envelope may be recorded but not handled: a durable inbox
    /// resumes it after a restart (or once this node's heartbeat expires), the in-memory one
    /// never does.
    pub async fn dispatch(
        &self,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
    ) -> Result<(), Error> {
        self.dispatch_holding(envelope, reply, &mut None).await
    }

    /// [`dispatch`](Self::dispatch) while the caller holds `held`, a token on the virtual
    /// clock (the test harness's, so that what it publishes together is accepted before time
    /// moves): given up if the envelope must wait for capacity.
    ///
    /// # Errors
    ///
    /// As [`dispatch`](Self::dispatch).
    pub async fn dispatch_holding(
        &self,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        held: &mut Option<crate::Busy>,
    ) -> Result<(), Error> {
        self.dispatch_from_caller(envelope, reply, held, None).await
    }

    /// A caller's envelope to the next worker, in `room` if the caller took it already.
    async fn dispatch_from_caller(
        &self,
        envelope: Envelope,
        reply: Option<oneshot::Sender<DeliveryReport>>,
        held: &mut Option<crate::Busy>,
        room: Option<crate::capacity::Slot>,
    ) -> Result<(), Error> {
        if !self.shared.tracker.admit(true) {
            return Err(Error::ShuttingDown(Box::new(envelope)));
        }
        let admission = Admission(&self.shared.tracker);
        self.next_worker()
            .deliver(admission, envelope, reply, held, true, room)
            .await
    }

    /// Waits for room for one delivery, giving `held` up while it waits (as
    /// [`dispatch_holding`](Self::dispatch_holding) does); `None` once the runtime closes.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled wait takes no room.
    pub(crate) async fn room(
        &self,
        held: &mut Option<crate::Busy>,
    ) -> Option<crate::capacity::Slot> {
        let shared = &self.shared;
        if let Some(slot) = shared.capacity.try_acquire() {
            return Some(slot);
        }
        held.take();
        tokio::select! {
            biased;
            () = shared.tracker.closed() => None,
            slot = shared.capacity.acquire() => Some(slot),
        }
    }

    /// [`dispatch_holding`](Self::dispatch_holding) in room already taken with
    /// [`room`](Self::room).
    pub(crate) async fn dispatch_in(
        &self,
        envelope: Envelope,
        room: crate::capacity::Slot,
        held: &mut Option<crate::Busy>,
    ) -> Result<(), Error> {
        self.dispatch_from_caller(envelope, None, held, Some(room))
            .await
    }

    /// Accepts every envelope of `envelopes` in one store transaction, all or nothing, then
    /// starts their deliveries, each once the engine has room for it: returns once every one
    /// is persisted and started (or reported, for a duplicate or a scheduled one, or handed
    /// back in the shutdown's report when a shutdown's drain ended before it had room).
    ///
    /// # Errors
    ///
    /// [`Error::ShuttingDown`] (with the first envelope) when the runtime is closing, and the
    /// inbox's error, with none of them recorded.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: cancelled once the batch is persisted, the deliveries not started yet
    /// are resumed by this node's orphan sweep.
    pub async fn dispatch_batch(&self, envelopes: Vec<Envelope>) -> Result<(), Error> {
        self.persist_batch(envelopes).await?.start().await;
        Ok(())
    }

    /// The first half of [`dispatch_batch`](Self::dispatch_batch): persists the batch, all or
    /// nothing, and answers at once for its duplicates and scheduled envelopes; the rest wait
    /// for [`Persisted::start`]. A transport acknowledges the batch in between, so that
    /// nothing of the broker's (a PostgreSQL queue's transaction, a prefetch) stays held
    /// while the deliveries wait for room, and starts them before it takes the next batch,
    /// which keeps its pace to the engine's.
    ///
    /// # Errors
    ///
    /// As [`dispatch_batch`](Self::dispatch_batch).
    ///
    /// # Cancel safety
    ///
    /// As [`dispatch_batch`](Self::dispatch_batch); so is dropping what it returns unstarted.
    pub async fn persist_batch(&self, envelopes: Vec<Envelope>) -> Result<Persisted, Error> {
        let tracker = &self.shared.tracker;
        let mut admissions = Vec::with_capacity(envelopes.len());
        for envelope in &envelopes {
            if !tracker.admit(true) {
                return Err(Error::ShuttingDown(Box::new(envelope.clone())));
            }
            admissions.push(Admission(tracker));
        }
        let mut envelopes = envelopes;
        for envelope in &mut envelopes {
            // The attempts another system counted are not this runtime's.
            envelope.attempts = 0;
        }
        // Listed from before the write, whose commit can wait longer than the node timeout,
        // and then, the new ones, as starting until each starts (waiting for room can take as
        // long): none is taken for an orphan and run a second time.
        let receiving = self
            .shared
            .receiving(envelopes.iter().map(|envelope| envelope.id).collect());
        let receipts = {
            // Persisting is work: the virtual clock waits for it.
            let _busy = self.shared.timers.busy();
            self.next_worker().inbox.receive_batch(&envelopes).await?
        };
        let waiting = Waiting {
            shared: Arc::clone(&self.shared),
            ids: envelopes
                .iter()
                .zip(&receipts)
                .filter(|(_, receipt)| **receipt == Receipt::New)
                .map(|(envelope, _)| envelope.id)
                .collect(),
            started: 0,
        };
        for id in &waiting.ids {
            self.shared.list_starting(*id);
        }
        drop(receiving);
        self.shared
            .pass(crate::Failpoint::BeforeAcknowledge, None)
            .await;
        let counters = self.shared.stats.dispatching();
        let mut to_start = std::collections::VecDeque::with_capacity(envelopes.len());
        for ((envelope, receipt), admission) in envelopes.into_iter().zip(receipts).zip(admissions)
        {
            counters.bump(Counter::Received);
            // A duplicate or a scheduled envelope is answered for at once: it takes no room,
            // and its broker message is not held back behind deliveries that do.
            if self
                .next_worker()
                .answered_without_starting(&envelope, receipt, &mut None)
            {
                drop(admission);
                continue;
            }
            // Its admission goes with it: `Persisted` counts it out if it never starts.
            std::mem::forget(admission);
            to_start.push_back((envelope, receipt));
        }
        let counted = !to_start.is_empty();
        if counted {
            self.shared.batches_waiting.enter();
        }
        Ok(Persisted {
            dispatcher: self.clone(),
            waiting,
            to_start,
            counted,
        })
    }

    /// Resumes a delivery whose state the inbox already recorded as this node's (recovered,
    /// or replayed), on one of the workers; callable from any thread.
    ///
    /// # Errors
    ///
    /// [`Error::ShuttingDown`] with the envelope when the runtime is closing: its recorded
    /// state is resumed at the next start on the same store.
    pub fn resume(&self, resumable: Resumable) -> Result<(), Error> {
        let Some(worker) = self.admit_resume(resumable.envelope.id) else {
            return Err(Error::ShuttingDown(Box::new(resumable.envelope)));
        };
        let on = worker.arbiter.clone();
        on.spawn(async move {
            let shared = &worker.shared;
            let permit = tokio::select! {
                biased;
                permit = shared.capacity.acquire() => permit,
                // A shutdown does not wait for room it may never get: a durable store resumes
                // the delivery at the next start, and the report names it.
                () = shared.tracker.closed() => {
                    shared.unlist_starting(resumable.envelope.id);
                    let due_at = resumable.due_at.unwrap_or_else(|| shared.clock.now());
                    shared
                        .unstarted_resumes
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(crate::PendingRetry {
                            envelope: resumable.envelope,
                            due_at,
                            failures: resumable.failures,
                        });
                    shared.tracker.release();
                    return;
                }
            };
            start_resumed(worker, resumable, permit);
        });
        Ok(())
    }

    /// Resumes a recovered delivery on a slot the caller already holds.
    pub(crate) fn resume_on(&self, resumable: Resumable, permit: crate::capacity::Slot) {
        // Refused only by a shutdown, which leaves the row to the next start.
        if let Some(worker) = self.admit_resume(resumable.envelope.id) {
            start_resumed(worker, resumable, permit);
        }
    }

    /// Counts a resumed delivery in and lists it as starting (its supervisor takes it off the
    /// list when it starts); the worker that will run it, `None` once a shutdown began.
    fn admit_resume(&self, id: uuid::Uuid) -> Option<Arc<Worker>> {
        // A closing runtime hands its work back rather than taking more.
        if !self.shared.tracker.admit(true) {
            return None;
        }
        self.shared.list_starting(id);
        Some(Arc::clone(self.next_worker()))
    }

    /// Lists `id` as being received on this node, before a write that records it as this
    /// node's (a replay) and until the returned guard is dropped: this node's orphan sweep
    /// leaves the row alone meanwhile. A resume started meanwhile lists it as starting.
    pub fn receiving(&self, id: uuid::Uuid) -> Receiving {
        self.shared.receiving(vec![id])
    }

    /// Whether the runtime is shutting down (it accepts nothing more).
    pub fn is_closing(&self) -> bool {
        self.shared.tracker.is_closing()
    }

    /// Waits until every accepted envelope has settled, retries included.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn idle(&self) {
        self.shared.tracker.settled().await;
    }

    /// The engine's counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.shared.stats
    }

    /// Where published messages get their logical ids.
    pub fn deduplication_rules(&self) -> &crate::DeduplicationRules {
        &self.workers[0].rules
    }

    /// The routes this engine serves.
    pub fn registry(&self) -> &Registry {
        &self.workers[0].registry
    }
}
