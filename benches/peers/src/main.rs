//! dacapo next to apalis 1.0 (apalis-sqlite, apalis-postgres) on B2's workload, in one run: one
//! handler doing one INSERT keyed on a deterministic id, a durable accept and settle, SQLite in
//! WAL mode with `synchronous = FULL` for both, PostgreSQL with its defaults for both.
//!
//! Two workloads, each on a fresh database per contender:
//! - `live`: one publisher awaiting each publish (dacapo `publish`, apalis `push`) while the
//!   runtime or the worker handles;
//! - `16 pub.`: sixteen such publishers at once;
//! - `backlog`: every message already stored, then drained (dacapo: rows in its inbox that a
//!   starting node takes up; apalis: tasks pushed before the worker starts).
//!
//! The time runs until every message is handled *and* its completion is stored (dacapo's
//! settle; apalis's `Done`); then each handler's row is counted, one per message. apalis runs
//! twice: with its defaults, and tuned (batches of 100, 32 tasks at once); both poll every
//! 10 ms when idle (without a poll strategy its worker, once idle, waits for its 30 s
//! heartbeat). Three rounds, the contenders interleaved; the figures are medians.
//!
//! Run with `cargo run --release --manifest-path benches/peers/Cargo.toml` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; scratch
//! databases are created and dropped). Goals (issue 11): at least 25× apalis-sqlite and 3×
//! apalis-postgres.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use apalis::prelude::{BackendExt, BoxDynError, Data, TaskSink, WorkerBuilder, WorkerBuilderExt};
use dacapo::prelude::*;
use dacapo::transaction::HandlerTransactions;
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};
use tokio::sync::Notify;

use scratch::{ScratchPostgres, ScratchSqlite};

#[path = "../../support/scratch.rs"]
mod scratch;
#[path = "../../support/seed.rs"]
mod seed;
use seed::{SEED_POSTGRES, SEED_SQLITE};

const MESSAGES: u64 = 2_000;
const PUBLISHERS: u64 = 16;
/// How often an idle apalis worker looks for tasks.
const APALIS_POLL: Duration = Duration::from_millis(10);
const APALIS_BATCH: usize = 100;
const APALIS_CONCURRENCY: usize = 32;
/// apalis with its defaults sets no bound on tasks at once; this one is never reached.
const UNLIMITED: usize = 1 << 20;

#[derive(Clone, Serialize, Deserialize)]
struct Ping {
    n: u64,
}

impl Message for Ping {
    const TYPE: &'static str = "bench.ping";
}

const TABLE: &str =
    "CREATE TABLE IF NOT EXISTS bench_rows (id TEXT PRIMARY KEY, n BIGINT NOT NULL)";
const INSERT_ROW: &str =
    "INSERT INTO bench_rows (id, n) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING";

/// Counts handled messages and wakes the bench at the last one.
#[derive(Clone, Default)]
struct Count {
    handled: Arc<AtomicU64>,
    last: Arc<Notify>,
}

impl Count {
    fn one(&self) {
        if self.handled.fetch_add(1, Ordering::SeqCst) + 1 == MESSAGES {
            self.last.notify_one();
        }
    }
}

/// dacapo's handler: the INSERT, its id derived from the message id, on a handler connection
/// (on SQLite it takes the runtime's turn to write and is made durable by the settle's fsync,
/// so the row is as durable as apalis's once the message counts as handled).
struct Insert<DB> {
    count: Count,
    database: std::marker::PhantomData<fn() -> DB>,
}

macro_rules! dacapo_handler {
    ($db:ty) => {
        impl Handler<Ping> for Insert<$db> {
            async fn handle(&self, ping: &Ping, ctx: &MessageContext) -> Result<(), HandlerError> {
                let id = dacapo::ids::derive_or_random(ctx.message_id(), "row");
                let mut connection = ctx.connection::<$db>().await?;
                sqlx::query(INSERT_ROW)
                    .bind(id)
                    .bind(ping.n as i64)
                    .execute(&mut *connection)
                    .await?;
                drop(connection);
                self.count.one();
                Ok(())
            }
        }
    };
}
dacapo_handler!(sqlx::Sqlite);
dacapo_handler!(sqlx::Postgres);

