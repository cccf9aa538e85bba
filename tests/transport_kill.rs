//! A node killed (SIGKILL) while messages flow through a broker loses nothing, and no effect
//! happens twice: the broker redelivers what the dead node had not acknowledged, and the
//! surviving node's recovery finishes what the dead node had recorded. The node runs in a child
//! process (this test binary, running the ignored `child_node`), so the kill is a real one.
//!
//! Every node is one service on one PostgreSQL store; the handler writes its effect in a
//! handler transaction, so a delivery the dead node ran but never settled is not run twice.

#[path = "support/brokers.rs"]
mod brokers;
#[path = "support/child.rs"]
mod child;

use std::process::Child;
use std::time::Duration;

use brokers::*;
use dacapo::prelude::*;
use dacapo::sqlx;
use dacapo::store::PostgresStore;
use dacapo::testing::ScratchDatabase;
use dacapo::transaction::HandlerTransactions;
use dacapo::transport::{Nats, PostgresQueue, RabbitMq, Transport};
use serde::{Deserialize, Serialize};

const PUBLISHED: i64 = 300;

/// What the child node is told, through its environment.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Setup {
    kind: Kind,
    database: String,
    /// The queue, consumer or stream names of this test.
    name: String,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Kind {
    RabbitMq,
    Nats,
    PostgresQueue,
}

const SETUP: &str = "DACAPO_KILL_TEST_NODE";

impl Setup {
    fn transport(&self) -> Transport {
        match self.kind {
            Kind::RabbitMq => RabbitMq::new(
                std::env::var("DACAPO_TEST_RABBITMQ")
                    .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
                &self.name,
            )
            .exchange(&self.name)
            .route::<Ping>()
            .prefetch(20)
            .into(),
            Kind::Nats => Nats::new(
                std::env::var("DACAPO_TEST_NATS")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
                &self.name,
            )
            .stream(&self.name)
            .subject_prefix(&self.name)
            .route::<Ping>()
            .prefetch(20)
            // The dead node's unacknowledged messages come back after this.
            .ack_wait(Duration::from_secs(2))
            .into(),
            Kind::PostgresQueue => PostgresQueue::connect(&self.database, &self.name)
                .unwrap()
                .route::<Ping>()
                .prefetch(20)
                .into(),
        }
    }

    /// A node on the store at `database` (short heartbeats, so a dead node is taken over
    /// quickly), with the transport and, unless it only publishes, the handler.
    async fn node(&self, database: &str, node: &str, handles: bool) -> Runtime {
        let store = PostgresStore::connect(database)
            .await
            .unwrap()
            .node_id(node)
            .node_timeout(Duration::from_secs(2));
        let mut builder = Runtime::builder()
            .store(store)
            .transport(self.transport())
            .recovery_interval(Duration::from_millis(200))
            .relay_interval(Duration::from_millis(50));
        if handles {
            let pool = sqlx::PgPool::connect(&self.database).await.unwrap();
            builder = builder.module(Module::new("effects").handle::<Ping, _>(Effect {
                node: node.to_owned(),
                pool,
            }));
        }
        builder.build().unwrap()
    }
}

/// Writes one row per message in a handler transaction, then takes a moment, so a kill
/// finds deliveries whose effect committed and which never settled.
struct Effect {
    node: String,
    pool: sqlx::PgPool,
}

impl Handler<Ping> for Effect {
    async fn handle(&self, ping: &Ping, ctx: &MessageContext) -> Result<(), HandlerError> {
        let Some(mut tx) = ctx.transaction::<sqlx::Postgres>().await? else {
            sqlx::query("INSERT INTO skips (envelope_id, node, attempt) VALUES ($1, $2, $3)")
                .bind(ctx.message_id().unwrap().simple().to_string())
                .bind(&self.node)
                .bind(ctx.attempt() as i32)
                .execute(&self.pool)
                .await?;
            return Ok(()); // an earlier attempt, on whichever node, committed it
        };
        let id = ctx.message_id().expect("inside a delivery").to_string();
        sqlx::query("INSERT INTO effects (envelope_id, n) VALUES ($1, $2)")
            .bind(id)
            .bind(i64::from(ping.n))
            .execute(&mut **tx)
            .await?;
        tx.commit().await?;
        tokio::time::sleep(Duration::from_millis(3)).await;
        Ok(())
    }
}

/// The child process's node: listens, says so on stdout, and runs until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the kill tests, which run it themselves"]
async fn child_node() {
    let setup: Setup =
        serde_json::from_str(&std::env::var(SETUP).expect("run by a kill test")).expect("a setup");
    let runtime = setup.node(&setup.database, "victim", true).await;
    listening(&runtime).await;
    println!("listening");
    std::future::pending::<()>().await;
}

fn spawn_child(setup: &Setup) -> Child {
    let setup = serde_json::to_string(setup).unwrap();
    child::spawn("child_node", (SETUP, &setup), "listening", WAIT)
}

