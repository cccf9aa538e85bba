//! Handler connections on a real SQLite file and a real PostgreSQL server: a handler's own
//! statements, each committed on its own, land once per message however often the delivery
//! runs; on SQLite they take turns with the runtime's writers, and on both they leave their
//! flush to the delivery's settle.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/child.rs"]
mod support_child;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dacapo::DeadLetterReason;
use dacapo::prelude::*;
use dacapo::transaction::HandlerTransactions;
use support::MemberRemoved;
use support_stores::Backend;

const WAIT: Duration = Duration::from_secs(20);

/// Once `runtime` is idle, and shut down: how many deliveries it handled, retried and
/// dead-lettered, and the rows in `tallies`.
async fn settled(runtime: Runtime, pool: &sqlx::SqlitePool) -> ((u64, u64, u64), i64) {
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let stats = runtime.stats();
    runtime.shutdown().await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tallies")
        .fetch_one(pool)
        .await
        .unwrap();
    ((stats.handled, stats.retried, stats.dead_lettered), rows)
}

const TABLE: &str =
    "CREATE TABLE IF NOT EXISTS tallies (id TEXT PRIMARY KEY, member BIGINT NOT NULL)";
const INSERT: &str = "INSERT INTO tallies (id, member) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING";

/// Writes one row per message under an id derived from it, on a handler connection; fails its
/// first attempt after writing when asked to, so the retry writes the same row again.
#[derive(Clone)]
struct Tally {
    backend: Backend,
    fail_first: bool,
    /// SQLite's `synchronous` level on the handler's connection, as each run saw it.
    levels: Arc<Mutex<Vec<i64>>>,
}

impl Tally {
    fn new(backend: Backend, fail_first: bool) -> Self {
        Self {
            backend,
            fail_first,
            levels: Arc::default(),
        }
    }
}

impl Handler<MemberRemoved> for Tally {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        let member = event.member_id as i64;
        match self.backend {
            Backend::Sqlite => {
                let mut connection = ctx.connection::<sqlx::Sqlite>().await?;
                sqlx::query(INSERT)
                    .bind(&id)
                    .bind(member)
                    .execute(&mut *connection)
                    .await?;
                let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(&mut *connection)
                    .await?;
                self.levels.lock().unwrap().push(level);
            }
            Backend::Postgres => {
                let mut connection = ctx.connection::<sqlx::Postgres>().await?;
                sqlx::query(INSERT)
                    .bind(&id)
                    .bind(member)
                    .execute(&mut *connection)
                    .await?;
            }
        }
        if self.fail_first && ctx.attempt() == 1 {
            return Err("failed after writing".into());
        }
        Ok(())
    }
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy {
        retry_limit: 3,
        min_retry_interval: Duration::from_millis(20),
        retry_interval_delta: Duration::from_millis(10),
        max_retry_interval: Duration::from_millis(100),
    }
}

fn members(count: u64) -> Vec<MemberRemoved> {
    (0..count)
        .map(|member_id| MemberRemoved {
            organization_id: 1,
            member_id,
        })
        .collect()
}

on_both_backends!(
    a_retry_finds_the_rows_its_first_attempt_wrote_on_a_handler_connection_sqlite,
    a_retry_finds_the_rows_its_first_attempt_wrote_on_a_handler_connection_postgres,
    |db| {
        db.execute(TABLE).await;
        let tally = Tally::new(db.backend, true);
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(quick_retries())
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", tally))
            .build()
            .unwrap();
        runtime.publish_batch(&members(20)).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        let stats = runtime.stats();
        assert_eq!(
            (stats.handled, stats.retried, stats.dead_lettered),
            (20, 20, 0),
            "{stats:?}"
        );
        runtime.shutdown().await;
        assert_eq!(db.scalar("SELECT count(*) FROM tallies").await, 20);
        assert_eq!(
            db.scalar("SELECT count(DISTINCT member) FROM tallies")
                .await,
            20
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'")
                .await,
            20
        );
    }
);

/// On a SQLite file a handler connection commits without an fsync (`NORMAL`, 1) while the
/// runtime's own pool, whose settles make the handler's writes durable, fsyncs each commit
/// (`FULL`, 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_sqlite_file_a_handler_connection_leaves_its_fsync_to_the_settle() {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    db.execute(TABLE).await;
    let store = db.sqlite().await;
    let pool = store.pool().clone();
    let tally = Tally::new(Backend::Sqlite, false);
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", tally.clone()))
        .build()
        .unwrap();
    runtime.publish_batch(&members(3)).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    runtime.shutdown().await;
    assert_eq!(*tally.levels.lock().unwrap(), [1, 1, 1]);
    let runtime_level: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(runtime_level, 2);
    assert_eq!(db.scalar("SELECT count(*) FROM tallies").await, 3);
}

