//! B5: how a dead node's backlog drains on PostgreSQL as it grows. A node left `N` envelopes
//! unsettled and stopped; another node recovers and handles them (one no-op handler), a
//! capacity's worth at a time. The drain rate at 100 000 pending against the rate at 20 000
//! shows whether a claim's cost grows with the backlog (a claim that scans and sorts every
//! pending row would make the whole drain quadratic); peak memory shows whether recovery holds
//! the backlog in memory.
//!
//! Run with `cargo bench --bench b5_backlog --features postgres` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; a scratch
//! database per size is created and dropped). Three rounds, the sizes interleaved so that a
//! slow spell of the machine falls on both; the ratio is of the medians. Goal: the 100k rate at
//! least 0.9 of the 20k rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
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

/// Counts its calls and wakes the bench at the last one: polling the table with `count(*)`
/// would cost more the larger the backlog, and bias the ratio.
#[derive(Clone)]
struct Counted {
    calls: Arc<AtomicI64>,
    last: i64,
    done: Arc<tokio::sync::Notify>,
}

impl Handler<Ping> for Counted {
    async fn handle(&self, _: &Ping, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.last {
            self.done.notify_one();
        }
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
    let counted = Counted {
        calls: Arc::default(),
        last: n,
        done: Arc::default(),
    };
    let start = Instant::now();
    let runtime = Runtime::builder()
        .store(store.node_id("drainer"))
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("bench").handle_named::<Ping, _>("noop", counted.clone()))
        .build()
        .unwrap();
    counted.done.notified().await;
    // The last deliveries' settles.
    runtime.idle().await;
    let elapsed = start.elapsed();
    let handled: i64 = sqlx::query_scalar(HANDLED).fetch_one(&pool).await.unwrap();
    assert_eq!(handled, n, "every envelope handled once");
    runtime.shutdown().await;
    drop(pool);
    scratch.remove().await;
    (n as f64 / elapsed.as_secs_f64(), peak_memory_mib())
}

fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("B5: a dead node's backlog drained by another node, PostgreSQL, one no-op handler");
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let (mut memory_small, mut memory_large) = (0.0, 0.0);
    for round in 1..=3 {
        let (rate_small, after_small) = drain(20_000).await;
        println!("  round {round}  20 000 pending   {rate_small:>8.0} deliveries/s");
        let (rate_large, after_large) = drain(100_000).await;
        println!(
            "  round {round}  100 000 pending  {rate_large:>8.0} deliveries/s   (ratio {:.2})",
            rate_large / rate_small
        );
        small.push(rate_small);
        large.push(rate_large);
        // Peak memory only grows: the first round's pair is the one that compares.
        if round == 1 {
            (memory_small, memory_large) = (after_small, after_large);
        }
    }
    let (small, large) = (median(small), median(large));
    println!("  medians: 20k {small:.0}/s, 100k {large:.0}/s");
    println!(
        "  rate at 100k / rate at 20k = {:.2} (goal >= 0.90); peak memory {memory_small:.1} MiB \
         after 20k, {memory_large:.1} MiB after 100k (grew {:.1} MiB)",
        large / small,
        memory_large - memory_small
    );
}