/// apalis's handler on `$pool`: the same INSERT, its id derived from the message.
macro_rules! apalis_handler {
    ($name:ident, $pool:ty) => {
        async fn $name(
            ping: Ping,
            pool: Data<$pool>,
            count: Data<Count>,
        ) -> Result<(), BoxDynError> {
            sqlx::query(INSERT_ROW)
                .bind(format!("{}-row", ping.n))
                .bind(ping.n as i64)
                .execute(&*pool)
                .await?;
            count.one();
            Ok(())
        }
    };
}
apalis_handler!(apalis_sqlite_insert, SqlitePool);
apalis_handler!(apalis_postgres_insert, PgPool);

#[derive(Clone, Copy, PartialEq)]
enum Workload {
    Live,
    /// Sixteen publishers at once, handled live.
    Publishers16,
    Backlog,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Publishers16 => "16 pub.",
            Self::Backlog => "backlog",
        }
    }
}

/// A pool on the SQLite file at `path`, WAL, `synchronous = FULL` on every connection.
async fn sqlite_pool(path: &str) -> SqlitePool {
    sqlite_pool_with(path, &[]).await
}

/// [`sqlite_pool`] with `pragmas` on every connection too: the ones apalis's setup sets, but
/// `synchronous`.
async fn sqlite_pool_with(path: &str, pragmas: &[(&'static str, &'static str)]) -> SqlitePool {
    let mut options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10));
    for (name, value) in pragmas {
        options = options.pragma(*name, *value);
    }
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap()
}

/// dacapo on `store`: the workload's time until every delivery is settled.
async fn dacapo_run<DB, S>(store: S, workload: Workload) -> Duration
where
    Insert<DB>: Handler<Ping>,
    S: dacapo::ports::DurableInbox
        + dacapo::ports::DeadLetterStore
        + dacapo::ports::Claims
        + dacapo::ports::OutboxStore,
{
    let count = Count::default();
    let start = Instant::now();
    let runtime = Runtime::builder()
        .store(store)
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("bench").handle_named::<Ping, _>(
            "insert",
            Insert::<DB> {
                count: count.clone(),
                database: std::marker::PhantomData,
            },
        ))
        .build()
        .unwrap();
    match workload {
        Workload::Live => {
            for n in 0..MESSAGES {
                runtime.publish(&Ping { n }).await.unwrap();
            }
        }
        Workload::Publishers16 => {
            futures::future::join_all((0..PUBLISHERS).map(|publisher| {
                let runtime = &runtime;
                async move {
                    for n in (publisher..MESSAGES).step_by(PUBLISHERS as usize) {
                        runtime.publish(&Ping { n }).await.unwrap();
                    }
                }
            }))
            .await;
        }
        Workload::Backlog => {}
    }
    count.last.notified().await;
    runtime.idle().await;
    let elapsed = start.elapsed();
    assert_eq!(runtime.stats().handled, MESSAGES);
    runtime.shutdown().await;
    elapsed
}

async fn dacapo_sqlite(workload: Workload) -> Duration {
    let file = ScratchSqlite::new("peers");
    let pool = sqlite_pool(file.path()).await;
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    let store = dacapo::store::SqliteStore::with_pool(pool.clone())
        .await
        .unwrap();
    if workload == Workload::Backlog {
        sqlx::query(SEED_SQLITE)
            .bind(MESSAGES as i64)
            .execute(&pool)
            .await
            .unwrap();
    }
    let elapsed = dacapo_run::<sqlx::Sqlite, _>(store, workload).await;
    assert_eq!(rows(&pool).await, MESSAGES as i64, "one row per message");
    pool.close().await;
    elapsed
}

async fn dacapo_postgres(workload: Workload) -> Duration {
    let database = ScratchPostgres::create("peers").await;
    let store = dacapo::store::PostgresStore::connect(&database.url)
        .await
        .unwrap();
    let pool = store.pool().clone();
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    if workload == Workload::Backlog {
        sqlx::query(SEED_POSTGRES)
            .bind(MESSAGES as i64)
            .execute(&pool)
            .await
            .unwrap();
    }
    let elapsed = dacapo_run::<sqlx::Postgres, _>(store, workload).await;
    assert_eq!(rows(&pool).await, MESSAGES as i64, "one row per message");
    pool.close().await;
    database.remove().await;
    elapsed
}