/// An in-memory database has nothing to fsync and one connection: handler connections are
/// that connection, as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_a_handler_connection_is_the_runtimes_own() {
    let store = dacapo::store::SqliteStore::open("sqlite::memory:")
        .await
        .unwrap();
    sqlx::query(TABLE).execute(store.pool()).await.unwrap();
    let pool = store.pool().clone();
    let tally = Tally::new(Backend::Sqlite, false);
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", tally.clone()))
        .build()
        .unwrap();
    runtime.publish_batch(&members(3)).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(runtime.stats().handled, 3);
    runtime.shutdown().await;
    assert_eq!(*tally.levels.lock().unwrap(), [2, 2, 2]);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tallies")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 3);
}

/// Handler connections take their turn with the runtime's writers: sixteen batches published
/// at once, each message's row written on a handler connection, never find the database
/// locked even with SQLite's busy timeout at zero (a writer that found the lock taken would
/// fail at once, and its delivery be retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_connections_take_turns_with_the_runtimes_writers_on_sqlite() {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let (pool, store) = support_stores::never_waiting_sqlite(&db.url, TABLE).await;
    let runtime = tallying_runtime(store, false);
    let batches = (0..16u64).map(|batch| {
        let messages: Vec<MemberRemoved> = (0..20)
            .map(|n| MemberRemoved {
                organization_id: batch,
                member_id: batch * 20 + n,
            })
            .collect();
        let runtime = &runtime;
        async move { runtime.publish_batch(&messages).await }
    });
    let published = futures::future::join_all(batches).await;
    assert!(published.iter().all(Result::is_ok), "{published:?}");
    assert_eq!(settled(runtime, &pool).await, ((320, 0, 0), 320));
}

#[tokio::test]
async fn a_detached_context_opens_no_connection() {
    let context = MessageContext::detached();
    let error = context.connection::<sqlx::Sqlite>().await.unwrap_err();
    assert!(matches!(error, dacapo::Error::Detached), "{error}");
}

/// Asks for a PostgreSQL connection, whatever the store.
struct OpensPostgres;

impl Handler<MemberRemoved> for OpensPostgres {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        ctx.connection::<sqlx::Postgres>().await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_connection_needs_a_store_of_its_database() {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let runtime = Runtime::builder()
        .store(db.sqlite().await)
        .retry_policy(RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        })
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", OpensPostgres))
        .build()
        .unwrap();
    let id = runtime.publish(&support::member_removed()).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let letter = runtime.dead_letters().inspect(id).await.unwrap();
    assert_eq!(letter.reason, DeadLetterReason::RetriesExhausted);
    let failure = &letter.failures[0].failures[0].error;
    assert!(failure.contains("PostgresStore"), "{failure}");
    runtime.shutdown().await;
}

/// Keeps a copy of its context and, once told, opens a connection with it: after its attempt.
#[derive(Clone, Default)]
struct KeepsItsContext {
    kept: Arc<Mutex<Option<MessageContext>>>,
}

impl Handler<MemberRemoved> for KeepsItsContext {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        *self.kept.lock().unwrap() = Some(ctx.clone());
        Ok(())
    }
}

/// A write after the attempt would come after the settle that makes it durable: a copy of the
/// context kept past its attempt opens no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_past_its_attempt_opens_no_connection() {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let handler = KeepsItsContext::default();
    let runtime = Runtime::builder()
        .store(db.sqlite().await)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("keep", handler.clone()))
        .build()
        .unwrap();
    runtime.publish(&support::member_removed()).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(runtime.stats().handled, 1);
    let kept = handler
        .kept
        .lock()
        .unwrap()
        .clone()
        .expect("the handler ran");
    let error = kept.connection::<sqlx::Sqlite>().await.unwrap_err();
    assert!(matches!(error, dacapo::Error::Detached), "{error}");
    runtime.shutdown().await;
}

/// Deliveries that settle in an inbox apart from the store never fsync the store's log: there
/// a handler connection commits at the store's own level (`FULL`, 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_deliveries_settle_elsewhere_gives_connections_at_its_own_level() {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    db.execute(TABLE).await;
    let tally = Tally::new(Backend::Sqlite, false);
    let builder = Runtime::builder()
        .store(db.sqlite().await)
        .inbox(inbox_elsewhere());
    handled_once(tallying(builder, tally.clone()), &members(1)).await;
    assert_eq!(*tally.levels.lock().unwrap(), [2]);
}

/// Writes one row per message on a handler connection to PostgreSQL and notes, on that
/// connection, its `synchronous_commit` and where the server's write-ahead log ended after the
/// write; then, when given a gate, waits at it before returning.
#[derive(Clone, Default)]
struct TallyOnPostgres {
    seen: Arc<Mutex<Vec<(String, String)>>>,
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Handler<MemberRemoved> for TallyOnPostgres {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        {
            let mut connection = ctx.connection::<sqlx::Postgres>().await?;
            sqlx::query(INSERT)
                .bind(&id)
                .bind(event.member_id as i64)
                .execute(&mut *connection)
                .await?;
            let (level, written): (String, String) = sqlx::query_as(
                "SELECT current_setting('synchronous_commit'), pg_current_wal_insert_lsn()::text",
            )
            .fetch_one(&mut *connection)
            .await?;
            self.seen.lock().unwrap().push((level, written));
        }
        if let Some(gate) = &self.gate {
            gate.acquire().await?.forget();
        }
        Ok(())
    }
}

