//! B6: end-to-end deliveries per second through each transport — published through the outbox
//! (`publish_batch` of 100, one outbox commit), sent by the relay with the broker's confirms,
//! consumed with a prefetch of 100, persisted in the inbox, handled (a no-op handler), settled —
//! against two raw client loops, in one run, on the same servers; the runtime's store is a
//! SQLite file with `synchronous = FULL` (the default).
//!
//! - The broker loop (issue 13's baseline): the same broker work with the same prefetch and
//!   confirms — publish 100 messages, await their confirms; consume, acknowledge each batch —
//!   and nothing else. Its messages are the ones dacapo puts on the wire (the same headers and
//!   properties, the same body), so the broker does the same work for both.
//! - The durable loop (the limit, by the project's rule that a baseline has the same
//!   durability): the broker loop, plus what makes dacapo's path durable, done as a raw loop
//!   does it best — each batch enlisted in a SQLite outbox before it is sent and marked
//!   published after its confirms; each received batch recorded in a SQLite inbox before it is
//!   acknowledged and marked handled after; one transaction and one statement per batch, on one
//!   connection the two sides take in turn (WAL, `synchronous = FULL`), marks overlapping the
//!   next batch's broker work.
//!
//! Then publish-to-handled latency, p50 and p99, at a steady 200 messages/s (one `publish`
//! each, below saturation).
//!
//! Run with `cargo bench --bench b6_transports --all-features` (RabbitMQ at
//! `DACAPO_BENCH_RABBITMQ`, NATS at `DACAPO_BENCH_NATS`, PostgreSQL at `DACAPO_BENCH_POSTGRES`,
//! defaulting to the local servers; `B6_ONLY=rabbitmq|nats|postgresqueue` runs one). Three
//! rounds, each running every transport's two raw loops, then dacapo on it; the figures are
//! the medians, the ranges the rounds' own ratios. Goal (issue 13): at least 0.5 of the raw
//! loop — judged against the durable loop, the one with dacapo's durability; the ratio to the
//! broker loop is printed beside it, for what the store costs.

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
/// Issue 13's goal, of the durable loop.
const GOAL: f64 = 0.5;

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
    // Until every delivery settled, as the raw loops run until their last mark.
    runtime.idle().await;
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

/// The raw loops' deliveries per second for `kind`: the broker loop, and the durable loop
/// when given a ledger.
async fn raw(kind: Kind, queue_database: &str, ledger: Option<Arc<Ledger>>) -> f64 {
    match kind {
        Kind::RabbitMq => raw_rabbitmq(ledger).await,
        Kind::Nats => raw_nats(ledger).await,
        Kind::PostgresQueue => raw_postgres_queue(queue_database, ledger).await,
    }
}

/// One message as the raw loops send it: what dacapo puts on the wire for a published `Ping`
/// — its id, its type, its sent time, its content type and its correlation id as headers, the
/// JSON as the body.
struct Outgoing {
    id: String,
    body: Vec<u8>,
    sent_at: chrono::DateTime<chrono::Utc>,
    headers: Vec<(&'static str, String)>,
}

impl Outgoing {
    fn batch() -> Vec<Self> {
        (0..BATCH)
            .map(|n| {
                let id = uuid::Uuid::now_v7().simple().to_string();
                let sent_at = chrono::Utc::now();
                let headers = vec![
                    ("message-id", id.clone()),
                    ("message-type", Ping::TYPE.to_owned()),
                    (
                        "sent-at",
                        sent_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    ),
                    ("content-type", "application/json".to_owned()),
                    ("correlation-id", id.clone()),
                ];
                let body = serde_json::to_vec(&Ping {
                    n: n as u64,
                    at: now_micros(),
                })
                .unwrap();
                Self {
                    id,
                    body,
                    sent_at,
                    headers,
                }
            })
            .collect()
    }