/// The pushes of the live workloads, while the worker runs: one publisher or sixteen, each on
/// a clone of `$storage`.
macro_rules! push_live {
    ($storage:expr, $workload:expr) => {{
        let publishers = match $workload {
            Workload::Live => 1,
            Workload::Publishers16 => PUBLISHERS,
            Workload::Backlog => 0,
        };
        futures::future::join_all((0..publishers).map(|publisher| {
            let mut storage = $storage.clone();
            async move {
                for n in (publisher..MESSAGES).step_by(publishers as usize) {
                    storage.push(Ping { n }).await.unwrap();
                }
            }
        }))
        .await;
    }};
}

/// Waits, bounded, until every handler ran, then until `done()` counts every message: apalis
/// records completions in batches after its handlers return.
async fn until_all_done(count: &Count, done: impl AsyncFn() -> i64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while count.handled.load(Ordering::SeqCst) < MESSAGES {
        assert!(Instant::now() < deadline, "handlers still running");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    loop {
        let stored = done().await;
        if stored >= MESSAGES as i64 {
            return;
        }
        assert!(Instant::now() < deadline, "{stored} of {MESSAGES} done");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// apalis on `$storage` over `$pool`, with `$handler`: the workload's time until every task is
/// `Done` (`$done` counts them), then a check of the handlers' rows.
macro_rules! apalis_run {
    ($storage:ident, $pool:ident, $handler:ident, $done:literal, $workload:ident, $tuning:ident) => {{
        let count = Count::default();
        let done = async || -> i64 { sqlx::query_scalar($done).fetch_one(&$pool).await.unwrap() };
        if $workload == Workload::Backlog {
            let mut storage = $storage.clone();
            for n in 0..MESSAGES {
                storage.push(Ping { n }).await.unwrap();
            }
        }
        let start = Instant::now();
        let worker = WorkerBuilder::new("bench")
            // Without a poll strategy, a worker that found nothing sleeps until its
            // heartbeat (30 s): a push does not wake it.
            .backend($storage.clone().poll_with_interval(APALIS_POLL))
            .data($pool.clone())
            .data(count.clone())
            .concurrency(if $tuning == Tuning::Tuned {
                APALIS_CONCURRENCY
            } else {
                UNLIMITED
            })
            .build($handler);
        let last = Arc::clone(&count.last);
        let running = tokio::spawn(worker.run_until(async move {
            last.notified().await;
            Ok::<(), std::io::Error>(())
        }));
        push_live!($storage, $workload);
        until_all_done(&count, done).await;
        let elapsed = start.elapsed();
        let _ = running.await;
        assert_eq!(rows(&$pool).await, MESSAGES as i64, "one row per message");
        elapsed
    }};
}

/// How apalis is set up: its defaults, or batches of 100 and 32 tasks at once.
#[derive(Clone, Copy, PartialEq)]
enum Tuning {
    Defaults,
    Tuned,
}

async fn apalis_sqlite(workload: Workload, tuning: Tuning) -> Duration {
    let file = ScratchSqlite::new("peers");
    let pool = sqlite_pool(file.path()).await;
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    // Its setup sets `synchronous = OFF` on the connection it runs on: that pool is closed,
    // and the run opens connections of its own, with FULL.
    apalis_sqlite::SqliteStorage::setup(&pool).await.unwrap();
    pool.close().await;
    let pool = sqlite_pool_with(
        file.path(),
        &[("cache_size", "64000"), ("temp_store", "MEMORY")],
    )
    .await;
    let mut config = apalis_sqlite::Config::default().queue("bench");
    if tuning == Tuning::Tuned {
        config = config.batch_size(APALIS_BATCH);
    }
    let storage = apalis_sqlite::SqliteStorage::<Ping>::new(&pool).with_config(config);
    let elapsed = apalis_run!(
        storage,
        pool,
        apalis_sqlite_insert,
        "SELECT count(*) FROM Jobs WHERE status = 'Done'",
        workload,
        tuning
    );
    pool.close().await;
    elapsed
}

async fn apalis_postgres(workload: Workload, tuning: Tuning) -> Duration {
    let database = ScratchPostgres::create("peers").await;
    // Without the ping before each use, as dacapo's own pool.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .test_before_acquire(false)
        .connect(&database.url)
        .await
        .unwrap();
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    apalis_postgres::PostgresStorage::setup(&pool)
        .await
        .unwrap();
    let mut config = apalis_postgres::Config::default().queue("bench");
    if tuning == Tuning::Tuned {
        config = config.batch_size(APALIS_BATCH);
    }
    let storage = apalis_postgres::PostgresStorage::<Ping>::new(&pool).with_config(config);
    let elapsed = apalis_run!(
        storage,
        pool,
        apalis_postgres_insert,
        "SELECT count(*) FROM apalis.jobs WHERE status = 'Done'",
        workload,
        tuning
    );
    pool.close().await;
    database.remove().await;
    elapsed
}

/// The handlers' rows.
async fn rows<'e, E>(pool: E) -> i64
where
    E: sqlx::Executor<'e>,
    i64: sqlx::Type<E::Database> + for<'r> sqlx::Decode<'r, E::Database>,
    for<'q> <E::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<E::Database>,
    (i64,): for<'r> sqlx::FromRow<'r, <E::Database as sqlx::Database>::Row>,
{
    sqlx::query_scalar("SELECT count(*) FROM bench_rows")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn rate(elapsed: Duration) -> f64 {
    MESSAGES as f64 / elapsed.as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

const ROUNDS: usize = 3;
const WORKLOADS: [Workload; 3] = [Workload::Live, Workload::Publishers16, Workload::Backlog];
const TUNINGS: [Tuning; 2] = [Tuning::Defaults, Tuning::Tuned];

/// One workload's rates over the rounds: dacapo's, then apalis's by tuning.
#[derive(Default)]
struct Rates {
    dacapo: Vec<f64>,
    apalis: [Vec<f64>; 2],
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "dacapo and apalis 1.0, {MESSAGES} messages, one INSERT per handler (SQLite WAL \
         synchronous=FULL; PostgreSQL synchronous_commit=on); apalis defaults, then tuned: \
         batches of {APALIS_BATCH}, {APALIS_CONCURRENCY} at once; medians of {ROUNDS} rounds"
    );
    let mut sqlite: Vec<Rates> = WORKLOADS.iter().map(|_| Rates::default()).collect();
    let mut postgres: Vec<Rates> = WORKLOADS.iter().map(|_| Rates::default()).collect();
    for _ in 0..ROUNDS {
        for (at, workload) in WORKLOADS.into_iter().enumerate() {
            scratch::flush_writes();
            sqlite[at].dacapo.push(rate(dacapo_sqlite(workload).await));
            for (tuned, tuning) in TUNINGS.into_iter().enumerate() {
                scratch::flush_writes();
                sqlite[at].apalis[tuned].push(rate(apalis_sqlite(workload, tuning).await));
            }
            scratch::flush_writes();
            postgres[at]
                .dacapo
                .push(rate(dacapo_postgres(workload).await));
            for (tuned, tuning) in TUNINGS.into_iter().enumerate() {
                scratch::flush_writes();
                postgres[at].apalis[tuned].push(rate(apalis_postgres(workload, tuning).await));
            }
        }
    }
    for (backend, peer, goal, rates) in [
        ("SQLite", "apalis-sqlite", 25.0, &sqlite),
        ("PostgreSQL", "apalis-postgres", 3.0, &postgres),
    ] {
        for (workload, rates) in WORKLOADS.iter().zip(rates) {
            let dacapo = median(rates.dacapo.clone());
            for (tuning, apalis) in TUNINGS.iter().zip(&rates.apalis) {
                let apalis = median(apalis.clone());
                let ratio = dacapo / apalis;
                println!(
                    "  {backend:<11} {:<8} dacapo {dacapo:>7.0}/s   {peer:<15} {:<8} {apalis:>7.0}/s   {ratio:>5.1}x (goal >= {goal}x: {})",
                    workload.name(),
                    tuning.name(),
                    if ratio >= goal { "met" } else { "unmet" }
                );
            }
        }
    }
}

impl Tuning {
    fn name(self) -> &'static str {
        match self {
            Self::Defaults => "defaults",
            Self::Tuned => "tuned",
        }
    }
}
