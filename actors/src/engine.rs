use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use actix::{Actor, Arbiter, System};
use tokio::sync::oneshot;

use crate::capacity::Capacity;
use crate::{DeliveryReport, Envelope};
use uuid::Uuid;

use crate::dispatcher::{Shared, UnknownMessageTypes, Worker};
use crate::ports::{Claims, Clock, DurableInbox, Inbox, OutboxStore};
use crate::tracker::{PendingRetry, Tracker};
use crate::{
    CleanupActor, DeduplicationRules, Dispatcher, Error, ReaperActor, RecoveryActor, Registry,
    RelayActor, RetryScope, Stats, TimerActor,
};

/// How the engine runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Worker arbiters (threads) that run deliveries; 0 runs everything on the engine's own
    /// thread.
    pub workers: usize,
    /// Deliveries accepted and not yet settled, beyond which dispatch waits.
    pub max_in_flight: usize,
    /// Largest envelope accepted, in bytes.
    pub max_envelope_size: usize,
    /// What happens to messages no handler handles.
    pub unknown_message_types: UnknownMessageTypes,
    /// Which handlers a retry runs again (default: all of them).
    pub retry_scope: RetryScope,
    /// How long a logical deduplication claim holds (default 24 h): the guarantee.
    pub deduplication_window: Duration,
    /// How often expired claims are reaped (default 5 min).
    pub deduplication_reap_interval: Duration,
    /// Expired claims deleted per statement, each in its own transaction (default 1000).
    pub deduplication_reap_batch: usize,
    /// Recovery and cleanup, for a durable inbox (`None` for one in memory).
    pub durability: Option<Durability>,
    /// The engine's own timers: tokio's, or the test harness's virtual clock.
    pub timers: crate::Timers,
    /// Told of every delivery's report as it settles, cascaded ones included (the test
    /// harness's record); `None` in production, where only a caller that asked gets one.
    pub reports: Option<ReportSink>,
    /// Where a test crashes the engine (`None`: nowhere).
    pub failpoints: Option<Arc<crate::Failpoints>>,
}

/// Where the engine tells every settled delivery's report.
#[derive(Clone)]
pub struct ReportSink(pub Arc<dyn Fn(&DeliveryReport) + Send + Sync>);

impl std::fmt::Debug for ReportSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReportSink")
    }
}

/// How the engine looks after a durable inbox.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Durability {
    /// How often the node heartbeats and looks for deliveries to recover (default 10 s).
    pub recovery_interval: Duration,
    /// Deliveries claimed per recovery query (default 100).
    pub recovery_batch: usize,
    /// How long handled envelopes are kept to discard redeliveries (default 5 min).
    pub keep_after_handling: Duration,
    /// How often expired handled envelopes are removed (default 1 min).
    pub cleanup_interval: Duration,
    /// Envelopes removed per cleanup statement (default 1000).
    pub cleanup_batch: usize,
    /// How often the outbox relay looks for enlisted envelopes (default 200 ms).
    pub relay_interval: Duration,
    /// Envelopes the relay publishes per batch (default 100).
    pub relay_batch: usize,
    /// How long published outbox rows are kept before they are removed (default 1 h).
    pub outbox_retention: Duration,
    /// An outbox backlog older than this logs a warning: a stuck relay is never silent
    /// (default 1 min).
    pub outbox_warn_after: Duration,
    /// How long idempotency keys recorded by handlers are kept (default 7 days): the window
    /// within which the same key is refused again, as a retry, a redelivery or a replay of a
    /// dead letter would present it.
    pub idempotency_key_retention: Duration,
}