    fn headers_json(&self) -> String {
        let map: std::collections::BTreeMap<&str, &str> = self
            .headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect();
        serde_json::to_string(&map).unwrap()
    }
}

/// A message as the raw loops' consumers record it.
struct Incoming {
    id: String,
    body: Vec<u8>,
    headers: String,
}

/// The durable loops' store: what dacapo's path writes, as a raw loop writes it best — a SQLite
/// file (WAL, `synchronous = FULL`, as the runtime's store) on one connection that the
/// publishing and the consuming side take in turn; each write one transaction for a whole
/// batch, its rows in one statement (`?` parameters). The publishing side enlists a batch,
/// sends it, and marks it published; the consuming side records a batch, acknowledges it,
/// and marks it handled; each mark overlaps the next batch's broker work.
struct Ledger {
    connection: tokio::sync::Mutex<sqlx::SqliteConnection>,
    _file: ScratchSqlite,
}

impl Ledger {
    async fn open() -> Arc<Self> {
        use sqlx::ConnectOptions;
        let file = ScratchSqlite::new("b6-ledger");
        let mut connection = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(file.path())
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
            .connect()
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE outbox (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, \
             message_type TEXT NOT NULL, payload BLOB NOT NULL, headers TEXT NOT NULL, \
             sent_at INTEGER NOT NULL, enlisted_at INTEGER NOT NULL, published_at INTEGER); \
             CREATE TABLE inbox (id TEXT PRIMARY KEY, message_type TEXT NOT NULL, \
             payload BLOB NOT NULL, headers TEXT NOT NULL, received_at INTEGER NOT NULL, \
             handled_at INTEGER)",
        )
        .execute(&mut connection)
        .await
        .unwrap();
        Arc::new(Self {
            connection: tokio::sync::Mutex::new(connection),
            _file: file,
        })
    }

    /// Runs `statement` in a transaction of its own.
    async fn write(
        &self,
        statement: sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Vec<sqlx::sqlite::SqliteRow> {
        use sqlx::Connection;
        let mut connection = self.connection.lock().await;
        let mut tx = connection.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let rows = statement.fetch_all(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        rows
    }

    /// Enlists `batch` in the outbox; their positions.
    async fn enlist(&self, batch: &[Outgoing]) -> Vec<i64> {
        use sqlx::Row;
        let now = chrono::Utc::now().timestamp_millis();
        let text = format!(
            "INSERT INTO outbox (id, message_type, payload, headers, sent_at, enlisted_at) \
             VALUES {} RETURNING seq",
            vec!["(?, ?, ?, ?, ?, ?)"; batch.len()].join(", ")
        );
        let mut statement = sqlx::query(sqlx::AssertSqlSafe(text));
        for message in batch {
            statement = statement
                .bind(message.id.clone())
                .bind(Ping::TYPE)
                .bind(message.body.clone())
                .bind(message.headers_json())
                .bind(message.sent_at.timestamp_millis())
                .bind(now);
        }
        self.write(statement)
            .await
            .iter()
            .map(|row| row.get::<i64, _>("seq"))
            .collect()
    }

    async fn published(&self, positions: Vec<i64>) {
        self.stamp("UPDATE outbox SET published_at = ? WHERE seq IN", positions)
            .await;
    }

    /// Runs `update` (which sets one column to `?`, now) on the rows whose key is one of `keys`.
    async fn stamp<K>(&self, update: &str, keys: Vec<K>)
    where
        K: for<'q> sqlx::Encode<'q, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite> + Send,
    {
        let text = format!("{update} ({})", vec!["?"; keys.len()].join(", "));
        let mut statement =
            sqlx::query(sqlx::AssertSqlSafe(text)).bind(chrono::Utc::now().timestamp_millis());
        for key in keys {
            statement = statement.bind(key);
        }
        self.write(statement).await;
    }

    /// Records `batch` in the inbox (a redelivered id is kept once).
    async fn receive(&self, batch: &[Incoming]) {
        let text = format!(
            "INSERT INTO inbox (id, message_type, payload, headers, received_at) VALUES {} \
             ON CONFLICT (id) DO NOTHING",
            vec!["(?, ?, ?, ?, ?)"; batch.len()].join(", ")
        );
        let now = chrono::Utc::now().timestamp_millis();
        let mut statement = sqlx::query(sqlx::AssertSqlSafe(text));
        for message in batch {
            statement = statement
                .bind(message.id.clone())
                .bind(Ping::TYPE)
                .bind(message.body.clone())
                .bind(message.headers.clone())
                .bind(now);
        }
        self.write(statement).await;
    }

    async fn handled(&self, ids: Vec<String>) {
        self.stamp("UPDATE inbox SET handled_at = ? WHERE id IN", ids)
            .await;
    }
}

/// The publishing side of a raw loop: a task enlists the batches (durable loop) as fast as
/// its commits go, as dacapo's publisher runs ahead of its relay; each batch goes to `send`
/// (which returns once the broker confirmed it) and is marked published while the next batch
/// is sent.
async fn publish_all<F, S>(ledger: Option<Arc<Ledger>>, mut send: S)
where
    S: FnMut(Vec<Outgoing>) -> F,
    F: std::future::Future<Output = ()>,
{
    let (enlisted, mut to_send) = tokio::sync::mpsc::channel(MESSAGES / BATCH);
    let enlisting = {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            for _ in (0..MESSAGES).step_by(BATCH) {
                let batch = Outgoing::batch();
                let positions = match &ledger {
                    Some(ledger) => Some(ledger.enlist(&batch).await),
                    None => None,
                };
                enlisted.send((batch, positions)).await.unwrap();
            }
        })
    };
    let mut marking: Option<tokio::task::JoinHandle<()>> = None;
    while let Some((batch, positions)) = to_send.recv().await {
        send(batch).await;
        if let Some(marking) = marking.take() {
            marking.await.unwrap();
        }
        if let (Some(ledger), Some(positions)) = (&ledger, positions) {
            let ledger = Arc::clone(ledger);
            marking = Some(tokio::spawn(
                async move { ledger.published(positions).await },
            ));
        }
    }
    enlisting.await.unwrap();
    if let Some(marking) = marking {
        marking.await.unwrap();
    }
}