/// Whether the PostgreSQL server behind `pool` has flushed its write-ahead log up to `lsn`.
async fn flushed_past(pool: &sqlx::PgPool, lsn: &str) -> bool {
    sqlx::query_scalar("SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn")
        .bind(lsn)
        .fetch_one(pool)
        .await
        .unwrap()
}

impl TallyOnPostgres {
    fn levels(&self) -> Vec<String> {
        let seen = self.seen.lock().unwrap();
        seen.iter().map(|(level, _)| level.clone()).collect()
    }
}

/// A runtime with `handler` as billing's `tally`.
fn tallying(builder: dacapo::RuntimeBuilder, handler: impl Handler<MemberRemoved>) -> Runtime {
    builder
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", handler))
        .build()
        .unwrap()
}

/// Publishes `messages` on `runtime` and shuts it down once it is idle: what it counted.
async fn handled_once(runtime: Runtime, messages: &[MemberRemoved]) -> dacapo::StatsSnapshot {
    runtime.publish_batch(messages).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let stats = runtime.stats();
    runtime.shutdown().await;
    stats
}

/// An inbox apart from the store, which deliveries settle in.
fn inbox_elsewhere() -> Arc<dacapo::store::MemoryInbox> {
    Arc::new(dacapo::store::MemoryInbox::new(
        Duration::from_secs(60),
        Arc::new(dacapo::ports::SystemClock),
    ))
}

/// On PostgreSQL a handler connection commits without waiting for the server's flush
/// (`synchronous_commit = off`) while the runtime's own pool waits for it: once the deliveries
/// settled, the log is flushed past every handler's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_handler_connection_leaves_its_flush_to_the_settle() {
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute(TABLE).await;
    let store = db.postgres().await;
    let pool = store.pool().clone();
    let tally = TallyOnPostgres::default();
    let runtime = tallying(Runtime::builder().store(store), tally.clone());
    assert_eq!(handled_once(runtime, &members(3)).await.handled, 3);
    let seen = tally.seen.lock().unwrap().clone();
    for (_, written) in seen {
        assert!(flushed_past(&pool, &written).await, "{written} not flushed");
    }
    assert_eq!(tally.levels(), ["off"; 3]);
    // The store's own level, which its runtime pool shares and its settles commit at.
    let store_level: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(store_level, "on");
    assert_eq!(db.scalar("SELECT count(*) FROM tallies").await, 3);
}

/// Before the outbox relay sends what it read to a broker, it has the store make durable
/// what handler connections committed (`OutboxStore::sync`): on PostgreSQL the log is flushed
/// past a write whose delivery has not settled yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_relays_sync_flushes_what_an_unsettled_handler_wrote() {
    use dacapo::ports::OutboxStore;

    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute(TABLE).await;
    let store = db.postgres().await;
    let (pool, relays) = (store.pool().clone(), store.clone());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let tally = TallyOnPostgres {
        seen: Arc::default(),
        gate: Some(Arc::clone(&gate)),
    };
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", tally.clone()))
        .build()
        .unwrap();
    runtime.publish(&members(1)[0]).await.unwrap();
    let written = tokio::time::timeout(WAIT, async {
        loop {
            if let Some((_, written)) = tally.seen.lock().unwrap().first() {
                return written.clone();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the handler wrote");
    relays.sync().await.unwrap();
    assert!(flushed_past(&pool, &written).await, "{written} not flushed");
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'")
            .await,
        0,
        "flushed before the settle"
    );
    gate.add_permits(1);
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(runtime.stats().handled, 1);
    runtime.shutdown().await;
}

/// The relay's sync flushes on PostgreSQL whether or not this process opened a handler
/// connection: the rows it read may be another node's, written by its handlers with
/// `synchronous_commit = off`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_relays_sync_flushes_what_another_nodes_handlers_wrote() {
    use dacapo::ports::OutboxStore;
    use sqlx::Connection;

    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute(TABLE).await;
    let store = db.postgres().await;
    let pool = store.pool().clone();
    let mut elsewhere = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("SET synchronous_commit = off")
        .execute(&mut elsewhere)
        .await
        .unwrap();
    sqlx::query(INSERT)
        .bind("written-elsewhere")
        .bind(1_i64)
        .execute(&mut elsewhere)
        .await
        .unwrap();
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&mut elsewhere)
        .await
        .unwrap();
    store.sync().await.unwrap();
    assert!(flushed_past(&pool, &written).await, "{written} not flushed");
}

