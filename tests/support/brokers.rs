//! What the transport tests share: a handler that records the ids it saw, runtimes on real
//! stores with a transport, and the scenarios every transport must pass.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dacapo::DeadLetterReason;
use dacapo::prelude::*;
use dacapo::store::{PostgresStore, SqliteStore};
use dacapo::testing::ScratchDatabase;
use dacapo::transport::{Transport, TransportState};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use uuid::Uuid;

/// Sent across the broker in the tests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ping {
    pub n: u32,
}

impl Message for Ping {
    const TYPE: &'static str = "tests.ping";
}

/// Never routed: stays on the node that publishes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Local {
    pub n: u32,
}

impl Message for Local {
    const TYPE: &'static str = "tests.local";
}

/// What a handler saw: each envelope id with its context, in the order handled.
#[derive(Clone, Debug)]
pub struct Sighting {
    pub id: Uuid,
    pub node: &'static str,
    pub correlation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub deduplication_id: Option<String>,
    pub header: Option<String>,
    pub n: u32,
}

/// Records every call of its handler, shared by the runtimes of a test.
#[derive(Clone, Default)]
pub struct Seen {
    calls: Arc<Mutex<Vec<Sighting>>>,
    changed: Arc<Notify>,
}

impl Seen {
    pub fn calls(&self) -> Vec<Sighting> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits until `count` calls were recorded, at most `within`; the calls then.
    pub async fn wait_for(&self, count: usize, within: Duration) -> Vec<Sighting> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let changed = self.changed.notified();
            let calls = self.calls();
            if calls.len() >= count {
                return calls;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                panic!(
                    "{} calls seen within {within:?}, {count} expected",
                    self.calls().len()
                );
            }
        }
    }

    /// A handler for `Ping` that records its calls as `node`'s.
    pub fn handler(&self, node: &'static str) -> PingHandler {
        PingHandler {
            seen: self.clone(),
            node,
        }
    }

    /// Each envelope id seen, with how many times.
    pub fn counts(&self) -> HashMap<Uuid, usize> {
        let mut counts = HashMap::new();
        for call in self.calls() {
            *counts.entry(call.id).or_insert(0) += 1;
        }
        counts
    }
}

#[derive(Clone)]
pub struct PingHandler {
    seen: Seen,
    node: &'static str,
}

impl Handler<Ping> for PingHandler {
    async fn handle(&self, ping: &Ping, ctx: &MessageContext) -> Result<(), HandlerError> {
        let sighting = Sighting {
            id: ctx.message_id().expect("inside a delivery"),
            node: self.node,
            correlation_id: ctx.correlation_id(),
            causation_id: ctx.causation_id(),
            deduplication_id: ctx.deduplication_id().map(str::to_owned),
            header: ctx.headers().get("tenant").cloned(),
            n: ping.n,
        };
        self.seen.calls.lock().unwrap().push(sighting);
        self.seen.changed.notify_waiters();
        Ok(())
    }
}

impl Handler<Local> for PingHandler {
    async fn handle(&self, local: &Local, ctx: &MessageContext) -> Result<(), HandlerError> {
        self.handle(&Ping { n: local.n }, ctx).await
    }
}

/// A unique name for this test's broker objects (queues, streams, consumers).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}{}", &Uuid::new_v4().simple().to_string()[..12])
}

/// How long a test waits for deliveries across a broker before it fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// A store of one of the backends, on a scratch database that lives as long as it.
pub enum TestStore {
    Sqlite(SqliteStore, ScratchDatabase),
    Postgres(PostgresStore, Arc<ScratchDatabase>),
}

