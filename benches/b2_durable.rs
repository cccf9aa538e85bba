//! B2 and B3: durable deliveries per second, one handler doing one INSERT keyed on a
//! deterministic id, on SQLite (B2) and PostgreSQL (B3), measured in one run against the
//! *limit*: a raw sqlx loop doing the same statements (persist the envelope, the handler's
//! insert, mark it handled) in batches of 100 — one transaction for a batch's envelopes, one
//! for their inserts and marks — with the same durability (SQLite WAL with
//! `synchronous = FULL`; PostgreSQL defaults, `synchronous_commit = on`). A second baseline
//! runs the same statements one commit each, pipelined as the runtime pipelines them, which
//! is what dacapo did before group commit. A third is the database's own limit: the same
//! writes a hundred rows to a statement, four such loops at once on PostgreSQL (which flushes
//! concurrent commits together; SQLite has one writer). The goal is set against the first,
//! as issue 11 defines it; the third shows how far the database itself could go.
//!
//! dacapo runs each workload twice: with the handler inserting on the application's pool (an
//! autocommit, so an fsync of its own, taken without the runtime's turn to write), and on a
//! handler connection (`HandlerTransactions::connection`: on SQLite it takes the runtime's turn
//! and leaves its fsync to the delivery's settle, which fsyncs the write-ahead log after it).
//!
//! Four workloads: `live` (one publisher awaiting each publish while the runtime handles),
//! `16 publishers` (sixteen tasks publishing at once), `publish_batch` (a hundred messages to
//! a call), and `backlog`: 20 000 envelopes already in the inbox, drained by a node that
//! starts on them, against a raw loop that reads a hundred pending envelopes and commits
//! their inserts and marks in one transaction.
//!
//! `live` and `16 publishers` are also set against their limit with their own durability:
//! publishers that await each publish cannot have more of them in one commit than there are
//! publishers, so the loops `live-limit` (one commit per message) and `16-limit` (a commit
//! for what the sixteen have waiting) commit each envelope with its handling — the handler's
//! insert and its mark — in the commit its publisher awaits.
//!
//! Run with `cargo bench --bench b2_durable --features postgres` (PostgreSQL at
//! `DACAPO_BENCH_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`; a scratch
//! database is created and dropped). Three rounds (`B2_ROUNDS`), every contender once a round;
//! each ratio is a round's own, and the figures are the rounds' medians; before each contender
//! times its run, the writes the system still holds (the last contender's, its own seed's) are
//! flushed to the disk, so none is slowed by another's. `B2_ONLY=live,batched`
//! runs some contenders (and the latency runs only when it lists `latency`);
//! `B2_BACKEND=sqlite` or `postgres` runs one backend; `B2_VERBOSE=1` prints each run as it
//! ends. Goal (issue 11): at least 0.6 of the batched loop.

use std::time::{Duration, Instant};

use dacapo::RuntimeBuilder;
use dacapo::ids;
use dacapo::prelude::*;
use dacapo::store::{PostgresStore, SqliteStore};
use dacapo::transaction::HandlerTransactions;
use scratch::{ScratchPostgres, ScratchSqlite};
use serde::{Deserialize, Serialize};

#[path = "support/scratch.rs"]
mod scratch;
#[path = "support/seed.rs"]
mod seed;
use seed::{SEED_POSTGRES, SEED_SQLITE};
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

/// The one handler: one INSERT with a deterministic id — on the application's pool (`P`), or,
/// when `on_connection`, on a handler connection (`HandlerTransactions::connection`: on
/// SQLite it takes the runtime's turn to write and leaves its fsync to the settle).
struct InsertRow<P> {
    pool: P,
    on_connection: bool,
}

impl<P> InsertRow<P> {
    fn new(pool: P, on_connection: bool) -> Self {
        Self {
            pool,
            on_connection,
        }
    }
}

macro_rules! insert_row_handler {
    ($pool:ty, $db:ty) => {
        impl Handler<Ping> for InsertRow<$pool> {
            async fn handle(
                &self,
                ping: &Ping,
                context: &MessageContext,
            ) -> Result<(), HandlerError> {
                let id = ids::derive_or_random(context.message_id(), "row");
                let insert = sqlx::query(INSERT_ROW).bind(id).bind(ping.n as i64);
                if self.on_connection {
                    let mut connection = context.connection::<$db>().await?;
                    insert.execute(&mut *connection).await?;
                } else {
                    insert.execute(&self.pool).await?;
                }
                Ok(())
            }
        }
    };
}
insert_row_handler!(sqlx::SqlitePool, sqlx::Sqlite);
insert_row_handler!(sqlx::PgPool, sqlx::Postgres);