/// Rejects every connection that would commit with `synchronous_commit = off`, as a pooler
/// in front of the server that refuses the option does.
fn refusing_unflushed_commits(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|connection, _| {
            Box::pin(async move {
                let level: String = sqlx::query_scalar("SHOW synchronous_commit")
                    .fetch_one(&mut *connection)
                    .await?;
                if level == "off" {
                    return Err(sqlx::Error::Protocol(
                        "unsupported startup parameter".into(),
                    ));
                }
                Ok(())
            })
        })
        .connect_lazy(url)
        .unwrap()
}

/// Where a connection with `synchronous_commit = off` cannot be opened, handler connections
/// come from the runtime's own pool, at the store's level, and work as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_handler_connections_the_server_refuses_unflushed_are_the_runtimes_own() {
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute(TABLE).await;
    let store = dacapo::store::PostgresStore::with_pool(refusing_unflushed_commits(&db.url))
        .await
        .unwrap();
    let tally = TallyOnPostgres::default();
    let runtime = tallying(Runtime::builder().store(store), tally.clone());
    let stats = handled_once(runtime, &members(2)).await;
    assert_eq!((stats.handled, stats.retried), (2, 0), "{stats:?}");
    assert_eq!(tally.levels(), ["on", "on"]);
    assert_eq!(db.scalar("SELECT count(*) FROM tallies").await, 2);
}

/// Hands its work to a task of its own, which opens a handler connection while the attempt
/// runs and writes on it a while after the handler returned, noting the server's clock.
struct HandsItsConnectionOn;

impl Handler<MemberRemoved> for HandsItsConnectionOn {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let (opened, open) = tokio::sync::oneshot::channel();
        let (ctx, member) = (ctx.clone(), event.member_id as i64);
        tokio::spawn(async move {
            let mut connection = ctx.connection::<sqlx::Postgres>().await.unwrap();
            opened.send(()).unwrap();
            // Work that outlasts the handler.
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query(
                "INSERT INTO late_rows (member, written_at) \
                 VALUES ($1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)",
            )
            .bind(member)
            .execute(&mut *connection)
            .await
            .unwrap();
        });
        open.await?;
        Ok(())
    }
}

/// On PostgreSQL, with no turn to keep a handler connection inside its attempt, the attempt's
/// end waits until the connections opened in it are back in their pool: a write made on one
/// after the handler returned comes before the settle, whose flush covers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_settle_comes_after_what_a_connection_handed_on_wrote() {
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute("CREATE TABLE late_rows (member BIGINT PRIMARY KEY, written_at BIGINT NOT NULL)")
        .await;
    let runtime = tallying(
        Runtime::builder().store(db.postgres().await),
        HandsItsConnectionOn,
    );
    assert_eq!(handled_once(runtime, &members(1)).await.handled, 1);
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM late_rows, dacapo_inbox \
             WHERE dacapo_inbox.status = 'handled' AND late_rows.written_at <= dacapo_inbox.handled_at"
        )
        .await,
        1,
        "the row was written before the delivery settled"
    );
}

/// A PostgreSQL store whose deliveries settle in another inbox gives handler connections at
/// its own level: no settle of its would flush what they wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_store_whose_deliveries_settle_elsewhere_gives_connections_at_its_level() {
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    db.execute(TABLE).await;
    let tally = TallyOnPostgres::default();
    let builder = Runtime::builder()
        .store(db.postgres().await)
        .inbox(inbox_elsewhere());
    handled_once(tallying(builder, tally.clone()), &members(1)).await;
    assert_eq!(tally.levels(), ["on"]);
}

/// Begins a transaction on its connection, writes, and on its first attempt fails before
/// committing: the transaction is dropped unfinished, its rollback left pending on the
/// connection.
struct GivesUpMidTransaction;

impl Handler<MemberRemoved> for GivesUpMidTransaction {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        let mut connection = ctx.connection::<sqlx::Sqlite>().await?;
        let mut tx = sqlx::Connection::begin_with(&mut *connection, "BEGIN IMMEDIATE").await?;
        sqlx::query(INSERT)
            .bind(&id)
            .bind(event.member_id as i64)
            .execute(&mut *tx)
            .await?;
        if ctx.attempt() == 1 {
            return Err("gave up before committing".into());
        }
        tx.commit().await?;
        Ok(())
    }
}

/// The rollback a handler left pending on its connection when it gave up mid-transaction runs
/// before the next writer writes: with SQLite's busy timeout at zero, no write — the
/// runtime's or the next handler's — finds the database locked after forty handlers gave up
/// mid-transaction, and each wrote its row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_left_mid_transaction_is_rolled_back_before_the_next_writer_goes() {
    let ran = run_never_waiting(GivesUpMidTransaction, Runtime::builder(), 40).await;
    assert_eq!(ran, ((40, 40, 0), 40));
}

/// Begins a transaction by hand (a `BEGIN` statement, which sqlx knows nothing of) for
/// members that are multiples of `every`, writes its row in it and returns without
/// committing; writes the other members' rows each on its own. Its rows count members from
/// [`LEFT_OPEN_ROWS`]. A `BEGIN` on a connection an earlier handler left in a transaction fails: its row
/// then goes in that one.
const LEFT_OPEN_ROWS: u64 = 1_000_000;

