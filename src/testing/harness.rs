use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dacapo_actors::{
    DeliveryReport, Envelope, Failpoint, Failpoints, HandlerId, Invoke, Message, Module, Registry,
    RetryPolicy, SendOptions, ShutdownReport,
};
use futures::FutureExt;
use tokio::sync::oneshot;

use crate::testing::store_fault::StoreHooks;
use crate::testing::{Fault, StoreFault, StoreFaults};
use crate::{Error, Runtime, RuntimeBuilder};

/// The environment variable that sets a harness's seed when the test does not: a number, or
/// `random` for one drawn now (printed if the test fails).
pub const SEED_VARIABLE: &str = "DACAPO_SEED";

/// Configures a [`TestHarness`].
pub struct TestHarnessBuilder {
    runtime: RuntimeBuilder,
    faults: Vec<(HandlerId, Fault)>,
    settle_timeout: Duration,
    seed: Option<u64>,
    failpoints: Arc<Failpoints>,
    store_faults: StoreFaults,
    /// Whether [`store_faults`](Self::store_faults) handed them out: they strike nothing
    /// without a store, which the build then says.
    store_faults_taken: std::sync::atomic::AtomicBool,
    /// The store given to [`store`](Self::store), which crashes and restarts need, put on
    /// the virtual clock and the harness's hooks at build.
    store: Option<PendingStore>,
}

impl std::fmt::Debug for TestHarnessBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestHarnessBuilder")
            .field("runtime", &self.runtime)
            .field("faults", &self.faults)
            .field("settle_timeout", &self.settle_timeout)
            .field("seed", &self.seed)
            .field("store", &self.store.is_some())
            .finish_non_exhaustive()
    }
}

/// The store given to the harness, for each run of the runtime.
#[derive(Clone)]
struct PendingStore {
    /// The node the store runs as, where it was named, which seeded envelope ids are drawn
    /// for (a name drawn at random would make them differ from run to run).
    node: Arc<str>,
    give: GiveStore,
    /// Returns once a write the database had begun for a killed runtime ended.
    writes_ended: Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>,
}

/// Puts the store on the harness's clock and hooks, and gives it to the runtime: on
/// PostgreSQL each call on a runtime pool of its own, since a killed runtime's connections die
/// with it (SQLite's run on threads of their own, and the pool is kept).
type GiveStore = Arc<
    dyn Fn(RuntimeBuilder, Arc<dacapo_actors::VirtualClock>, Arc<StoreHooks>) -> RuntimeBuilder
        + Send
        + Sync,
>;

impl TestHarnessBuilder {
    /// Registers a module.
    #[must_use]
    pub fn module(mut self, module: Module) -> Self {
        self.runtime = self.runtime.module(module);
        self
    }