pub fn admin_url() -> String {
    std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

impl TestStore {
    pub async fn sqlite() -> Self {
        let scratch = ScratchDatabase::sqlite();
        let store = scratch.sqlite_store().await.unwrap();
        Self::Sqlite(store, scratch)
    }

    pub async fn postgres() -> Self {
        let scratch = ScratchDatabase::postgres(&admin_url())
            .await
            .expect("PostgreSQL must be running for the tests (.ci/run starts it)");
        let store = scratch.postgres_store().await.unwrap();
        Self::Postgres(store, Arc::new(scratch))
    }

    /// Another node's store on the same PostgreSQL database.
    pub async fn another_node(&self, node: &str) -> Self {
        match self {
            Self::Postgres(_, scratch) => {
                let store = PostgresStore::connect(scratch.url())
                    .await
                    .unwrap()
                    .node_id(node);
                Self::Postgres(store, Arc::clone(scratch))
            }
            Self::Sqlite(..) => panic!("nodes share a store on PostgreSQL"),
        }
    }

    pub fn url(&self) -> &str {
        match self {
            Self::Sqlite(_, scratch) => scratch.url(),
            Self::Postgres(_, scratch) => scratch.url(),
        }
    }

    /// A runtime on this store with `module` and `transport`.
    pub fn runtime(&self, module: Module, transport: impl Into<Transport>) -> Runtime {
        self.builder(module, transport).build().unwrap()
    }

    /// The builder of [`runtime`](Self::runtime), for a test to add its own settings.
    pub fn builder(
        &self,
        module: Module,
        transport: impl Into<Transport>,
    ) -> dacapo::RuntimeBuilder {
        let builder = Runtime::builder()
            .module(module)
            .transport(transport)
            .relay_interval(Duration::from_millis(50));
        match self {
            Self::Sqlite(store, _) => builder.store(store.clone()),
            Self::Postgres(store, _) => builder.store(store.clone()),
        }
    }
}

/// Waits until `condition` holds, at most `within`.
pub async fn wait_until(within: Duration, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `runtime` listens on its broker, at most `WAIT`.
pub async fn listening(runtime: &Runtime) {
    tokio::time::timeout(WAIT, runtime.listening())
        .await
        .expect("the transport listens within the wait")
        .expect("the transport listens");
}

/// Waits, at most `WAIT`, until `runtime` stops listening for good with an error that says
/// `why` (no retry would change it), then shuts it down.
pub async fn stops_listening(runtime: Runtime, why: &str) {
    let error = tokio::time::timeout(WAIT, runtime.listening())
        .await
        .expect("answers within the wait")
        .unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    assert!(error.to_string().contains(why), "{error}");
    runtime.shutdown().await;
}

/// Waits until `runtime` kept `count` dead letters, at most `WAIT`.
pub async fn dead_letters(runtime: &Runtime, count: usize) -> Vec<dacapo::DeadLetter> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let letters = runtime.dead_letters().list().await.unwrap();
        if letters.len() >= count {
            return letters;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} dead letters within {WAIT:?}, {count} expected",
            letters.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The module every transport test registers: `Ping` and `Local` recorded by `seen`.
pub fn module(seen: &Seen, node: &'static str) -> Module {
    Module::new("pings")
        .handle::<Ping, _>(seen.handler(node))
        .handle::<Local, _>(seen.handler(node))
}

/// Publishes `count` pings through `runtime`, with a header and a deduplication id each.
pub async fn publish_pings(runtime: &Runtime, from: u32, count: u32) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for n in from..from + count {
        let options = SendOptions::new()
            .header("tenant", "acme")
            .deduplication_id(format!("ping-{n}"));
        ids.push(runtime.publish_with(&Ping { n }, options).await.unwrap());
    }
    ids
}

/// Routed pings cross the broker and each is handled once, with its ids and headers: they are
/// published by another service, on a store of its own, that has no handler for them (if they
/// did not cross, it would dead-letter them); a type not routed stays on the consumer's node;
/// both outboxes are empty afterwards.
pub async fn routed_messages_cross_the_broker_once(
    store: TestStore,
    make: impl Fn() -> Transport,
) -> TestStore {
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), make());
    listening(&runtime).await;
    let elsewhere = TestStore::sqlite().await;
    let publisher = elsewhere.runtime(Module::new("elsewhere"), make());
    listening(&publisher).await;
    let ids = publish_pings(&publisher, 0, 20).await;
    let local = runtime.publish(&Local { n: 99 }).await.unwrap();
    let calls = seen.wait_for(21, WAIT).await;
    let counts = seen.counts();
    for id in ids.iter().chain([&local]) {
        assert_eq!(counts.get(id), Some(&1), "envelope {id} handled once");
    }
    let ping = calls.iter().find(|call| call.id == ids[3]).unwrap();
    assert_eq!(ping.n, 3);
    assert_eq!(ping.header.as_deref(), Some("acme"));
    assert_eq!(ping.deduplication_id.as_deref(), Some("ping-3"));
    assert_eq!(ping.correlation_id, Some(ids[3]));
    runtime.idle().await;
    publisher.idle().await;
    for node in [&runtime, &publisher] {
        assert_eq!(
            node.outbox_backlog().await.unwrap().map(|b| b.depth),
            Some(0),
            "every routed envelope was confirmed by the broker and marked"
        );
    }
    assert!(publisher.dead_letters().list().await.unwrap().is_empty());
    assert!(publisher.shutdown().await.is_clean());
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(
        seen.calls().len(),
        21,
        "nothing handled twice after the fact"
    );
    store
}