struct LeavesItsTransactionOpen {
    backend: Backend,
    every: u64,
}

impl Handler<MemberRemoved> for LeavesItsTransactionOpen {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "left-open");
        let left_open = event.member_id.is_multiple_of(self.every);
        let member = (LEFT_OPEN_ROWS + event.member_id) as i64;
        // The same statements on either database's connection.
        macro_rules! write_on {
            ($db:ty) => {{
                let mut connection = ctx.connection::<$db>().await?;
                if left_open {
                    let _ = sqlx::query("BEGIN").execute(&mut *connection).await;
                }
                let insert = sqlx::query(INSERT).bind(&id).bind(member);
                insert.execute(&mut *connection).await?;
            }};
        }
        match self.backend {
            Backend::Sqlite => write_on!(sqlx::Sqlite),
            Backend::Postgres => write_on!(sqlx::Postgres),
        }
        Ok(())
    }
}

/// The left-open tests one at a time: each reads the endings the runtime told while it ran.
static LEFT_OPEN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How the runtime ended each transaction a handler left open, as it told (`"COMMIT"` or
/// `"ROLLBACK"`), in this test binary so far. Its first call starts the capture.
fn endings_told() -> Vec<String> {
    support_warnings::warnings()
        .lock()
        .unwrap()
        .iter()
        .filter(|warning| warning.contains("began by hand"))
        .map(|warning| {
            if warning.contains("COMMIT") {
                "COMMIT".to_owned()
            } else {
                "ROLLBACK".to_owned()
            }
        })
        .collect()
}

/// On SQLite's parked handler connection, a transaction a handler began by hand and left
/// open, with nobody taking the connection after it, is rolled back before the runtime's next
/// write, like an sqlx transaction dropped: its row is not there, the runtime's writes never
/// meet its lock (the busy timeout is zero), and the next message is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_a_handler_left_open_alone_on_a_parked_connection_is_rolled_back() {
    let _alone = LEFT_OPEN.lock().await;
    let told = endings_told().len();
    let handler = LeavesItsTransactionOpen {
        backend: Backend::Sqlite,
        every: 2,
    };
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let (pool, store) = support_stores::never_waiting_sqlite(&db.url, TABLE).await;
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", handler))
        .build()
        .unwrap();
    for member in members(2) {
        runtime.publish(&member).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    }
    assert_eq!(settled(runtime, &pool).await, ((2, 0, 0), 1));
    assert_eq!(endings_told()[told..], ["ROLLBACK"]);
}

/// On SQLite's parked handler connection, a transaction a handler began by hand and left open
/// is committed when the next handler took the connection before the runtime's next write:
/// that handler's statements, meant to commit one by one, may be inside it. Two handlers of
/// one message, one leaving its transaction open: the other's row always lands, the first's
/// as the runtime told, and the delivery settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_a_handler_left_open_on_a_parked_connection_keeps_the_next_handlers_rows() {
    let _alone = LEFT_OPEN.lock().await;
    let told = endings_told().len();
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let (pool, store) = support_stores::never_waiting_sqlite(&db.url, TABLE).await;
    let left_open = LeavesItsTransactionOpen {
        backend: Backend::Sqlite,
        every: 1,
    };
    let runtime = Runtime::builder()
        .store(store)
        .module(
            Module::new("billing")
                .handle_named::<MemberRemoved, _>("left-open", left_open)
                .handle_named::<MemberRemoved, _>("tally", Tally::new(Backend::Sqlite, false)),
        )
        .build()
        .unwrap();
    let message_id = runtime.publish(&members(1)[0]).await.unwrap();
    let ((handled, retried, dead), rows) = settled(runtime, &pool).await;
    assert_eq!((handled, retried, dead), (1, 0, 0));
    let told = endings_told()[told..].to_vec();
    assert_eq!(told.len(), 1, "{told:?}");
    let tally: i64 = sqlx::query_scalar("SELECT count(*) FROM tallies WHERE id = $1")
        .bind(ids::derive_or_random(Some(message_id), "tally"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(tally, 1, "the other handler's row");
    assert_eq!(rows, if told[0] == "COMMIT" { 2 } else { 1 }, "{told:?}");
}

/// Where a handler connection goes back to the runtime's own pool (SQLite at `NORMAL`), a
/// transaction its handler began by hand and left open is rolled back before the connection
/// goes back, or the turn to write does: what the handler did not commit is not there, the
/// runtime's own writes neither wait for its lock nor run inside it, and every delivery
/// settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_a_handler_left_open_on_the_runtimes_pool_is_rolled_back_sqlite() {
    let _alone = LEFT_OPEN.lock().await;
    let told = endings_told().len();
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let store =
        dacapo::store::SqliteStore::open_with(&db.url, sqlx::sqlite::SqliteSynchronous::Normal)
            .await
            .unwrap();
    sqlx::query(TABLE).execute(store.pool()).await.unwrap();
    let pool = store.pool().clone();
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>(
            "tally",
            LeavesItsTransactionOpen {
                backend: Backend::Sqlite,
                every: 2,
            },
        ))
        .build()
        .unwrap();
    runtime.publish_batch(&members(10)).await.unwrap();
    assert_eq!(settled(runtime, &pool).await, ((10, 0, 0), 5));
    let odd: i64 = sqlx::query_scalar("SELECT count(*) FROM tallies WHERE member % 2 = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(odd, 5);
    assert_eq!(endings_told()[told..], ["ROLLBACK"; 5]);
}

