//! The durable store, written once for both backends against [`Database`].

use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use dacapo_actors::ports::{
    Claim, ClaimOutcome, Claims, Clock, DeadLetterStore, DurableInbox, Fenced, Handled, Inbox,
    OutboxBacklog, OutboxRow, OutboxStore, Receipt, Replay, ReplayTo, Resumable, RetryRecord,
    ScheduledEnvelope, SystemClock,
};
use dacapo_actors::{DeadLetter, DeadLetterFilter, DeadLetterReason, Envelope, Error};
use futures::stream::BoxStream;
use uuid::Uuid;

use super::columns::{
    DeadLetterColumns, EnvelopeColumns, attempts, failures_from, from_json, id_text, json, millis,
    parse_id, stored_attempts, time,
};
use super::database::{Database, Row, Value};
use super::group_commit::{GroupCommit, Grouping, Write, Written, in_one_transaction};
use super::node_hold::NodeHold;
use super::statements::*;
use super::{Dialect, claim_lost};

/// The durable inbox, dead letters, deduplication claims and outbox in one SQL database:
/// [`SqliteStore`](crate::store::SqliteStore) (`SqlStore<sqlx::Sqlite>`) or
/// [`PostgresStore`](crate::store::PostgresStore) (`SqlStore<sqlx::Postgres>`).
///
/// Tables are prefixed `dacapo_` and created by the store's own migrations when it opens, so
/// they sit beside the application's tables; [`pool`](Self::pool) is the application's too.
pub struct SqlStore<D: Dialect> {
    pool: sqlx::Pool<D>,
    /// The runtime's own pool (the application's when it has one connection only).
    engine: sqlx::Pool<D>,
    /// Where handler connections come from when not from `engine`: connections whose commits
    /// leave their flush to the delivery's settle (on a SQLite file in WAL mode, on
    /// PostgreSQL).
    handlers: Option<Arc<super::HandlerPool<D>>>,
    /// `engine`, as the store's code reaches it.
    db: Database,
    /// Accepts and settles of many deliveries, committed together.
    group: Arc<GroupCommit>,
    /// Makes a [`Database`] of a pool of this backend.
    #[cfg(feature = "testing")]
    database: fn(sqlx::Pool<D>) -> Database,
    /// The thread that opened the connections the store opens as it starts (PostgreSQL's),
    /// and drives them while it lives: the runtime that opens the store may stay idle after,
    /// which would leave a connection opened on it waiting, whichever runtime uses it.
    opened_on: Option<Arc<super::own_thread::OwnThread>>,
    node: Arc<str>,
    /// Whether `node` was named (a random name needs no hold: no other process has it).
    named: bool,
    /// This process's hold on `node`, taken before the store's first write under it.
    hold: Arc<NodeHold>,
    node_timeout: Duration,
    clock: Arc<dyn Clock>,
    /// Set once the claims table exists, so a claim never meets a missing table.
    claims_ready: Arc<tokio::sync::OnceCell<()>>,
    /// Whether the runtime's deliveries are rows of this store's inbox (not of an inbox of
    /// their own, beside which this store only serves handler transactions).
    deliveries_here: bool,
    /// Idempotency keys of this process's HTTP requests in progress, shared by every layer
    /// on this store.
    #[cfg(feature = "http")]
    http_in_flight: Arc<std::sync::Mutex<HashSet<String>>>,
    dialect: PhantomData<fn() -> D>,
}

impl<D: Dialect> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            engine: self.engine.clone(),
            handlers: self.handlers.clone(),
            db: self.db.clone(),
            group: Arc::clone(&self.group),
            #[cfg(feature = "testing")]
            database: self.database,
            opened_on: self.opened_on.clone(),
            node: Arc::clone(&self.node),
            named: self.named,
            hold: Arc::clone(&self.hold),
            node_timeout: self.node_timeout,
            clock: Arc::clone(&self.clock),
            claims_ready: Arc::clone(&self.claims_ready),
            deliveries_here: self.deliveries_here,
            #[cfg(feature = "http")]
            http_in_flight: Arc::clone(&self.http_in_flight),
            dialect: PhantomData,
        }
    }
}

