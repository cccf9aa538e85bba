//! B6: end-to-end deliveries per second through each transport — published through the outbox
//! (`publish_batch` of 100, one outbox commit), sent by the relay with the broker's confirms,
//! consumed with a prefetch of 100, persisted in the inbox, handled (a no-op handler), settled —
//! against the limit: a raw client loop doing the same broker work with the same prefetch and
//! confirms (publish 100, await their confirms; consume, acknowledge each batch), nothing else.
//! Both run in one run, on the same servers; the runtime's store is a SQLite file with
//! `synchronous = FULL` (the default).
//!
//! Then publish-to-handled latency, p50 and p99, at a steady 200 messages/s (one `publish`
//! each, below saturation).
//!
//! Run with `cargo bench --bench b6_transports --all-features` (RabbitMQ at
//! `DACAPO_BENCH_RABBITMQ`, NATS at `DACAPO_BENCH_NATS`, PostgreSQL at `DACAPO_BENCH_POSTGRES`,
//! defaulting to the local servers; `B6_ONLY=rabbitmq|nats|postgresqueue` runs one). Three
//! rounds, each running every transport's raw loop, then dacapo on it; the figures are the
//! medians, the ratio range is the rounds' own ratios. Goal (issue 13): at least 0.5 of the
//! raw loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dacapo::prelude::*;
use dacapo::store::SqliteStore;
use dacapo::transport::{Nats, PostgresQueue, RabbitMq, Transport};
use futures::{FutureExt, StreamExt};
use scratch::{ScratchPostgres, ScratchSqlite};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

#[path = "support/scratch.rs"]
mod scratch;

const MESSAGES: usize = 5_000;
const BATCH: usize = 100;
const PREFETCH: u16 = 100;
const STEADY_RATE: u64 = 200;
const STEADY_MESSAGES: usize = 1_000;
const ROUNDS: usize = 3;

#[derive(Clone, Serialize, Deserialize)]
struct Ping {
    n: u64,
    /// When it was published, in microseconds since the Unix epoch.
    at: i64,
}

impl Message for Ping {
    const TYPE: &'static str = "bench.ping";
}

fn now_micros() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// Counts handled messages and how long each took from publish.
#[derive(Clone, Default)]
struct Count {
    seen: Arc<AtomicUsize>,
    latencies: Arc<Mutex<Vec<Duration>>>,
    changed: Arc<Notify>,
}

impl Count {
    async fn until(&self, count: usize) {
        loop {
            let changed = self.changed.notified();
            if self.seen.load(Ordering::SeqCst) >= count {
                return;
            }
            if tokio::time::timeout(Duration::from_secs(120), changed)
                .await
                .is_err()
            {
                panic!("{} of {count} handled", self.seen.load(Ordering::SeqCst));
            }
        }
    }
}