/// An envelope the broker can never take (`options` break it) is dead-lettered by the relay
/// as undeliverable, and the rest of its batch, and of the outbox, goes on.
pub async fn what_the_broker_can_never_take_is_dead_lettered(
    transport: Transport,
    breaking: SendOptions,
) {
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    let broken = runtime
        .publish_with(&Ping { n: 1 }, breaking)
        .await
        .unwrap();
    let fine = runtime.publish(&Ping { n: 2 }).await.unwrap();
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id, fine);
    let letters = dead_letters(&runtime, 1).await;
    assert_eq!(letters[0].envelope.id, broken);
    assert!(
        matches!(
            letters[0].reason,
            dacapo::DeadLetterReason::Undeliverable(_)
        ),
        "{}",
        letters[0].reason
    );
    runtime.idle().await;
    assert_eq!(runtime.outbox_backlog().await.unwrap().unwrap().depth, 0);
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(seen.calls().len(), 1);
}

/// Two runtimes of one service, on one PostgreSQL store, consuming one queue: every envelope
/// handled once between them.
pub async fn two_nodes_share_the_queue(make: impl Fn() -> Transport, both_take_a_share: bool) {
    // Its warnings (a store write retried, a batch refused) are shown if it fails: it once
    // saw no call in 30 s on NATS, in a full run, and never again.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::WARN)
        .try_init();
    let seen = Seen::default();
    let first = TestStore::postgres().await;
    let second = first.another_node("node-b").await;
    let a = first.runtime(module(&seen, "a"), make());
    let b = second.runtime(module(&seen, "b"), make());
    listening(&a).await;
    listening(&b).await;
    let mut ids = publish_pings(&a, 0, 100).await;
    ids.extend(publish_pings(&b, 100, 100).await);
    if tokio::time::timeout(WAIT, seen.wait_for(200, WAIT * 2))
        .await
        .is_err()
    {
        panic!(
            "{} calls seen within {WAIT:?}, 200 expected; node a: {:?}, {} pauses; node b: \
             {:?}, {} pauses",
            seen.calls().len(),
            a.transports(),
            a.listener().pauses(),
            b.transports(),
            b.listener().pauses(),
        );
    }
    a.idle().await;
    b.idle().await;
    let counts = seen.counts();
    assert_eq!(counts.len(), 200);
    assert!(ids.iter().all(|id| counts.get(id) == Some(&1)), "each once");
    if both_take_a_share {
        let calls = seen.calls();
        for node in ["a", "b"] {
            assert!(
                calls.iter().any(|call| call.node == node),
                "node {node} handled a share"
            );
        }
    }
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
    assert_eq!(seen.calls().len(), 200);
}

/// The broker connection cut while messages flow, then restored: everything published
/// meanwhile (kept in the outbox) arrives, each once.
pub async fn a_cut_connection_resumes_by_itself(
    store: TestStore,
    transport: Transport,
    cut: impl Fn(),
    restore: impl Fn(),
    consumer_sees_the_cut: bool,
) {
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    let mut ids = publish_pings(&runtime, 0, 10).await;
    seen.wait_for(10, WAIT).await;
    cut();
    if consumer_sees_the_cut {
        wait_until(WAIT, || {
            runtime
                .transports()
                .iter()
                .any(|(_, state)| matches!(state, TransportState::Connecting { .. }))
        })
        .await;
    }
    // Publishing needs only the store: the publications wait in the outbox meanwhile.
    ids.extend(publish_pings(&runtime, 10, 10).await);
    restore();
    seen.wait_for(20, WAIT).await;
    runtime.idle().await;
    let counts = seen.counts();
    assert!(ids.iter().all(|id| counts.get(id) == Some(&1)), "each once");
    assert_eq!(runtime.outbox_backlog().await.unwrap().unwrap().depth, 0);
    assert!(runtime.shutdown().await.is_clean());
}

/// Publishes as a service without dacapo would: raw headers and body, with the broker's own
/// client.
#[allow(async_fn_in_trait)]
pub trait RawPublisher {
    /// The prefix of CloudEvents attribute headers in this broker's binding.
    const CLOUD_EVENTS: &'static str;

    /// Publishes `body` with `headers` where messages of `message_type` are routed.
    async fn publish_raw(&self, message_type: &str, headers: &[(&str, &str)], body: &[u8]);
}