impl<D: Dialect> std::fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("database", &<D as sqlx::Database>::NAME)
            .field("node", &self.node)
            .field("node_timeout", &self.node_timeout)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> SqlStore<D> {
    /// A store whose schema is created or brought up to date first, through the application's
    /// `pool`, and which runs on `engine`; `database` makes either a [`Database`].
    pub(crate) async fn open_on(
        pool: sqlx::Pool<D>,
        engine: sqlx::Pool<D>,
        database: fn(sqlx::Pool<D>) -> Database,
    ) -> Result<Self, Error> {
        migrate(&database(pool.clone())).await?;
        Ok(Self::on(pool, engine, database))
    }

    /// A store on a database whose schema must already be this version's: nothing is created
    /// or migrated. `at` names the database in the error.
    pub(crate) async fn existing_on(
        pool: sqlx::Pool<D>,
        engine: sqlx::Pool<D>,
        database: fn(sqlx::Pool<D>) -> Database,
        at: String,
    ) -> Result<Self, crate::Error> {
        let db = database(pool.clone());
        let present: i64 = db.fetch_one(db.has_schema(), &[]).await?.get("present")?;
        let version: i64 = if present > 0 {
            db.fetch_one(SCHEMA_VERSION, &[]).await?.get("version")?
        } else {
            0
        };
        let newest = db.migrations().last().map_or(0, |m| m.version);
        if version < newest {
            let at = if version == 0 {
                at
            } else {
                format!(
                    "{at} (it is at version {version}, this build needs {newest}: start the \
                     application once, which migrates it)"
                )
            };
            return Err(crate::Error::NoSchema { at });
        }
        Ok(Self::on(pool, engine, database))
    }

    fn on(
        pool: sqlx::Pool<D>,
        engine: sqlx::Pool<D>,
        database: fn(sqlx::Pool<D>) -> Database,
    ) -> Self {
        Self {
            db: database(engine.clone()),
            group: GroupCommit::new(Grouping {
                commits: D::CONCURRENT_COMMITS,
                linger: D::LINGER,
                ..Grouping::default()
            }),
            #[cfg(feature = "testing")]
            database,
            opened_on: None,
            pool,
            engine,
            handlers: None,
            node: Arc::from(format!("node-{}", Uuid::new_v4().simple())),
            named: false,
            hold: Arc::default(),
            node_timeout: Duration::from_secs(30),
            clock: Arc::new(SystemClock),
            claims_ready: Arc::default(),
            deliveries_here: true,
            #[cfg(feature = "http")]
            http_in_flight: Arc::default(),
            dialect: PhantomData,
        }
    }

    /// The write that records `envelope` as received at `now`.
    fn receive_write(&self, envelope: &Envelope, now: DateTime<Utc>) -> Result<Write, Error> {
        Ok(Write::Receive {
            columns: EnvelopeColumns::of(envelope)?,
            // The engine starts the first attempt right after: a crash from here counts it.
            attempts: stored_attempts(envelope.attempts.saturating_add(1)),
            node: Arc::clone(&self.node),
            now: millis(now),
            due_at: envelope.scheduled_for.filter(|at| *at > now).map(millis),
        })
    }

    /// Returns once a write the database had begun for a runtime that was killed has ended.
    /// On SQLite, a kill drops the task that awaited a write, not the write: the connection's
    /// thread goes on with it, holding the write lock, which a write transaction of this
    /// store's waits for; tried again for as long as SQLite answers busy, so the caller's
    /// timeout bounds the wait. (A write that was still waiting for the lock is not seen.)
    /// On PostgreSQL the harness does not wait: the server runs a gone client's statement to
    /// its end by itself.
    #[cfg(feature = "testing")]
    pub(crate) async fn writes_under_way_ended(&self) {
        if D::NAME != "SQLite" {
            return;
        }
        loop {
            let ended = match self.db.begin().await {
                Ok(tx) => tx.rollback().await,
                Err(error) => Err(error),
            };
            match ended {
                Ok(()) => return,
                Err(error) if sqlite_busy(&error) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(error) => {
                    tracing::warn!(%error, "test harness: could not wait for the killed runtime's writes");
                    return;
                }
            }
        }
    }

    /// This store with the test harness's hooks on the runtime's statements.
    #[cfg(feature = "testing")]
    pub(crate) fn with_test_hooks(&self, hooks: Arc<crate::testing::StoreHooks>) -> Self {
        let mut store = self.clone();
        store.db = self.db.with_hooks(hooks);
        // A group commits on one database handle: this one's statements carry the hooks.
        store.group = GroupCommit::new(self.group.grouping());
        store
    }

    /// This store on a new runtime pool of the same settings, for a runtime started after
    /// another was killed: a PostgreSQL connection belongs to the tokio runtime that opened
    /// it, and the killed runtime's went with it. SQLite's connections run on threads of
    /// their own and outlive it, and an in-memory database lives only in its connection: its
    /// pool is kept.
    #[cfg(feature = "testing")]
    pub(crate) fn with_new_engine_pool(&self) -> Self {
        if D::NAME == "SQLite" {
            return self.clone();
        }
        let engine = self
            .engine
            .options()
            .clone()
            .connect_lazy_with((*self.engine.connect_options()).clone());
        let mut store = self.clone();
        store.db = match self.db.hooks() {
            Some(hooks) => (self.database)(engine.clone()).with_hooks(hooks),
            None => (self.database)(engine.clone()),
        };
        if let Some(handlers) = &self.handlers {
            store.handlers = Some(Arc::new(handlers.on_new_pools(&engine)));
        }
        store.engine = engine;
        store.group = GroupCommit::new(self.group.grouping());
        store
    }

    /// How accepts, attempt begins, scheduled retries and settles are committed together
    /// (group commit): at most `max_batch` deliveries' writes in one transaction (default
    /// 128; 1 commits each alone), and, when three or more wait, the group waits `linger` for
    /// others to join first, or until it is full (default 150 µs on SQLite, zero on PostgreSQL; zero makes a batch
    /// what arrived while the previous commit ran). The wait is on tokio's timer, which counts
    /// whole milliseconds: it ends at the first tick after `linger`, so 150 µs waits 0.15 to
    /// 1.15 ms. A lone write never lingers, nor two (a publisher's accept and the settle of its
    /// last message, with no one else to come). Each caller still returns only once its own
    /// write committed, and a batch that fails fails every write in it. SQLite commits one
    /// group at a time (it has one writer); PostgreSQL up to four at once, since it flushes
    /// concurrent commits together: a write arriving while a group commits starts the next
    /// group at once, which lingers as any does.
    #[must_use]
    pub fn group_commit(mut self, max_batch: usize, linger: Duration) -> Self {
        self.group = GroupCommit::new(Grouping {
            max_batch,
            linger,
            ..self.group.grouping()
        });
        self
    }

    /// This node's name in the store (default: random per process). Give each node of a fleet
    /// its own; a node restarted under the same name resumes its own deliveries at once.
    ///
    /// One live process per name: before its first write under the name, the store holds it —
    /// a lock on the file `<database>.node-<uuid>.lock` next to a SQLite file, an advisory
    /// lock in a PostgreSQL session of its own (checked every 2 s, taken again if the session
    /// was lost) — which the system lets go when the process ends, `kill -9` included. A
    /// process that finds the name held waits up to [`node_timeout`](Self::node_timeout) for
    /// it, then its writes fail with [`Error::NodeHeld`](crate::Error::NodeHeld). Stores of
    /// one process share the hold.
    #[must_use]
    pub fn node_id(mut self, node: impl Into<Arc<str>>) -> Self {
        self.node = node.into();
        self.named = true;
        self.hold = Arc::default();
        self
    }

    /// How long a node may miss heartbeats before other nodes take over its unsettled
    /// deliveries and claims (default 30 s), and how long a process waits for a node another
    /// process holds. Each heartbeat carries it: another node takes this one for dead only once
    /// both this timeout and its own have passed since the last beat. A node heartbeats every
    /// recovery interval (default 10 s) or third of this timeout, whichever is shorter.
    #[must_use]
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = timeout;
        self
    }

    /// The wall clock used for stored times (default: the system's).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// This node's name where it was given ([`node_id`](Self::node_id)), not drawn at random.
    #[cfg(feature = "testing")]
    pub(crate) fn named_node(&self) -> Option<&str> {
        self.named.then_some(&*self.node)
    }

    /// Holds this store's node, if it was named, before a write under it.
    async fn held(&self) -> Result<(), Error> {
        if !self.named {
            return Ok(());
        }
        self.hold
            .ensure(&self.node, self.node_timeout, self.db.node_target())
            .await
    }

    /// The connection pool, for the application's own queries. The runtime runs on a pool of
    /// its own with the same options — so up to twice the connections, three times on
    /// PostgreSQL, whose handler connections have a third — (a one-connection
    /// SQLite pool, such as an in-memory database, is shared): the connections the runtime
    /// opens for its own writes and handler transactions, on its own threads, never end up in
    /// the application's pool. Queries a handler runs on this pool do open connections on
    /// the runtime's threads: give handlers [`transaction`](crate::transaction) instead, or a
    /// pool of their own.
    pub fn pool(&self) -> &sqlx::Pool<D> {
        &self.pool
    }

    /// Idempotency keys of this process's HTTP requests in progress.
    #[cfg(feature = "http")]
    pub(crate) fn http_in_flight(&self) -> &Arc<std::sync::Mutex<HashSet<String>>> {
        &self.http_in_flight
    }

    /// The turn to write on SQLite, for a handler transaction (or connection) on the
    /// runtime's pool: it then waits for the runtime's writes, and they for it, in turn.
    pub(crate) async fn write_turn(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        self.db.handler_write_turn().await
    }

    /// The turn of a handler transaction on the runtime's pool ([`Database::handler_transaction_turn`]).
    pub(crate) async fn handler_transaction_turn(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        self.db.handler_transaction_turn().await
    }

    /// On PostgreSQL, where handler connections come from the runtime's own pool, the slot
    /// one holds there ([`Database::handler_slot`]); `None` otherwise.
    pub(crate) async fn handler_connection_slot(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        match &self.handlers {
            Some(_) => Ok(None),
            None => self.db.handler_slot().await,
        }
    }

    /// The runtime's own pool, which handler transactions run on.
    pub(crate) fn engine_pool(&self) -> &sqlx::Pool<D> {
        &self.engine
    }

    /// The pool handler connections come from, and, when their commits leave their sync to
    /// the settle, what they report their opening and closing to.
    pub(crate) fn handler_pool(&self) -> (&sqlx::Pool<D>, Option<&Arc<super::Unsynced>>) {
        match &self.handlers {
            Some(handlers) => (&handlers.pool, Some(&handlers.unsynced)),
            None => (&self.engine, None),
        }
    }

    /// This store with handler connections from `handlers`.
    pub(crate) fn with_handler_pool(mut self, handlers: super::HandlerPool<D>) -> Self {
        self.handlers = Some(Arc::new(handlers));
        self
    }

    /// This store with the connections it opened as it started driven by `thread`.
    #[cfg(feature = "postgres")]
    pub(crate) fn opened_on(mut self, thread: Arc<super::own_thread::OwnThread>) -> Self {
        self.opened_on = Some(thread);
        self
    }

    /// This store beside an inbox of the runtime's own: its deliveries are no rows here, and
    /// handler connections come from the runtime's own pool.
    pub(crate) fn beside_another_inbox(mut self) -> Self {
        self.handlers = None;
        self.deliveries_here = false;
        self
    }

    /// Whether the runtime's deliveries are rows of this store's inbox.
    pub(crate) fn deliveries_here(&self) -> bool {
        self.deliveries_here
    }

    /// The current time on the store's clock.
    pub(crate) fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// Until when this node, beating at `now`, asks to be taken for alive.
    fn alive_until(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        chrono::Duration::from_std(self.node_timeout)
            .ok()
            .and_then(|timeout| now.checked_add_signed(timeout))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }

    /// A node that heartbeat since then is alive, as is one whose own expiry has not passed;
    /// others are taken for dead.
    fn alive_since(&self) -> DateTime<Utc> {
        chrono::Duration::from_std(self.node_timeout)
            .ok()
            .and_then(|timeout| self.now().checked_sub_signed(timeout))
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// An unsettled row as a delivery to resume.
    fn unsettled(row: &Row) -> Result<Resumable, Error> {
        let stored: i32 = row.get("attempts")?;
        let execute_at: Option<i64> = row.get("execute_at")?;
        let failures: Option<String> = row.get("failures")?;
        let succeeded: Option<String> = row.get("succeeded")?;
        let cascaded: Option<String> = row.get("cascaded")?;
        Ok(Resumable::new(
            EnvelopeColumns::read(row)?.into_envelope(attempts(stored))?,
            execute_at.map(time).transpose()?,
            failures_from(failures.as_deref())?,
            succeeded
                .as_deref()
                .map(from_json)
                .transpose()?
                .unwrap_or_default(),
            cascaded
                .as_deref()
                .map(from_json)
                .transpose()?
                .unwrap_or_default(),
        ))
    }

    /// A claimed row as a delivery to resume; a row that cannot be read (a column written by
    /// hand, say) is logged and left, owned by this node, instead of stopping the recovery of
    /// every row after it.
    fn readable(row: &Row) -> Option<Resumable> {
        match Self::unsettled(row) {
            Ok(resumable) => Some(resumable),
            Err(error) => {
                let id: Option<String> = row.get("id").ok();
                tracing::error!(
                    messaging.message.id = ?id,
                    %error,
                    "an unsettled inbox row cannot be read; it is left for an operator"
                );
                None
            }
        }
    }

    fn dead_letter_row(row: &Row) -> Result<DeadLetter, Error> {
        let reason: String = row.get("reason")?;
        let failures: String = row.get("failures")?;
        let stored: i32 = row.get("attempts")?;
        let first: i64 = row.get("first_failure_at")?;
        let last: i64 = row.get("last_failure_at")?;
        let mut letter = DeadLetter::failed(
            EnvelopeColumns::read(row)?.into_envelope(0)?,
            from_json(&reason)?,
            from_json(&failures)?,
            time(first)?,
            time(last)?,
        );
        letter.attempts = attempts(stored);
        Ok(letter)
    }

    fn limit(limit: usize) -> Value<'static> {
        Value::Int64(i64::try_from(limit).unwrap_or(i64::MAX))
    }
}

