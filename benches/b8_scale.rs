//! B8: how durable throughput scales with the handlers per event (1, 3, 10) and the payload
//! (100 B, 10 KB, 100 KB), on SQLite (WAL, `synchronous = FULL`) and PostgreSQL
//! (`synchronous_commit = on`): 16 publishers, no-op handlers, so what is measured is the
//! runtime's own work — the accept, a supervisor and a handler actor per handler, the settle.
//! Peak memory with a 100 000-envelope backlog on PostgreSQL is B5's.
//!
//! Run with `cargo bench --bench b8_scale --features postgres` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`).

use std::sync::Arc;
use std::time::Instant;

use dacapo::RuntimeBuilder;
use dacapo::prelude::*;
use dacapo::store::{PostgresStore, SqliteStore};
use scratch::{ScratchPostgres, ScratchSqlite};
use serde::{Deserialize, Serialize};

#[path = "support/scratch.rs"]
mod scratch;

#[derive(Serialize, Deserialize)]
struct Parcel {
    n: u64,
    body: String,
}

impl dacapo::Message for Parcel {
    const TYPE: &'static str = "bench.parcel";
}

struct Accept;

impl Handler<Parcel> for Accept {
    async fn handle(&self, _: &Parcel, _: &MessageContext) -> Result<(), HandlerError> {
        Ok(())
    }
}

const PUBLISHERS: u64 = 16;

/// Deliveries per second of `count` messages with `handlers` handlers and a `payload`-byte body.
async fn rate(builder: RuntimeBuilder, handlers: usize, payload: usize, count: u64) -> f64 {
    let mut module = Module::new("bench");
    for index in 0..handlers {
        module = module.handle_named::<Parcel, _>(format!("h{index}").as_str(), Accept);
    }
    let runtime = Arc::new(
        builder
            .module(module)
            .max_envelope_size(256 * 1024)
            .build()
            .unwrap(),
    );
    let body = "x".repeat(payload);
    let start = Instant::now();
    let mut publishing = tokio::task::JoinSet::new();
    for publisher in 0..PUBLISHERS {
        let (runtime, body) = (Arc::clone(&runtime), body.clone());
        publishing.spawn(async move {
            let mut n = publisher;
            while n < count {
                runtime
                    .publish(&Parcel {
                        n,
                        body: body.clone(),
                    })
                    .await
                    .unwrap();
                n += PUBLISHERS;
            }
        });
    }
    while publishing.join_next().await.is_some() {}
    runtime.idle().await;
    let elapsed = start.elapsed();
    assert_eq!(runtime.stats().handled, count);
    runtime.shutdown().await;
    count as f64 / elapsed.as_secs_f64()
}

#[tokio::main]
async fn main() {
    let count: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1000);
    let cases = [
        (1, 100),
        (3, 100),
        (10, 100),
        (1, 10 * 1024),
        (1, 100 * 1024),
    ];
    println!("B8: {count} durable deliveries, {PUBLISHERS} publishers, no-op handlers");
    println!(
        "  {:<9} {:>9}   {:>12}   {:>12}",
        "handlers", "payload", "SQLite", "PostgreSQL"
    );
    for (handlers, payload) in cases {
        let sqlite = {
            let scratch = ScratchSqlite::new("b8");
            let store = SqliteStore::open(scratch.path()).await.unwrap();
            rate(Runtime::builder().store(store), handlers, payload, count).await
        };
        let postgres = {
            let scratch = ScratchPostgres::create("b8").await;
            let store = PostgresStore::connect(&scratch.url).await.unwrap();
            let rate = rate(Runtime::builder().store(store), handlers, payload, count).await;
            scratch.remove().await;
            rate
        };
        println!(
            "  {handlers:<9} {:>9}   {sqlite:>10.0}/s   {postgres:>10.0}/s",
            format!("{payload} B")
        );
    }
}