    /// The runtime-wide retry policy.
    #[must_use]
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.runtime = self.runtime.retry_policy(policy);
        self
    }

    /// The per-handler timeout.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.runtime = self.runtime.handler_timeout(timeout);
        self
    }

    /// Any other runtime setting.
    #[must_use]
    pub fn configure(mut self, configure: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder) -> Self {
        self.runtime = configure(self.runtime);
        self
    }

    /// Runs the harness on a real store (a [`SqliteStore`](crate::store::SqliteStore) or a
    /// [`PostgresStore`](crate::store::PostgresStore); see
    /// [`ScratchDatabase`](crate::testing::ScratchDatabase) for a fresh one per test), with
    /// what a store adds to the harness: [`crash_at`](TestHarness::crash_at) and
    /// [`restart`](TestHarness::restart), and [`store_fault`](TestHarness::store_fault).
    /// The store stamps its rows (received, due, handled, heartbeats) on the harness's
    /// virtual clock, like the runtime's cutoffs: a retry due in an hour, or a scheduled
    /// message, that a restart left in the store runs once
    /// [`advance`](TestHarness::advance) reaches it.
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
    #[must_use]
    pub fn store<D: crate::store::Dialect>(mut self, store: crate::store::SqlStore<D>) -> Self {
        let first = Mutex::new(Some(store.clone()));
        let ended = store.clone();
        self.store = Some(PendingStore {
            node: Arc::from(store.named_node().unwrap_or_default()),
            give: Arc::new(move |runtime: RuntimeBuilder, clock, hooks| {
                let store = first
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
                    .unwrap_or_else(|| store.with_new_engine_pool());
                let store = store
                    .clock(Arc::clone(&clock) as Arc<dyn dacapo_actors::ports::Clock>)
                    .with_test_hooks(hooks);
                runtime.store(store).clock(clock)
            }),
            writes_ended: Arc::new(move || {
                let store = ended.clone();
                Box::pin(async move { store.writes_under_way_ended().await })
            }),
        });
        self
    }

    /// The seed of the orders the runtime chooses under the harness: timers due at the same
    /// virtual instant run one at a time in an order drawn from it, and recovered batches are
    /// shuffled by it. The same seed gives the same order; a failing test prints its seed.
    /// Default: the `DACAPO_SEED` environment variable, else 0, which keeps the order things
    /// came in (and runs timers due together at once).
    ///
    /// Seeded, published envelopes take ids drawn from the seed (and from the store's node,
    /// where it was named with `node_id`): two harnesses on one store under one seed need
    /// named nodes, or they publish the same ids.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The faults of the store given to [`store`](Self::store), for a handler to start an
    /// outage from inside its delivery (see [`TestHarness::store_faults`]).
    pub fn store_faults(&self) -> StoreFaults {
        self.store_faults_taken
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.store_faults.clone()
    }

    /// Injects `fault` in front of the handler `name` of `module`. A counted fault counts
    /// for this handler alone, even where one `Fault` (or its clones) is given to several.
    #[must_use]
    pub fn fault(mut self, module: &str, name: &str, fault: Fault) -> Self {
        let id = HandlerId {
            module: module.into(),
            name: name.into(),
        };
        self.faults.push((id, fault.counted_afresh()));
        self
    }

    /// How long, in real time, a tracked call waits for its delivery to be accepted and
    /// settled, both together (default 10 s). Virtual time makes cooldowns instant, so this
    /// only bounds a stuck test.
    #[must_use]
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = timeout;
        self
    }

    /// Starts the runtime on virtual time.
    ///
    /// # Errors
    ///
    /// The runtime's build errors, [`Error::UnknownHandler`] (which lists the registered
    /// handlers) when a fault names a handler that is not registered, and
    /// [`Error::Configuration`] when [`store_faults`](Self::store_faults) were taken but no
    /// store was given.
    pub fn build(self) -> Result<TestHarness, Error> {
        if self.store.is_none() && self.store_faults_taken.into_inner() {
            return Err(Error::Configuration(
                "store faults need a store given to TestHarnessBuilder::store: without one \
                 they strike nothing"
                    .into(),
            ));
        }
        let seed = match self.seed {
            Some(seed) => seed,
            None => seed_from_environment()?,
        };
        let clock = dacapo_actors::VirtualClock::seeded(seed);
        let reports = Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let reports = Arc::clone(&reports);
            dacapo_actors::ReportSink(Arc::new(move |report: &DeliveryReport| {
                reports
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(report.clone());
            }))
        };
        let mut runtime = self.runtime;
        let mut hooks = None;
        if let Some(store) = &self.store {
            let live = Arc::new(StoreHooks::of_the_live_run(
                &self.failpoints,
                &self.store_faults,
            ));
            runtime = (store.give)(runtime, Arc::clone(&clock), Arc::clone(&live));
            hooks = Some(live);
        }
        let (mut registry, runtime) = runtime
            .virtual_time(Arc::clone(&clock))
            .report_to(sink)
            .failpoints(Arc::clone(&self.failpoints))
            .into_parts()?;
        for (id, fault) in self.faults {
            if !registry.wrap_handler(&id, |inner| fault.clone().wrap(inner)) {
                let mut registered: Vec<_> = registry.entries().map(|e| e.id.clone()).collect();
                registered.sort_by_key(ToString::to_string);
                registered.dedup();
                return Err(Error::UnknownHandler {
                    handler: id,
                    registered,
                });
            }
        }
        let mut ids: Vec<HandlerId> = registry.entries().map(|e| e.id.clone()).collect();
        ids.sort_by_key(ToString::to_string);
        ids.dedup();
        for id in &ids {
            let failpoints = Arc::clone(&self.failpoints);
            registry.wrap_handler(id, |inner| fenced(inner, Arc::clone(&failpoints)));
        }
        let node = self
            .store
            .as_ref()
            .map_or_else(|| Arc::from(""), |store| Arc::clone(&store.node));
        let transports = runtime.has_transports();
        let restart = self.store.map(|store| Restart {
            transports,
            runtime: runtime.restartable(),
            registry: registry.replicate(),
            store,
            hooks: hooks.expect("a store has the live run's hooks"),
        });
        let mut harness = TestHarness {
            runtime: Arc::new(runtime.start(registry)?),
            settle_timeout: self.settle_timeout,
            clock,
            reports,
            seed,
            failpoints: self.failpoints,
            store_faults: self.store_faults,
            restart,
            killer: None,
            published: std::sync::atomic::AtomicU64::new(0),
            node,
        };
        harness.kill_on_crash();
        Ok(harness)
    }
}