/// Creates the schema, or brings it up to date, in one transaction (under a lock where nodes
/// may start together).
async fn migrate(db: &Database) -> Result<(), Error> {
    let mut tx = db.begin().await?;
    for lock in db.lock_migrations() {
        tx.execute(lock, &[]).await?;
    }
    tx.execute(MIGRATIONS_TABLE, &[]).await?;
    for migration in db.migrations() {
        let version = Value::Int64(migration.version);
        let applied: i64 = tx
            .fetch_one(APPLIED_MIGRATION, &[version])
            .await?
            .get("applied")?;
        if applied > 0 {
            continue;
        }
        tx.execute_script(migration.sql).await?;
        let now = Value::Int64(millis(Utc::now()));
        let description = Value::Text(migration.description);
        tx.execute(RECORD_MIGRATION, &[version, description, now])
            .await?;
    }
    tx.commit().await
}

#[cfg(feature = "sqlite")]
impl SqlStore<sqlx::Sqlite> {
    /// The turn to write for a handler connection on SQLite's handler pool, the connection
    /// parked with the turn if there is one, and where to park it once the handler is done;
    /// `None` when handler connections come from the runtime's own pool, which parks none (its
    /// readers would miss the connection).
    pub(crate) async fn parked_handler_turn(
        &self,
    ) -> Result<Option<crate::transaction::ParkedTurn<sqlx::Sqlite>>, Error> {
        let (Some(handlers), Some(parking)) = (&self.handlers, self.db.parking().cloned()) else {
            return Ok(None);
        };
        let unsynced = Arc::clone(&handlers.unsynced);
        let (turn, taken) = self.db.handler_turn().await?;
        let (connection, counted, interrupt) = match taken {
            Some(taken) => (taken.connection, taken.counted, taken.interrupt),
            None => {
                let mut connection = handlers.pool.acquire().await.map_err(super::db_error)?;
                // Fresh from the pool: a progress handler of its own, to stop what a handler
                // given up on leaves running.
                let interrupt = super::Interrupt::install(&mut connection)
                    .await
                    .map_err(super::db_error)?;
                (connection, false, interrupt)
            }
        };
        // Taken while still counted open, it may still run what the last holder left (a
        // statement whose future that handler dropped, its own business): an interrupt would
        // stop that too, so only a connection that was quiet, or fresh, when taken is
        // interrupted for its holder.
        let only_its_holders = !counted;
        Ok(Some(crate::transaction::ParkedTurn {
            turn,
            connection: Some((connection, counted)),
            park: Box::new(move |connection, given_up| {
                // Inside a transaction, its rollback is queued behind the statement, and an
                // interrupted write would roll the transaction back under sqlx's feet: the
                // next holder of the turn waits for it to end instead (see `parking`).
                if given_up
                    && only_its_holders
                    && !sqlx::Connection::is_in_transaction(&*connection)
                {
                    interrupt.raise();
                }
                // Taken still counted open, what this handler wrote may be inside a
                // transaction an earlier one left open: it commits rather than rolls back.
                parking.park(connection, Some(unsynced), interrupt, !only_its_holders);
            }),
        }))
    }
}