/// The consuming side's record of a batch (durable loop), before it is acknowledged; what
/// marks it handled afterwards, which overlaps the next batch.
struct Recorder {
    ledger: Option<Arc<Ledger>>,
    marking: Option<tokio::task::JoinHandle<()>>,
}

impl Recorder {
    fn new(ledger: Option<Arc<Ledger>>) -> Self {
        Self {
            ledger,
            marking: None,
        }
    }

    async fn record(&self, batch: &[Incoming]) {
        if let Some(ledger) = &self.ledger {
            ledger.receive(batch).await;
        }
    }

    async fn handled(&mut self, batch: Vec<Incoming>) {
        if let Some(marking) = self.marking.take() {
            marking.await.unwrap();
        }
        if let Some(ledger) = &self.ledger {
            let ledger = Arc::clone(ledger);
            let ids = batch.into_iter().map(|message| message.id).collect();
            self.marking = Some(tokio::spawn(async move { ledger.handled(ids).await }));
        }
    }

    async fn finish(mut self) {
        if let Some(marking) = self.marking.take() {
            marking.await.unwrap();
        }
    }
}

async fn raw_rabbitmq(ledger: Option<Arc<Ledger>>) -> f64 {
    use lapin::options::*;
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
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
    let mut recorder = Recorder::new(ledger.clone());
    let consume = tokio::spawn(async move {
        let incoming = |delivery: lapin::message::Delivery| {
            let headers = delivery
                .properties
                .headers()
                .as_ref()
                .map(|table| {
                    table
                        .inner()
                        .iter()
                        .filter_map(|(name, value)| match value {
                            AMQPValue::LongString(text) => {
                                Some((name.to_string(), text.to_string()))
                            }
                            _ => None,
                        })
                        .collect::<std::collections::BTreeMap<_, _>>()
                })
                .unwrap_or_default();
            Incoming {
                id: headers.get("message-id").cloned().unwrap_or_default(),
                headers: serde_json::to_string(&headers).unwrap(),
                body: delivery.data,
            }
        };
        let mut taken = 0;
        while taken < MESSAGES {
            let first = consumer.next().await.unwrap().unwrap();
            let mut last = first.delivery_tag;
            let mut batch = vec![incoming(first)];
            while let Some(Some(Ok(delivery))) = consumer.next().now_or_never() {
                last = delivery.delivery_tag;
                batch.push(incoming(delivery));
            }
            taken += batch.len();
            recorder.record(&batch).await;
            consumer_channel
                .basic_ack(last, BasicAckOptions { multiple: true })
                .await
                .unwrap();
            recorder.handled(batch).await;
        }
        recorder.finish().await;
    });
    let route = name.clone();
    publish_all(ledger, |batch| {
        let (publisher, route) = (&publisher, &route);
        async move {
            let mut confirms = Vec::with_capacity(batch.len());
            for message in &batch {
                let mut headers = FieldTable::default();
                for (header, value) in &message.headers {
                    headers.insert(
                        ShortString::from(*header),
                        AMQPValue::LongString(LongString::from(value.as_str())),
                    );
                }
                let properties = lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_content_type("application/json".into())
                    .with_message_id(message.id.as_str().into())
                    .with_timestamp(message.sent_at.timestamp() as u64)
                    .with_headers(headers)
                    .with_type(Ping::TYPE.into())
                    .with_correlation_id(message.id.as_str().into());
                confirms.push(
                    publisher
                        .basic_publish(
                            "".into(),
                            route.as_str().into(),
                            BasicPublishOptions::default(),
                            &message.body,
                            properties,
                        )
                        .await
                        .unwrap(),
                );
            }
            for confirm in confirms {
                assert!(confirm.await.unwrap().is_ack());
            }
        }
    })
    .await;
    consume.await.unwrap();
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = publisher
        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
        .await;
    rate
}

