//! B5: how a dead node's backlog drains on PostgreSQL as it grows. A node left `N` envelopes
//! unsettled and stopped; another node recovers and handles them (one no-op handler), a
//! capacity's worth at a time. The drain rate at 100 000 pending against the rate at 20 000
//! shows whether a claim's cost grows with the backlog (a claim that scans and sorts every
//! pending row would make the whole drain quadratic); peak memory shows whether recovery holds
//! the backlog in memory.
//!
//! Run with `cargo bench --bench b5_backlog --features postgres` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; a scratch
//! database per size is created and dropped). Goal: the 100k rate at least 0.9 of the 20k rate.

use std::time::{Duration, Instant};

use dacapo::prelude::*;
use dacapo::store::PostgresStore;
use scratch::ScratchPostgres;
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

struct NoOp;

impl Handler<Ping> for NoOp {
    async fn handle(&self, _: &Ping, _: &MessageContext) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// `n` unsettled envelopes of a node that never heartbeat, received long ago.
const SEED: &str = "INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, \
    status, attempts, owner, received_at) \
    SELECT lpad(to_hex(i), 32, '0'), 'bench.ping', convert_to('{\"n\":1}', 'UTF8'), '{}', 0, \
    'incoming', 0, 'dead-node', i FROM generate_series(1, $1) AS i";

const HANDLED: &str = "SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'";

/// The process's peak resident memory so far, in MiB (Linux).
fn peak_memory_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Seeds `n` orphaned envelopes, then times how long a new node takes to handle them all.
async fn drain(n: i64) -> (f64, f64) {
    let scratch = ScratchPostgres::create("b5").await;
    let store = PostgresStore::connect(&scratch.url).await.unwrap();
    sqlx::query(SEED)
        .bind(n)
        .execute(store.pool())
        .await
        .unwrap();
    let pool = store.pool().clone();
    let start = Instant::now();
    let runtime = Runtime::builder()
        .store(store.node_id("drainer"))
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("bench").handle_named::<Ping, _>("noop", NoOp))
        .build()
        .unwrap();
    loop {
        let handled: i64 = sqlx::query_scalar(HANDLED).fetch_one(&pool).await.unwrap();
        if handled >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = start.elapsed();
    runtime.shutdown().await;
    drop(pool);
    scratch.remove().await;
    (n as f64 / elapsed.as_secs_f64(), peak_memory_mib())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("B5: a dead node's backlog drained by another node, PostgreSQL, one no-op handler");
    let (small, memory_small) = drain(20_000).await;
    println!("  20 000 pending   {small:>8.0} deliveries/s   peak memory {memory_small:>6.1} MiB");
    let (large, memory_large) = drain(100_000).await;
    println!("  100 000 pending  {large:>8.0} deliveries/s   peak memory {memory_large:>6.1} MiB");
    println!(
        "  rate at 100k / rate at 20k = {:.2} (goal >= 0.90); peak memory grew {:.1} MiB",
        large / small,
        memory_large - memory_small
    );
}