/// What one insert of an inbox row answered.
#[async_trait]
impl<D: Dialect> Inbox for SqlStore<D> {
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, Error> {
        self.held().await?;
        let write = self.receive_write(envelope, self.now())?;
        match self.group.write(&self.db, write).await? {
            Written::Received(receipt) => Ok(receipt),
            _ => Err(Error::store("a receive answered as another write")),
        }
    }

    async fn receive_batch(&self, envelopes: &[Envelope]) -> Result<Vec<Receipt>, Error> {
        self.held().await?;
        let now = self.now();
        let writes = envelopes
            .iter()
            .map(|envelope| self.receive_write(envelope, now))
            .collect::<Result<Vec<_>, _>>()?;
        in_one_transaction(&self.db, &writes)
            .await?
            .into_iter()
            .map(|written| match written {
                Written::Received(receipt) => Ok(receipt),
                _ => Err(Error::store("a receive answered as another write")),
            })
            .collect()
    }

    async fn never_started(&self, ids: &[Uuid]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        self.held().await?;
        let mut tx = self.db.begin().await?;
        for id in ids {
            let id = id_text(*id);
            tx.execute(NEVER_STARTED, &[Value::Text(&id), Value::Text(&self.node)])
                .await?;
        }
        tx.commit().await
    }

    async fn begin_attempt(&self, id: Uuid, attempt: u32) -> Result<Fenced, Error> {
        self.held().await?;
        let write = Write::BeginAttempt {
            id: id_text(id),
            attempt: stored_attempts(attempt),
            previous: stored_attempts(attempt.saturating_sub(1)),
            node: Arc::clone(&self.node),
        };
        match self.group.write(&self.db, write).await? {
            Written::Begun(fenced) => Ok(fenced),
            _ => Err(Error::store("an attempt's begin answered as another write")),
        }
    }

    async fn schedule_retry(&self, record: RetryRecord<'_>) -> Result<Fenced, Error> {
        self.held().await?;
        let write = Write::ScheduleRetry {
            id: id_text(record.envelope.id),
            attempts: stored_attempts(record.envelope.attempts),
            due_at: millis(record.due_at),
            failures: json(&record.failures)?,
            succeeded: json(&record.succeeded)?,
            cascaded: if record.cascaded.is_empty() {
                None
            } else {
                Some(json(&record.cascaded)?)
            },
            node: Arc::clone(&self.node),
        };
        match self.group.write(&self.db, write).await? {
            Written::Scheduled(fenced) => Ok(fenced),
            _ => Err(Error::store("a scheduled retry answered as another write")),
        }
    }

    async fn settle_handled(
        &self,
        id: Uuid,
        attempts: u32,
        cascaded: &[Envelope],
    ) -> Result<Handled, Error> {
        self.held().await?;
        let write = Write::Settle {
            id: id_text(id),
            node: Arc::clone(&self.node),
            now: millis(self.now()),
            attempts: attempts_bound(attempts),
            cascaded: cascaded
                .iter()
                .map(EnvelopeColumns::of)
                .collect::<Result<_, _>>()?,
        };
        match self.group.write(&self.db, write).await? {
            Written::Settled(handled) => Ok(handled),
            _ => Err(Error::store("a settle answered as another write")),
        }
    }

    async fn dead_letter(
        &self,
        letter: &DeadLetter,
        release_claims: bool,
    ) -> Result<Fenced, Error> {
        self.held().await?;
        if release_claims {
            self.provision().await?;
        }
        let id = id_text(letter.envelope.id);
        let mut tx = self.db.begin().await?;
        let mark = [
            Value::Text(&id),
            Value::Int64(millis(self.now())),
            Value::Text(&self.node),
            Value::Int32(attempts_bound(letter.attempts)),
        ];
        if tx.execute(MARK_HANDLED, &mark).await? == 0 {
            tx.rollback().await?;
            return Ok(Fenced::OwnedElsewhere);
        }
        let columns = DeadLetterColumns::of(letter)?;
        let values = columns.values();
        tx.execute(PUT_DEAD_LETTER, &values).await?;
        if release_claims {
            let values = [
                Value::Text(&id),
                Value::Text(&self.node),
                Value::Int64(millis(self.alive_since())),
                Value::Int64(millis(self.now())),
            ];
            tx.execute(RELEASE_ENVELOPE_CLAIMS, &values).await?;
        }
        self.db
            .pass(
                dacapo_actors::Failpoint::DeadLetterMove,
                &letter.envelope.message_type,
            )
            .await;
        tx.commit().await?;
        Ok(Fenced::Written)
    }

    async fn replay(&self, id: Uuid, to: ReplayTo) -> Result<Replay, Error> {
        self.held().await?;
        let id = id_text(id);
        let mut tx = self.db.begin().await?;
        // Removed first, in the transaction: a concurrent replay waits for this one and then
        // finds nothing to remove.
        let Some(row) = tx
            .fetch_optional(REMOVE_DEAD_LETTER, &[Value::Text(&id)])
            .await?
        else {
            let status = tx.fetch_optional(INBOX_STATUS, &[Value::Text(&id)]).await?;
            tx.rollback().await?;
            let status: Option<String> = status.map(|row| row.get("status")).transpose()?;
            return Ok(match status.as_deref() {
                Some("incoming" | "scheduled") => Replay::InProgress,
                _ => Replay::NotFound,
            });
        };
        let letter = Self::dead_letter_row(&row)?;
        if matches!(letter.reason, DeadLetterReason::Unreadable(_)) {
            tx.rollback().await?;
            return Ok(Replay::Unreadable);
        }
        let mut envelope = letter.envelope;
        envelope.attempts = 0;
        if matches!(letter.reason, DeadLetterReason::Undeliverable(_)) {
            // It never reached the broker: out again through the outbox, at its end, not into
            // this node's inbox (whose handlers, if any, are not the ones it was sent to).
            let columns = EnvelopeColumns::of(&envelope)?;
            tx.execute(DELETE_OUTBOX_ROW, &[Value::Text(&id)]).await?;
            tx.execute(
                ENLIST,
                &columns.values_and(&[Value::Int64(millis(self.now()))]),
            )
            .await?;
            tx.commit().await?;
            return Ok(Replay::Enlisted(envelope));
        }
        let owner = match to {
            ReplayTo::ThisNode => Some(&*self.node),
            _ => None,
        };
        let columns = EnvelopeColumns::of(&envelope)?;
        let values =
            columns.values_and(&[Value::OptionalText(owner), Value::Int64(millis(self.now()))]);
        if tx.execute(REPLAY, &values).await? == 0 {
            tx.rollback().await?;
            return Ok(Replay::InProgress);
        }
        tx.commit().await?;
        Ok(Replay::Replayed(envelope))
    }

