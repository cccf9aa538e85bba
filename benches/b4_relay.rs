//! B4: outbox burn-down. 100k envelopes enlisted in the outbox (in one transaction, before the
//! clock starts) are published by the relay to the in-process transport, in batches of 100, and
//! marked published; against a raw SQL drain doing the same reads (`SELECT` of the same columns,
//! oldest first, `LIMIT 100`) and the same updates (`UPDATE … WHERE seq IN (…)`) with the same
//! batch size, pipelined the same way (a batch is marked while the next is read), in one run, on
//! SQLite and on PostgreSQL.
//!
//! The receiving side keeps its inbox in memory and runs one no-op handler, so the figure is the
//! relay's: what it costs to read, decode, hand over and mark each envelope, not what the
//! receiving inbox costs (B2 and B3 measure that).
//!
//! Run with `cargo bench --bench b4_relay --features postgres` (add a row count to change
//! 100000; PostgreSQL at `DACAPO_BENCH_POSTGRES`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`, a scratch database is created and dropped).
//! Goal: at least 0.5 of the raw drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dacapo::RuntimeBuilder;
use dacapo::outbox::Outbox;
use dacapo::prelude::*;
use dacapo::store::{MemoryInbox, PostgresStore, SqliteStore};
use scratch::{ScratchPostgres, ScratchSqlite};
use serde::{Deserialize, Serialize};

#[path = "support/scratch.rs"]
mod scratch;

#[derive(Serialize, Deserialize)]
struct Ping {
    n: u64,
}

impl dacapo::Message for Ping {
    const TYPE: &'static str = "bench.ping";
}

#[derive(Clone, Default)]
struct Count(Arc<AtomicU64>);

impl Handler<Ping> for Count {
    async fn handle(&self, _: &Ping, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

const BATCH: usize = 100;

/// The relay's read, as the relay issues it.
const READ: &str = "SELECT seq, id, message_type, payload, headers, deduplication_id, \
    correlation_id, causation_id, sent_at, scheduled_for \
    FROM dacapo_outbox WHERE published_at IS NULL AND seq > $2 ORDER BY seq LIMIT $1";

/// `UPDATE … WHERE seq IN ($2, …)` for `count` positions, as the relay marks a batch.
fn mark(count: usize) -> String {
    let positions: Vec<String> = (2..count + 2).map(|n| format!("${n}")).collect();
    format!(
        "UPDATE dacapo_outbox SET published_at = $1 WHERE seq IN ({})",
        positions.join(", ")
    )
}

macro_rules! fill {
    ($name:ident, $pool:ty, $begin:literal) => {
        async fn $name(pool: &$pool, rows: u64) {
            let mut tx = pool.begin_with($begin).await.unwrap();
            for n in 0..rows {
                Outbox::enlist(&mut tx, &Ping { n }).await.unwrap();
            }
            tx.commit().await.unwrap();
        }
    };
}
fill!(fill_sqlite, sqlx::SqlitePool, "BEGIN IMMEDIATE");
fill!(fill_postgres, sqlx::PgPool, "BEGIN");

macro_rules! raw_drain {
    ($name:ident, $pool:ty) => {
        /// The relay's statements, pipelined as the relay pipelines them: each batch is marked
        /// while the next one is read.
        async fn $name(pool: &$pool) -> (Duration, u64) {
            use sqlx::Row;
            let read = |after: i64| {
                sqlx::query(READ)
                    .bind(BATCH as i64)
                    .bind(after)
                    .fetch_all(pool)
            };
            let start = Instant::now();
            let mut drained = 0;
            let mut rows = read(i64::MIN).await.unwrap();
            while !rows.is_empty() {
                let mut update = sqlx::query(sqlx::AssertSqlSafe(mark(rows.len())))
                    .bind(chrono::Utc::now().timestamp_millis());
                let mut after = i64::MIN;
                for row in &rows {
                    after = row.get::<i64, _>(0);
                    update = update.bind(after);
                }
                drained += rows.len() as u64;
                if rows.len() < BATCH {
                    update.execute(pool).await.unwrap();
                    break;
                }
                let (marked, next) = tokio::join!(update.execute(pool), read(after));
                marked.unwrap();
                rows = next.unwrap();
            }
            (start.elapsed(), drained)
        }
    };
}
raw_drain!(raw_sqlite, sqlx::SqlitePool);
raw_drain!(raw_postgres, sqlx::PgPool);

/// Builds a runtime on `builder` (whose outbox holds `rows` envelopes) and waits until the relay
/// has published them all and the handler has seen each.
async fn relay(builder: RuntimeBuilder, rows: u64) -> Duration {
    let count = Count::default();
    let start = Instant::now();
    let runtime = builder
        .inbox(Arc::new(MemoryInbox::new(
            Duration::from_secs(300),
            Arc::new(dacapo::ports::SystemClock),
        )))
        .relay_batch(BATCH)
        .module(Module::new("bench").handle_named::<Ping, _>("count", count.clone()))
        .build()
        .unwrap();
    runtime.idle().await;
    let elapsed = start.elapsed();
    assert_eq!(
        count.0.load(Ordering::Relaxed),
        rows,
        "every row published once"
    );
    let backlog = runtime.outbox_backlog().await.unwrap().unwrap();
    assert_eq!(backlog.depth, 0);
    runtime.shutdown().await;
    elapsed
}

fn rate(rows: u64, elapsed: Duration) -> f64 {
    rows as f64 / elapsed.as_secs_f64()
}

async fn sqlite(rows: u64) -> (f64, f64) {
    let (ours, raw) = (ScratchSqlite::new("b4"), ScratchSqlite::new("b4-raw"));
    let store = SqliteStore::open(ours.path()).await.unwrap();
    fill_sqlite(store.pool(), rows).await;
    let dacapo = relay(Runtime::builder().store(store), rows).await;

    let store = SqliteStore::open(raw.path()).await.unwrap();
    fill_sqlite(store.pool(), rows).await;
    let (baseline, drained) = raw_sqlite(store.pool()).await;
    assert_eq!(drained, rows);
    store.pool().close().await;
    (rate(rows, dacapo), rate(rows, baseline))
}

async fn postgres(rows: u64) -> (f64, f64) {
    let mut measured = Vec::new();
    for which in ["dacapo", "raw"] {
        let scratch = ScratchPostgres::create(&format!("b4_{which}")).await;
        let store = PostgresStore::connect(&scratch.url).await.unwrap();
        let pool = store.pool().clone();
        fill_postgres(&pool, rows).await;
        let elapsed = if which == "dacapo" {
            relay(Runtime::builder().store(store), rows).await
        } else {
            let (elapsed, drained) = raw_postgres(&pool).await;
            assert_eq!(drained, rows);
            elapsed
        };
        pool.close().await;
        scratch.remove().await;
        measured.push(rate(rows, elapsed));
    }
    (measured[0], measured[1])
}

#[tokio::main]
async fn main() {
    let rows: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let (sqlite_ours, sqlite_raw) = sqlite(rows).await;
    let (pg_ours, pg_raw) = postgres(rows).await;
    println!("B4: relay burn-down of {rows} enlisted rows, batches of {BATCH}");
    println!(
        "  SQLite      relay {sqlite_ours:>9.0}/s   raw drain {sqlite_raw:>9.0}/s   ratio {:.2} (goal >= 0.50)",
        sqlite_ours / sqlite_raw
    );
    println!(
        "  PostgreSQL  relay {pg_ours:>9.0}/s   raw drain {pg_raw:>9.0}/s   ratio {:.2} (goal >= 0.50)",
        pg_ours / pg_raw
    );
}