async fn count(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    let (count,): (i64,) = sqlx::query_as(sql).fetch_one(pool).await.unwrap();
    count
}

/// Whether `at_least` envelopes had their effect within `within`.
async fn effects_within(pool: &sqlx::PgPool, at_least: i64, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let seen = count(pool, "SELECT count(DISTINCT envelope_id) FROM effects").await;
        if seen >= at_least {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn killing_a_node_while_messages_flow_loses_nothing(kind: Kind) {
    let database = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    // The store's schema, before any node races to create it.
    let _ = database.postgres_store().await.unwrap();
    let pool = sqlx::PgPool::connect(database.url()).await.unwrap();
    sqlx::query("CREATE TABLE effects (envelope_id TEXT NOT NULL, n BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE skips (envelope_id TEXT, node TEXT, attempt INT)")
        .execute(&pool)
        .await
        .unwrap();
    let setup = Setup {
        kind,
        database: database.url().to_owned(),
        name: unique("kill"),
    };
    let mut victim = spawn_child(&setup);
    // Another service publishes, from a database of its own: a node on the service's store
    // recovers the dead node's deliveries, and must handle what it recovers.
    let elsewhere = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let publisher = setup.node(elsewhere.url(), "publisher", false).await;
    listening(&publisher).await;
    let mut published = Vec::new();
    for n in 0..PUBLISHED {
        published.push(publisher.publish(&Ping { n: n as u32 }).await.unwrap());
    }
    assert!(
        effects_within(&pool, PUBLISHED / 5, WAIT).await,
        "the victim handles some"
    );
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed_at = count(&pool, "SELECT count(*) FROM effects").await;
    assert!(killed_at < PUBLISHED, "killed while messages flowed");

    let survivor = setup.node(&setup.database, "survivor", true).await;
    listening(&survivor).await;
    if !effects_within(&pool, PUBLISHED, Duration::from_secs(60)).await {
        let rows: Vec<(String, String, Option<String>, i32)> = sqlx::query_as(
            "SELECT i.id, i.status, i.owner, i.attempts FROM dacapo_inbox i WHERE NOT EXISTS \
             (SELECT 1 FROM effects e WHERE replace(e.envelope_id, '-', '') = i.id)",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let inbox = count(&pool, "SELECT count(*) FROM dacapo_inbox").await;
        let unpublished = count(
            &pool,
            "SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL",
        )
        .await;
        let skips: Vec<(String, String, i32)> =
            sqlx::query_as("SELECT envelope_id, node, attempt FROM skips")
                .fetch_all(&pool)
                .await
                .unwrap();
        let completions: Vec<(String, String)> = sqlx::query_as(
            "SELECT envelope_id, handler FROM dacapo_handler_completions c WHERE NOT EXISTS \
             (SELECT 1 FROM effects e WHERE replace(e.envelope_id, '-', '') = c.envelope_id)",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        panic!(
            "not every effect within 60 s: {inbox} in the inbox, {unpublished} unpublished, \
             in the inbox without an effect: {rows:?}; skips {skips:?}; completions without \
             an effect {completions:?}"
        );
    }
    survivor.idle().await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM effects").await,
        PUBLISHED,
        "no effect happened twice"
    );
    let mut stored: Vec<String> = sqlx::query_scalar("SELECT envelope_id FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    stored.sort();
    let mut expected: Vec<String> = published.iter().map(ToString::to_string).collect();
    expected.sort();
    assert_eq!(stored, expected, "every published envelope had its effect");
    assert!(survivor.shutdown().await.is_clean());
    assert!(publisher.shutdown().await.is_clean());
    pool.close().await;
    remove_broker_objects(&setup).await;
}

/// This test's queue and exchange, or stream, so runs leave nothing on the broker.
async fn remove_broker_objects(setup: &Setup) {
    match setup.kind {
        Kind::RabbitMq => {
            use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
            let url = std::env::var("DACAPO_TEST_RABBITMQ")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let connection =
                lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let channel = connection.create_channel().await.unwrap();
            let name = setup.name.as_str();
            let _ = channel
                .queue_delete(name.into(), QueueDeleteOptions::default())
                .await;
            let _ = channel
                .exchange_delete(name.into(), ExchangeDeleteOptions::default())
                .await;
        }
        Kind::Nats => {
            let url = std::env::var("DACAPO_TEST_NATS")
                .unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
            let client = async_nats::connect(url).await.unwrap();
            let _ = async_nats::jetstream::new(client)
                .delete_stream(&setup.name)
                .await;
        }
        Kind::PostgresQueue => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_rabbitmq_delivers_loses_nothing() {
    killing_a_node_while_messages_flow_loses_nothing(Kind::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_jetstream_delivers_loses_nothing() {
    killing_a_node_while_messages_flow_loses_nothing(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_taking_from_the_postgres_queue_loses_nothing() {
    killing_a_node_while_messages_flow_loses_nothing(Kind::PostgresQueue).await;
}