    async fn scheduled(&self, limit: usize) -> Result<Vec<ScheduledEnvelope>, Error> {
        let rows = self
            .db
            .fetch_all(LIST_SCHEDULED, &[Self::limit(limit)])
            .await?;
        let read = |row: &Row| -> Result<ScheduledEnvelope, Error> {
            let due_at: i64 = row.get("execute_at")?;
            let envelope = EnvelopeColumns::read(row)?.into_envelope(0)?;
            Ok(ScheduledEnvelope::new(envelope, time(due_at)?))
        };
        // A row this build cannot read is left out, and said so, rather than failing the whole
        // listing, and with it every operator's look at the schedule (it still counts against
        // `limit`: a listing may then hold fewer than there are).
        Ok(rows
            .iter()
            .filter_map(|row| {
                read(row)
                    .inspect_err(|error| {
                        let id: Option<String> = row.get("id").ok();
                        tracing::warn!(
                            messaging.message.id = ?id,
                            %error,
                            "a scheduled envelope cannot be read; left out of the listing"
                        );
                    })
                    .ok()
            })
            .collect())
    }

    fn durable(self: Arc<Self>) -> Option<Arc<dyn DurableInbox>> {
        Some(self)
    }

    async fn cancel_scheduled(&self, id: Uuid) -> Result<bool, Error> {
        let id = id_text(id);
        let values = [Value::Text(&id), Value::Int64(millis(self.now()))];
        Ok(self.db.execute(CANCEL_SCHEDULED, &values).await? == 1)
    }
}

#[async_trait]
impl<D: Dialect> DurableInbox for SqlStore<D> {
    async fn recover(
        &self,
        limit: usize,
        due_before: DateTime<Utc>,
        lapsed: bool,
    ) -> Result<Vec<Resumable>, Error> {
        self.held().await?;
        let values = [
            Value::Text(&self.node),
            Value::Int64(millis(self.alive_since())),
            Self::limit(limit),
            Value::Int64(millis(due_before)),
            Value::Int64(i64::from(lapsed)),
            Value::Int64(millis(self.now())),
        ];
        let mut tx = self.db.begin().await?;
        let rows = tx.fetch_all(self.db.claim_statement(), &values).await?;
        tx.commit().await?;
        Ok(rows.iter().filter_map(Self::readable).collect())
    }

    async fn orphaned(
        &self,
        before: DateTime<Utc>,
        running: &HashSet<Uuid>,
        limit: usize,
    ) -> Result<Vec<Resumable>, Error> {
        self.held().await?;
        let values = [
            Value::Text(&self.node),
            Value::Int64(millis(before)),
            Self::limit(running.len().saturating_add(limit)),
        ];
        let candidates = self.db.fetch_all(OWN_UNSETTLED, &values).await?;
        let mut orphans = Vec::new();
        for candidate in candidates {
            let id: String = candidate.get("id")?;
            // A row whose id is no uuid is left for an operator, as recovery leaves it (and
            // says so): failing the sweep on it would stop it for every other row, each round.
            let Ok(parsed) = parse_id(&id) else {
                continue;
            };
            if orphans.len() == limit || running.contains(&parsed) {
                continue;
            }
            let values = [Value::Text(&id), Value::Text(&self.node)];
            let row = self.db.fetch_optional(OWN_UNSETTLED_ROW, &values).await?;
            if let Some(orphan) = row.as_ref().and_then(Self::readable) {
                orphans.push(orphan);
            }
        }
        Ok(orphans)
    }

    async fn release_before(&self, started_at: DateTime<Utc>) -> Result<(), Error> {
        self.held().await?;
        let values = [Value::Text(&self.node), Value::Int64(millis(started_at))];
        self.db.execute(RELEASE_BEFORE, &values).await?;
        Ok(())
    }

    async fn heartbeat(&self) -> Result<(), Error> {
        self.held().await?;
        // Out of order by less than a third of the node timeout (a beat's interval at most).
        let out_of_order = i64::try_from((self.node_timeout / 3).as_millis()).unwrap_or(i64::MAX);
        // Stamped once the write has its turn (SQLite's writes queue for theirs, behind
        // handler transactions among others): stamped before the wait, a beat that waited
        // long would say this node was last alive then, and other nodes would take it for
        // dead while it works.
        self.db
            .execute_made(HEARTBEAT, || {
                let now = self.now();
                [
                    Value::Text(&self.node),
                    Value::Int64(millis(now)),
                    Value::Int64(out_of_order),
                    Value::Int64(millis(self.alive_until(now))),
                ]
            })
            .await?;
        Ok(())
    }

    fn node_timeout(&self) -> Duration {
        self.node_timeout
    }

    fn stamping_clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    async fn release(&self, still_running: &[Uuid]) -> Result<(), Error> {
        self.held().await?;
        let mut tx = self.db.begin().await?;
        tx.execute(RELEASE, &[Value::Text(&self.node)]).await?;
        // Taken back in the same transaction: no other node sees them released.
        for id in still_running {
            let id = id_text(*id);
            tx.execute(KEEP_RUNNING, &[Value::Text(&self.node), Value::Text(&id)])
                .await?;
        }
        if still_running.is_empty() {
            tx.execute(FORGET_NODE, &[Value::Text(&self.node)]).await?;
        }
        tx.commit().await
    }

    async fn delete_handled_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error> {
        let values = [Value::Int64(millis(before)), Self::limit(limit)];
        let mut removed = 0;
        for statement in [DELETE_HANDLED, crate::transaction::DELETE_COMPLETIONS] {
            removed += self.db.execute(statement, &values).await?;
        }
        Ok(removed)
    }

    async fn forget_nodes_before(&self, before: DateTime<Utc>) -> Result<u64, Error> {
        self.db
            .execute(FORGET_SILENT_NODES, &[Value::Int64(millis(before))])
            .await
    }

