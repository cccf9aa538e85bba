//! dacapo next to apalis 1.0 (apalis-sqlite, apalis-postgres) on B2's workload, in one run: one
//! handler doing one INSERT keyed on a deterministic id, a durable accept and settle, SQLite in
//! WAL mode with `synchronous = FULL` for both, PostgreSQL with its defaults for both.
//!
//! Two workloads, each on a fresh database per contender:
//! - `live`: one publisher awaiting each publish (dacapo `publish`, apalis `push`) while the
//!   runtime or the worker handles;
//! - `backlog`: every message already stored, then drained (dacapo: rows in its inbox that a
//!   starting node takes up; apalis: tasks pushed before the worker starts).
//!
//! The time runs until every message is handled *and* its completion is stored (dacapo's
//! settle; apalis's `Done`); then each handler's row is counted, one per message. apalis runs
//! twice: with its defaults, and tuned (batches of 100, 32 tasks at once).
//!
//! Run with `cargo run --release --manifest-path benches/peers/Cargo.toml` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; scratch
//! databases are created and dropped). Goals (issue 11): at least 25× apalis-sqlite and 3×
//! apalis-postgres.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use apalis::prelude::{BoxDynError, Data, TaskSink, WorkerBuilder, WorkerBuilderExt};
use dacapo::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};
use tokio::sync::Notify;

use scratch::{ScratchPostgres, ScratchSqlite};

#[path = "../../support/scratch.rs"]
mod scratch;

const MESSAGES: u64 = 2_000;
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

/// dacapo's handler: the INSERT, its id derived from the message id.
struct Insert<P> {
    pool: P,
    count: Count,
}

macro_rules! dacapo_handler {
    ($pool:ty) => {
        impl Handler<Ping> for Insert<$pool> {
            async fn handle(&self, ping: &Ping, ctx: &MessageContext) -> Result<(), HandlerError> {
                let id = dacapo::ids::derive_or_random(ctx.message_id(), "row");
                sqlx::query(INSERT_ROW)
                    .bind(id)
                    .bind(ping.n as i64)
                    .execute(&self.pool)
                    .await?;
                self.count.one();
                Ok(())
            }
        }
    };
}
dacapo_handler!(SqlitePool);
dacapo_handler!(PgPool);

/// apalis's handler: the same INSERT, its id derived from the message.
async fn apalis_sqlite_insert(
    ping: Ping,
    pool: Data<SqlitePool>,
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

async fn apalis_postgres_insert(
    ping: Ping,
    pool: Data<PgPool>,
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

#[derive(Clone, Copy, PartialEq)]
enum Workload {
    Live,
    Backlog,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Backlog => "backlog",
        }
    }
}

/// A pool on the SQLite file at `path`, WAL, `synchronous = FULL` on every connection.
async fn sqlite_pool(path: &str) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap()
}

const SEED_SQLITE: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
    WHERE i < $1) INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
    attempts, owner, received_at) SELECT printf('%032x', i), 'bench.ping', \
    CAST('{\"n\":' || i || '}' AS BLOB), '{}', 0, 'incoming', 0, NULL, i FROM n";
const SEED_POSTGRES: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
    WHERE i < $1) INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
    attempts, owner, received_at) SELECT lpad(to_hex(i), 32, '0'), 'bench.ping', \
    convert_to('{\"n\":' || i || '}', 'UTF8'), '{}', 0, 'incoming', 0, NULL, i FROM n";

/// dacapo on `store`: the workload's time until every delivery is settled.
async fn dacapo_run<P: Clone, S>(store: S, pool: P, workload: Workload) -> Duration
where
    Insert<P>: Handler<Ping>,
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
            Insert {
                pool,
                count: count.clone(),
            },
        ))
        .build()
        .unwrap();
    if workload == Workload::Live {
        for n in 0..MESSAGES {
            runtime.publish(&Ping { n }).await.unwrap();
        }
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
    let elapsed = dacapo_run(store, pool.clone(), workload).await;
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
    let elapsed = dacapo_run(store, pool.clone(), workload).await;
    assert_eq!(rows(&pool).await, MESSAGES as i64, "one row per message");
    pool.close().await;
    database.remove().await;
    elapsed
}