impl Default for Durability {
    fn default() -> Self {
        Self {
            recovery_interval: Duration::from_secs(10),
            recovery_batch: 100,
            keep_after_handling: Duration::from_secs(5 * 60),
            cleanup_interval: Duration::from_secs(60),
            cleanup_batch: 1000,
            relay_interval: Duration::from_millis(200),
            relay_batch: 100,
            outbox_retention: Duration::from_secs(60 * 60),
            outbox_warn_after: Duration::from_secs(60),
            idempotency_key_retention: Duration::from_secs(7 * 24 * 60 * 60),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            max_in_flight: 1024,
            max_envelope_size: 1024 * 1024,
            unknown_message_types: UnknownMessageTypes::default(),
            retry_scope: RetryScope::default(),
            deduplication_window: Duration::from_secs(24 * 60 * 60),
            deduplication_reap_interval: Duration::from_secs(5 * 60),
            deduplication_reap_batch: 1000,
            durability: None,
            timers: crate::Timers::Real,
            reports: None,
            failpoints: None,
        }
    }
}

/// What a shutdown left undone, handed back rather than dropped.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Deliveries that were waiting for a cooldown, and, as due at the shutdown, those that
    /// were waiting for room: a replayed dead letter, or a delivery that got its room only
    /// once the drain was over (a durable store also keeps them, released to the next node).
    pub pending_retries: Vec<PendingRetry>,
    /// Deliveries still running when the drain timed out.
    pub still_running: Vec<Uuid>,
    /// Messages cascaded by handled deliveries whose own delivery never started: they waited
    /// for room under `max_in_flight` when the engine stopped (a durable store also keeps
    /// them, and resumes them at the next start).
    pub unstarted_cascades: Vec<Envelope>,
}

impl ShutdownReport {
    /// Whether everything accepted was settled.
    pub fn is_clean(&self) -> bool {
        self.pending_retries.is_empty()
            && self.still_running.is_empty()
            && self.unstarted_cascades.is_empty()
    }
}

/// The actor system: a thread running actix with its worker arbiters and the timer.
#[derive(Debug)]
pub struct Engine {
    dispatcher: Dispatcher,
    system: System,
    stopped: tokio::sync::Mutex<Option<oneshot::Receiver<()>>>,
}

/// The engine's dependencies.
pub struct EngineParts {
    /// Handlers and policies.
    pub registry: Registry,
    /// Envelope-id deduplication.
    pub inbox: Arc<dyn Inbox>,
    /// The same inbox as a durable one, shared by nodes (`None` in memory): its deliveries are
    /// recovered, its nodes heartbeat, and its settled rows are removed after their retention.
    pub durable: Option<Arc<dyn DurableInbox>>,
    /// Wall-clock time.
    pub clock: Arc<dyn Clock>,
    /// Logical deduplication claims (`None`: deduplication is off).
    pub claims: Option<Arc<dyn Claims>>,
    /// Where published messages get their logical ids.
    pub rules: DeduplicationRules,
    /// The outbox to relay (`None`: no outbox).
    pub outbox: Option<Arc<dyn OutboxStore>>,
    /// Where the relay sends message types routed to a broker (`None`: all stay here).
    pub outbound: Option<Arc<dyn crate::ports::Outbound>>,
    /// Where the relay keeps what the broker can never take.
    pub dead_letters: Option<Arc<dyn crate::ports::DeadLetterStore>>,
    /// The store itself, for handlers that open transactions on it; `None` without one.
    pub store: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Whether the deduplication claims live in that store, so a handler transaction can
    /// complete its claim in the same transaction as its work.
    pub claims_in_store: bool,
}