    async fn delete_idempotency_keys_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error> {
        let values = [Value::Int64(millis(before)), Self::limit(limit)];
        let keys = self.db.execute(DELETE_IDEMPOTENCY_KEYS, &values).await?;
        // HTTP keys carry their own expiry, set by the layer that recorded them.
        let values = [Value::Int64(millis(self.now())), Self::limit(limit)];
        let http_keys = self.db.execute(DELETE_EXPIRED_HTTP_KEYS, &values).await?;
        Ok(keys + http_keys)
    }
}

/// The most attempts a settle of a runner that started `attempts` finds counted: at least the
/// one a receive counts before the delivery starts.
fn attempts_bound(attempts: u32) -> i32 {
    i32::try_from(attempts.max(1)).unwrap_or(i32::MAX)
}

/// How many outbox rows one statement marks published: far below the parameters a statement
/// may bind (32 766 on SQLite, 65 535 on PostgreSQL).
const MARKED_AT_ONCE: usize = 1000;

#[async_trait]
impl<D: Dialect> Claims for SqlStore<D> {
    async fn provision(&self) -> Result<(), Error> {
        // It releases this node's uncompleted claims: a write under the node.
        self.held().await?;
        self.claims_ready
            .get_or_try_init(|| async {
                // Under the migrations' lock: nodes starting together create it once.
                let mut tx = self.db.begin().await?;
                for lock in self.db.lock_migrations() {
                    tx.execute(lock, &[]).await?;
                }
                for statement in PROVISION_CLAIMS {
                    tx.execute(statement, &[]).await?;
                }
                let has_node: i64 = tx
                    .fetch_one(self.db.claims_have_node(), &[])
                    .await?
                    .get("present")?;
                if has_node == 0 {
                    tx.execute(ADD_CLAIMS_NODE, &[]).await?;
                }
                tx.commit().await?;
                // What a crashed run left uncompleted under this node is free again: nothing
                // runs it now. Once per process's hold, not per store: another store of this
                // process under the node, opened later, would release the claims of
                // handlers running now.
                self.hold
                    .once_per_hold(|| async {
                        self.db
                            .execute(RELEASE_OWN_UNCOMPLETED_CLAIMS, &[Value::Text(&self.node)])
                            .await
                            .map(drop)
                    })
                    .await
            })
            .await?;
        Ok(())
    }

    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, Error> {
        self.held().await?;
        self.provision().await?;
        let values = [
            Value::Text(&claim.handler),
            Value::Text(&claim.key_hash),
            Value::Text(&claim.key),
            Value::Text(&claim.fingerprint),
            Value::Text(&claim.envelope_id),
            Value::Int64(millis(claim.claimed_at)),
            Value::Int64(millis(claim.expires_at)),
            Value::Text(&self.node),
            Value::Int64(millis(self.alive_since())),
            Value::Int64(millis(self.now())),
        ];
        let holder = [Value::Text(&claim.handler), Value::Text(&claim.key_hash)];
        // A claim released between the insert and the read is free: claim again.
        for _ in 0..3 {
            if self.db.execute(CLAIM, &values).await? == 1 {
                return Ok(ClaimOutcome::Claimed);
            }
            // The insert decided; this read only tells a duplicate from a conflict, and both
            // from this delivery's own claim.
            let Some(row) = self.db.fetch_optional(CLAIM_HOLDER, &holder).await? else {
                continue;
            };
            let envelope_id: String = row.get("envelope_id")?;
            if envelope_id == claim.envelope_id {
                let completed: i32 = row.get("completed")?;
                if completed != 0 {
                    return Ok(ClaimOutcome::Completed);
                }
                // Uncompleted, and not taken over: a live node's attempt of this very delivery
                // may still run it. This attempt fails and retries until that one ends (it
                // completes or releases the claim) or its node is taken for dead.
                let node: String = row.get("node")?;
                tracing::info!(messaging.message.id = %claim.envelope_id, dacapo.deduplication_id = %claim.key, node, "the deduplication claim is held by an attempt of this delivery on another node");
                return Ok(ClaimOutcome::RunningElsewhere);
            }
            let fingerprint: String = row.get("fingerprint")?;
            return Ok(ClaimOutcome::Held {
                same_payload: fingerprint == claim.fingerprint,
            });
        }
        Err(Error::store(
            "a deduplication claim kept being released while claiming",
        ))
    }

    async fn release(&self, claim: &Claim) -> Result<(), Error> {
        self.held().await?;
        self.provision().await?;
        let values = [
            Value::Text(&claim.handler),
            Value::Text(&claim.key_hash),
            Value::Text(&claim.envelope_id),
            Value::Text(&self.node),
        ];
        self.db.execute(RELEASE_CLAIM, &values).await?;
        Ok(())
    }