async fn raw_nats(ledger: Option<Arc<Ledger>>) -> f64 {
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
    let mut recorder = Recorder::new(ledger.clone());
    let consume = tokio::spawn(async move {
        let mut taken = 0;
        while taken < MESSAGES {
            let first = messages.next().await.unwrap().unwrap();
            let mut received = vec![first];
            while let Some(Some(Ok(message))) = messages.next().now_or_never() {
                received.push(message);
            }
            taken += received.len();
            let batch: Vec<Incoming> = received
                .iter()
                .map(|message| {
                    let headers: std::collections::BTreeMap<String, String> = message
                        .headers
                        .iter()
                        .flat_map(|map| map.iter())
                        .filter_map(|(name, values)| {
                            Some((name.to_string(), values.first()?.as_str().to_owned()))
                        })
                        .collect();
                    Incoming {
                        id: headers.get("message-id").cloned().unwrap_or_default(),
                        headers: serde_json::to_string(&headers).unwrap(),
                        body: message.payload.to_vec(),
                    }
                })
                .collect();
            recorder.record(&batch).await;
            for message in received {
                message.ack().await.unwrap();
            }
            recorder.handled(batch).await;
        }
        recorder.finish().await;
    });
    let subject = format!("{name}.ping");
    publish_all(ledger, |batch| {
        let (context, subject) = (&context, &subject);
        async move {
            let mut acks = Vec::with_capacity(batch.len());
            for message in batch {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", message.id.as_str());
                for (header, value) in &message.headers {
                    headers.insert(*header, value.as_str());
                }
                acks.push(
                    context
                        .publish_with_headers(subject.clone(), headers, message.body.into())
                        .await
                        .unwrap(),
                );
            }
            for ack in acks {
                ack.await.unwrap();
            }
        }
    })
    .await;
    consume.await.unwrap();
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = context.delete_stream(&name).await;
    rate
}