/// The same INSERT, then the time it was handled, by message number.
struct Stamped<P> {
    insert: InsertRow<P>,
    handled: std::sync::Arc<std::sync::Mutex<Vec<Option<Instant>>>>,
}

macro_rules! stamped_handler {
    ($pool:ty) => {
        impl Handler<Ping> for Stamped<$pool> {
            async fn handle(
                &self,
                ping: &Ping,
                context: &MessageContext,
            ) -> Result<(), HandlerError> {
                self.insert.handle(ping, context).await?;
                self.handled.lock().unwrap()[ping.n as usize] = Some(Instant::now());
                Ok(())
            }
        }
    };
}
stamped_handler!(sqlx::SqlitePool);
stamped_handler!(sqlx::PgPool);

/// Publish-to-handled latency (p50, p99) at a steady `per_second`, `count` messages.
async fn latency<P: Clone>(
    store_builder: RuntimeBuilder,
    pool: P,
    count: u64,
    per_second: u64,
) -> (Duration, Duration)
where
    Stamped<P>: Handler<Ping>,
{
    let handled = std::sync::Arc::new(std::sync::Mutex::new(vec![None; count as usize]));
    let runtime = store_builder
        .module(Module::new("bench").handle_named::<Ping, _>(
            "insert",
            Stamped {
                insert: InsertRow::new(pool, false),
                handled: std::sync::Arc::clone(&handled),
            },
        ))
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let mut sent = Vec::with_capacity(count as usize);
    for n in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs(1) * n as u32 / per_second as u32)
            .await;
        sent.push(Instant::now());
        runtime.publish(&Ping { n }).await.unwrap();
    }
    runtime.idle().await;
    runtime.shutdown().await;
    let handled = handled.lock().unwrap();
    let mut latencies: Vec<Duration> = sent
        .iter()
        .zip(handled.iter())
        .map(|(sent, handled)| {
            handled
                .expect("every message handled")
                .duration_since(*sent)
        })
        .collect();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    (at(0.50), at(0.99))
}

