//! B2 and B3: durable deliveries per second, one handler doing one INSERT keyed on a
//! deterministic id, on SQLite (B2) and PostgreSQL (B3), against a raw sqlx loop running the
//! same SQL (persist the envelope, the handler's insert, mark it handled), pipelined the same
//! way (envelopes persisted one after another, handlers and completions concurrent, the same
//! in-flight bound) with the same durability settings (SQLite WAL with `synchronous = FULL`;
//! PostgreSQL defaults), in one run.
//!
//! Run with `cargo bench --bench b2_durable --features postgres` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; a scratch
//! database is created and dropped). Goal: at least 0.5 of the raw loop on each.

use std::time::{Duration, Instant};

use dacapo::RuntimeBuilder;
use dacapo::ids;
use dacapo::prelude::*;
use dacapo::store::{PostgresStore, SqliteStore};
use scratch::{ScratchPostgres, ScratchSqlite};
use serde::{Deserialize, Serialize};

#[path = "support/scratch.rs"]
mod scratch;
use sqlx::Executor;

#[derive(Serialize, Deserialize)]
struct Ping {
    n: u64,
}

impl dacapo::Message for Ping {
    const TYPE: &'static str = "bench.ping";
}

const TABLE: &str =
    "CREATE TABLE IF NOT EXISTS bench_rows (id TEXT PRIMARY KEY, n BIGINT NOT NULL)";
const INSERT_ROW: &str =
    "INSERT INTO bench_rows (id, n) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING";

/// The one handler: one INSERT with a deterministic id.
struct InsertRow<P>(P);

macro_rules! insert_row_handler {
    ($pool:ty) => {
        impl Handler<Ping> for InsertRow<$pool> {
            async fn handle(
                &self,
                ping: &Ping,
                context: &MessageContext,
            ) -> Result<(), HandlerError> {
                let id = ids::derive_or_random(context.message_id(), "row");
                sqlx::query(INSERT_ROW)
                    .bind(id)
                    .bind(ping.n as i64)
                    .execute(&self.0)
                    .await?;
                Ok(())
            }
        }
    };
}
insert_row_handler!(sqlx::SqlitePool);
insert_row_handler!(sqlx::PgPool);

async fn through_dacapo<H: Handler<Ping>>(
    store_builder: RuntimeBuilder,
    handler: H,
    deliveries: u64,
) -> Duration {
    let runtime = store_builder
        .module(Module::new("bench").handle_named::<Ping, _>("insert", handler))
        .build()
        .unwrap();
    let start = Instant::now();
    for n in 0..deliveries {
        runtime.publish(&Ping { n }).await.unwrap();
    }
    runtime.idle().await;
    let elapsed = start.elapsed();
    assert_eq!(runtime.stats().handled, deliveries);
    runtime.shutdown().await;
    elapsed
}

const RAW_RECEIVE: &str = "INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, attempts, owner, received_at) \
    VALUES ($1, 'bench.ping', $2, '{}', $3, 'incoming', 1, 'raw', $3) ON CONFLICT (id) DO NOTHING";
const RAW_HANDLED: &str =
    "UPDATE dacapo_inbox SET status = 'handled', handled_at = $2, owner = NULL WHERE id = $1";

macro_rules! raw_loop {
    ($name:ident, $pool:ty) => {
        /// The same three statements per message, pipelined as the runtime pipelines them:
        /// each envelope is persisted before the next is accepted, and its handler's insert and
        /// its completion run concurrently with later ones, up to the same in-flight bound.
        async fn $name(pool: &$pool, deliveries: u64) -> Duration {
            let start = Instant::now();
            let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(1024));
            let mut running = tokio::task::JoinSet::new();
            for n in 0..deliveries {
                let id = uuid::Uuid::new_v4();
                let payload = serde_json::to_vec(&Ping { n }).unwrap();
                let now = chrono::Utc::now().timestamp_millis();
                let permit = std::sync::Arc::clone(&in_flight)
                    .acquire_owned()
                    .await
                    .unwrap();
                sqlx::query(RAW_RECEIVE)
                    .bind(id.simple().to_string())
                    .bind(payload)
                    .bind(now)
                    .execute(pool)
                    .await
                    .unwrap();
                let pool = pool.clone();
                running.spawn(async move {
                    let row = ids::derive(id, "row");
                    sqlx::query(INSERT_ROW)
                        .bind(row)
                        .bind(n as i64)
                        .execute(&pool)
                        .await
                        .unwrap();
                    sqlx::query(RAW_HANDLED)
                        .bind(id.simple().to_string())
                        .bind(now)
                        .execute(&pool)
                        .await
                        .unwrap();
                    drop(permit);
                });
            }
            while running.join_next().await.is_some() {}
            start.elapsed()
        }
    };
}
raw_loop!(raw_sqlite, sqlx::SqlitePool);
raw_loop!(raw_postgres, sqlx::PgPool);

fn rate(deliveries: u64, elapsed: Duration) -> f64 {
    deliveries as f64 / elapsed.as_secs_f64()
}

async fn sqlite(deliveries: u64) -> (f64, f64) {
    let (ours, raw) = (ScratchSqlite::new("b2"), ScratchSqlite::new("b2-raw"));
    let store = SqliteStore::open(ours.path()).await.unwrap();
    let pool = store.pool().clone();
    pool.execute(TABLE).await.unwrap();
    let dacapo = through_dacapo(Runtime::builder().store(store), InsertRow(pool), deliveries).await;

    let store = SqliteStore::open(raw.path()).await.unwrap();
    let pool = store.pool().clone();
    pool.execute(TABLE).await.unwrap();
    let baseline = raw_sqlite(&pool, deliveries).await;
    pool.close().await;
    (rate(deliveries, dacapo), rate(deliveries, baseline))
}

async fn postgres(deliveries: u64) -> (f64, f64) {
    let mut measured = Vec::new();
    for which in ["dacapo", "raw"] {
        let scratch = ScratchPostgres::create(&format!("b3_{which}")).await;
        let store = PostgresStore::connect(&scratch.url).await.unwrap();
        let pool = store.pool().clone();
        pool.execute(TABLE).await.unwrap();
        let elapsed = if which == "dacapo" {
            through_dacapo(
                Runtime::builder().store(store),
                InsertRow(pool.clone()),
                deliveries,
            )
            .await
        } else {
            raw_postgres(&pool, deliveries).await
        };
        pool.close().await;
        scratch.remove().await;
        measured.push(rate(deliveries, elapsed));
    }
    (measured[0], measured[1])
}

#[tokio::main]
async fn main() {
    let deliveries: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let (sqlite_ours, sqlite_raw) = sqlite(deliveries).await;
    let (pg_ours, pg_raw) = postgres(deliveries).await;
    println!("B2/B3: {deliveries} durable deliveries, one INSERT each");
    println!(
        "  B2 SQLite      dacapo {sqlite_ours:>9.0}/s   raw sqlx loop {sqlite_raw:>9.0}/s   ratio {:.2} (goal >= 0.50)",
        sqlite_ours / sqlite_raw
    );
    println!(
        "  B3 PostgreSQL  dacapo {pg_ours:>9.0}/s   raw sqlx loop {pg_raw:>9.0}/s   ratio {:.2} (goal >= 0.50)",
        pg_ours / pg_raw
    );
}
