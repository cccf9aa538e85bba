use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dacapo_actors::ports::{
    Claims, Clock, DeadLetterStore, DurableInbox, Inbox, OutboxStore, SystemClock,
};
use dacapo_actors::{
    Deduplication, DeduplicationRules, Durability, Engine, EngineConfig, EngineParts, HandlerId,
    Message, Module, Registry, RetryPolicy, RetryScope, UnknownMessageTypes,
};

use crate::store::{MemoryClaims, MemoryInbox};
use crate::transport::{InProcess, Pending, Transport};
use crate::{Error, Runtime};

/// Chooses handlers by id and message type.
type HandlerFilter = Box<dyn Fn(&HandlerId, &str) -> bool + Send + Sync>;

/// Configures a [`Runtime`]. Every setting has the default the design documents.
pub struct RuntimeBuilder {
    modules: Vec<Module>,
    retry_policy: RetryPolicy,
    message_policies: HashMap<String, RetryPolicy>,
    handler_timeout: Duration,
    engine: EngineConfig,
    drain_timeout: Duration,
    keep_after_handling: Duration,
    inbox: Option<Arc<dyn Inbox>>,
    /// The store's inbox as a durable one, set with [`store`](Self::store).
    durable: Option<Arc<dyn DurableInbox>>,
    /// A durable inbox given to [`inbox`](Self::inbox), which `build` refuses.
    durable_as_inbox: bool,
    claims: Option<Arc<dyn Claims>>,
    outbox: Option<Arc<dyn OutboxStore>>,
    /// The store given to [`store`](Self::store), for handler transactions.
    store: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Whether the claims are that store's (not set apart with [`claims`](Self::claims)).
    claims_in_store: bool,
    deduplication: bool,
    deduplication_policies: Vec<(HandlerFilter, Deduplication)>,
    deduplication_rules: DeduplicationRules,
    dead_letters: Option<Arc<dyn DeadLetterStore>>,
    clock: Arc<dyn Clock>,
    /// Whether [`clock`](Self::clock) was called (the test harness keeps that clock).
    clock_given: bool,
    /// Brokers that routed message types leave through and arrive from.
    transports: Vec<Transport>,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            modules: Vec::new(),
            retry_policy: RetryPolicy::default(),
            message_policies: HashMap::new(),
            handler_timeout: Duration::from_secs(30),
            engine: EngineConfig::default(),
            drain_timeout: Duration::from_secs(30),
            keep_after_handling: Duration::from_secs(5 * 60),
            inbox: None,
            durable: None,
            durable_as_inbox: false,
            claims: None,
            outbox: None,
            store: None,
            claims_in_store: false,
            deduplication: false,
            deduplication_policies: Vec::new(),
            deduplication_rules: DeduplicationRules::default(),
            dead_letters: None,
            clock: Arc::new(SystemClock),
            clock_given: false,
            transports: Vec::new(),
        }
    }
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("modules", &self.modules)
            .field("retry_policy", &self.retry_policy)
            .field("handler_timeout", &self.handler_timeout)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl RuntimeBuilder {
    /// Registers a module and its handlers.
    #[must_use]
    pub fn module(mut self, module: Module) -> Self {
        self.modules.push(module);
        self
    }

    /// The runtime-wide retry policy (default: 5 retries, 1 s, 6 s, 16 s, 36 s, 60 s).
    #[must_use]
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry_policy = policy;
        self
    }

    /// The retry policy of one message type; it wins over module and runtime policies.
    #[must_use]
    pub fn message_retry_policy<M: Message>(mut self, policy: RetryPolicy) -> Self {
        self.message_policies.insert(M::TYPE.to_owned(), policy);
        self
    }

    /// Which handlers a retry runs again: all of them (the default, as the reference
    /// frameworks do), or only those that failed.
    #[must_use]
    pub fn retry_scope(mut self, scope: RetryScope) -> Self {
        self.engine.retry_scope = scope;
        self
    }

    /// How long a handler may run before it counts as failed (default 30 s).
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// Worker threads running deliveries (default: one per core).
    #[must_use]
    pub fn workers(mut self, workers: usize) -> Self {
        self.engine.workers = workers;
        self
    }

    /// Deliveries accepted and not settled (cooling down included) beyond which publishing
    /// waits (default 1024).
    #[must_use]
    pub fn max_in_flight(mut self, max: usize) -> Self {
        self.engine.max_in_flight = max;
        self
    }

    /// Largest envelope accepted, in bytes (default 1 MiB): larger ones are refused at publish
    /// and dead-lettered at receive.
    #[must_use]
    pub fn max_envelope_size(mut self, bytes: usize) -> Self {
        self.engine.max_envelope_size = bytes;
        self
    }

    /// What happens to messages no handler handles (default: dead-letter).
    #[must_use]
    pub fn unknown_message_types(mut self, policy: UnknownMessageTypes) -> Self {
        self.engine.unknown_message_types = policy;
        self
    }

    /// How long a shutdown waits for deliveries in flight (default 30 s).
    #[must_use]
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// How long handled envelope ids are remembered to discard redeliveries (default 5 min).
    /// A dead-lettered envelope's id is remembered for as long as its letter is kept.
    #[must_use]
    pub fn keep_after_handling(mut self, keep: Duration) -> Self {
        self.keep_after_handling = keep;
        self.sync_retention();
        self
    }

    /// The outbox the relay publishes from, instead of the store's (a store set with
    /// [`store`](Self::store) provides one; without any, no relay runs). Given alone, it
    /// starts the relay at the default intervals.
    ///
    /// Beside a durable store, it must read that store's own database: the store's settles
    /// write what handlers cascaded to its `dacapo_outbox`, and only a relay reading that
    /// table publishes them (an outbox wrapped to observe it, say). An outbox on another
    /// database leaves them there.
    #[must_use]
    pub fn outbox_store(mut self, outbox: Arc<dyn OutboxStore>) -> Self {
        self.outbox = Some(outbox);
        self.engine
            .durability
            .get_or_insert_with(Durability::default);
        self
    }

    /// An inbox whose deliveries live with the process, to deduplicate envelope ids with; it
    /// keeps the dead letters of the deliveries it settles (default: a [`MemoryInbox`]).
    /// Dead-lettering is one transition of the inbox — the letter written and the envelope
    /// settled together — so the two live in one store.
    ///
    /// A durable store ([`Inbox::durable`]: a `SqliteStore`, a `PostgresStore`) is given with
    /// [`store`](Self::store), which also runs its recovery, its outbox relay, its claims and
    /// handler transactions on it; [`build`](Self::build) refuses one given here.
    #[must_use]
    pub fn inbox<S: Inbox + DeadLetterStore>(mut self, inbox: Arc<S>) -> Self {
        // Deliveries settle in `inbox` now, not in the store: the store's handler connections
        // commit at its own level instead of waiting for a settle of its that never comes.
        #[cfg(feature = "sqlite")]
        handlers_on_the_runtimes_pool::<sqlx::Sqlite>(&mut self.store);
        #[cfg(feature = "postgres")]
        handlers_on_the_runtimes_pool::<sqlx::Postgres>(&mut self.store);
        self.inbox = Some(Arc::clone(&inbox) as Arc<dyn Inbox>);
        self.durable_as_inbox = Arc::clone(&inbox).durable().is_some();
        self.durable = None;
        self.dead_letters = Some(inbox);
        self
    }

    /// A durable store for the inbox and the dead letters (a
    /// [`SqliteStore`](crate::store::SqliteStore) or
    /// [`PostgresStore`](crate::store::PostgresStore)): envelopes are persisted before they
    /// count as received, retries survive restarts, handled envelopes are cleaned up after
    /// their retention, and the deliveries of a node that stops are resumed.
    #[must_use]
    pub fn store<S: DurableInbox + DeadLetterStore + Claims + OutboxStore>(
        mut self,
        store: S,
    ) -> Self {
        // The runtime's cutoffs read the clock the store stamps its rows on, unless the
        // runtime has one of its own.
        if !self.clock_given {
            self.clock = store.stamping_clock();
        }
        let store = Arc::new(store);
        self.store = Some(Arc::clone(&store) as Arc<dyn std::any::Any + Send + Sync>);
        self.inbox = Some(Arc::clone(&store) as Arc<dyn Inbox>);
        self.durable = Some(Arc::clone(&store) as Arc<dyn DurableInbox>);
        self.durable_as_inbox = false;
        self.outbox = Some(Arc::clone(&store) as Arc<dyn OutboxStore>);
        // Claims set explicitly with `claims` stay.
        if self.claims.is_none() {
            self.claims = Some(Arc::clone(&store) as Arc<dyn Claims>);
            self.claims_in_store = true;
        }
        self.dead_letters = Some(store);
        self.engine
            .durability
            .get_or_insert_with(Durability::default);
        self.sync_retention();
        self
    }

    /// A broker for the message types `transport` routes: published, they are written to the
    /// store's outbox and sent to the broker by the relay, which marks them sent once the
    /// broker confirmed them; this node listens on the broker for those it handles, and
    /// acknowledges each once its inbox recorded it. The rest stay node-local. Several
    /// transports may be given; a type goes through the first that routes it.
    ///
    /// Needs a durable store ([`store`](Self::store)): its outbox is what makes a publication
    /// survive a broker outage (an outbox set apart with [`outbox_store`](Self::outbox_store)
    /// must take envelopes outside a transaction, [`OutboxStore::enlist`]). The transport runs on a thread of its own, connects (and
    /// declares its topology) in the background, and reconnects with backoff;
    /// [`Runtime::listening`] says when it listens.
    #[must_use]
    pub fn transport(mut self, transport: impl Into<Transport>) -> Self {
        self.transports.push(transport.into());
        self
    }

    /// How often a durable store's node heartbeats and looks for deliveries to resume
    /// (default 10 s).
    #[must_use]
    pub fn recovery_interval(mut self, interval: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .recovery_interval = interval;
        self
    }

    /// How long published outbox rows are kept before the relay removes them (default 1 h).
    #[must_use]
    pub fn outbox_retention(mut self, retention: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .outbox_retention = retention;
        self
    }

    /// An outbox backlog whose oldest envelope waits longer than this logs a warning
    /// (default 1 min).
    #[must_use]
    pub fn outbox_warn_after(mut self, after: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .outbox_warn_after = after;
        self
    }

    /// How many unsettled deliveries one recovery query claims (default 100).
    #[must_use]
    pub fn recovery_batch(mut self, batch: usize) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .recovery_batch = batch;
        self
    }

    /// How often the outbox relay looks for enlisted envelopes (default 200 ms).
    #[must_use]
    pub fn relay_interval(mut self, interval: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .relay_interval = interval;
        self
    }

    /// How many envelopes the outbox relay publishes and marks per batch (default 100).
    #[must_use]
    pub fn relay_batch(mut self, batch: usize) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .relay_batch = batch;
        self
    }

    /// How long idempotency keys recorded by handlers
    /// ([`idempotency::record_key`](crate::idempotency::record_key)) are kept before the cleanup
    /// removes them (default 7 days). Within it, the same key is refused again; size it against
    /// how late a retry, a redelivery or a dead letter's replay could come.
    #[must_use]
    pub fn idempotency_key_retention(mut self, retention: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .idempotency_key_retention = retention;
        self
    }

    /// How often a durable store's expired handled envelopes are removed (default 1 min).
    #[must_use]
    pub fn cleanup_interval(mut self, interval: Duration) -> Self {
        self.engine
            .durability
            .get_or_insert_with(Durability::default)
            .cleanup_interval = interval;
        self
    }

    fn sync_retention(&mut self) {
        if let Some(durability) = &mut self.engine.durability {
            durability.keep_after_handling = self.keep_after_handling;
        }
    }

    /// The wall clock used for timestamps and retention (default: the system's).
    ///
    /// A durable store stamps its rows on a clock of its own
    /// ([`SqlStore::clock`](crate::store::SqlStore::clock)), which the runtime reads too
    /// unless given this one: then give both the same clock, as the test harness does, for the
    /// runtime's cutoffs (retention, expiry) read this one.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self.clock_given = true;
        self
    }

    /// Tells `sink` of every delivery's report as it settles, cascaded deliveries included.
    #[cfg(feature = "testing")]
    pub(crate) fn report_to(mut self, sink: dacapo_actors::ReportSink) -> Self {
        self.engine.reports = Some(sink);
        self
    }

    /// Runs the engine's timers on `clock`, and the wall clock it stamps with too — unless a
    /// clock was given, or a durable store keeps time of its own: its stamps (received,
    /// handled, due) and the runtime's cutoffs must read one clock.
    #[cfg(feature = "testing")]
    pub(crate) fn virtual_time(mut self, clock: Arc<dacapo_actors::VirtualClock>) -> Self {
        self.engine.timers = dacapo_actors::Timers::Virtual(Arc::clone(&clock));
        if !self.clock_given && self.durable.is_none() {
            self.clock = clock;
        }
        self.engine.workers = 0;
        self
    }

    /// Whether transports were given: they open once, with the runtime that takes them, and
    /// [`restartable`](Self::restartable) cannot carry them.
    #[cfg(feature = "testing")]
    pub(crate) fn has_transports(&self) -> bool {
        !self.transports.is_empty()
    }

    /// What [`into_parts`](Self::into_parts) left, again: the settings to start another
    /// runtime (a restart under the test harness), to which the store is given again.
    #[cfg(feature = "testing")]
    pub(crate) fn restartable(&self) -> Self {
        Self {
            modules: Vec::new(),
            retry_policy: self.retry_policy,
            message_policies: HashMap::new(),
            handler_timeout: self.handler_timeout,
            engine: self.engine.clone(),
            drain_timeout: self.drain_timeout,
            keep_after_handling: self.keep_after_handling,
            inbox: self.inbox.clone(),
            durable: self.durable.clone(),
            durable_as_inbox: self.durable_as_inbox,
            // The store's own claims go with the store given again.
            claims: if self.claims_in_store {
                None
            } else {
                self.claims.clone()
            },
            outbox: self.outbox.clone(),
            store: self.store.clone(),
            claims_in_store: self.claims_in_store,
            deduplication: self.deduplication,
            deduplication_policies: Vec::new(),
            deduplication_rules: self.deduplication_rules.clone(),
            dead_letters: self.dead_letters.clone(),
            clock: Arc::clone(&self.clock),
            clock_given: self.clock_given,
            transports: Vec::new(),
        }
    }

    /// Crashes the engine where `failpoints` say.
    #[cfg(feature = "testing")]
    pub(crate) fn failpoints(mut self, failpoints: Arc<dacapo_actors::Failpoints>) -> Self {
        self.engine.failpoints = Some(failpoints);
        self
    }

    /// Where deduplication claims are kept, instead of the store's (or memory).
    #[must_use]
    pub fn claims(mut self, claims: Arc<dyn Claims>) -> Self {
        self.claims = Some(claims);
        self.claims_in_store = false;
        self
    }

    /// Turns logical deduplication on: handlers that opted in claim each message's logical id
    /// before they run, and the claims table is provisioned (in the store, or in memory without
    /// one). Off by default, and then nothing about the schema changes.
    #[must_use]
    pub fn enable_deduplication(mut self) -> Self {
        self.deduplication = true;
        self
    }

    /// How long a claim holds (default 24 h). This *is* the guarantee: past it, the same
    /// logical id is accepted again. Size it against how late a duplicate could arrive; it
    /// must be longer than every deduplicating handler's timeout, or [`build`](Self::build)
    /// refuses it.
    #[must_use]
    pub fn deduplication_window(mut self, window: Duration) -> Self {
        self.engine.deduplication_window = window;
        self
    }

    /// Derives the logical id of every published message of type `M` (`None` or an empty
    /// string: no id). Rules apply in registration order, after an id set explicitly on the
    /// send and before the type's own declaration; none overwrites an id already set.
    #[must_use]
    pub fn deduplicate_by<M: Message>(
        mut self,
        rule: impl Fn(&M) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.deduplication_rules.by_message(rule);
        self
    }

    /// Takes the logical id of any published message from its first top-level member named
    /// in `names`, for message types you can neither change nor write a rule for.
    #[must_use]
    pub fn deduplicate_by_member_named(mut self, names: &[&str]) -> Self {
        self.deduplication_rules.by_member_named(names);
        self
    }

    /// How often expired claims are reaped (default 5 min).
    #[must_use]
    pub fn deduplication_reap_interval(mut self, interval: Duration) -> Self {
        self.engine.deduplication_reap_interval = interval;
        self
    }

    /// How many expired claims one reaping statement deletes, each batch in its own
    /// transaction so that reaping never holds a long lock (default 1000; at least 1). A round
    /// goes on until a batch comes back short.
    #[must_use]
    pub fn deduplication_reap_batch(mut self, batch: usize) -> Self {
        self.engine.deduplication_reap_batch = batch;
        self
    }

    /// Opts every handler for which `filter` holds (given its id and message type) in to
    /// `deduplication`, unless it chose its own. A filter is required on purpose: applied to
    /// every handler, a required logical id would dead-letter all traffic that has none.
    #[must_use]
    pub fn require_deduplication(
        mut self,
        filter: impl Fn(&HandlerId, &str) -> bool + Send + Sync + 'static,
        deduplication: Deduplication,
    ) -> Self {
        self.deduplication_policies
            .push((Box::new(filter), deduplication));
        self
    }

    /// Refuses a timer of zero: it would fire without pause and spin the thread it runs on
    /// (and a zero relay interval leaves the relay no time to publish at all).
    fn check_intervals(&self) -> Result<(), Error> {
        let durability = self.engine.durability.clone().unwrap_or_default();
        let node_timeout = self.durable.as_ref().map(|durable| durable.node_timeout());
        let intervals = [
            ("recovery_interval", Some(durability.recovery_interval)),
            ("relay_interval", Some(durability.relay_interval)),
            ("cleanup_interval", Some(durability.cleanup_interval)),
            (
                "deduplication_reap_interval",
                Some(self.engine.deduplication_reap_interval),
            ),
            ("the store's node_timeout", node_timeout),
        ];
        match intervals
            .into_iter()
            .find(|(_, interval)| interval.is_some_and(|interval| interval.is_zero()))
        {
            Some((name, _)) => Err(Error::Configuration(format!(
                "{name} is zero: a timer of zero would run without pause; give it at least a \
                 millisecond"
            ))),
            None => Ok(()),
        }
    }

    /// The handler registry this builder would run, to adjust before starting.
    pub(crate) fn into_parts(self) -> Result<(Registry, Self), Error> {
        self.check_intervals()?;
        if !self.transports.is_empty() && self.durable.is_none() {
            return Err(Error::Configuration(
                "a transport needs a durable store (RuntimeBuilder::store): routed messages \
                 leave through its outbox"
                    .into(),
            ));
        }
        if self.durable_as_inbox {
            return Err(Error::Configuration(
                "a durable store was given to RuntimeBuilder::inbox; give it to \
                 RuntimeBuilder::store, which also runs its recovery, outbox and claims"
                    .into(),
            ));
        }
        let mut this = self;
        let modules = std::mem::take(&mut this.modules);
        let mut registry = Registry::new(
            modules,
            this.retry_policy,
            std::mem::take(&mut this.message_policies),
            this.handler_timeout,
        )?;
        for (filter, deduplication) in std::mem::take(&mut this.deduplication_policies) {
            registry.require_deduplication(
                |entry| filter(&entry.id, entry.message_type),
                &deduplication,
            );
        }
        if this.deduplication {
            this.check_deduplication_window(&registry)?;
        }
        Ok((registry, this))
    }

    /// A claim must outlast its handler's run: one that expires while its handler still runs
    /// is taken by the next envelope with the same logical id, whose handler then runs beside
    /// it.
    fn check_deduplication_window(&self, registry: &Registry) -> Result<(), Error> {
        let window = self.engine.deduplication_window;
        let longest = registry
            .entries()
            .filter(|entry| entry.deduplication.is_some())
            .map(|entry| (registry.timeout_of(entry), &entry.id))
            .max_by_key(|(timeout, _)| *timeout);
        match longest {
            Some((timeout, handler)) if window <= timeout => Err(Error::Configuration(format!(
                "the deduplication window ({window:?}) must be longer than every deduplicating \
                 handler's timeout ({handler}'s is {timeout:?}): a claim that expires while its \
                 handler runs lets the same logical id run again beside it"
            ))),
            _ => Ok(()),
        }
    }

    /// Starts the runtime's threads.
    ///
    /// # Errors
    ///
    /// [`Error::Registry`] for inconsistent registrations (a handler registered twice, a
    /// policy for a type nobody handles), [`Error::Configuration`] for a durable store given to
    /// [`inbox`](Self::inbox), an interval of zero (recovery, relay, cleanup, reaping, the
    /// store's node timeout) or a deduplication window no longer than a handler's timeout, and
    /// [`Error::Startup`] if threads cannot start.
    pub fn build(self) -> Result<Runtime, Error> {
        let (registry, this) = self.into_parts()?;
        this.start(registry)
    }

    pub(crate) fn start(self, registry: Registry) -> Result<Runtime, Error> {
        let (inbox, dead_letters) = match (self.inbox, self.dead_letters) {
            (Some(inbox), Some(dead_letters)) => (inbox, dead_letters),
            _ => {
                let memory = Arc::new(MemoryInbox::new(
                    self.keep_after_handling,
                    Arc::clone(&self.clock),
                ));
                (
                    Arc::clone(&memory) as Arc<dyn Inbox>,
                    memory as Arc<dyn DeadLetterStore>,
                )
            }
        };
        let max_envelope_size = self.engine.max_envelope_size;
        let routes: Vec<crate::transport::Routes> =
            self.transports.iter().map(|t| t.routes.clone()).collect();
        let handled: Vec<&'static str> = registry.entries().map(|e| e.message_type).collect();
        let (outbound, pending) = Pending::prepare(self.transports);
        let engine = Engine::start(
            self.engine,
            EngineParts {
                registry,
                inbox: Arc::clone(&inbox),
                durable: self.durable,
                clock: Arc::clone(&self.clock),
                rules: self.deduplication_rules,
                outbox: self.outbox.clone(),
                outbound: outbound
                    .map(|outbound| Arc::new(outbound) as Arc<dyn dacapo_actors::ports::Outbound>),
                dead_letters: Some(Arc::clone(&dead_letters)),
                store: self.store,
                claims_in_store: self.claims_in_store,
                claims: self.deduplication.then(|| {
                    self.claims
                        .unwrap_or_else(|| Arc::new(MemoryClaims::default()) as Arc<dyn Claims>)
                }),
            },
        )?;
        let transport = InProcess::new(engine.dispatcher().clone());
        let hosts = pending
            .into_iter()
            .map(|pending| {
                pending.start(
                    &handled,
                    crate::transport::Listener::new(
                        transport.clone(),
                        Arc::clone(&dead_letters),
                        Arc::clone(&self.clock),
                    ),
                    Arc::clone(&dead_letters),
                    Arc::clone(&self.clock),
                    max_envelope_size,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Runtime {
            engine,
            transport,
            routes,
            hosts,
            inbox,
            dead_letters,
            clock: Arc::clone(&self.clock),
            outbox: self.outbox,
            max_envelope_size,
            drain_timeout: self.drain_timeout,
        })
    }
}

/// Gives `store`, when it is a `SqlStore<D>`, handler connections from its runtime's own pool.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn handlers_on_the_runtimes_pool<D: crate::store::sql::Dialect>(
    store: &mut Option<Arc<dyn std::any::Any + Send + Sync>>,
) {
    let on_its_pool = store
        .as_deref()
        .and_then(|store| store.downcast_ref::<crate::store::sql::SqlStore<D>>())
        .map(|store| store.clone().beside_another_inbox());
    if let Some(on_its_pool) = on_its_pool {
        *store = Some(Arc::new(on_its_pool));
    }
}
