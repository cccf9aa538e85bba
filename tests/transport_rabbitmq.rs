//! The RabbitMQ transport against the real broker (127.0.0.1:5672, guest/guest, started by
//! `.ci/run`): these tests fail, never skip, when it is down.

#[path = "support/brokers.rs"]
mod brokers;
#[path = "support/proxy.rs"]
mod proxy;

use brokers::*;
use dacapo::Runtime;
use dacapo::transport::{QueueKind, RabbitMq, Transport, WireFormat};
use lapin::options::{
    BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use proxy::Proxy;
use uuid::Uuid;

fn url() -> String {
    std::env::var("DACAPO_TEST_RABBITMQ")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// This test's exchange and queue, removed at its end.
struct Broker {
    exchange: String,
    queue: String,
    channel: Channel,
    _connection: Connection,
}

impl Broker {
    async fn new() -> Self {
        let connection = Connection::connect(&url(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ must be running for the tests (.ci/run starts it)");
        let channel = connection.create_channel().await.unwrap();
        Self {
            exchange: unique("dacapo-test-"),
            queue: unique("pings-"),
            channel,
            _connection: connection,
        }
    }

    fn transport(&self, url: &str) -> RabbitMq {
        RabbitMq::new(url, &self.queue)
            .exchange(&self.exchange)
            .route::<Ping>()
            .prefetch(20)
    }

    /// Messages ready in the queue (neither delivered nor acknowledged).
    async fn ready(&self) -> u32 {
        self.channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    async fn remove(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// A node of service `a` on `store` with `transport`, once it listens; and what its handlers
/// saw.
async fn listening_node(store: &TestStore, transport: RabbitMq) -> (Runtime, Seen) {
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    (runtime, seen)
}

/// This test's broker objects and a node of service `a` on `store` listening on them.
async fn broker_and_node(store: &TestStore) -> (Broker, Runtime, Seen) {
    let broker = Broker::new().await;
    let (runtime, seen) = listening_node(store, broker.transport(&url())).await;
    (broker, runtime, seen)
}

/// Checks that `runtime` handled nothing (what it got was dead-lettered), stops it cleanly,
/// and removes the test's broker objects.
async fn none_handled_then_removed(runtime: Runtime, seen: &Seen, broker: Broker) {
    assert!(seen.calls().is_empty());
    assert!(runtime.shutdown().await.is_clean());
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_messages_cross_a_classic_queue_once() {
    let broker = Broker::new().await;
    routed_messages_cross_the_broker_once(TestStore::sqlite().await, || {
        broker.transport(&url()).into()
    })
    .await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_messages_cross_a_quorum_queue_once_as_cloud_events() {
    let broker = Broker::new().await;
    routed_messages_cross_the_broker_once(TestStore::postgres().await, || {
        broker
            .transport(&url())
            .queue_kind(QueueKind::Quorum)
            .wire_format(WireFormat::CloudEvents)
            .into()
    })
    .await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_on_one_queue_handle_every_envelope_once() {
    let broker = Broker::new().await;
    two_nodes_share_the_queue(|| Transport::from(broker.transport(&url())), true).await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_broker_connection_resumes_and_loses_nothing() {
    let broker = Broker::new().await;
    let proxy = Proxy::start("127.0.0.1:5672".to_owned()).await;
    let through = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    a_cut_connection_resumes_by_itself(
        TestStore::sqlite().await,
        broker.transport(&through).into(),
        || proxy.cut(),
        || proxy.restore(),
        true,
    )
    .await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_service_reaches_the_handler_with_its_ids() {
    let broker = Broker::new().await;
    a_foreign_service_reaches_the_handler(&broker, broker.transport(&url()).into()).await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_envelope_is_discarded_by_the_inbox() {
    let store = TestStore::sqlite().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    let id = Uuid::new_v4().to_string();
    let headers = [("message-id", id.as_str()), ("message-type", "tests.ping")];
    // What a relay that crashed between the broker's confirm and its mark sends again.
    broker
        .publish_raw("tests.ping", &headers, br#"{"n":1}"#)
        .await;
    broker
        .publish_raw("tests.ping", &headers, br#"{"n":1}"#)
        .await;
    let after = Uuid::new_v4().to_string();
    let barrier = [
        ("message-id", after.as_str()),
        ("message-type", "tests.ping"),
    ];
    broker
        .publish_raw("tests.ping", &barrier, br#"{"n":2}"#)
        .await;
    // One queue delivers in order: once the barrier is handled, both copies were taken.
    seen.wait_for(2, WAIT).await;
    runtime.idle().await;
    assert_eq!(seen.calls().len(), 2, "the copy was discarded");
    assert_eq!(runtime.stats().deduplicated, 1);
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(broker.ready().await, 0, "every copy was acknowledged");
    broker.remove().await;
}

/// A message over the runtime's envelope limit is dead-lettered as it arrives, before any
/// inbox write: a broker's burst of large messages (RabbitMQ takes up to 128 MiB each) in one
/// inbox transaction could pass PostgreSQL's 1 GiB message and be refused, and retried, for
/// ever, or take the process's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_envelope_limit_is_dead_lettered_as_it_arrives() {
    let store = TestStore::sqlite().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    let big = Uuid::new_v4();
    let padded = format!(r#"{{"n":1,"pad":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let big_text = big.to_string();
    broker
        .publish_raw(
            "tests.ping",
            &[
                ("message-id", big_text.as_str()),
                ("message-type", "tests.ping"),
            ],
            padded.as_bytes(),
        )
        .await;
    let fine = Uuid::new_v4().to_string();
    broker
        .publish_raw(
            "tests.ping",
            &[
                ("message-id", fine.as_str()),
                ("message-type", "tests.ping"),
            ],
            br#"{"n":2}"#,
        )
        .await;
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id.to_string(), fine);
    let letters = dead_letters(&runtime, 1).await;
    assert_eq!(letters[0].envelope.id, big);
    assert!(
        matches!(
            letters[0].reason,
            dacapo::DeadLetterReason::TooLarge {
                limit: 1_048_576,
                ..
            }
        ),
        "{}",
        letters[0].reason
    );
    let TestStore::Sqlite(sqlite, _) = &store else {
        unreachable!()
    };
    let inboxed: i64 = sqlx::query_scalar("SELECT count(*) FROM dacapo_inbox WHERE id = $1")
        .bind(big.simple().to_string())
        .fetch_one(sqlite.pool())
        .await
        .unwrap();
    assert_eq!(inboxed, 0, "never written to the inbox");
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(broker.ready().await, 0, "both acknowledged");
    assert_eq!(seen.calls().len(), 1);
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_from_the_wire_is_dead_lettered_and_acknowledged() {
    let broker = Broker::new().await;
    bad_input_from_the_wire_is_dead_lettered(&broker, broker.transport(&url()).into()).await;
    assert_eq!(broker.ready().await, 0, "none was requeued");
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_only_checked_and_missing_stops_listening_with_a_clear_error() {
    let broker = Broker::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), broker.transport(&url()).declare(false));
    stops_listening(runtime, "only checks").await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_amqp_cannot_carry_dead_letters_its_envelope_only() {
    let broker = Broker::new().await;
    let too_long = "h".repeat(300);
    what_the_broker_can_never_take_is_dead_lettered(
        broker.transport(&url()).into(),
        dacapo::SendOptions::new().header(too_long, "v"),
    )
    .await;
    broker.remove().await;
}

/// RabbitMQ carries every header of a message in one frame, at most `frame_max` bytes (128 KiB
/// by default), and closes the connection on a larger one: a header far under the runtime's
/// envelope size must not hold back every envelope behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_larger_than_a_frame_dead_letter_their_envelope_only() {
    let broker = Broker::new().await;
    what_the_broker_can_never_take_is_dead_lettered(
        broker.transport(&url()).into(),
        dacapo::SendOptions::new().header("big", "v".repeat(200 * 1024)),
    )
    .await;
    broker.remove().await;
}

/// An exchange the broker refuses publications to (an internal one here; in production, one
/// this service's user may not write to) closes the channel at the first publication to it,
/// failing the rest of the batch with it. One at a time then tells them apart: only the
/// refused envelope is held, and the others go. The whole batch failed every round before,
/// and nothing this service routed reached the broker again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_that_refuses_publications_holds_back_only_its_own_envelopes() {
    let broker = Broker::new().await;
    let internal = unique("internal-");
    broker
        .channel
        .exchange_declare(
            internal.as_str().into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                internal: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let store = TestStore::sqlite().await;
    // The topology is declared first: the node under test only checks it, as where it is
    // managed elsewhere (a declaration would find the internal exchange declared otherwise).
    let (setup, _) = listening_node(&store, broker.transport(&url())).await;
    setup.shutdown().await;
    let transport = broker
        .transport(&url())
        .declare(false)
        .route_to::<Local>(&internal);
    let (runtime, seen) = listening_node(&store, transport).await;

    // In one transaction, the refused one first: the relay reads them as one batch, which
    // the broker's closing of the channel fails whole.
    let TestStore::Sqlite(sqlite, _) = &store else {
        unreachable!("a SQLite store")
    };
    let mut tx = sqlite.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    runtime
        .outbox()
        .enlist(&mut tx, &Local { n: 0 })
        .await
        .unwrap();
    for n in 1..=5 {
        runtime.outbox().enlist(&mut tx, &Ping { n }).await.unwrap();
    }
    runtime.outbox().commit(tx).await.unwrap();
    let calls = seen.wait_for(5, WAIT).await;
    assert_eq!(calls.len(), 5);
    // Marked once the relay's call returns, which may be just after the consumer handled them.
    let deadline = tokio::time::Instant::now() + WAIT;
    while runtime.outbox_backlog().await.unwrap().unwrap().depth != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the refused envelope alone waits in the outbox"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    runtime.shutdown().await;
    let _ = broker
        .channel
        .exchange_delete(internal.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    broker.remove().await;
}

/// The service's exchange deleted under a live connection: the broker closes the channel on
/// the next publication to it (404), and the publisher, on a new channel, declares it again
/// with its bindings, so the next envelopes arrive. A new channel that kept what the old one
/// had declared published to the missing exchange for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_deleted_under_the_publisher_is_declared_again() {
    let store = TestStore::sqlite().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    publish_pings(&runtime, 0, 1).await;
    seen.wait_for(1, WAIT).await;
    broker
        .channel
        .exchange_delete(
            broker.exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await
        .unwrap();
    publish_pings(&runtime, 1, 3).await;
    seen.wait_for(4, WAIT).await;
    runtime.shutdown().await;
    broker.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_delivered_and_not_recorded_goes_back_to_the_queue_at_shutdown() {
    let broker = Broker::new().await;
    let database = TestStore::postgres().await;
    let (proxy, through) = Proxy::to(database.url()).await;
    let store = dacapo::store::PostgresStore::connect(&through)
        .await
        .unwrap();
    let seen = Seen::default();
    let runtime = Runtime::builder()
        .store(store)
        .module(module(&seen, "a"))
        .transport(broker.transport(&url()))
        .drain_timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    listening(&runtime).await;
    // The store goes away: the consumer receives the batch and cannot record it.
    proxy.cut();
    for n in 0..5u32 {
        let id = Uuid::new_v4().to_string();
        let body = format!("{{\"n\":{n}}}");
        let headers = [("message-id", id.as_str()), ("message-type", "tests.ping")];
        broker
            .publish_raw("tests.ping", &headers, body.as_bytes())
            .await;
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while broker.ready().await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the consumer took the batch"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    runtime.shutdown().await;
    assert_eq!(
        broker.ready().await,
        5,
        "handed back to the queue, none acknowledged"
    );
    assert!(seen.calls().is_empty());
    proxy.restore();
    broker.remove().await;
}

impl RawPublisher for Broker {
    const CLOUD_EVENTS: &'static str = "cloudEvents_";

    async fn publish_raw(&self, routing_key: &str, headers: &[(&str, &str)], body: &[u8]) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                ShortString::from(*name),
                AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
            );
        }
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default().with_headers(table),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// Routed to the test's exchange, where no queue takes it until the test binds one.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Orphan {
    n: u32,
}

impl dacapo::Message for Orphan {
    const TYPE: &'static str = "tests.orphan";
}

/// Envelopes in the outbox not yet marked sent.
async fn outbox_depth(runtime: &Runtime) -> Option<u64> {
    runtime
        .outbox_backlog()
        .await
        .unwrap()
        .map(|backlog| backlog.depth)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envelope_no_queue_takes_yet_waits_in_the_outbox_and_holds_back_nothing_else() {
    let broker = Broker::new().await;
    let store = TestStore::sqlite().await;
    let (runtime, seen) = listening_node(&store, broker.transport(&url()).route::<Orphan>()).await;
    let orphan = orphan_held_and_ping_sent(&store, &runtime, &seen).await;

    // A queue bound for its type takes it on a later round.
    let orphans = unique("orphans-");
    orphans_queue(&broker, &orphans, FieldTable::default()).await;
    went_out_once(broker, runtime, &seen, &orphans, orphan).await;
}

/// Declares `queue`, bound for `Orphan` on `broker`'s exchange; with `arguments`.
async fn orphans_queue(broker: &Broker, queue: &str, arguments: FieldTable) {
    use lapin::options::QueueBindOptions;
    broker
        .channel
        .queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
        .await
        .unwrap();
    broker
        .channel
        .queue_bind(
            queue.into(),
            broker.exchange.as_str().into(),
            <Orphan as dacapo::Message>::TYPE.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// Waits until the outbox holds `depth` envelopes not marked sent.
async fn outbox_reaches(runtime: &Runtime, depth: u64, what: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while outbox_depth(runtime).await != Some(depth) {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Enlists an `Orphan` and a `Ping` in one commit, so in one batch of the relay, the orphan
/// first; returns the orphan's id once the ping was handled and marked sent while the orphan
/// waits in the outbox.
async fn orphan_held_and_ping_sent(store: &TestStore, runtime: &Runtime, seen: &Seen) -> Uuid {
    let TestStore::Sqlite(sqlite, _) = store else {
        unreachable!()
    };
    let mut tx = sqlite.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let orphan = runtime
        .outbox()
        .enlist(&mut tx, &Orphan { n: 1 })
        .await
        .unwrap();
    let ping = runtime
        .outbox()
        .enlist(&mut tx, &Ping { n: 2 })
        .await
        .unwrap();
    runtime.outbox().commit(tx).await.unwrap();
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id, ping);
    outbox_reaches(runtime, 1, "the ping was never marked sent").await;
    orphan
}

/// Checks that the orphan left, once, into `queue`, that the ping was handled once, and
/// removes the test's broker objects.
async fn went_out_once(broker: Broker, runtime: Runtime, seen: &Seen, queue: &str, orphan: Uuid) {
    outbox_reaches(&runtime, 0, "the orphan never left").await;
    let queued = broker
        .channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count();
    assert_eq!(queued, 1, "the orphan {orphan} went out once, once placed");
    assert!(
        dead_letters(&runtime, 0).await.is_empty(),
        "held, not dead-lettered"
    );
    assert_eq!(seen.calls().len(), 1, "the ping was handled once");
    assert!(runtime.shutdown().await.is_clean());
    let _ = broker
        .channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    broker.remove().await;
}

/// The broker refuses one envelope of a batch (nack: its queue is full and rejects
/// publications): it waits in the outbox, and the envelope the broker confirmed is marked,
/// not sent again with it round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envelope_the_broker_refuses_waits_in_the_outbox_and_holds_back_nothing_else() {
    let broker = Broker::new().await;
    let store = TestStore::sqlite().await;
    let full = unique("full-");
    let mut limits = FieldTable::default();
    limits.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    limits.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    let (runtime, seen) = listening_node(&store, broker.transport(&url()).route::<Orphan>()).await;
    orphans_queue(&broker, &full, limits).await;
    let orphan = orphan_held_and_ping_sent(&store, &runtime, &seen).await;

    // A queue with room takes it on a later round.
    broker
        .channel
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let roomy = unique("orphans-");
    orphans_queue(&broker, &roomy, FieldTable::default()).await;
    went_out_once(broker, runtime, &seen, &roomy, orphan).await;
}

/// Another service's exchange the broker refuses to this node (declared there as `direct`,
/// where this transport declares topic exchanges): the envelope routed to it waits in the
/// outbox, and the rest of its batch goes out; once the exchange is one this node can use, it
/// goes out too, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_the_broker_refuses_holds_back_its_envelopes_only() {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    let broker = Broker::new().await;
    let store = TestStore::sqlite().await;
    let billing = unique("billing-");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    broker
        .channel
        .exchange_declare(
            billing.as_str().into(),
            lapin::ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (runtime, seen) = listening_node(
        &store,
        broker.transport(&url()).route_to::<Orphan>(&billing),
    )
    .await;
    let orphan = orphan_held_and_ping_sent(&store, &runtime, &seen).await;

    // Billing's exchange made again as one this node can publish to, with a queue bound.
    broker
        .channel
        .exchange_delete(billing.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    broker
        .channel
        .exchange_declare(
            billing.as_str().into(),
            lapin::ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let invoices = unique("invoices-");
    broker
        .channel
        .queue_declare(
            invoices.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    broker
        .channel
        .queue_bind(
            invoices.as_str().into(),
            billing.as_str().into(),
            <Orphan as dacapo::Message>::TYPE.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    went_out_once(broker, runtime, &seen, &invoices, orphan).await;
    let cleanup = Broker::new().await;
    let _ = cleanup
        .channel
        .exchange_delete(billing.as_str().into(), ExchangeDeleteOptions::default())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_type_or_deduplication_id_is_dead_lettered_in_postgresql_not_lost() {
    let store = TestStore::postgres().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    let id = Uuid::new_v4().to_string();
    broker
        .publish_raw(
            "tests.ping",
            &[("message-id", &id), ("message-type", "tests.\0ping")],
            br#"{"n":1}"#,
        )
        .await;
    let other = Uuid::new_v4().to_string();
    broker
        .publish_raw(
            "tests.ping",
            &[
                ("message-id", &other),
                ("message-type", "tests.ping"),
                ("deduplication-id", "order\0-7"),
            ],
            br#"{"n":2}"#,
        )
        .await;
    let letters = dead_letters(&runtime, 2).await;
    for letter in &letters {
        assert!(
            matches!(&letter.reason, dacapo::DeadLetterReason::Unreadable(why) if why.contains("NUL")),
            "{:?}",
            letter.reason
        );
    }
    let typed = letters
        .iter()
        .find(|letter| {
            letter
                .envelope
                .headers
                .get("message-type")
                .map(String::as_str)
                == Some("tests.\0ping")
        })
        .expect("the headers kept as they arrived");
    assert_eq!(typed.envelope.message_type.as_ref(), "unknown");
    none_handled_then_removed(runtime, &seen, broker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_messages_told_apart_only_by_their_amqp_properties_or_headers_keep_a_dead_letter_each()
 {
    let store = TestStore::sqlite().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    // The same headers and body, no type anywhere: unreadable, and different messages, told
    // apart by their message id, another property, or a header no text reads.
    let plain = || BasicProperties::default();
    let with_header = |value: AMQPValue| {
        let mut headers = FieldTable::default();
        headers.insert("amount".into(), value);
        BasicProperties::default().with_headers(headers)
    };
    let messages = [
        plain().with_message_id("order-1".into()),
        plain().with_message_id("order-2".into()),
        plain().with_app_id("billing".into()),
        plain().with_app_id("orders".into()),
        with_header(AMQPValue::Double(1.5)),
        with_header(AMQPValue::Double(2.5)),
    ];
    for properties in messages {
        let mut headers = properties.headers().clone().unwrap_or_default();
        headers.insert("x".into(), AMQPValue::LongString("1".into()));
        broker
            .channel
            .basic_publish(
                broker.exchange.as_str().into(),
                "tests.ping".into(),
                BasicPublishOptions::default(),
                b"same body",
                properties.with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let letters = dead_letters(&runtime, 6).await;
    let kept = |name: &str| {
        let mut kept: Vec<&str> = letters
            .iter()
            .filter_map(|letter| letter.envelope.headers.get(name))
            .map(String::as_str)
            .collect();
        kept.sort_unstable();
        kept
    };
    assert_eq!(
        kept("property-message-id"),
        ["order-1", "order-2"],
        "each keeps the id it arrived with"
    );
    assert_eq!(kept("property-app-id"), ["billing", "orders"]);
    assert_eq!(kept("amount").len(), 2, "{:?}", kept("amount"));
    let ids: std::collections::HashSet<_> =
        letters.iter().map(|letter| letter.envelope.id).collect();
    assert_eq!(ids.len(), 6, "a dead letter each");
    none_handled_then_removed(runtime, &seen, broker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_removed_under_the_service_is_made_again_and_its_message_goes_out() {
    let store = TestStore::sqlite().await;
    let (broker, runtime, seen) = broker_and_node(&store).await;
    // The first publication connects the publisher, which binds the service's queue.
    runtime.publish(&Ping { n: 1 }).await.unwrap();
    seen.wait_for(1, WAIT).await;
    broker
        .channel
        .queue_unbind(
            broker.queue.as_str().into(),
            broker.exchange.as_str().into(),
            <Ping as dacapo::Message>::TYPE.into(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let second = runtime.publish(&Ping { n: 2 }).await.unwrap();
    let calls = seen.wait_for(2, WAIT).await;
    assert!(calls.iter().any(|call| call.id == second), "{calls:?}");
    assert!(runtime.shutdown().await.is_clean());
    broker.remove().await;
}

/// Publishes through `exchange` under `routing_key` a message whose headers table holds the
/// entries `headers` as they are, names that lapin cannot read among them, over a connection
/// of the test's own that speaks AMQP 0-9-1 frames by hand; returns once it was sent and the
/// connection closed.
async fn publish_raw_frames(
    exchange: &str,
    routing_key: &str,
    headers: &[(&[u8], &str)],
    body: &[u8],
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    fn short(into: &mut Vec<u8>, bytes: &[u8]) {
        into.push(u8::try_from(bytes.len()).unwrap());
        into.extend_from_slice(bytes);
    }
    fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(0xCE);
        frame
    }
    fn method(channel: u16, class: u16, id: u16, arguments: &[u8]) -> Vec<u8> {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(arguments);
        frame(1, channel, &payload)
    }
    /// Reads frames until a method of `class` and `id`; its payload.
    async fn until(socket: &mut tokio::net::TcpStream, class: u16, id: u16) -> Vec<u8> {
        loop {
            let mut head = [0u8; 7];
            socket.read_exact(&mut head).await.unwrap();
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0; size + 1];
            socket.read_exact(&mut payload).await.unwrap();
            payload.pop();
            if head[0] == 1 && payload[..4] == [class.to_be_bytes(), id.to_be_bytes()].concat()[..]
            {
                return payload;
            }
            assert!(
                !(head[0] == 1 && payload[..4] == [0, 60, 0, 120]),
                "RabbitMQ refused the publication"
            );
            assert!(
                !(head[0] == 1
                    && payload[..2] == 10u16.to_be_bytes()
                    && payload[2..4] == 50u16.to_be_bytes()),
                "RabbitMQ closed the connection: {}",
                String::from_utf8_lossy(&payload)
            );
        }
    }
    let uri: lapin::uri::AMQPUri = url().parse().unwrap();
    let mut socket =
        tokio::net::TcpStream::connect((uri.authority.host.as_str(), uri.authority.port))
            .await
            .unwrap();
    socket.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
    until(&mut socket, 10, 10).await;
    let user = &uri.authority.userinfo;
    let credentials = format!("\0{}\0{}", user.username, user.password);
    let mut start_ok = 0u32.to_be_bytes().to_vec();
    short(&mut start_ok, b"PLAIN");
    start_ok.extend_from_slice(&u32::try_from(credentials.len()).unwrap().to_be_bytes());
    start_ok.extend_from_slice(credentials.as_bytes());
    short(&mut start_ok, b"en_US");
    socket
        .write_all(&method(0, 10, 11, &start_ok))
        .await
        .unwrap();
    let tune = until(&mut socket, 10, 30).await;
    let mut tune_ok = tune[4..10].to_vec();
    tune_ok.extend_from_slice(&[0, 0]);
    socket
        .write_all(&method(0, 10, 31, &tune_ok))
        .await
        .unwrap();
    let mut open = Vec::new();
    short(&mut open, uri.vhost.as_bytes());
    open.extend_from_slice(&[0, 0]);
    socket.write_all(&method(0, 10, 40, &open)).await.unwrap();
    until(&mut socket, 10, 41).await;
    socket.write_all(&method(1, 20, 10, &[0])).await.unwrap();
    until(&mut socket, 20, 11).await;
    // Publisher confirms, so that the message is in the queue when this returns.
    socket.write_all(&method(1, 85, 10, &[0])).await.unwrap();
    until(&mut socket, 85, 11).await;
    let mut publish = vec![0, 0];
    short(&mut publish, exchange.as_bytes());
    short(&mut publish, routing_key.as_bytes());
    publish.push(0);
    let mut table = Vec::new();
    for (name, value) in headers {
        short(&mut table, name);
        table.push(b'S');
        table.extend_from_slice(&u32::try_from(value.len()).unwrap().to_be_bytes());
        table.extend_from_slice(value.as_bytes());
    }
    let mut header = 60u16.to_be_bytes().to_vec();
    header.extend_from_slice(&[0, 0]);
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    header.extend_from_slice(&(1u16 << 13).to_be_bytes());
    header.extend_from_slice(&u32::try_from(table.len()).unwrap().to_be_bytes());
    header.extend_from_slice(&table);
    let mut message = method(1, 60, 40, &publish);
    message.extend(frame(2, 1, &header));
    message.extend(frame(3, 1, body));
    socket.write_all(&message).await.unwrap();
    until(&mut socket, 60, 80).await;
    let _ = socket.shutdown().await;
}

/// A message whose headers lapin cannot read (a name that is not UTF-8) ends lapin's
/// connection as it is delivered, before the transport sees it, and RabbitMQ puts it back at
/// the head of the queue: found there as the next subscription begins, it is dead-lettered,
/// kept exactly, and acknowledged, and the message behind it is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_headers_lapin_cannot_read_is_dead_lettered_and_blocks_nothing() {
    let broker = Broker::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), broker.transport(&url()));
    listening(&runtime).await;
    let id = Uuid::new_v4().to_string();
    publish_raw_frames(
        &broker.exchange,
        "tests.ping",
        &[
            (b"message-id", &id),
            (b"message-type", "tests.ping"),
            (b"bad\xffname", "x"),
        ],
        br#"{"n":1}"#,
    )
    .await;
    let good = Uuid::new_v4().to_string();
    broker
        .publish_raw(
            "tests.ping",
            &[("message-id", &good), ("message-type", "tests.ping")],
            br#"{"n":2}"#,
        )
        .await;

    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].n, 2);
    let letters = dead_letters(&runtime, 1).await;
    let dacapo::DeadLetterReason::Unreadable(why) = &letters[0].reason else {
        panic!("{:?}", letters[0].reason);
    };
    assert!(why.contains("lapin cannot read"), "{why}");
    assert_eq!(
        letters[0].envelope.payload, br#"{"n":1}"#,
        "kept as it arrived"
    );
    assert_eq!(
        letters[0]
            .envelope
            .headers
            .get("bad\u{fffd}name")
            .map(String::as_str),
        Some("x")
    );
    assert!(letters[0].envelope.headers["amqp-properties-hex"].contains("ff"));
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(broker.ready().await, 0, "acknowledged, not put back");
    broker.remove().await;
}