/// On PostgreSQL a transaction a handler began by hand and left open on its connection is
/// rolled back before the connection goes back to its pool: left open, the next handler's
/// statements on a pool of two connections would run inside it, and another session would
/// not see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_a_handler_left_open_on_the_runtimes_pool_is_rolled_back_postgres() {
    let _alone = LEFT_OPEN.lock().await;
    let told = endings_told().len();
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .unwrap();
    let store = dacapo::store::PostgresStore::with_pool(pool).await.unwrap();
    db.execute(TABLE).await;
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("billing").handle_named::<MemberRemoved, _>(
            "tally",
            LeavesItsTransactionOpen {
                backend: Backend::Postgres,
                every: 2,
            },
        ))
        .build()
        .unwrap();
    runtime.publish_batch(&members(10)).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    runtime.publish(&members(1)[0].clone()).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let stats = runtime.stats();
    runtime.shutdown().await;
    assert_eq!((stats.handled, stats.retried), (11, 0), "{stats:?}");
    // Seen from sessions of their own.
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'")
            .await,
        11
    );
    assert_eq!(db.scalar("SELECT count(*) FROM tallies").await, 5);
    assert_eq!(
        db.scalar("SELECT count(*) FROM tallies WHERE member % 2 = 1")
            .await,
        5
    );
    // The message published last left its transaction open too.
    assert_eq!(endings_told()[told..], ["ROLLBACK"; 6]);
}

/// Runs `count` messages through `handler` on a SQLite file whose busy timeout is zero, with
/// quick retries: what `settled` tells. A write that found the database locked would fail at
/// once, and none was warned of.
///
/// One run at a time: their handlers leave statements of a third of a second or more of SQLite's time
/// running (unoptimized in a test build), and side by side on two cores one outlasted the 5 s
/// the runtime waits for a handler connection; the warnings they check are the process's.
async fn run_never_waiting(
    handler: impl Handler<MemberRemoved>,
    builder: dacapo::RuntimeBuilder,
    count: u64,
) -> ((u64, u64, u64), i64) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_AT_A_TIME.lock().await;
    let warnings = support_warnings::warnings();
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    let (pool, store) = support_stores::never_waiting_sqlite(&db.url, TABLE).await;
    let runtime = builder
        .store(store)
        .retry_policy(quick_retries())
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("tally", handler))
        .build()
        .unwrap();
    runtime.publish_batch(&members(count)).await.unwrap();
    let ran = settled(runtime, &pool).await;
    let locked: Vec<String> = warnings
        .lock()
        .unwrap()
        .iter()
        .filter(|warning| warning.contains("locked") || warning.contains("busy"))
        .cloned()
        .collect();
    assert!(locked.is_empty(), "{locked:#?}");
    ran
}

/// On its first attempt, writes its row in the statement it holds, slow enough to outlast the
/// handler's timeout: the attempt is cancelled while SQLite still runs it.
struct OutlastsItsTimeout(&'static str);

/// A third of a second or more of SQLite's time (unoptimized in a test build) before the row is
/// written.
const SLOW_INSERT: &str = "INSERT INTO tallies (id, member) SELECT $1, $2 FROM \
    (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) \
     SELECT max(x) FROM c) WHERE true ON CONFLICT (id) DO NOTHING";

impl Handler<MemberRemoved> for OutlastsItsTimeout {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        let statement = if ctx.attempt() == 1 { self.0 } else { INSERT };
        let mut connection = ctx.connection::<sqlx::Sqlite>().await?;
        sqlx::query(statement)
            .bind(&id)
            .bind(event.member_id as i64)
            .execute(&mut *connection)
            .await?;
        Ok(())
    }
}

/// A statement a cancelled handler left running ends before the runtime's next write: with
/// SQLite's busy timeout at zero, none of the runtime's writes finds the database locked (one
/// would fail at once), the retry runs, and the row is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_a_cancelled_handler_left_running_ends_before_the_runtimes_next_write() {
    let builder = Runtime::builder().handler_timeout(Duration::from_millis(100));
    let ran = run_never_waiting(OutlastsItsTimeout(SLOW_INSERT), builder, 2).await;
    assert_eq!(ran, ((2, 2, 0), 2));
}