/// The seed `DACAPO_SEED` sets (0 when unset).
fn seed_from_environment() -> Result<u64, Error> {
    let Ok(value) = std::env::var(SEED_VARIABLE) else {
        return Ok(0);
    };
    let value = value.trim();
    if value.eq_ignore_ascii_case("random") {
        // Any nonzero number: zero means "no seed".
        let random = uuid::Uuid::new_v4().as_u64_pair().0;
        return Ok(random.max(1));
    }
    value.parse().map_err(|_| {
        Error::Configuration(format!(
            "{SEED_VARIABLE}={value:?} is neither a number nor \"random\""
        ))
    })
}

/// `inner`, except that a handler does not start once the runtime crashed: a process that is
/// gone runs nothing.
fn fenced(inner: Invoke, failpoints: Arc<Failpoints>) -> Invoke {
    Arc::new(move |route, index, decoded, context| {
        let inner = Arc::clone(&inner);
        let failpoints = Arc::clone(&failpoints);
        async move {
            failpoints.fence().await;
            inner(route, index, decoded, context).await
        }
        .boxed()
    })
}

/// What a restart starts again: the runtime's settings on the same store, and its handlers.
struct Restart {
    runtime: RuntimeBuilder,
    /// Whether the runtime had transports, which a restart cannot open again.
    transports: bool,
    registry: Registry,
    store: PendingStore,
    /// The live run's hooks on its store's statements.
    hooks: Arc<StoreHooks>,
}

impl std::fmt::Debug for Restart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restart").finish_non_exhaustive()
    }
}

/// A runtime on virtual time with faults injected, and calls that wait for deliveries to
/// settle and report them.
#[derive(Debug)]
pub struct TestHarness {
    runtime: Arc<Runtime>,
    settle_timeout: Duration,
    clock: Arc<dacapo_actors::VirtualClock>,
    /// Every settled delivery's report, in the order they settled.
    reports: Arc<Mutex<Vec<DeliveryReport>>>,
    seed: u64,
    failpoints: Arc<Failpoints>,
    store_faults: StoreFaults,
    /// `None` without a store given to the builder's `store`.
    restart: Option<Restart>,
    /// Stops the runtime's threads as soon as it crashes.
    killer: Option<tokio::task::JoinHandle<()>>,
    /// Envelopes published so far, for seeded ids.
    published: std::sync::atomic::AtomicU64,
    /// The named node of the store given to the builder (empty without one): seeded ids are
    /// drawn for it, so two named nodes' harnesses on one store publish no id twice.
    node: Arc<str>,
}