/// Publishers at once: 1 is the `live` workload; 0 publishes with `publish_batch`, a hundred
/// messages to a call.
async fn through_dacapo<H: Handler<Ping>>(
    store_builder: RuntimeBuilder,
    handler: H,
    deliveries: u64,
    publishers: u64,
) -> Duration {
    let runtime = std::sync::Arc::new(
        store_builder
            .module(Module::new("bench").handle_named::<Ping, _>("insert", handler))
            .build()
            .unwrap(),
    );
    let start = Instant::now();
    let mut publishing = tokio::task::JoinSet::new();
    if publishers == 0 {
        // publish_batch, a hundred messages to a call.
        let mut n = 0;
        while n < deliveries {
            let batch: Vec<Ping> = (n..deliveries.min(n + 100)).map(|n| Ping { n }).collect();
            runtime.publish_batch(&batch).await.unwrap();
            n += batch.len() as u64;
        }
    }
    for publisher in 0..publishers {
        let runtime = std::sync::Arc::clone(&runtime);
        publishing.spawn(async move {
            let mut n = publisher;
            while n < deliveries {
                runtime.publish(&Ping { n }).await.unwrap();
                n += publishers;
            }
        });
    }
    while publishing.join_next().await.is_some() {}
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

/// The limit: the same statements, a hundred messages to a transaction — their envelopes in
/// one, their handlers' inserts and their marks in the next.
macro_rules! batched_loop {
    ($name:ident, $pool:ty) => {
        async fn $name(pool: &$pool, deliveries: u64) -> Duration {
            let start = Instant::now();
            let mut n = 0;
            while n < deliveries {
                let batch: Vec<(String, u64)> = (n..deliveries.min(n + 100))
                    .map(|n| (uuid::Uuid::new_v4().simple().to_string(), n))
                    .collect();
                let now = chrono::Utc::now().timestamp_millis();
                let mut tx = pool.begin().await.unwrap();
                for (id, n) in &batch {
                    let payload = serde_json::to_vec(&Ping { n: *n }).unwrap();
                    sqlx::query(RAW_RECEIVE)
                        .bind(id)
                        .bind(payload)
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                for (id, n) in &batch {
                    sqlx::query(INSERT_ROW)
                        .bind(format!("{id}-row"))
                        .bind(*n as i64)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    sqlx::query(RAW_HANDLED)
                        .bind(id)
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                n += batch.len() as u64;
            }
            start.elapsed()
        }
    };
}
batched_loop!(batched_sqlite, sqlx::SqlitePool);
batched_loop!(batched_postgres, sqlx::PgPool);

/// The predicate of the inbox's pending index, so that the read uses it as the runtime's does.
const RAW_NEXT: &str = "SELECT id, payload FROM dacapo_inbox \
    WHERE status IN ('incoming', 'scheduled') ORDER BY received_at LIMIT 100";

/// Message `n`'s envelope recorded in `tx`, and handled in it: its handler's insert and its
/// mark — the commit its publisher awaits carries its handling too.
macro_rules! handled_in_its_commit {
    ($tx:ident, $n:expr, $now:expr) => {{
        let id = uuid::Uuid::now_v7().simple().to_string();
        sqlx::query(RAW_RECEIVE)
            .bind(&id)
            .bind(serde_json::to_vec(&Ping { n: $n }).unwrap())
            .bind($now)
            .execute(&mut *$tx)
            .await
            .unwrap();
        sqlx::query(INSERT_ROW)
            .bind(format!("{id}-row"))
            .bind($n as i64)
            .execute(&mut *$tx)
            .await
            .unwrap();
        sqlx::query(RAW_HANDLED)
            .bind(&id)
            .bind($now)
            .execute(&mut *$tx)
            .await
            .unwrap();
    }};
}

/// The live workload's limit, with its durability: one publisher that awaits each publish
/// commits each envelope on its own (no loop can batch what a caller awaits one at a time),
/// and at best the envelope's handling rides in that commit — its handler's insert and its
/// mark with it: one commit per message, nothing else.
macro_rules! live_limit {
    ($name:ident, $pool:ty) => {
        async fn $name(pool: &$pool, deliveries: u64) -> Duration {
            let start = Instant::now();
            for n in 0..deliveries {
                let now = chrono::Utc::now().timestamp_millis();
                let mut tx = pool.begin().await.unwrap();
                handled_in_its_commit!(tx, n, now);
                tx.commit().await.unwrap();
            }
            start.elapsed()
        }
    };
}
live_limit!(live_limit_sqlite, sqlx::SqlitePool);
live_limit!(live_limit_postgres, sqlx::PgPool);

/// The 16-publisher workload's limit, with its durability: sixteen publishers each await
/// their publish, so a commit holds at most sixteen envelopes (what is waiting when the last
/// commit ends, none lingered for), and at best each rides with its handling — the handler's
/// insert and its mark in the same commit. One committer on SQLite, which has one writer;
/// four on PostgreSQL, which flushes concurrent commits together (as the runtime runs up to
/// four group commits at once there).
macro_rules! publishers_limit {
    ($name:ident, $pool:ty, $committers:expr) => {
        async fn $name(pool: &$pool, deliveries: u64) -> Duration {
            type Waiting = (u64, tokio::sync::oneshot::Sender<()>);
            let start = Instant::now();
            let (send, receive) = tokio::sync::mpsc::channel::<Waiting>(PUBLISHERS as usize);
            let receive = std::sync::Arc::new(tokio::sync::Mutex::new(receive));
            let mut committers = tokio::task::JoinSet::new();
            for _ in 0..$committers {
                let (receive, pool) = (std::sync::Arc::clone(&receive), pool.clone());
                committers.spawn(async move {
                    let mut waiting: Vec<Waiting> = Vec::with_capacity(PUBLISHERS as usize);
                    while receive
                        .lock()
                        .await
                        .recv_many(&mut waiting, PUBLISHERS as usize)
                        .await
                        > 0
                    {
                        let now = chrono::Utc::now().timestamp_millis();
                        let mut tx = pool.begin().await.unwrap();
                        for &(n, _) in &waiting {
                            handled_in_its_commit!(tx, n, now);
                        }
                        tx.commit().await.unwrap();
                        for (_, committed) in waiting.drain(..) {
                            committed.send(()).unwrap();
                        }
                    }
                });
            }
            let mut publishing = tokio::task::JoinSet::new();
            for publisher in 0..PUBLISHERS {
                let send = send.clone();
                publishing.spawn(async move {
                    let mut n = publisher;
                    while n < deliveries {
                        let (committed, on_commit) = tokio::sync::oneshot::channel();
                        send.send((n, committed)).await.unwrap();
                        on_commit.await.unwrap();
                        n += PUBLISHERS;
                    }
                });
            }
            drop(send);
            while publishing.join_next().await.is_some() {}
            while committers.join_next().await.is_some() {}
            start.elapsed()
        }
    };
}
publishers_limit!(publishers_limit_sqlite, sqlx::SqlitePool, 1);
publishers_limit!(publishers_limit_postgres, sqlx::PgPool, 4);

/// How many tasks publish at once in the 16-publisher workload.
const PUBLISHERS: u64 = 16;

/// The backlog workload's limit: a hundred pending envelopes read, then their handlers'
/// inserts and their marks in one transaction, until none is left.
macro_rules! batched_drain {
    ($name:ident, $pool:ty) => {
        async fn $name(pool: &$pool) -> u64 {
            let mut drained = 0;
            loop {
                let rows: Vec<(String, Vec<u8>)> =
                    sqlx::query_as(RAW_NEXT).fetch_all(pool).await.unwrap();
                if rows.is_empty() {
                    return drained;
                }
                let now = chrono::Utc::now().timestamp_millis();
                let mut tx = pool.begin().await.unwrap();
                for (id, payload) in &rows {
                    let ping: Ping = serde_json::from_slice(payload).unwrap();
                    sqlx::query(INSERT_ROW)
                        .bind(format!("{id}-row"))
                        .bind(ping.n as i64)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    sqlx::query(RAW_HANDLED)
                        .bind(id)
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                drained += rows.len() as u64;
            }
        }
    };
}
batched_drain!(batched_drain_sqlite, sqlx::SqlitePool);
batched_drain!(batched_drain_postgres, sqlx::PgPool);

/// `text` with each `?` numbered in order (`$1`, `$2` …) for PostgreSQL; as it is for SQLite,
/// which binds bare `?`s in order fastest (it looks a numbered parameter up by a linear search
/// of the statement's names, once per parameter at each execution).
fn numbered(text: String, postgres: bool) -> sqlx::AssertSqlSafe<String> {
    if !postgres {
        return sqlx::AssertSqlSafe(text);
    }
    let mut out = String::with_capacity(text.len() + text.len() / 2);
    let mut n = 0;
    for c in text.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    sqlx::AssertSqlSafe(out)
}

/// `row` `rows` times, joined by commas.
fn repeated(row: &str, rows: usize) -> String {
    vec![row; rows].join(", ")
}

/// A hundred envelopes in one statement: id, payload and the time twice for each.
fn receive_rows(rows: usize, postgres: bool) -> sqlx::AssertSqlSafe<String> {
    numbered(
        format!(
            "INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
             attempts, owner, received_at) VALUES {} ON CONFLICT (id) DO NOTHING",
            repeated(
                "(?, 'bench.ping', ?, '{}', ?, 'incoming', 1, 'raw', ?)",
                rows
            )
        ),
        postgres,
    )
}

/// The handlers' hundred inserts in one statement.
fn insert_rows(rows: usize, postgres: bool) -> sqlx::AssertSqlSafe<String> {
    numbered(
        format!(
            "INSERT INTO bench_rows (id, n) VALUES {} ON CONFLICT (id) DO NOTHING",
            repeated("(?, ?)", rows)
        ),
        postgres,
    )
}

/// A hundred marks in one statement: the time, then the ids.
fn mark_rows(rows: usize, postgres: bool) -> sqlx::AssertSqlSafe<String> {
    numbered(
        format!(
            "UPDATE dacapo_inbox SET status = 'handled', handled_at = ?, owner = NULL \
             WHERE id IN ({})",
            repeated("?", rows)
        ),
        postgres,
    )
}

/// The database's limit: the same writes, a hundred messages to a transaction — their envelopes in one,
/// their handlers' inserts and their marks in the next — each kind of write a hundred rows to
/// a statement, and `$workers` such loops at once (PostgreSQL commits concurrent
/// transactions in one WAL flush; SQLite has one writer, so one loop).
macro_rules! multirow_loop {
    ($name:ident, $pool:ty, $workers:expr, $postgres:expr) => {
        async fn $name(pool: &$pool, deliveries: u64) -> Duration {
            let start = Instant::now();
            let mut workers = tokio::task::JoinSet::new();
            let share = deliveries.div_ceil($workers);
            for worker in 0..$workers {
                let pool = pool.clone();
                let (from, to) = (worker * share, deliveries.min((worker + 1) * share));
                workers.spawn(async move {
                    let mut n = from;
                    while n < to {
                        let batch: Vec<(String, u64)> = (n..to.min(n + 100))
                            .map(|n| (uuid::Uuid::new_v4().simple().to_string(), n))
                            .collect();
                        let now = chrono::Utc::now().timestamp_millis();
                        let mut tx = pool.begin().await.unwrap();
                        let mut receive = sqlx::query(receive_rows(batch.len(), $postgres));
                        for (id, n) in &batch {
                            receive = receive
                                .bind(id.clone())
                                .bind(serde_json::to_vec(&Ping { n: *n }).unwrap())
                                .bind(now)
                                .bind(now);
                        }
                        receive.execute(&mut *tx).await.unwrap();
                        tx.commit().await.unwrap();
                        let mut tx = pool.begin().await.unwrap();
                        let mut insert = sqlx::query(insert_rows(batch.len(), $postgres));
                        let mut mark = sqlx::query(mark_rows(batch.len(), $postgres)).bind(now);
                        for (id, n) in &batch {
                            insert = insert.bind(format!("{id}-row")).bind(*n as i64);
                            mark = mark.bind(id.clone());
                        }
                        insert.execute(&mut *tx).await.unwrap();
                        mark.execute(&mut *tx).await.unwrap();
                        tx.commit().await.unwrap();
                        n += batch.len() as u64;
                    }
                });
            }
            while workers.join_next().await.is_some() {}
            start.elapsed()
        }
    };
}
multirow_loop!(multirow_sqlite, sqlx::SqlitePool, 1, false);
multirow_loop!(multirow_postgres, sqlx::PgPool, 4, true);

/// The same read for one of several loops at once: rows another loop holds are skipped.
const RAW_NEXT_LOCKED: &str = "SELECT id, payload FROM dacapo_inbox \
    WHERE status IN ('incoming', 'scheduled') ORDER BY received_at LIMIT 100 \
    FOR UPDATE SKIP LOCKED";

/// The backlog workload's database limit: a hundred pending envelopes read, then their
/// handlers' inserts and their marks in the same transaction, a statement each, until none is
/// left; `$workers` loops at once, as in [`multirow_loop`].
macro_rules! multirow_drain {
    ($name:ident, $pool:ty, $next:expr, $workers:expr, $postgres:expr) => {
        async fn $name(pool: &$pool) -> u64 {
            let mut workers = tokio::task::JoinSet::new();
            for _ in 0..$workers {
                let pool = pool.clone();
                workers.spawn(async move {
                    let mut drained = 0;
                    loop {
                        let mut tx = pool.begin().await.unwrap();
                        let rows: Vec<(String, Vec<u8>)> =
                            sqlx::query_as($next).fetch_all(&mut *tx).await.unwrap();
                        if rows.is_empty() {
                            return drained;
                        }
                        let now = chrono::Utc::now().timestamp_millis();
                        let mut insert = sqlx::query(insert_rows(rows.len(), $postgres));
                        let mut mark = sqlx::query(mark_rows(rows.len(), $postgres)).bind(now);
                        for (id, payload) in &rows {
                            let ping: Ping = serde_json::from_slice(payload).unwrap();
                            insert = insert.bind(format!("{id}-row")).bind(ping.n as i64);
                            mark = mark.bind(id.clone());
                        }
                        insert.execute(&mut *tx).await.unwrap();
                        mark.execute(&mut *tx).await.unwrap();
                        tx.commit().await.unwrap();
                        drained += rows.len() as u64;
                    }
                });
            }
            let mut drained = 0;
            while let Some(worker) = workers.join_next().await {
                drained += worker.unwrap();
            }
            drained
        }
    };
}
multirow_drain!(multirow_drain_sqlite, sqlx::SqlitePool, RAW_NEXT, 1, false);
multirow_drain!(
    multirow_drain_postgres,
    sqlx::PgPool,
    RAW_NEXT_LOCKED,
    4,
    true
);

/// The same insert, counted: the bench wakes at the last one.
struct Counting<P> {
    insert: InsertRow<P>,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    last: u64,
    done: std::sync::Arc<tokio::sync::Notify>,
}

macro_rules! counting_handler {
    ($pool:ty) => {
        impl Handler<Ping> for Counting<$pool> {
            async fn handle(
                &self,
                ping: &Ping,
                context: &MessageContext,
            ) -> Result<(), HandlerError> {
                self.insert.handle(ping, context).await?;
                let calls = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if calls + 1 == self.last {
                    self.done.notify_one();
                }
                Ok(())
            }
        }
    };
}
counting_handler!(sqlx::SqlitePool);
counting_handler!(sqlx::PgPool);

/// The backlog workload: a node starts on an inbox holding `deliveries` pending envelopes and
/// handles them all; its time from start to the last settle.
async fn drain_backlog<P: Clone>(
    store_builder: RuntimeBuilder,
    pool: P,
    on_connection: bool,
    deliveries: u64,
) -> Duration
where
    Counting<P>: Handler<Ping>,
{
    let done = std::sync::Arc::new(tokio::sync::Notify::new());
    let start = Instant::now();
    let runtime = store_builder
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("bench").handle_named::<Ping, _>(
            "insert",
            Counting {
                insert: InsertRow::new(pool, on_connection),
                calls: std::sync::Arc::default(),
                last: deliveries,
                done: std::sync::Arc::clone(&done),
            },
        ))
        .build()
        .unwrap();
    done.notified().await;
    runtime.idle().await;
    let elapsed = start.elapsed();
    assert_eq!(runtime.stats().handled, deliveries);
    runtime.shutdown().await;
    elapsed
}

/// Deliveries per second of each contender on one backend, by contender.
#[derive(Default)]
struct Figures(std::collections::HashMap<&'static str, f64>);

impl Figures {
    fn set(&mut self, contender: &'static str, rate: f64) {
        self.0.insert(contender, rate);
    }

    /// The rate of `contender`, 0 when it did not run.
    fn of(&self, contender: &str) -> f64 {
        self.0.get(contender).copied().unwrap_or(0.0)
    }
}

fn rate(deliveries: u64, elapsed: Duration) -> f64 {
    deliveries as f64 / elapsed.as_secs_f64()
}

/// The runs of one backend, by name: dacapo's workloads — the handler inserting on the
/// application's pool, then (`-conn`) on a handler connection, and (`-alone`) with group
/// commit off — then the raw loops.
const CONTENDERS: [&str; 17] = [
    "live",
    "live-limit",
    "live-conn",
    "16",
    "16-limit",
    "16-conn",
    "live-alone",
    "16-alone",
    "publish-batch",
    "publish-batch-conn",
    "batched",
    "one",
    "backlog",
    "backlog-conn",
    "backlog-limit",
    "multirow",
    "backlog-multirow",
];

/// How many envelopes the backlog workload starts with.
const BACKLOG: u64 = 20_000;

/// Runs `$contender` on `$store` and its `$pool`, with this backend's raw loops; how many
/// deliveries it made, and its time.
macro_rules! measure {
    ($contender:ident, $store:ident, $pool:ident, $deliveries:ident, $batched:ident, $raw:ident, $seed:ident, $drain:ident, $multirow:ident, $multirow_drain:ident, $live_limit:ident, $publishers_limit:ident) => {{
        $pool.execute(TABLE).await.unwrap();
        if $contender.starts_with("backlog") {
            sqlx::query($seed)
                .bind(BACKLOG as i64)
                .execute(&$pool)
                .await
                .unwrap();
        }
        scratch::flush_writes();
        let store = if $contender.ends_with("alone") {
            $store.group_commit(1, Duration::ZERO)
        } else {
            $store
        };
        let builder = Runtime::builder().store(store);
        let on_connection = $contender.ends_with("conn");
        let handler = InsertRow::new($pool.clone(), on_connection);
        match $contender {
            "live" | "live-conn" | "live-alone" => (
                $deliveries,
                through_dacapo(builder, handler, $deliveries, 1).await,
            ),
            "16" | "16-conn" | "16-alone" => (
                $deliveries,
                through_dacapo(builder, handler, $deliveries, PUBLISHERS).await,
            ),
            "publish-batch" | "publish-batch-conn" => (
                $deliveries,
                through_dacapo(builder, handler, $deliveries, 0).await,
            ),
            "batched" => ($deliveries, $batched(&$pool, $deliveries).await),
            "live-limit" => ($deliveries, $live_limit(&$pool, $deliveries).await),
            "16-limit" => ($deliveries, $publishers_limit(&$pool, $deliveries).await),
            "backlog" | "backlog-conn" => (
                BACKLOG,
                drain_backlog(builder, $pool.clone(), on_connection, BACKLOG).await,
            ),
            "backlog-limit" => {
                let start = Instant::now();
                assert_eq!($drain(&$pool).await, BACKLOG);
                (BACKLOG, start.elapsed())
            }
            "multirow" => ($deliveries, $multirow(&$pool, $deliveries).await),
            "backlog-multirow" => {
                let start = Instant::now();
                assert_eq!($multirow_drain(&$pool).await, BACKLOG);
                (BACKLOG, start.elapsed())
            }
            _ => ($deliveries, $raw(&$pool, $deliveries).await),
        }
    }};
}

/// The contenders to run: all, or those `B2_ONLY` lists (`B2_ONLY=backlog,backlog-limit`).
fn contenders() -> Vec<&'static str> {
    let only = std::env::var("B2_ONLY").unwrap_or_default();
    CONTENDERS
        .into_iter()
        .filter(|contender| only.is_empty() || only.split(',').any(|name| name == *contender))
        .collect()
}

async fn sqlite(deliveries: u64) -> Figures {
    let mut figures = Figures::default();
    for contender in contenders() {
        let scratch = ScratchSqlite::new(&format!("b2-{contender}"));
        let store = SqliteStore::open(scratch.path()).await.unwrap();
        let pool = store.pool().clone();
        let (count, elapsed) = measure!(
            contender,
            store,
            pool,
            deliveries,
            batched_sqlite,
            raw_sqlite,
            SEED_SQLITE,
            batched_drain_sqlite,
            multirow_sqlite,
            multirow_drain_sqlite,
            live_limit_sqlite,
            publishers_limit_sqlite
        );
        pool.close().await;
        figures.set(contender, rate(count, elapsed));
        verbose("sqlite", contender, count, elapsed);
    }
    figures
}

/// With `B2_VERBOSE` set, each contender's run on standard error as it ends, to see the
/// spread the medians hide.
fn verbose(backend: &str, contender: &str, count: u64, elapsed: Duration) {
    if std::env::var_os("B2_VERBOSE").is_some() {
        eprintln!(
            "{backend} {contender:<20} {count:>6} in {elapsed:>10.3?}: {:>7.0}/s",
            rate(count, elapsed)
        );
    }
}

async fn postgres(deliveries: u64) -> Figures {
    let mut figures = Figures::default();
    for contender in contenders() {
        let scratch = ScratchPostgres::create(&format!("b3_{}", contender.replace('-', "_"))).await;
        let store = PostgresStore::connect(&scratch.url).await.unwrap();
        let pool = store.pool().clone();
        let (count, elapsed) = measure!(
            contender,
            store,
            pool,
            deliveries,
            batched_postgres,
            raw_postgres,
            SEED_POSTGRES,
            batched_drain_postgres,
            multirow_postgres,
            multirow_drain_postgres,
            live_limit_postgres,
            publishers_limit_postgres
        );
        pool.close().await;
        scratch.remove().await;
        figures.set(contender, rate(count, elapsed));
        verbose("postgres", contender, count, elapsed);
    }
    figures
}

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The median rate of `contender` over the rounds.
fn rate_of(rounds: &[Figures], contender: &str) -> f64 {
    median(rounds.iter().map(|figures| figures.of(contender)).collect())
}

/// The median of `contender`'s ratio to `limit`, each round's own, and their range.
fn ratio_of(rounds: &[Figures], contender: &str, limit: &str) -> String {
    let ratios: Vec<f64> = rounds
        .iter()
        .filter(|figures| figures.of(contender) > 0.0 && figures.of(limit) > 0.0)
        .map(|figures| figures.of(contender) / figures.of(limit))
        .collect();
    if ratios.is_empty() {
        return "-".to_owned();
    }
    let (low, high) = ratios.iter().fold((f64::MAX, f64::MIN), |(low, high), r| {
        (low.min(*r), high.max(*r))
    });
    format!("{:.2} ({low:.2}-{high:.2})", median(ratios))
}

fn print(name: &str, rounds: &[Figures]) {
    let rate = |contender: &str| rate_of(rounds, contender);
    println!(
        "  {name:<11} batched loop (limit) {:>7.0}/s   one commit each {:>7.0}/s   database limit (100 rows to a statement) {:>7.0}/s",
        rate("batched"),
        rate("one"),
        rate("multirow"),
    );
    println!(
        "  {:<11} {:<22} {:>9} {:>17} {:>15} {:>17} {:>8}",
        "",
        "dacapo, inserting on",
        "app pool",
        "ratio (range)",
        "handler conn.",
        "ratio (range)",
        "goal"
    );
    for (workload, contender, limit) in [
        ("live (one publisher)", "live", "batched"),
        ("16 publishers", "16", "batched"),
        ("publish_batch(100)", "publish-batch", "batched"),
        ("backlog drained", "backlog", "backlog-limit"),
    ] {
        let connection = format!("{contender}-conn");
        println!(
            "  {:<11} {workload:<22} {:>7.0}/s {:>17} {:>13.0}/s {:>17} {:>8}",
            "",
            rate(contender),
            ratio_of(rounds, contender, limit),
            rate(&connection),
            ratio_of(rounds, &connection, limit),
            ">= 0.60",
        );
    }
    for (workload, contender, limit, how) in [
        (
            "live",
            "live",
            "live-limit",
            "one commit per awaited publish, the message handled in it",
        ),
        (
            "16 publishers",
            "16",
            "16-limit",
            "a commit holds the publishes waiting, each handled in it",
        ),
    ] {
        println!(
            "  {:<11} {workload} against its limit with the same durability ({how}: {:>7.0}/s): app pool {}, handler conn. {}",
            "",
            rate(limit),
            ratio_of(rounds, contender, limit),
            ratio_of(rounds, &format!("{contender}-conn"), limit),
        );
    }
    println!(
        "  {:<11} group commit off: live {:>7.0}/s, 16 publishers {:>7.0}/s   backlog limit (read 100, insert and mark in one transaction) {:>7.0}/s   database limits {:>7.0}/s, backlog {:>7.0}/s",
        "",
        rate("live-alone"),
        rate("16-alone"),
        rate("backlog-limit"),
        rate("multirow"),
        rate("backlog-multirow"),
    );
}

/// p50 and p99 in milliseconds at `RATE` messages/s on SQLite (or PostgreSQL), group commit on
/// (or off).
async fn latency_run(postgres: bool, grouped: bool) -> (f64, f64) {
    const COUNT: u64 = 1000;
    const RATE: u64 = 200;
    let millis =
        |(p50, p99): (Duration, Duration)| (p50.as_secs_f64() * 1e3, p99.as_secs_f64() * 1e3);
    if postgres {
        let scratch = ScratchPostgres::create(&format!("b3_latency_{grouped}")).await;
        let store = PostgresStore::connect(&scratch.url).await.unwrap();
        let pool = store.pool().clone();
        pool.execute(TABLE).await.unwrap();
        let store = if grouped {
            store
        } else {
            store.group_commit(1, Duration::ZERO)
        };
        let figures = latency(Runtime::builder().store(store), pool.clone(), COUNT, RATE).await;
        pool.close().await;
        scratch.remove().await;
        millis(figures)
    } else {
        let scratch = ScratchSqlite::new(&format!("b2-latency-{grouped}"));
        let store = SqliteStore::open(scratch.path()).await.unwrap();
        let pool = store.pool().clone();
        pool.execute(TABLE).await.unwrap();
        let store = if grouped {
            store
        } else {
            store.group_commit(1, Duration::ZERO)
        };
        let figures = latency(Runtime::builder().store(store), pool.clone(), COUNT, RATE).await;
        pool.close().await;
        millis(figures)
    }
}

/// p50 and p99 at 200 messages/s, group commit on and off, on both backends: `rounds` rounds,
/// the four runs interleaved; the medians, and the range of p99.
async fn latencies(rounds: usize) {
    println!(
        "Publish-to-handled latency at a steady 200 messages/s, 1 000 messages, medians of {rounds} rounds:"
    );
    let mut runs: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 4];
    for _ in 0..rounds {
        for (at, (postgres, grouped)) in
            [(false, true), (false, false), (true, true), (true, false)]
                .into_iter()
                .enumerate()
        {
            runs[at].push(latency_run(postgres, grouped).await);
        }
    }
    for (at, name) in [
        "SQLite      group commit on ",
        "SQLite      group commit off",
        "PostgreSQL  group commit on ",
        "PostgreSQL  group commit off",
    ]
    .into_iter()
    .enumerate()
    {
        let p50 = median(runs[at].iter().map(|run| run.0).collect());
        let p99s: Vec<f64> = runs[at].iter().map(|run| run.1).collect();
        let (low, high) = p99s.iter().fold((f64::MAX, f64::MIN), |(low, high), p| {
            (low.min(*p), high.max(*p))
        });
        println!(
            "  {name}  p50 {p50:>6.2} ms   p99 {:>6.2} ms ({low:.2}-{high:.2})",
            median(p99s.clone())
        );
    }
}

#[tokio::main]
async fn main() {
    let deliveries: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let rounds: usize = std::env::var("B2_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(3);
    let (mut sqlite_rounds, mut postgres_rounds) = (Vec::new(), Vec::new());
    // `B2_BACKEND=sqlite` (or `postgres`) runs one backend alone, for a profile of it.
    let backend = std::env::var("B2_BACKEND").unwrap_or_default();
    let rounds_of_contenders = if contenders().is_empty() { 0 } else { rounds };
    for _ in 0..rounds_of_contenders {
        if backend != "postgres" {
            sqlite_rounds.push(sqlite(deliveries).await);
        }
        if backend != "sqlite" {
            postgres_rounds.push(postgres(deliveries).await);
        }
    }
    println!(
        "B2/B3: {deliveries} durable deliveries, one INSERT each (SQLite WAL synchronous=FULL; \
         PostgreSQL synchronous_commit=on); medians of {rounds} rounds, the contenders interleaved, \
         ratios each round's own"
    );
    if !sqlite_rounds.is_empty() {
        print("B2 SQLite", &sqlite_rounds);
    }
    if !postgres_rounds.is_empty() {
        print("B3 Postgres", &postgres_rounds);
    }
    let only = std::env::var("B2_ONLY").unwrap_or_default();
    if only.is_empty() || only.split(',').any(|name| name == "latency") {
        latencies(rounds).await;
    }
}