/// Minutes of SQLite's time before the row is written.
const RUNAWAY_INSERT: &str = "INSERT INTO tallies (id, member) SELECT $1, $2 FROM \
    (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) \
     SELECT max(x) FROM c) WHERE true ON CONFLICT (id) DO NOTHING";

/// A statement left running by a handler the runtime gave up on is interrupted: the runtime's
/// next write waits for it no longer than it takes to stop (waiting its 5 s out, the runtime
/// would warn that the connection was still busy, and with SQLite's busy timeout at zero its
/// write would then fail at once), the retry runs, and the row is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_left_running_by_a_handler_given_up_on_is_interrupted() {
    let builder = Runtime::builder().handler_timeout(Duration::from_millis(100));
    let ran = run_never_waiting(OutlastsItsTimeout(RUNAWAY_INSERT), builder, 2).await;
    assert_eq!(ran, ((2, 2, 0), 2));
}

/// The first run to come opens a transaction on its handler connection, writes its row, and
/// runs a query slow enough to outlast its own patience: it gives up after 100 ms, dropping
/// the query while SQLite still runs it, the database's write lock held until the
/// transaction's rollback, queued behind it, has run. Every other run writes its row at once.
#[derive(Default)]
struct GivesUpOnItsQuery {
    slow_taken: std::sync::atomic::AtomicBool,
}

/// As long, writing nothing.
const SLOW_QUERY: &str = "SELECT max(x) FROM (WITH RECURSIVE c(x) AS \
    (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) SELECT x FROM c)";

impl Handler<MemberRemoved> for GivesUpOnItsQuery {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        let mut connection = ctx.connection::<sqlx::Sqlite>().await?;
        let insert = sqlx::query(INSERT).bind(&id).bind(event.member_id as i64);
        if self
            .slow_taken
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            insert.execute(&mut *connection).await?;
            return Ok(());
        }
        let mut tx = sqlx::Connection::begin_with(&mut *connection, "BEGIN IMMEDIATE").await?;
        insert.execute(&mut *tx).await?;
        tokio::select! {
            _ = sqlx::query(SLOW_QUERY).execute(&mut *tx) => Err("not given up".into()),
            () = tokio::time::sleep(Duration::from_millis(100)) => Err("gave up on a slow query".into()),
        }
    }
}

/// The next handler connection is the one a handler left a statement running on, its
/// statements queued behind it: with SQLite's busy timeout at zero, the other messages'
/// handlers, which take the turn while the first one's transaction still holds the
/// database's lock, never find it locked (on another connection they would fail at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_handler_writes_behind_what_a_cancelled_handler_left_on_its_connection() {
    let ran = run_never_waiting(GivesUpOnItsQuery::default(), Runtime::builder(), 4).await;
    assert_eq!(ran, ((4, 1, 0), 4));
}

/// The first run to come opens a handler transaction, writes its row in it, and gives up on
/// a query slow enough to outlast its patience, dropping the transaction while SQLite still
/// runs the query: the transaction's rollback, queued behind it, releases the database's
/// write lock. Every other run writes its row in a handler transaction and commits.
#[derive(Default)]
struct GivesUpInItsTransaction {
    slow_taken: std::sync::atomic::AtomicBool,
}

impl Handler<MemberRemoved> for GivesUpInItsTransaction {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let id = ids::derive_or_random(ctx.message_id(), "tally");
        let Some(mut tx) = ctx.transaction::<sqlx::Sqlite>().await? else {
            return Ok(());
        };
        sqlx::query(INSERT)
            .bind(&id)
            .bind(event.member_id as i64)
            .execute(&mut **tx)
            .await?;
        if self
            .slow_taken
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            tx.commit().await?;
            return Ok(());
        }
        tokio::select! {
            _ = sqlx::query(SLOW_QUERY).execute(&mut **tx) => Err("not given up".into()),
            () = tokio::time::sleep(Duration::from_millis(100)) => Err("gave up on a slow query".into()),
        }
    }
}

/// A handler transaction dropped while a statement of its still runs keeps the turn to write
/// until its rollback ran: with SQLite's busy timeout at zero, no writer after it — the
/// runtime's settles, the other handlers' transactions — finds the database locked (one would
/// fail at once), and each message's row is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_transaction_dropped_mid_statement_ends_before_the_next_writer_goes() {
    let ran = run_never_waiting(GivesUpInItsTransaction::default(), Runtime::builder(), 4).await;
    assert_eq!(ran, ((4, 1, 0), 4));
}

/// What the killed node is told, through its environment: its SQLite file.
const KILLED: &str = "DACAPO_HANDLER_CONNECTIONS_KILL_TEST";
/// The same, for a node whose second handler leaves a transaction open for every third
/// message.
const KILLED_LEAVING_OPEN: &str = "DACAPO_HANDLER_CONNECTIONS_KILL_TEST_LEAVING_OPEN";

/// The messages the killed node publishes, and the name it and its successor share.
const KILLED_MESSAGES: u64 = 3000;
const KILLED_NODE: &str = "tally-1";