impl Engine {
    /// Starts the engine's threads.
    ///
    /// # Errors
    ///
    /// [`Error::Startup`] if a thread or tokio runtime cannot be created.
    pub fn start(config: EngineConfig, parts: EngineParts) -> Result<Self, Error> {
        let mut builder = tokio::runtime::Builder::new_current_thread();
        builder.enable_all();
        let runtime = builder.build().map_err(|e| Error::Startup(e.to_string()))?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stopped_tx, stopped_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("dacapo-engine".into())
            .spawn(move || {
                let runner = System::with_tokio_rt(move || runtime);
                let workers: Vec<Arbiter> = (0..config.workers).map(|_| Arbiter::new()).collect();
                let started = runner.block_on(async {
                    let timer = TimerActor::new(config.timers.clone()).start();
                    let arbiters = if workers.is_empty() {
                        vec![Arbiter::current()]
                    } else {
                        workers.iter().map(Arbiter::handle).collect()
                    };
                    let shared = Arc::new(Shared {
                        durable: parts.durable.clone(),
                        clock: parts.clock,
                        timers: config.timers.clone(),
                        reports: config.reports.clone(),
                        failpoints: config.failpoints.clone(),
                        recovery_rounds: tokio::sync::watch::Sender::new(0),
                        timer,
                        tracker: Tracker::new(arbiters.len()),
                        stats: Arc::new(Stats::new(arbiters.len() + 1)),
                        capacity: Capacity::new(config.max_in_flight),
                        next_worker: AtomicUsize::new(0),
                        max_envelope_size: config.max_envelope_size,
                        unknown_message_types: config.unknown_message_types,
                        retry_scope: config.retry_scope,
                        outbox_enlisted: tokio::sync::Notify::new(),
                        recovering: tokio::sync::Mutex::new(()),
                        heartbeats: Arc::default(),
                        drain_over: std::sync::atomic::AtomicBool::new(false),
                        drain_ends: tokio::sync::Notify::new(),
                        batches_waiting: crate::dispatcher::BatchesWaiting::default(),
                        unstarted_cascades: std::sync::Mutex::default(),
                        unstarted_resumes: std::sync::Mutex::default(),
                        unstarted_fresh: std::sync::Mutex::default(),
                        store: parts.store.clone(),
                        claims_in_store: parts.claims_in_store,
                        starting: std::sync::Mutex::default(),
                        receiving: std::sync::Mutex::default(),
                        // Only an outbox a relay publishes from.
                        outbox: config.durability.as_ref().and(parts.outbox.clone()),
                        outbound: parts.outbound.clone(),
                    });
                    let workers = arbiters
                        .into_iter()
                        .enumerate()
                        .map(|(index, arbiter)| {
                            Arc::new(Worker {
                                index,
                                shared: Arc::clone(&shared),
                                arbiter,
                                registry: parts.registry.replicate(),
                                inbox: Arc::clone(&parts.inbox),
                                claims: parts.claims.clone(),
                                rules: parts.rules.clone(),
                                deduplication_window: config.deduplication_window,
                            })
                        })
                        .collect();
                    let dispatcher = Dispatcher { shared, workers };
                    if let Some(claims) = &parts.claims {
                        ReaperActor::new(
                            Arc::clone(claims),
                            Arc::clone(&dispatcher.shared.clock),
                            Arc::clone(&dispatcher.shared.heartbeats),
                            config.deduplication_reap_interval,
                            config.deduplication_reap_batch,
                            config.timers.clone(),
                            // Recovery beats the runtime's durable store; claims anywhere else
                            // need beats of their own.
                            !(parts.claims_in_store
                                && config.durability.is_some()
                                && parts.durable.is_some()),
                        )
                        .start();
                    } else {
                        for entry in parts.registry.entries().filter(|e| e.deduplication.is_some()) {
                            tracing::warn!(
                                handler = %entry.id,
                                "this handler asks for deduplication, which this runtime has not enabled; \
                                 it will fail on its first message"
                            );
                        }
                    }
                    if let (Some(durability), Some(outbox)) = (&config.durability, &parts.outbox) {
                        RelayActor::new(
                            Arc::clone(outbox),
                            parts.outbound.clone(),
                            parts.dead_letters.clone(),
                            dispatcher.clone(),
                            durability.clone(),
                        )
                        .start();
                    }
                    if let (Some(durability), Some(durable)) = (&config.durability, &parts.durable) {
                        RecoveryActor::new(
                            dispatcher.clone(),
                            Arc::clone(durable),
                            durability.recovery_interval,
                            durability.recovery_batch,
                        )
                        .start();
                        CleanupActor::new(
                            Arc::clone(durable),
                            Arc::clone(&dispatcher.shared.clock),
                            durability.keep_after_handling,
                            durability.idempotency_key_retention,
                            durability.cleanup_interval,
                            durability.cleanup_batch,
                            config.timers.clone(),
                        )
                        .start();
                    }
                    (dispatcher, System::current())
                });
                if ready_tx.send(started).is_ok() {
                    // Stopping drops the actors' pending futures with the runtime; a database
                    // connection dropped then returns itself to its pool by spawning, which
                    // needs a runtime handle in scope even as the runtime goes away.
                    let handle = runner.runtime().tokio_runtime().handle().clone();
                    let _entered = handle.enter();
                    let _ = runner.run();
                }
                // Every worker is told first: one whose thread a handler holds must not keep
                // the others running.
                for worker in &workers {
                    worker.stop();
                }
                for worker in workers {
                    let _ = worker.join();
                }
                let _ = stopped_tx.send(());
            })
            .map_err(|e| Error::Startup(e.to_string()))?;
        let (dispatcher, system) = ready_rx
            .recv()
            .map_err(|_| Error::Startup("the engine thread died while starting".into()))?;
        Ok(Self {
            dispatcher,
            system,
            stopped: tokio::sync::Mutex::new(Some(stopped_rx)),
        })
    }