async fn raw_postgres_queue(url: &str, ledger: Option<Arc<Ledger>>) -> f64 {
    use sqlx::Row;
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    // The columns and index of dacapo's queue table, in a table of the raw loop's own.
    for statement in [
        "CREATE TABLE IF NOT EXISTS b6_raw_queue (seq BIGSERIAL PRIMARY KEY, queue TEXT NOT NULL, \
         id TEXT NOT NULL, message_type TEXT NOT NULL, payload BYTEA NOT NULL, \
         headers TEXT NOT NULL, correlation_id TEXT, sent_at BIGINT NOT NULL, \
         enqueued_at BIGINT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS b6_raw_queue_next ON b6_raw_queue (queue, seq)",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let started = Instant::now();
    let consuming = pool.clone();
    let mut recorder = Recorder::new(ledger.clone());
    let consume = tokio::spawn(async move {
        let mut taken = 0usize;
        while taken < MESSAGES {
            let mut tx = consuming.begin().await.unwrap();
            let rows = sqlx::query(
                "SELECT seq, id, payload, headers FROM b6_raw_queue WHERE queue = 'raw' \
                 ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
            )
            .bind(i64::from(PREFETCH))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
            if rows.is_empty() {
                tx.commit().await.unwrap();
                tokio::task::yield_now().await;
                continue;
            }
            let seqs: Vec<i64> = rows.iter().map(|row| row.get("seq")).collect();
            let batch: Vec<Incoming> = rows
                .iter()
                .map(|row| Incoming {
                    id: row.get("id"),
                    body: row.get("payload"),
                    headers: row.get("headers"),
                })
                .collect();
            recorder.record(&batch).await;
            sqlx::query("DELETE FROM b6_raw_queue WHERE seq = ANY($1)")
                .bind(&seqs)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            taken += seqs.len();
            recorder.handled(batch).await;
        }
        recorder.finish().await;
    });
    publish_all(ledger, |batch| {
        let pool = &pool;
        async move {
            let now = chrono::Utc::now().timestamp_millis();
            let mut tx = pool.begin().await.unwrap();
            for message in &batch {
                sqlx::query(
                    "INSERT INTO b6_raw_queue (queue, id, message_type, payload, headers, \
                     correlation_id, sent_at, enqueued_at) \
                     VALUES ('raw', $1, $2, $3, $4, $1, $5, $6)",
                )
                .bind(&message.id)
                .bind(Ping::TYPE)
                .bind(&message.body)
                .bind(message.headers_json())
                .bind(message.sent_at.timestamp_millis())
                .bind(now)
                .execute(&mut *tx)
                .await
                .unwrap();
            }
            tx.commit().await.unwrap();
        }
    })
    .await;
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
    broker: f64,
    durable: f64,
    rate: f64,
    p50: f64,
    p99: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The median of `ratios` and their range, as text.
fn ratio(ratios: Vec<f64>) -> (f64, String) {
    let (low, high) = ratios.iter().fold((f64::MAX, f64::MIN), |(low, high), r| {
        (low.min(*r), high.max(*r))
    });
    (median(ratios), format!("{low:.2}-{high:.2}"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let queue_database = ScratchPostgres::create("b6").await;
    println!(
        "B6: {MESSAGES} messages, batches of {BATCH}, prefetch {PREFETCH}, SQLite store \
         synchronous=FULL; latency at {STEADY_RATE}/s over {STEADY_MESSAGES} messages; goal \
         {GOAL} of the durable loop; \
         medians of {ROUNDS} rounds, the raw loops and dacapo interleaved"
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
            let broker = raw(*kind, &queue_database.url, None).await;
            let durable = raw(*kind, &queue_database.url, Some(Ledger::open().await)).await;
            let (rate, mut latencies) = through_dacapo(*kind, &queue_database.url).await;
            rounds.push(Round {
                broker,
                durable,
                rate,
                p50: percentile(&mut latencies, 0.5),
                p99: percentile(&mut latencies, 0.99),
            });
        }
    }
    println!(
        "{:<14} {:>10} {:>10} {:>9} {:>18} {:>18} {:>6} {:>7} {:>7}",
        "transport",
        "broker/s",
        "durable/s",
        "dacapo/s",
        "of broker (range)",
        "of durable (range)",
        "goal",
        "p50 ms",
        "p99 ms"
    );
    for (kind, rounds) in kinds.iter().zip(&rounds) {
        let (of_broker, broker_range) = ratio(
            rounds
                .iter()
                .map(|round| round.rate / round.broker)
                .collect(),
        );
        let (of_durable, durable_range) = ratio(
            rounds
                .iter()
                .map(|round| round.rate / round.durable)
                .collect(),
        );
        println!(
            "{:<14} {:>10.0} {:>10.0} {:>9.0} {:>18} {:>18} {:>6} {:>7.2} {:>7.2}",
            format!("{kind:?}"),
            median(rounds.iter().map(|round| round.broker).collect()),
            median(rounds.iter().map(|round| round.durable).collect()),
            median(rounds.iter().map(|round| round.rate).collect()),
            format!("{of_broker:.2} ({broker_range})"),
            format!("{of_durable:.2} ({durable_range})"),
            if of_durable >= GOAL { "met" } else { "unmet" },
            median(rounds.iter().map(|round| round.p50).collect()),
            median(rounds.iter().map(|round| round.p99).collect()),
        );
    }
    queue_database.remove().await;
}