    async fn complete(&self, claim: &Claim, cascaded: &[Envelope]) -> Result<bool, Error> {
        self.held().await?;
        let values = [
            Value::Text(&claim.handler),
            Value::Text(&claim.key_hash),
            Value::Text(&claim.envelope_id),
            Value::Text(&self.node),
        ];
        if cascaded.is_empty() {
            if self.db.execute(COMPLETE_CLAIM, &values).await? == 0 {
                return Err(claim_lost(claim));
            }
            return Ok(true);
        }
        let columns = cascaded
            .iter()
            .map(EnvelopeColumns::of)
            .collect::<Result<Vec<_>, _>>()?;
        let at = Value::Int64(millis(self.clock.now()));
        let mut tx = self.db.begin().await?;
        // Dropped uncommitted on an early return: neither the completion nor the cascades.
        if tx.execute(COMPLETE_CLAIM, &values).await? == 0 {
            return Err(claim_lost(claim));
        }
        for columns in &columns {
            // A retry of this write, or the settle of an attempt that kept them after all,
            // writes the same deterministic ids: the first row stays.
            tx.execute(ENLIST_ONCE, &columns.values_and(&[at])).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn reap(&self, now: DateTime<Utc>, limit: usize) -> Result<u64, Error> {
        self.provision().await?;
        let mut tx = self.db.begin().await?;
        let values = [Value::Int64(millis(now)), Self::limit(limit)];
        let removed = tx.execute(REAP_CLAIMS, &values).await?;
        tx.commit().await?;
        Ok(removed)
    }

    fn keep_alive_interval(&self) -> Option<Duration> {
        // A claim of a node whose heartbeat is older than the node timeout is taken over.
        Some(self.node_timeout / 3)
    }

    async fn keep_alive(&self) -> Result<(), Error> {
        DurableInbox::heartbeat(self).await
    }

    async fn forget_silent_nodes(&self) -> Result<u64, Error> {
        let before = dacapo_actors::nodes_silent_since(self.now(), self.node_timeout);
        DurableInbox::forget_nodes_before(self, before).await
    }
}

#[async_trait]
impl<D: Dialect> OutboxStore for SqlStore<D> {
    async fn lease(&self, now: DateTime<Utc>, until: DateTime<Utc>) -> Result<bool, Error> {
        // The lease is the node's: another process under it would renew it as its own.
        self.held().await?;
        let values = [
            Value::Text(&self.node),
            Value::Int64(millis(now)),
            Value::Int64(millis(until)),
        ];
        Ok(self.db.execute(LEASE, &values).await? == 1)
    }

    fn enlisted(&self) -> Option<BoxStream<'static, Result<(), Error>>> {
        self.db.enlisted_signals()
    }

    async fn release_lease(&self) -> Result<(), Error> {
        self.db
            .execute(RELEASE_LEASE, &[Value::Text(&self.node)])
            .await?;
        Ok(())
    }

    async fn unpublished(&self, after: i64, limit: usize) -> Result<Vec<OutboxRow>, Error> {
        let values = [Self::limit(limit), Value::Int64(after)];
        let rows = self.db.fetch_all(UNPUBLISHED, &values).await?;
        rows.iter()
            .map(|row| {
                let position: i64 = row.get("seq")?;
                let envelope = EnvelopeColumns::read(row).and_then(|row| row.into_envelope(0));
                Ok((position, envelope))
            })
            .collect()
    }

    async fn backlog(&self) -> Result<OutboxBacklog, Error> {
        let row = self.db.fetch_one(BACKLOG, &[]).await?;
        let depth: i64 = row.get("depth")?;
        let oldest: Option<i64> = row.get("oldest")?;
        Ok(OutboxBacklog::new(
            u64::try_from(depth).unwrap_or(0),
            oldest.map(time).transpose()?,
        ))
    }

    async fn delete_published_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error> {
        let values = [Value::Int64(millis(before)), Self::limit(limit)];
        self.db.execute(DELETE_PUBLISHED, &values).await
    }

    async fn enlist(&self, envelopes: &[Envelope]) -> Result<(), Error> {
        let at = Value::Int64(millis(self.clock.now()));
        let columns = envelopes
            .iter()
            .map(EnvelopeColumns::of)
            .collect::<Result<Vec<_>, _>>()?;
        let mut tx = self.db.begin().await?;
        let mut rest = columns.as_slice();
        for size in Rows::sizes(columns.len()) {
            let (run, after) = rest.split_at(size);
            rest = after;
            let values: Vec<Value<'_>> = run
                .iter()
                .flat_map(|columns| columns.values_and(&[at]))
                .collect();
            tx.execute_built(ENLIST_ROWS.text(size), &values).await?;
        }
        tx.commit().await
    }

    async fn mark_published(&self, positions: &[i64], at: DateTime<Utc>) -> Result<(), Error> {
        if positions.is_empty() {
            return Ok(());
        }
        let values = |chunk: &[i64]| -> Vec<Value<'_>> {
            std::iter::once(Value::Int64(millis(at)))
                .chain(chunk.iter().map(|position| Value::Int64(*position)))
                .collect()
        };
        if positions.len() <= MARKED_AT_ONCE {
            self.db
                .execute_built(mark_published(positions.len()), &values(positions))
                .await?;
            return Ok(());
        }
        // In statements of a bounded size (a relay batch set larger than a statement's
        // parameters allow would fail its mark every round, and publish its rows again each
        // time), all in one transaction.
        let mut tx = self.db.begin().await?;
        for chunk in positions.chunks(MARKED_AT_ONCE) {
            tx.execute_built(mark_published(chunk.len()), &values(chunk))
                .await?;
        }
        tx.commit().await
    }

    async fn dead_letter_unsent(
        &self,
        position: i64,
        letter: &DeadLetter,
        at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        let columns = DeadLetterColumns::of(letter)?;
        let mut tx = self.db.begin().await?;
        tx.execute(PUT_DEAD_LETTER, &columns.values()).await?;
        tx.execute_built(
            mark_published(1),
            &[Value::Int64(millis(at)), Value::Int64(position)],
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn sync(&self) -> Result<(), Error> {
        // Only handler connections commit without a sync of their own.
        match &self.handlers {
            Some(handlers) => handlers.sync().await,
            None => Ok(()),
        }
    }
}

#[async_trait]
impl<D: Dialect> DeadLetterStore for SqlStore<D> {
    async fn put(&self, letter: DeadLetter) -> Result<(), Error> {
        let columns = DeadLetterColumns::of(&letter)?;
        let values = columns.values();
        self.db.execute(PUT_DEAD_LETTER, &values).await?;
        Ok(())
    }

    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, Error> {
        let rows = self
            .db
            .fetch_all(LIST_DEAD_LETTERS, &filter_values(filter))
            .await?;
        // One letter this build cannot read (a reason a newer one wrote, a row changed by
        // hand) must not hide the others from every listing, replay and purge.
        Ok(rows
            .iter()
            .filter_map(|row| match Self::dead_letter_row(row) {
                Ok(letter) => Some(letter),
                Err(error) => {
                    let id = row.get::<String>("id").unwrap_or_default();
                    tracing::warn!(%error, dacapo.dead_letter = %id, "a dead letter that cannot be read is left out of the listing: read it with a newer build, or delete its row from dacapo_dead_letters");
                    None
                }
            })
            .collect())
    }

    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        let id = id_text(id);
        let row = self
            .db
            .fetch_optional(GET_DEAD_LETTER, &[Value::Text(&id)])
            .await?;
        row.as_ref().map(Self::dead_letter_row).transpose()
    }

    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        let id = id_text(id);
        // A write: in a transaction, which takes the turn to write on SQLite.
        let mut tx = self.db.begin().await?;
        let row = tx
            .fetch_optional(REMOVE_DEAD_LETTER, &[Value::Text(&id)])
            .await?;
        tx.commit().await?;
        row.as_ref().map(Self::dead_letter_row).transpose()
    }

    async fn remove_if_unchanged(
        &self,
        id: Uuid,
        last_failure_at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        let id = id_text(id);
        let values = [Value::Text(&id), Value::Int64(millis(last_failure_at))];
        Ok(self
            .db
            .execute(REMOVE_UNCHANGED_DEAD_LETTER, &values)
            .await?
            > 0)
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        self.db
            .execute(PURGE_DEAD_LETTERS, &filter_values(filter))
            .await
    }
}

/// The parameters of a dead-letter query: type, time, limit (`i64::MAX`, no limit, in both
/// databases).
fn filter_values(filter: &DeadLetterFilter) -> [Value<'_>; 3] {
    [
        Value::OptionalText(filter.message_type.as_deref()),
        Value::OptionalInt64(filter.since.map(millis)),
        Value::Int64(
            filter
                .limit
                .map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX)),
        ),
    ]
}