/// A foreign service's messages, in dacapo's headers and as a CloudEvent whose id is not a
/// UUID, reach the handler with their ids.
pub async fn a_foreign_service_reaches_the_handler<P: RawPublisher>(raw: &P, transport: Transport) {
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    let (id, correlation, causation) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let (id_text, correlation_text, causation_text) = (
        id.to_string(),
        correlation.to_string(),
        causation.to_string(),
    );
    let plain = [
        ("message-id", id_text.as_str()),
        ("message-type", "tests.ping"),
        ("correlation-id", correlation_text.as_str()),
        ("causation-id", causation_text.as_str()),
        ("deduplication-id", "intent-1"),
        ("tenant", "acme"),
    ];
    raw.publish_raw("tests.ping", &plain, br#"{"n":41}"#).await;
    let attribute = |name: &str| format!("{}{name}", P::CLOUD_EVENTS);
    let names = ["specversion", "id", "source", "type", "deduplicationid"].map(attribute);
    let values = ["1.0", "evt-42", "/billing", "tests.ping", "intent-2"];
    let event: Vec<(&str, &str)> = names.iter().map(String::as_str).zip(values).collect();
    raw.publish_raw("tests.ping", &event, br#"{"n":42}"#).await;
    let calls = seen.wait_for(2, WAIT).await;
    let plain = calls.iter().find(|call| call.n == 41).unwrap();
    assert_eq!(plain.id, id);
    assert_eq!(plain.correlation_id, Some(correlation));
    assert_eq!(plain.causation_id, Some(causation));
    assert_eq!(plain.deduplication_id.as_deref(), Some("intent-1"));
    assert_eq!(plain.header.as_deref(), Some("acme"));
    let event = calls.iter().find(|call| call.n == 42).unwrap();
    assert_eq!(event.deduplication_id.as_deref(), Some("intent-2"));
    assert_ne!(event.id, Uuid::nil());
    assert!(runtime.shutdown().await.is_clean());
}

/// No id, a type header naming another handled type than the message's address, a body that is not
/// JSON and an oversized one: four dead letters, the unreadable ones kept as they arrived,
/// nothing handled. The caller checks they were
/// acknowledged.
pub async fn bad_input_from_the_wire_is_dead_lettered<P: RawPublisher>(
    raw: &P,
    transport: Transport,
) {
    let scratch = ScratchDatabase::sqlite();
    let store = scratch.sqlite_store().await.unwrap();
    let seen = Seen::default();
    let runtime = Runtime::builder()
        .module(module(&seen, "a"))
        .transport(transport)
        .max_envelope_size(1024)
        .store(store)
        .build()
        .unwrap();
    listening(&runtime).await;
    let ids = [Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4()].map(|id| id.to_string());
    raw.publish_raw("tests.ping", &[("x", "1")], b"no id").await;
    let headers = |id: &str, message_type: &'static str| {
        [
            ("message-id", id.to_owned()),
            ("message-type", message_type.to_owned()),
        ]
    };
    for (id, message_type, body) in [
        // A node-local type's handler, reached through a type's address it may publish to.
        (&ids[0], "tests.local", br#"{"n":1}"#.to_vec()),
        (&ids[1], "tests.ping", b"not json".to_vec()),
        (&ids[2], "tests.ping", vec![b' '; 4096]),
    ] {
        let headers = headers(id, message_type);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        raw.publish_raw("tests.ping", &headers, &body).await;
    }
    let letters = dead_letters(&runtime, 4).await;
    let reasons: Vec<String> = letters.iter().map(|l| l.reason.to_string()).collect();
    let has = |found: &dyn Fn(&DeadLetterReason) -> bool| letters.iter().any(|l| found(&l.reason));
    assert!(
        has(&|r| matches!(r, DeadLetterReason::Unreadable(why) if why.contains("message-id"))),
        "{reasons:?}"
    );
    // Addressed as tests.ping, which the broker's permissions judge: its type header may not
    // name another type.
    assert!(
        has(&|r| matches!(
            r,
            DeadLetterReason::Unreadable(why)
                if why.contains("\"tests.local\"") && why.contains("addressed to \"tests.ping\"")
        )),
        "{reasons:?}"
    );
    assert!(
        has(&|r| matches!(r, DeadLetterReason::MalformedPayload(_))),
        "{reasons:?}"
    );
    assert!(
        has(&|r| matches!(r, DeadLetterReason::TooLarge { .. })),
        "{reasons:?}"
    );
    let unreadable = letters
        .iter()
        .find(|l| matches!(&l.reason, DeadLetterReason::Unreadable(why) if why.contains("message-id")))
        .unwrap();
    assert_eq!(unreadable.envelope.payload, b"no id", "kept as it arrived");
    assert!(seen.calls().is_empty());
    assert!(runtime.shutdown().await.is_clean());
}