    /// Where received envelopes go.
    pub fn dispatcher(&self) -> &Dispatcher {
        &self.dispatcher
    }

    /// Refuses new envelopes, waits up to `drain` for active deliveries to settle (their
    /// cascaded messages included), hands back those cooling down, and stops the threads.
    ///
    /// Calling it again once it returned does nothing and reports nothing.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: once polled, the engine refuses new work even if the future is dropped.
    pub async fn shutdown(&self, drain: Duration) -> ShutdownReport {
        let tracker = &self.dispatcher.shared.tracker;
        tracker.close();
        let mut stopped = self.stopped.lock().await;
        let Some(stopped) = stopped.take() else {
            return ShutdownReport::default();
        };
        let draining_since = tokio::time::Instant::now();
        let drained = tokio::time::timeout(drain, tracker.drained()).await.is_ok();
        self.dispatcher
            .shared
            .drain_over
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.dispatcher.shared.drain_ends.notify_waiters();
        // Batches still waiting for room hand back what did not start, on their callers'
        // tasks (this one's, it may be): waited for, a bounded while, so that the report
        // names them — a thread paused here could otherwise read it before they did.
        let handed_back = tokio::time::timeout(
            drain
                .saturating_sub(draining_since.elapsed())
                .max(Duration::from_secs(1)),
            self.dispatcher.shared.batches_waiting.none(),
        );
        if handed_back.await.is_err() {
            tracing::warn!(
                "shutdown: a batch waiting for room did not hand its deliveries back; they resume from the store at the next start"
            );
        }
        // No delivery starts from here (one that got room late, after the drain, hands itself
        // back): those listed now are all that may run while the rest is released.
        tracker.freeze();
        // Active ones first: a delivery that starts cooling down in between is then in one
        // list or both (kept in the retries), never in neither.
        let mut still_running = if drained {
            Vec::new()
        } else {
            tracker.still_active()
        };
        let pending_retries = tracker.take_cooling();
        still_running.retain(|id| !pending_retries.iter().any(|p| p.envelope.id == *id));
        if !still_running.is_empty() {
            tracing::warn!(
                deliveries = still_running.len(),
                "shutdown: deliveries still running after the drain; they stay this node's until its heartbeat expires"
            );
        }
        let mut report = ShutdownReport {
            pending_retries,
            still_running,
            unstarted_cascades: Vec::new(),
        };
        for pending in &report.pending_retries {
            tracing::warn!(
                messaging.message.id = %pending.envelope.id,
                attempts = pending.envelope.attempts,
                due_at = %pending.due_at,
                "shutdown: retry still waiting, handed back in the shutdown report"
            );
        }
        // A recovery round that started before the close would claim rows again behind the
        // release, leaving them owned by a node that is gone, and a heartbeat written after it
        // would make the node look alive; one stuck on the store is not waited for past the
        // drain — a second at least, as the runtime's transports may have taken all of it, and
        // a round in flight takes milliseconds.
        let shared = &self.dispatcher.shared;
        let until = tokio::time::Instant::now() + drain.max(Duration::from_secs(1));
        let recovering = tokio::time::timeout_at(until, shared.recovering.lock())
            .await
            .ok();
        if tokio::time::timeout_at(until, shared.heartbeats.end())
            .await
            .is_err()
        {
            tracing::warn!(
                "a heartbeat still waits on the store: it may be written after the release, and this node look alive for one node timeout more"
            );
        }
        // Hand this node's unsettled deliveries (the retries above) to whoever starts next,
        // while the workers, whose runtimes some of the store's connections belong to, still
        // run. Not those still running: released, another node would claim one at once and run
        // it beside this one's handlers; they wait for this node's heartbeat to expire, as
        // after a crash.
        let unstarted = std::mem::take(
            &mut *shared
                .unstarted_fresh
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if let Some(durable) = &shared.durable {
            crate::dispatcher::take_back_first_attempts(&**durable, &unstarted).await;
        }
        if let Some(durable) = &self.dispatcher.shared.durable
            && let Err(error) = durable.release(&report.still_running).await
        {
            tracing::warn!(%error, "could not release unsettled deliveries; they resume once this node's heartbeat expires");
        }
        // The relay takes the lease no more (the drain is over): given up, another node's relay
        // publishes at its next poll, not ten of this one's later.
        if let Some(outbox) = &shared.outbox {
            match tokio::time::timeout_at(until, outbox.release_lease()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, "could not give up the outbox lease; it runs out by itself");
                }
                Err(_) => {
                    tracing::warn!(
                        "giving up the outbox lease took too long; it runs out by itself"
                    );
                }
            }
        }
        drop(recovering);
        self.system.stop();
        let _ = stopped.await;
        let shared = &self.dispatcher.shared;
        report.pending_retries.extend(std::mem::take(
            &mut *shared
                .unstarted_resumes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        ));
        report.pending_retries.sort_by_key(|p| p.due_at);
        report.unstarted_cascades = std::mem::take(
            &mut *self
                .dispatcher
                .shared
                .unstarted_cascades
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        report
    }
}