/// The application's pool and the store of the node on the SQLite file at `path`, its table
/// created.
async fn tallying_node_store(path: &str) -> (sqlx::SqlitePool, dacapo::store::SqliteStore) {
    let store = dacapo::store::SqliteStore::open(path)
        .await
        .unwrap()
        .node_id(KILLED_NODE);
    let pool = store.pool().clone();
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    (pool, store)
}

/// A node on the SQLite file at `path` whose handler tallies on a handler connection (a
/// second one `leaving_open` a transaction for every third message), and the application's
/// pool.
async fn tallying_node(path: &str, leaving_open: bool) -> (Runtime, sqlx::SqlitePool) {
    let (pool, store) = tallying_node_store(path).await;
    (tallying_runtime(store, leaving_open), pool)
}

/// A runtime on `store` whose handler tallies on a handler connection, beside one
/// `leaving_open` a transaction for every third message.
fn tallying_runtime(store: dacapo::store::SqliteStore, leaving_open: bool) -> Runtime {
    let mut billing = Module::new("billing")
        .handle_named::<MemberRemoved, _>("tally", Tally::new(Backend::Sqlite, false));
    if leaving_open {
        let left_open = LeavesItsTransactionOpen {
            backend: Backend::Sqlite,
            every: 3,
        };
        billing = billing.handle_named::<MemberRemoved, _>("left-open", left_open);
    }
    Runtime::builder()
        .store(store)
        .module(billing)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the node the kill test starts and kills itself"]
async fn tallying_node_to_kill() {
    let (path, leaving_open) = match std::env::var(KILLED_LEAVING_OPEN) {
        Ok(path) => (path, true),
        Err(_) => (std::env::var(KILLED).expect("run by a kill test"), false),
    };
    let (runtime, _pool) = tallying_node(&path, leaving_open).await;
    // Told first: the batch commits as one, then waits for the engine's capacity as its
    // deliveries are handled, so most would be handled before it returns.
    println!("publishing");
    runtime
        .publish_batch(&members(KILLED_MESSAGES))
        .await
        .unwrap();
    // Until it is killed, or its parent ends however it ends (its standard input closes).
    tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
        .await
        .unwrap();
}

/// A node killed (`kill -9`) while its handlers write on parked handler connections: the
/// node restarted under its name handles the rest, and every message has its row once, every
/// delivery settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_its_handlers_write_loses_no_row_and_writes_none_twice() {
    killed_while_writing(false).await;
}

/// As above, with a second handler leaving a transaction open for every third message, which
/// the tallying handler's statements may run inside until the runtime ends it: killed at
/// whatever point that is, every tally row is there once, and every delivery settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_a_handler_leaves_transactions_open_loses_no_other_row() {
    killed_while_writing(true).await;
}

/// A node, with a second handler `leaving_open` transactions or not, killed a third of the
/// way, then restarted: what each test above tells.
async fn killed_while_writing(leaving_open: bool) {
    let db = support_stores::TestDatabase::new(Backend::Sqlite).await;
    // Opened first, so that counting rows later waits for nothing.
    let (_, store) = tallying_node_store(&db.url).await;
    let pool = store.pool().clone();
    let mut child = support_child::spawn(
        "tallying_node_to_kill",
        (
            if leaving_open {
                KILLED_LEAVING_OPEN
            } else {
                KILLED
            },
            &db.url,
        ),
        "publishing",
        WAIT,
    );
    // The tallying handler's rows, not the other handler's.
    let rows = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM tallies WHERE member < $1")
            .bind(LEFT_OPEN_ROWS as i64)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    // Killed about a third of the way, at whatever point its handlers and settles are then.
    while rows().await < KILLED_MESSAGES as i64 / 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node handles within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = rows().await;
    pool.close().await;

    let (runtime, pool) = tallying_node(&db.url, leaving_open).await;
    tokio::time::timeout(WAIT, runtime.first_recovery())
        .await
        .unwrap();
    let ((handled, retried, dead_lettered), _) = settled(runtime, &pool).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tallies WHERE member < $1")
        .bind(LEFT_OPEN_ROWS as i64)
        .fetch_one(&pool)
        .await
        .unwrap();
    let unsettled: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dacapo_inbox WHERE status <> 'handled'")
            .fetch_one(&pool)
            .await
            .unwrap();
    eprintln!("{before} rows before the kill, {handled} deliveries handled after it");
    assert_eq!(rows, KILLED_MESSAGES as i64, "each message's row, once");
    assert_eq!(unsettled, 0, "every delivery settled");
    // Those whose rows were written but whose settle was not run again, and find their rows.
    let missing = (KILLED_MESSAGES as i64 - before) as u64;
    assert!(
        (missing..=KILLED_MESSAGES).contains(&handled),
        "{handled} handled after the kill, {missing} rows missing"
    );
    // An attempt the kill cut short counts as failed: each resumed delivery runs again once.
    assert!(retried <= handled, "{retried} retried");
    assert_eq!(dead_lettered, 0);
}