impl Drop for TestHarness {
    fn drop(&mut self) {
        if let Some(killer) = self.killer.take() {
            killer.abort();
        }
        if std::thread::panicking() {
            eprintln!(
                "dacapo test harness: seed {seed} (rerun with {SEED_VARIABLE}={seed})",
                seed = self.seed
            );
        }
    }
}

impl TestHarness {
    /// Starts configuring a harness.
    pub fn builder() -> TestHarnessBuilder {
        TestHarnessBuilder {
            runtime: Runtime::builder(),
            faults: Vec::new(),
            settle_timeout: Duration::from_secs(10),
            seed: None,
            failpoints: Arc::default(),
            store_faults: StoreFaults::default(),
            store_faults_taken: std::sync::atomic::AtomicBool::new(false),
            store: None,
        }
    }

    /// The seed of this harness's orders (see [`TestHarnessBuilder::seed`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Crashes the runtime the next time a delivery reaches `point`: there the process dies —
    /// nothing after it runs, nothing drains, nothing of the node is released — and every
    /// call waiting on the harness returns [`Error::Crashed`]. [`restart`](Self::restart)
    /// then starts the next process on the same store under the same node id.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] when the harness runs without a store given to
    /// [`TestHarnessBuilder::store`]: a crash would lose everything held in memory.
    pub fn crash_at(&self, point: Failpoint) -> Result<(), Error> {
        self.arm(point, None)
    }

    /// [`crash_at`](Self::crash_at) for a delivery of `M` only: the first one that reaches
    /// `point`. Others pass it — a message the handler cascaded, say, which may reach the
    /// point first. ([`Failpoint::BeforeOutboxMark`], and [`Failpoint::BeforeAcknowledge`]
    /// for a batch accepted together — `publish_batch`, `Listener::accept_batch` — are passed
    /// by several messages at once, never by a delivery of one type: arm them with
    /// [`crash_at`](Self::crash_at).)
    ///
    /// # Errors
    ///
    /// As [`crash_at`](Self::crash_at).
    pub fn crash_at_message<M: Message>(&self, point: Failpoint) -> Result<(), Error> {
        self.arm(point, Some(M::TYPE.to_owned()))
    }

    fn arm(&self, point: Failpoint, message_type: Option<String>) -> Result<(), Error> {
        if self.restart.is_none() {
            return Err(Error::Configuration(
                "crash_at needs a store given to TestHarnessBuilder::store: in memory, a \
                 crash loses everything"
                    .into(),
            ));
        }
        self.failpoints.arm(point, message_type);
        Ok(())
    }

    /// Where the runtime crashed, if it did and was not restarted since.
    pub fn crashed(&self) -> Option<Failpoint> {
        self.failpoints.crashed()
    }