/// Whether SQLite answered busy or locked (primary result codes 5 and 6).
#[cfg(feature = "testing")]
fn sqlite_busy(error: &Error) -> bool {
    let Error::Store(source) = error else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|database| database.code())
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use crate::store::SqliteStore;

    /// What makes the harness's restart try again for a killed runtime's write, and nothing
    /// else: SQLite's busy answer, not a refused row.
    #[cfg(feature = "testing")]
    #[tokio::test]
    async fn sqlite_busy_is_told_from_other_errors() {
        use sqlx::Connection as _;
        let directory =
            std::env::temp_dir().join(format!("dacapo-busy-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&directory).unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(directory.join("db.sqlite"))
            .create_if_missing(true)
            .busy_timeout(std::time::Duration::ZERO);
        let mut holder = sqlx::SqliteConnection::connect_with(&options)
            .await
            .unwrap();
        let mut other = sqlx::SqliteConnection::connect_with(&options)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (id INTEGER PRIMARY KEY)")
            .execute(&mut holder)
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .unwrap();
        let busy = sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap_err();
        assert!(super::sqlite_busy(&super::super::db_error(busy)));
        sqlx::query("INSERT INTO t (id) VALUES (1)")
            .execute(&mut holder)
            .await
            .unwrap();
        let duplicate = sqlx::query("INSERT INTO t (id) VALUES (1)")
            .execute(&mut holder)
            .await
            .unwrap_err();
        assert!(!super::sqlite_busy(&super::super::db_error(duplicate)));
        assert!(!super::sqlite_busy(&dacapo_actors::Error::store(
            "not a database's answer"
        )));
        let _ = std::fs::remove_dir_all(&directory);
    }

    /// Waits (a bounded while) until `done` holds.
    async fn until(what: &str, done: impl Fn() -> bool) {
        let waited = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while !done() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "not within 10 s: {what}");
    }

    /// An application that accepts with `block_on` on a runtime of its own, then leaves that
    /// runtime idle: the commit the group's leader began for the others still ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_commit_ends_when_the_runtime_that_began_it_is_left_idle() {
        use dacapo_actors::ports::{Inbox, Receipt};
        let directory =
            std::env::temp_dir().join(format!("dacapo-leader-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("db.sqlite");
        let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
        let envelope = || dacapo_actors::Envelope::new("tests.accepted", b"{}".to_vec());
        let (first, second) = (envelope(), envelope());
        // Held, the turn keeps the first commit waiting until the second write queued behind it.
        let turn = store.db.turn().await.unwrap();

        let (accepted, first_accepted) = tokio::sync::oneshot::channel();
        let (end, ended) = std::sync::mpsc::channel::<()>();
        let application = std::thread::spawn({
            let store = store.clone();
            move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let _ = accepted.send(runtime.block_on(store.receive(&first)));
                // The runtime stays, undriven, until the test is over.
                let _ = ended.recv_timeout(std::time::Duration::from_secs(30));
            }
        });
        until("the first write taken by its leader", || {
            store.group.waiting_and_leaders() == (0, 1)
        })
        .await;
        let queued = tokio::spawn({
            let store = store.clone();
            async move { store.receive(&second).await }
        });
        until("the second write queued behind it", || {
            store.group.waiting_and_leaders() == (1, 1)
        })
        .await;
        drop(turn);

        assert!(matches!(first_accepted.await, Ok(Ok(Receipt::New))));
        let second = tokio::time::timeout(std::time::Duration::from_secs(10), queued).await;
        let _ = end.send(());
        application.join().unwrap();
        assert!(
            matches!(second, Ok(Ok(Ok(Receipt::New)))),
            "the second write did not commit: {second:?}"
        );
        let _ = std::fs::remove_dir_all(&directory);
    }

    /// A third of a second or more of SQLite's time (unoptimized) before its row is written.
    const SLOW_INSERT: &str = "INSERT INTO rows (n) SELECT 1 FROM (WITH RECURSIVE c(x) AS \
        (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) SELECT max(x) FROM c)";

    /// Minutes of SQLite's time before its row is written, were it not stopped.
    const RUNAWAY_INSERT: &str = "INSERT INTO rows (n) SELECT 2 FROM (WITH RECURSIVE c(x) AS \
        (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT max(x) FROM c)";

    /// Takes the turn and the handler connection, as a handler's `ctx.connection()` does:
    /// whether it was taken while still counted open, and what `work` answered on it; then
    /// parks it, told whether the runtime gave up on the handler.
    async fn as_a_handler<T>(
        store: &SqliteStore,
        given_up: bool,
        work: impl AsyncFnOnce(&mut sqlx::SqliteConnection) -> T,
    ) -> (bool, T) {
        let parked = store
            .parked_handler_turn()
            .await
            .unwrap()
            .expect("a handler pool");
        let (mut connection, counted) = parked.connection.expect("a connection");
        let answer = work(&mut connection).await;
        (parked.park)(connection, given_up);
        drop(parked.turn);
        (counted, answer)
    }

    /// Starts `insert` on `connection` and drops its future: it still runs.
    async fn left_running(connection: &mut sqlx::SqliteConnection, insert: &'static str) {
        let running = sqlx::query(insert).execute(connection);
        futures::pin_mut!(running);
        assert!(futures::poll!(running).is_pending(), "the insert is slow");
    }

    async fn rows(connection: &mut sqlx::SqliteConnection) -> Vec<i64> {
        sqlx::query_scalar("SELECT n FROM rows ORDER BY n")
            .fetch_all(connection)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_handler_given_up_on_interrupts_what_it_ran_and_nothing_an_earlier_handler_left() {
        let directory = std::env::temp_dir().join(format!(
            "dacapo-interrupt-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("db.sqlite");
        let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
        sqlx::query("CREATE TABLE rows (n INTEGER)")
            .execute(store.pool())
            .await
            .unwrap();

        // One handler leaves its insert running (its own business), and returns.
        let (busy, ()) = as_a_handler(&store, false, async |connection| {
            left_running(connection, SLOW_INSERT).await;
        })
        .await;
        assert!(!busy, "fresh from its pool");
        // The next, given up on, takes the connection while that insert still runs.
        let (busy, ()) = as_a_handler(&store, true, async |_| {}).await;
        assert!(busy, "taken before it was seen to finish");
        let (_, seen) = as_a_handler(&store, false, rows).await;
        assert_eq!(seen, [1], "the earlier handler's insert ran to its end");

        // Seen to finish by the runtime's next write, the connection is the next handler's
        // alone: given up on, what it left running is stopped.
        store.db.parking().expect("SQLite").quiesce().await.unwrap();
        let (busy, ()) = as_a_handler(&store, true, async |connection| {
            left_running(connection, RUNAWAY_INSERT).await;
        })
        .await;
        assert!(!busy, "quiet when taken");
        // Within the 5 s after which a connection still busy would be given up.
        let (busy, seen) = tokio::time::timeout(
            std::time::Duration::from_secs(4),
            as_a_handler(&store, false, rows),
        )
        .await
        .expect("stopped at once");
        assert!(!busy, "the next handler got it once it stopped");
        assert_eq!(seen, [1], "the runaway insert wrote nothing");

        drop(store);
        let _ = std::fs::remove_dir_all(&directory);
    }
}