/// Waits, bounded, until `done()` counts every message: apalis records completions in batches
/// after its handlers return.
async fn until_all_done(done: impl AsyncFn() -> i64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let count = done().await;
        if count >= MESSAGES as i64 {
            return;
        }
        assert!(Instant::now() < deadline, "{count} of {MESSAGES} done");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
    let pool = sqlite_pool(file.path()).await;
    let mut config = apalis_sqlite::Config::default().queue("bench");
    if tuning == Tuning::Tuned {
        config = config.batch_size(APALIS_BATCH);
    }
    let mut storage = apalis_sqlite::SqliteStorage::<Ping>::new(&pool).with_config(config);
    let count = Count::default();
    let done = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM Jobs WHERE status = 'Done'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    if workload == Workload::Backlog {
        for n in 0..MESSAGES {
            storage.push(Ping { n }).await.unwrap();
        }
    }
    let start = Instant::now();
    let worker = WorkerBuilder::new("bench")
        .backend(storage.clone())
        .data(pool.clone())
        .data(count.clone())
        .concurrency(if tuning == Tuning::Tuned {
            APALIS_CONCURRENCY
        } else {
            UNLIMITED
        })
        .build(apalis_sqlite_insert);
    let last = Arc::clone(&count.last);
    let running = tokio::spawn(worker.run_until(async move {
        last.notified().await;
        Ok::<(), std::io::Error>(())
    }));
    if workload == Workload::Live {
        for n in 0..MESSAGES {
            storage.push(Ping { n }).await.unwrap();
        }
    }
    until_all_done(done).await;
    let elapsed = start.elapsed();
    let _ = running.await;
    assert_eq!(rows(&pool).await, MESSAGES as i64, "one row per message");
    pool.close().await;
    elapsed
}

async fn apalis_postgres(workload: Workload, tuning: Tuning) -> Duration {
    let database = ScratchPostgres::create("peers").await;
    let pool = PgPool::connect(&database.url).await.unwrap();
    sqlx::query(TABLE).execute(&pool).await.unwrap();
    apalis_postgres::PostgresStorage::setup(&pool)
        .await
        .unwrap();
    let mut config = apalis_postgres::Config::default().queue("bench");
    if tuning == Tuning::Tuned {
        config = config.batch_size(APALIS_BATCH);
    }
    let mut storage = apalis_postgres::PostgresStorage::<Ping>::new(&pool).with_config(config);
    let count = Count::default();
    let done = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM apalis.jobs WHERE status = 'Done'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    if workload == Workload::Backlog {
        for n in 0..MESSAGES {
            storage.push(Ping { n }).await.unwrap();
        }
    }
    let start = Instant::now();
    let worker = WorkerBuilder::new("bench")
        .backend(storage.clone())
        .data(pool.clone())
        .data(count.clone())
        .concurrency(if tuning == Tuning::Tuned {
            APALIS_CONCURRENCY
        } else {
            UNLIMITED
        })
        .build(apalis_postgres_insert);
    let last = Arc::clone(&count.last);
    let running = tokio::spawn(worker.run_until(async move {
        last.notified().await;
        Ok::<(), std::io::Error>(())
    }));
    if workload == Workload::Live {
        for n in 0..MESSAGES {
            storage.push(Ping { n }).await.unwrap();
        }
    }
    until_all_done(done).await;
    let elapsed = start.elapsed();
    let _ = running.await;
    assert_eq!(rows(&pool).await, MESSAGES as i64, "one row per message");
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "dacapo and apalis 1.0, {MESSAGES} messages, one INSERT per handler (SQLite WAL \
         synchronous=FULL; PostgreSQL synchronous_commit=on); apalis defaults, then tuned: batches of {APALIS_BATCH}, \
         {APALIS_CONCURRENCY} at once"
    );
    for workload in [Workload::Live, Workload::Backlog] {
        let dacapo = rate(dacapo_sqlite(workload).await);
        for tuning in [Tuning::Defaults, Tuning::Tuned] {
            let apalis = rate(apalis_sqlite(workload, tuning).await);
            println!(
                "  SQLite      {:<8} dacapo {dacapo:>8.0}/s   apalis-sqlite   {:<8} {apalis:>8.0}/s   {:>6.1}x (goal >= 25x)",
                workload.name(),
                tuning.name(),
                dacapo / apalis
            );
        }
        let dacapo = rate(dacapo_postgres(workload).await);
        for tuning in [Tuning::Defaults, Tuning::Tuned] {
            let apalis = rate(apalis_postgres(workload, tuning).await);
            println!(
                "  PostgreSQL  {:<8} dacapo {dacapo:>8.0}/s   apalis-postgres {:<8} {apalis:>8.0}/s   {:>6.1}x (goal >= 3x)",
                workload.name(),
                tuning.name(),
                dacapo / apalis
            );
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