    /// Starts a new runtime on the same store, under the same node id, with the same
    /// handlers, faults and virtual clock — a process started again after a crash (or after
    /// a shutdown) — and returns once its first recovery round resumed what the last one left.
    /// A runtime still running is killed first, as by a crash.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] without a store given to [`TestHarnessBuilder::store`], or
    /// for a runtime given transports (each opens once; restarted without them, the runtime
    /// would deliver in-process what was routed to a broker); the runtime's start errors; and
    /// [`Error::NotSettled`] (nil envelope id) when a write the killed runtime had begun (on
    /// SQLite, one holding the write lock), a call into it that holds the virtual clock (a
    /// listener's accept caught at a failpoint), or then the first recovery round, does not end
    /// within the settle timeout (each waits up to it). After the accept's case, end the task
    /// that called it (it waits at its failpoint for good) before restarting again.
    pub async fn restart(&mut self) -> Result<(), Error> {
        let Some(restart) = &mut self.restart else {
            return Err(Error::Configuration(
                "restart needs a store given to TestHarnessBuilder::store".into(),
            ));
        };
        if restart.transports {
            // Restarted without them, its relay would deliver in-process what was routed to a
            // broker, and it would no longer listen there.
            return Err(Error::Configuration(
                "restart cannot open the runtime's transports again (a transport opens once, \
                 with the runtime that takes it): crash a node with transports as a process of \
                 its own, and start another"
                    .into(),
            ));
        }
        if let Some(killer) = self.killer.take() {
            killer.abort();
        }
        self.runtime.kill().await;
        // A new run: what the killed one still has under way (a thread of its store's, which
        // the kill leaves running) begins no statement from now on; a commit it had begun
        // ends first, as one a dead process had sent would before anyone started again.
        self.failpoints.reset();
        let writes_ended = async {
            restart.hooks.commits_ended().await;
            // One whose task the kill dropped may still be ending in the database.
            (restart.store.writes_ended)().await;
        };
        tokio::time::timeout(self.settle_timeout, writes_ended)
            .await
            .map_err(|_| Error::NotSettled {
                envelope_id: uuid::Uuid::nil(),
                waited: self.settle_timeout,
            })?;
        // The next run takes back what this node's earlier run held, by received time in
        // milliseconds: it starts a millisecond after the crash, as a real one would.
        // Bounded: a call into the killed runtime that a crash caught holding the clock (a
        // listener's accept at its failpoint) would hold it for ever.
        tokio::time::timeout(
            self.settle_timeout,
            self.clock.advance(Duration::from_millis(1)),
        )
        .await
        .map_err(|_| Error::NotSettled {
            envelope_id: uuid::Uuid::nil(),
            waited: self.settle_timeout,
        })?;
        restart.hooks = Arc::new(StoreHooks::of_the_live_run(
            &self.failpoints,
            &self.store_faults,
        ));
        let runtime = (restart.store.give)(
            restart.runtime.restartable(),
            Arc::clone(&self.clock),
            Arc::clone(&restart.hooks),
        );
        let runtime = runtime.start(restart.registry.replicate())?;
        self.runtime = Arc::new(runtime);
        self.kill_on_crash();
        tokio::time::timeout(self.settle_timeout, self.runtime.first_recovery())
            .await
            .map_err(|_| Error::NotSettled {
                envelope_id: uuid::Uuid::nil(),
                waited: self.settle_timeout,
            })
    }

    /// Starts `fault` on the runtime's store (see [`StoreFault`]), in place of any other.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] when the harness runs without a store given to
    /// [`TestHarnessBuilder::store`].
    pub fn store_fault(&self, fault: StoreFault) -> Result<(), Error> {
        self.store_faults()?.inject(fault);
        Ok(())
    }

    /// The store's faults, to inject, end and count from anywhere (a handler included).
    ///
    /// # Errors
    ///
    /// As [`store_fault`](Self::store_fault).
    pub fn store_faults(&self) -> Result<StoreFaults, Error> {
        if self.restart.is_none() {
            return Err(Error::Configuration(
                "store faults need a store given to TestHarnessBuilder::store".into(),
            ));
        }
        Ok(self.store_faults.clone())
    }

    /// A token that holds the virtual clock while the harness hands work to the runtime.
    fn busy(&self) -> dacapo_actors::Busy {
        dacapo_actors::Timers::Virtual(Arc::clone(&self.clock)).busy()
    }