impl Engine {
    /// Stops the threads at once, as a killed process would: nothing drains, nothing of this
    /// node is released, and the futures under way are dropped where they stand.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a kill cancelled while the threads stop leaves the wait to the next
    /// call, which returns only once they stopped.
    pub async fn kill(&self) {
        let mut stopped = self.stopped.lock().await;
        if let Some(receiver) = stopped.as_mut() {
            self.system.stop();
            let _ = receiver.await;
            *stopped = None;
        }
    }

    /// Returns once the node's first recovery round is over, including the rounds that go on
    /// where the engine's capacity cut it short (at once without a durable store): what an
    /// earlier run under its name left is resumed by then, except retries due later than one
    /// recovery interval, which are resumed as they fall due. A round the store refused does
    /// not count, and is tried again soon; once the engine begins to close, this returns.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn first_recovery(&self) {
        let shared = &self.dispatcher.shared;
        if shared.durable.is_none() {
            return;
        }
        let mut rounds = shared.recovery_rounds.subscribe();
        // A closing runtime runs no more rounds: one refused before it began may never be
        // followed by one that gets through.
        tokio::select! {
            _ = rounds.wait_for(|rounds| *rounds > 0) => {}
            () = shared.tracker.closed() => {}
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Dropped without a shutdown: stop the threads without draining.
        if self.stopped.get_mut().is_some() {
            self.system.stop();
        }
    }
}