impl Handler<Ping> for Count {
    async fn handle(&self, ping: &Ping, _: &MessageContext) -> Result<(), HandlerError> {
        let took = Duration::from_micros(u64::try_from(now_micros() - ping.at).unwrap_or(0));
        self.latencies.lock().unwrap().push(took);
        self.seen.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    RabbitMq,
    Nats,
    PostgresQueue,
}

fn rabbitmq_url() -> String {
    std::env::var("DACAPO_BENCH_RABBITMQ")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn nats_url() -> String {
    std::env::var("DACAPO_BENCH_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

fn transport(kind: Kind, name: &str, queue_database: &str) -> Transport {
    match kind {
        Kind::RabbitMq => RabbitMq::new(rabbitmq_url(), name)
            .exchange(name)
            .prefetch(PREFETCH)
            .route::<Ping>()
            .into(),
        Kind::Nats => Nats::new(nats_url(), name)
            .stream(name)
            .subject_prefix(name)
            .prefetch(PREFETCH)
            .route::<Ping>()
            .into(),
        Kind::PostgresQueue => PostgresQueue::connect(queue_database, name)
            .unwrap()
            .prefetch(PREFETCH)
            .route::<Ping>()
            .into(),
    }
}

fn pings(from: usize, count: usize) -> Vec<Ping> {
    (from..from + count)
        .map(|n| Ping {
            n: n as u64,
            at: now_micros(),
        })
        .collect()
}

/// dacapo end to end: deliveries per second, and the latencies at a steady rate.
async fn through_dacapo(kind: Kind, queue_database: &str) -> (f64, Vec<Duration>) {
    let file = ScratchSqlite::new("b6");
    let store = SqliteStore::open(file.path()).await.unwrap();
    let count = Count::default();
    let name = unique("b6");
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("bench").handle::<Ping, _>(count.clone()))
        .transport(transport(kind, &name, queue_database))
        .max_in_flight(4 * MESSAGES)
        .build()
        .unwrap();
    runtime.listening().await.unwrap();
    let started = Instant::now();
    for from in (0..MESSAGES).step_by(BATCH) {
        runtime.publish_batch(&pings(from, BATCH)).await.unwrap();
    }
    count.until(MESSAGES).await;
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();

    count.latencies.lock().unwrap().clear();
    let every = Duration::from_micros(1_000_000 / STEADY_RATE);
    let mut tick = tokio::time::interval(every);
    for n in 0..STEADY_MESSAGES {
        tick.tick().await;
        runtime
            .publish(&Ping {
                n: n as u64,
                at: now_micros(),
            })
            .await
            .unwrap();
    }
    count.until(MESSAGES + STEADY_MESSAGES).await;
    let latencies = std::mem::take(&mut *count.latencies.lock().unwrap());
    runtime.shutdown().await;
    remove(kind, &name).await;
    (rate, latencies)
}

/// The raw loop's deliveries per second for `kind`.
async fn raw(kind: Kind, queue_database: &str) -> f64 {
    match kind {
        Kind::RabbitMq => raw_rabbitmq().await,
        Kind::Nats => raw_nats().await,
        Kind::PostgresQueue => raw_postgres_queue(queue_database).await,
    }
}

async fn raw_rabbitmq() -> f64 {
    use lapin::options::*;
    use lapin::types::FieldTable;
    let name = unique("b6raw");
    let url = rabbitmq_url();
    let connect = || lapin::Connection::connect(&url, lapin::ConnectionProperties::default());
    let (publishing, consuming) = (connect().await.unwrap(), connect().await.unwrap());
    let publisher = publishing.create_channel().await.unwrap();
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    publisher
        .queue_declare(name.as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    let consumer_channel = consuming.create_channel().await.unwrap();
    consumer_channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = consumer_channel
        .basic_consume(
            name.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let consume = tokio::spawn(async move {
        let mut taken = 0;
        while taken < MESSAGES {
            let first = consumer.next().await.unwrap().unwrap();
            let mut last = first.delivery_tag;
            taken += 1;
            while let Some(Some(Ok(delivery))) = consumer.next().now_or_never() {
                last = delivery.delivery_tag;
                taken += 1;
            }
            consumer_channel
                .basic_ack(last, BasicAckOptions { multiple: true })
                .await
                .unwrap();
        }
    });
    let body = serde_json::to_vec(&Ping { n: 0, at: 0 }).unwrap();
    for _ in (0..MESSAGES).step_by(BATCH) {
        let mut confirms = Vec::with_capacity(BATCH);
        for _ in 0..BATCH {
            confirms.push(
                publisher
                    .basic_publish(
                        "".into(),
                        name.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        lapin::BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .unwrap(),
            );
        }
        for confirm in confirms {
            assert!(confirm.await.unwrap().is_ack());
        }
    }
    consume.await.unwrap();
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = publisher
        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
        .await;
    rate
}

async fn raw_nats() -> f64 {
    use async_nats::jetstream::{self, consumer::pull, stream};
    let name = unique("B6RAW");
    let context = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    let stream = context
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::File,
            ..stream::Config::default()
        })
        .await
        .unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: i64::from(PREFETCH) * 2,
            ..pull::Config::default()
        })
        .await
        .unwrap();
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(usize::from(PREFETCH))
        .messages()
        .await
        .unwrap();
    let started = Instant::now();
    let consume = tokio::spawn(async move {
        for _ in 0..MESSAGES {
            let message = messages.next().await.unwrap().unwrap();
            message.ack().await.unwrap();
        }
    });
    let body = serde_json::to_vec(&Ping { n: 0, at: 0 }).unwrap();
    for batch in (0..MESSAGES).step_by(BATCH) {
        let mut acks = Vec::with_capacity(BATCH);
        for n in batch..batch + BATCH {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", n.to_string());
            acks.push(
                context
                    .publish_with_headers(format!("{name}.ping"), headers, body.clone().into())
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    consume.await.unwrap();
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = context.delete_stream(&name).await;
    rate
}

async fn raw_postgres_queue(url: &str) -> f64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS b6_raw_queue (seq BIGSERIAL PRIMARY KEY, queue TEXT NOT NULL, \
         payload BYTEA NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let started = Instant::now();
    let consuming = pool.clone();
    let consume = tokio::spawn(async move {
        let mut taken = 0usize;
        while taken < MESSAGES {
            let mut tx = consuming.begin().await.unwrap();
            let rows: Vec<(i64,)> = sqlx::query_as(
                "SELECT seq FROM b6_raw_queue WHERE queue = 'raw' ORDER BY seq LIMIT $1 \
                 FOR UPDATE SKIP LOCKED",
            )
            .bind(i64::from(PREFETCH))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
            let seqs: Vec<i64> = rows.into_iter().map(|(seq,)| seq).collect();
            sqlx::query("DELETE FROM b6_raw_queue WHERE seq = ANY($1)")
                .bind(&seqs)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            taken += seqs.len();
            if seqs.is_empty() {
                tokio::task::yield_now().await;
            }
        }
    });
    let body = serde_json::to_vec(&Ping { n: 0, at: 0 }).unwrap();
    for _ in (0..MESSAGES).step_by(BATCH) {
        let mut tx = pool.begin().await.unwrap();
        for _ in 0..BATCH {
            sqlx::query("INSERT INTO b6_raw_queue (queue, payload) VALUES ('raw', $1)")
                .bind(&body)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    consume.await.unwrap();
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    pool.close().await;
    rate
}

/// This run's broker objects, so runs leave nothing behind.
async fn remove(kind: Kind, name: &str) {
    match kind {
        Kind::RabbitMq => {
            use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
            let connection =
                lapin::Connection::connect(&rabbitmq_url(), lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let channel = connection.create_channel().await.unwrap();
            let _ = channel
                .queue_delete(name.into(), QueueDeleteOptions::default())
                .await;
            let _ = channel
                .exchange_delete(name.into(), ExchangeDeleteOptions::default())
                .await;
        }
        Kind::Nats => {
            let client = async_nats::connect(nats_url()).await.unwrap();
            let _ = async_nats::jetstream::new(client).delete_stream(name).await;
        }
        Kind::PostgresQueue => {}
    }
}

fn percentile(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let at = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(at).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// One transport's figures in one round.
struct Round {
    limit: f64,
    rate: f64,
    p50: f64,
    p99: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let queue_database = ScratchPostgres::create("b6").await;
    println!(
        "B6: {MESSAGES} messages, batches of {BATCH}, prefetch {PREFETCH}, SQLite store \
         synchronous=FULL; latency at {STEADY_RATE}/s over {STEADY_MESSAGES} messages; \
         medians of {ROUNDS} rounds, the raw loop and dacapo interleaved"
    );
    let only = std::env::var("B6_ONLY").ok();
    let kinds: Vec<Kind> = [Kind::RabbitMq, Kind::Nats, Kind::PostgresQueue]
        .into_iter()
        .filter(|kind| {
            only.as_deref()
                .is_none_or(|only| format!("{kind:?}").eq_ignore_ascii_case(only))
        })
        .collect();
    let mut rounds: Vec<Vec<Round>> = kinds.iter().map(|_| Vec::new()).collect();
    for _ in 0..ROUNDS {
        for (kind, rounds) in kinds.iter().zip(rounds.iter_mut()) {
            let limit = raw(*kind, &queue_database.url).await;
            let (rate, mut latencies) = through_dacapo(*kind, &queue_database.url).await;
            rounds.push(Round {
                limit,
                rate,
                p50: percentile(&mut latencies, 0.5),
                p99: percentile(&mut latencies, 0.99),
            });
        }
    }
    println!(
        "{:<16} {:>12} {:>12} {:>8} {:>13} {:>6} {:>9} {:>9}",
        "transport", "raw loop/s", "dacapo/s", "ratio", "ratio range", "goal", "p50 ms", "p99 ms"
    );
    for (kind, rounds) in kinds.iter().zip(&rounds) {
        let ratios: Vec<f64> = rounds
            .iter()
            .map(|round| round.rate / round.limit)
            .collect();
        let ratio = median(ratios.clone());
        let (low, high) = ratios.iter().fold((f64::MAX, f64::MIN), |(low, high), r| {
            (low.min(*r), high.max(*r))
        });
        println!(
            "{:<16} {:>12.0} {:>12.0} {:>8.2} {:>13} {:>6} {:>9.2} {:>9.2}",
            format!("{kind:?}"),
            median(rounds.iter().map(|round| round.limit).collect()),
            median(rounds.iter().map(|round| round.rate).collect()),
            ratio,
            format!("{low:.2}-{high:.2}"),
            if ratio >= 0.5 { "met" } else { "unmet" },
            median(rounds.iter().map(|round| round.p50).collect()),
            median(rounds.iter().map(|round| round.p99).collect()),
        );
    }
    queue_database.remove().await;
}