    /// Seeded, gives a published envelope an id drawn from the seed, the store's node and the
    /// count of envelopes published so far, so that what the runtime orders by the delivery
    /// (timers due together) comes in the same order in every run.
    fn seeded_id(&self, envelope: &mut Envelope) {
        if self.seed == 0 {
            return;
        }
        let count = self
            .published
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut bytes = Vec::with_capacity(16 + self.node.len());
        bytes.extend_from_slice(&self.seed.to_le_bytes());
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(self.node.as_bytes());
        let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &bytes);
        if envelope.correlation_id == Some(envelope.id) {
            envelope.correlation_id = Some(id);
        }
        envelope.id = id;
    }

    /// Watches for a crash, and stops the runtime's threads when it comes.
    fn kill_on_crash(&mut self) {
        if self.restart.is_none() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            // Outside tokio: the calls that wait, and the restart, stop it instead.
            return;
        };
        let failpoints = Arc::clone(&self.failpoints);
        let runtime = Arc::downgrade(&self.runtime);
        self.killer = Some(handle.spawn(async move {
            failpoints.until_crashed().await;
            if let Some(runtime) = runtime.upgrade() {
                runtime.kill().await;
            }
        }));
    }

    /// `work`, unless the runtime crashes first.
    async fn unless_crashed<T>(
        &self,
        work: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        tokio::select! {
            biased;
            at = self.failpoints.until_crashed() => {
                self.runtime.kill().await;
                Err(Error::Crashed { at })
            }
            done = work => done,
        }
    }

    /// The runtime under test.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Moves the runtime's virtual clock forward by `by`, timer by timer: each cooldown,
    /// handler timeout and background round due on the way runs at its own time, once the
    /// runtime is idle (a handler at work is waited for, never timed out by the jump). The
    /// clock also moves by itself to a delivery's next timer whenever nothing in the runtime
    /// works; this moves it further, for what waits on time with the runtime idle (background
    /// rounds: recovery, the outbox relay, cleanup, reaping). It returns once the work due
    /// on the way is done.
    ///
    /// # Errors
    ///
    /// [`Error::NotSettled`] (with a nil envelope id) when the runtime does not get idle for
    /// one of the timers on the way within the settle timeout (a handler blocked on something
    /// the test does only after this returns): each wait is bounded, not the whole span; and
    /// [`Error::Crashed`] when the runtime crashes at a failpoint on the way.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the clock stays where the last woken timer put it.
    pub async fn advance(&self, by: Duration) -> Result<(), Error> {
        self.unless_crashed(async {
            self.clock
                .advance_within(by, Some(self.settle_timeout))
                .await
                .map_err(|_| Error::NotSettled {
                    envelope_id: uuid::Uuid::nil(),
                    waited: self.settle_timeout,
                })
        })
        .await
    }

    /// The report of every delivery that settled so far, in the order they settled — the
    /// messages handlers cascaded included, which no call of the test waited for. Call
    /// [`idle`](Self::idle) first to have every one.
    pub fn reports(&self) -> Vec<DeliveryReport> {
        self.reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Time elapsed on the runtime's virtual clock since the harness started.
    pub fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// The runtime's time now, on its virtual clock: the time to schedule against
    /// (`SendOptions::deliver_at(harness.now() + …)`), where the system's clock would be as
    /// far behind as the virtual one was advanced.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        dacapo_actors::ports::Clock::now(&*self.clock)
    }

    /// Publishes `message` and waits until its delivery settles.
    ///
    /// # Errors
    ///
    /// [`Error::NotSettled`] past the settle timeout, [`Error::Crashed`] when the runtime
    /// crashes at a failpoint first, and the errors of [`Runtime::publish`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the message may be delivered without its report being awaited.
    pub async fn publish<M: Message>(&self, message: &M) -> Result<DeliveryReport, Error> {
        self.publish_with(message, SendOptions::default()).await
    }

    /// [`publish`](Self::publish) with send options.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_with<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<DeliveryReport, Error> {
        let mut envelope = self.runtime.envelope(message, options)?;
        self.seeded_id(&mut envelope);
        self.deliver(envelope).await
    }

    /// Delivers a prepared envelope (malformed, oversized, a copy of an earlier one…) and
    /// waits until it settles.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn deliver(&self, envelope: Envelope) -> Result<DeliveryReport, Error> {
        let id = envelope.id;
        // Accepting is work: the clock waits for it. The token goes only after a yield, so
        // that what a test publishes together (joined futures, polled one after another) is
        // all accepted before time moves for any of it.
        let mut busy = Some(self.busy());
        let deadline = self.deadline();
        self.unless_crashed(async {
            let report = self.accepted(id, &envelope, &mut busy, deadline).await;
            tokio::task::yield_now().await;
            drop(busy);
            self.settled(id, report?, deadline).await
        })
        .await
    }

    /// When a tracked call started now gives up: the settle timeout bounds the whole call,
    /// its accept and its settle (or every copy's) together.
    fn deadline(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        now.checked_add(self.settle_timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
    }

    /// Delivers the same envelope `copies` times, each copy accepted before any settles — a
    /// broker redelivering while the first delivery still runs — and waits for every copy to
    /// settle.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn deliver_concurrently(
        &self,
        envelope: Envelope,
        copies: usize,
    ) -> Result<Vec<DeliveryReport>, Error> {
        let id = envelope.id;
        let deadline = self.deadline();
        self.unless_crashed(async {
            let mut tokens: Vec<_> = (0..copies).map(|_| Some(self.busy())).collect();
            let accepted = futures::future::join_all(
                tokens
                    .iter_mut()
                    .map(|busy| self.accepted(id, &envelope, busy, deadline)),
            )
            .await;
            drop(tokens);
            let mut reports = Vec::with_capacity(copies);
            for receiver in accepted {
                reports.push(self.settled(id, receiver?, deadline).await?);
            }
            Ok(reports)
        })
        .await
    }

    /// Hands `envelope` to the runtime holding `busy` on the clock (given up if the engine
    /// has no room for it yet), until `deadline`.
    async fn accepted(
        &self,
        envelope_id: uuid::Uuid,
        envelope: &Envelope,
        busy: &mut Option<dacapo_actors::Busy>,
        deadline: tokio::time::Instant,
    ) -> Result<oneshot::Receiver<DeliveryReport>, Error> {
        let accept = self.runtime.receive_tracked_holding(envelope.clone(), busy);
        match tokio::time::timeout_at(deadline, accept).await {
            Ok(accepted) => accepted,
            Err(_) => Err(Error::NotSettled {
                envelope_id,
                waited: self.settle_timeout,
            }),
        }
    }

    async fn settled(
        &self,
        envelope_id: uuid::Uuid,
        report: oneshot::Receiver<DeliveryReport>,
        deadline: tokio::time::Instant,
    ) -> Result<DeliveryReport, Error> {
        match tokio::time::timeout_at(deadline, report).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(_)) => Err(Error::Abandoned(envelope_id)),
            Err(_) => Err(Error::NotSettled {
                envelope_id,
                waited: self.settle_timeout,
            }),
        }
    }

    /// Waits until every accepted delivery (cascaded messages and retries included) has
    /// settled.
    ///
    /// # Errors
    ///
    /// [`Error::NotSettled`] (with a nil envelope id) past the settle timeout, and
    /// [`Error::Crashed`] when the runtime crashes at a failpoint first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn idle(&self) -> Result<(), Error> {
        self.unless_crashed(async {
            let idle = async {
                // What the first recovery round resumes counts as accepted work.
                self.runtime.first_recovery().await;
                self.runtime.idle().await;
            };
            tokio::time::timeout(self.settle_timeout, idle)
                .await
                .map_err(|_| Error::NotSettled {
                    envelope_id: uuid::Uuid::nil(),
                    waited: self.settle_timeout,
                })
        })
        .await
    }

    /// Shuts the runtime down; see [`Runtime::shutdown`].
    ///
    /// # Cancel safety
    ///
    /// As [`Runtime::shutdown`].
    pub async fn shutdown(&self) -> ShutdownReport {
        self.runtime.shutdown().await
    }
}
