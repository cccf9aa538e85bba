//! The NATS JetStream transport against the real server (127.0.0.1:4222 with JetStream,
//! started by `.ci/run`): these tests fail, never skip, when it is down.

#[path = "support/brokers.rs"]
mod brokers;
#[path = "support/proxy.rs"]
mod proxy;

use async_nats::HeaderMap;
use async_nats::jetstream;
use brokers::*;
use dacapo::Runtime;
use dacapo::transport::{Nats, Transport, WireFormat};
use proxy::Proxy;
use uuid::Uuid;

fn url() -> String {
    std::env::var("DACAPO_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// This test's stream (and its subjects), removed at its end.
struct Server {
    stream: String,
    prefix: String,
    consumer: String,
    jetstream: jetstream::Context,
}

impl Server {
    async fn new() -> Self {
        let client = async_nats::connect(url())
            .await
            .expect("NATS must be running for the tests (.ci/run starts it)");
        Self {
            stream: unique("TEST"),
            prefix: unique("t"),
            consumer: unique("pings"),
            jetstream: jetstream::new(client),
        }
    }

    fn transport(&self, url: &str) -> Nats {
        Nats::new(url, &self.consumer)
            .stream(&self.stream)
            .subject_prefix(&self.prefix)
            .route::<Ping>()
            .prefetch(20)
    }

    /// Messages the stream keeps.
    async fn kept(&self) -> u64 {
        let mut stream = self.jetstream.get_stream(&self.stream).await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    /// What JetStream says of each of this test's consumers.
    async fn consumers(&self) -> Vec<jetstream::consumer::Info> {
        use futures::StreamExt;
        let stream = self.jetstream.get_stream(&self.stream).await.unwrap();
        let mut names = Vec::new();
        let mut listed = stream.consumer_names();
        while let Some(Ok(name)) = listed.next().await {
            names.push(name);
        }
        let mut infos = Vec::with_capacity(names.len());
        for name in names {
            infos.push(stream.consumer_info(&name).await.unwrap().clone());
        }
        infos
    }

    /// Messages of this test's consumers still to deliver or to be acknowledged.
    async fn outstanding(&self) -> u64 {
        self.consumers()
            .await
            .iter()
            .map(|info| info.num_pending + info.num_ack_pending as u64)
            .sum()
    }

    /// Messages of this test's consumers delivered and not acknowledged.
    async fn delivered_unacknowledged(&self) -> u64 {
        self.consumers()
            .await
            .iter()
            .map(|info| info.num_ack_pending as u64)
            .sum()
    }

    /// Waits until nothing of this test's consumers is pending or unacknowledged: acks
    /// travel without an answer, so they may land a moment after the runtime stopped.
    async fn all_acknowledged(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let outstanding = self.outstanding().await;
            if outstanding == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{outstanding} messages pending or unacknowledged"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    async fn remove(self) {
        let _ = self.jetstream.delete_stream(&self.stream).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_messages_cross_jetstream_once() {
    let server = Server::new().await;
    routed_messages_cross_the_broker_once(TestStore::sqlite().await, || {
        server.transport(&url()).into()
    })
    .await;
    server.all_acknowledged().await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_longer_than_jetstream_counts_are_its_longest_not_an_overflow() {
    let server = Server::new().await;
    let forever = std::time::Duration::MAX;
    routed_messages_cross_the_broker_once(TestStore::sqlite().await, || {
        server
            .transport(&url())
            .max_age(forever)
            .duplicate_window(forever)
            .ack_wait(forever)
            .into()
    })
    .await;
    let mut stream = server.jetstream.get_stream(&server.stream).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.max_age, std::time::Duration::ZERO, "no age limit");
    let longest = std::time::Duration::from_nanos(i64::MAX.unsigned_abs());
    assert_eq!(config.duplicate_window, longest);
    for consumer in server.consumers().await {
        assert_eq!(consumer.config.ack_wait, longest);
    }
    server.remove().await;
}

/// A stream that keeps messages a minute gets a duplicate window of a minute, not the default
/// two: JetStream refuses a window longer than the age, and the transport then never listened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_window_longer_than_the_streams_age_is_shortened_to_it() {
    let server = Server::new().await;
    let minute = std::time::Duration::from_secs(60);
    routed_messages_cross_the_broker_once(TestStore::sqlite().await, || {
        server.transport(&url()).max_age(minute).into()
    })
    .await;
    let mut stream = server.jetstream.get_stream(&server.stream).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.max_age, minute);
    assert_eq!(config.duplicate_window, minute);
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_messages_cross_jetstream_once_as_cloud_events() {
    let server = Server::new().await;
    routed_messages_cross_the_broker_once(TestStore::postgres().await, || {
        server
            .transport(&url())
            .wire_format(WireFormat::CloudEvents)
            .into()
    })
    .await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_on_one_consumer_handle_every_envelope_once() {
    let server = Server::new().await;
    two_nodes_share_the_queue(|| Transport::from(server.transport(&url())), true).await;
    server.all_acknowledged().await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_server_connection_resumes_and_loses_nothing() {
    let server = Server::new().await;
    let proxy = Proxy::start("127.0.0.1:4222".to_owned()).await;
    let through = format!("nats://127.0.0.1:{}", proxy.port);
    // The client reconnects by itself; the consumer sees the cut by the heartbeats it misses.
    a_cut_connection_resumes_by_itself(
        TestStore::sqlite().await,
        server.transport(&through).into(),
        || proxy.cut(),
        || proxy.restore(),
        true,
    )
    .await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_service_reaches_the_handler_with_its_ids() {
    let server = Server::new().await;
    a_foreign_service_reaches_the_handler(&server, server.transport(&url()).into()).await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstreams_own_message_id_stands_in_for_a_missing_id_header() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), server.transport(&url()));
    listening(&runtime).await;
    let msg_id = Uuid::new_v4().to_string();
    let headers = [
        ("Nats-Msg-Id", msg_id.as_str()),
        ("message-type", "tests.ping"),
    ];
    server
        .publish_raw("tests.ping", &headers, br#"{"n":43}"#)
        .await;
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id.to_string(), msg_id);
    assert!(runtime.shutdown().await.is_clean());
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_drops_a_republication_and_the_inbox_a_redelivery() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), server.transport(&url()));
    listening(&runtime).await;
    let id = Uuid::new_v4().to_string();
    // The same envelope published twice, as a relay that crashed before its mark would:
    // its Nats-Msg-Id is the envelope id, within the duplicate window.
    let with_msg_id = [
        ("Nats-Msg-Id", id.as_str()),
        ("message-id", id.as_str()),
        ("message-type", "tests.ping"),
    ];
    server
        .publish_raw("tests.ping", &with_msg_id, br#"{"n":1}"#)
        .await;
    server
        .publish_raw("tests.ping", &with_msg_id, br#"{"n":1}"#)
        .await;
    assert_eq!(server.kept().await, 1, "JetStream kept one copy");
    // Without Nats-Msg-Id the stream keeps both, and the inbox discards the second.
    let headers = [("message-id", id.as_str()), ("message-type", "tests.ping")];
    server
        .publish_raw("tests.ping", &headers, br#"{"n":1}"#)
        .await;
    let after = Uuid::new_v4().to_string();
    let barrier = [
        ("message-id", after.as_str()),
        ("message-type", "tests.ping"),
    ];
    server
        .publish_raw("tests.ping", &barrier, br#"{"n":2}"#)
        .await;
    seen.wait_for(2, WAIT).await;
    wait_until(WAIT, || runtime.stats().deduplicated == 1).await;
    assert_eq!(seen.calls().len(), 2);
    assert!(runtime.shutdown().await.is_clean());
    server.all_acknowledged().await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_from_the_wire_is_dead_lettered_and_acknowledged() {
    let server = Server::new().await;
    bad_input_from_the_wire_is_dead_lettered(&server, server.transport(&url()).into()).await;
    server.all_acknowledged().await;
    server.remove().await;
}

/// Two unreadable messages (no type) whose one header ends on the same value but held another
/// before it: a dead letter each, every value kept beside the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_messages_told_apart_only_by_a_headers_earlier_value_keep_a_dead_letter_each() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), server.transport(&url()));
    listening(&runtime).await;
    for first in ["0", "2"] {
        server
            .publish_raw("tests.ping", &[("x", first), ("x", "1")], b"same body")
            .await;
    }
    let letters = dead_letters(&runtime, 2).await;
    assert_ne!(letters[0].envelope.id, letters[1].envelope.id);
    let mut all_values = Vec::new();
    for letter in &letters {
        assert_eq!(
            letter.envelope.headers.get("x").map(String::as_str),
            Some("1")
        );
        all_values.extend(letter.envelope.headers.get("x-all-values").cloned());
    }
    all_values.sort_unstable();
    assert_eq!(all_values, [r#"["0", "1"]"#, r#"["2", "1"]"#]);
    assert!(seen.calls().is_empty());
    assert!(runtime.shutdown().await.is_clean());
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_only_checked_and_missing_stops_listening_with_a_clear_error() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), server.transport(&url()).declare(false));
    stops_listening(runtime, "only checks").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subjects_another_stream_captures_stop_listening_with_a_clear_error() {
    let server = Server::new().await;
    let other = unique("OTHER");
    server
        .jetstream
        .create_stream(jetstream::stream::Config {
            name: other.clone(),
            subjects: vec![format!("{}.>", server.prefix)],
            ..Default::default()
        })
        .await
        .unwrap();
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), server.transport(&url()));
    stops_listening(runtime, "cannot create stream").await;
    let _ = server.jetstream.delete_stream(&other).await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_nats_cannot_carry_dead_letters_its_envelope_only() {
    let server = Server::new().await;
    what_the_broker_can_never_take_is_dead_lettered(
        server.transport(&url()).into(),
        dacapo::SendOptions::new().header("note", "two\nlines"),
    )
    .await;
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_delivered_and_not_recorded_at_shutdown_is_handled_by_the_next_node() {
    let server = Server::new().await;
    let database = TestStore::postgres().await;
    let (proxy, through) = Proxy::to(database.url()).await;
    let store = dacapo::store::PostgresStore::connect(&through)
        .await
        .unwrap();
    let seen = Seen::default();
    let transport = || {
        server
            .transport(&url())
            .ack_wait(std::time::Duration::from_secs(2))
    };
    let runtime = Runtime::builder()
        .store(store)
        .module(module(&seen, "a"))
        .transport(transport())
        .drain_timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    listening(&runtime).await;
    // The store goes away: the consumer receives the batch and cannot record it.
    proxy.cut();
    let mut ids = Vec::new();
    for n in 0..5u32 {
        let id = Uuid::new_v4();
        ids.push(id);
        let body = format!("{{\"n\":{n}}}");
        let id = id.to_string();
        let headers = [("message-id", id.as_str()), ("message-type", "tests.ping")];
        server
            .publish_raw("tests.ping", &headers, body.as_bytes())
            .await;
    }
    wait_until_async(|| async { server.delivered_unacknowledged().await == 5 }).await;
    runtime.shutdown().await;
    assert!(seen.calls().is_empty(), "none was recorded, none handled");
    // Negatively acknowledged at shutdown, or left to the ack wait: none was acknowledged,
    // so the next node gets them all.
    proxy.restore();
    let next = database.runtime(module(&seen, "b"), transport());
    listening(&next).await;
    seen.wait_for(5, WAIT).await;
    let counts = seen.counts();
    assert!(ids.iter().all(|id| counts.get(id) == Some(&1)));
    assert!(next.shutdown().await.is_clean());
    server.all_acknowledged().await;
    server.remove().await;
}

/// Nodes that start together each find the stream missing and create it: the ones whose
/// create comes second find the stream the first made, and listen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_declaring_one_stream_at_once_all_listen() {
    let server = Server::new().await;
    let mut stores = Vec::new();
    for _ in 0..6 {
        stores.push(TestStore::sqlite().await);
    }
    let seen = Seen::default();
    let runtimes: Vec<_> = stores
        .iter()
        .map(|store| store.runtime(module(&seen, "a"), server.transport(&url())))
        .collect();
    futures::future::join_all(runtimes.iter().map(listening)).await;
    for runtime in runtimes {
        assert!(runtime.shutdown().await.is_clean());
    }
    server.remove().await;
}

/// Routed to a subject that no stream captures.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stray {
    n: u32,
}

impl dacapo::Message for Stray {
    const TYPE: &'static str = "tests.stray";
}

/// The server refuses one envelope of a batch (no stream captures its subject): it stays in
/// the outbox for a later round, and the envelopes the stream acknowledged are marked, not
/// held back behind it nor sent again with it round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envelope_no_stream_captures_waits_in_the_outbox_without_holding_back_the_others() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let transport = stray_routed(&server);
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    runtime.publish(&Stray { n: 1 }).await.unwrap();
    let ping = runtime.publish(&Ping { n: 2 }).await.unwrap();
    only_the_ping_went_and_strays_wait(&runtime, &seen, ping, 1).await;
    runtime.shutdown().await;
    assert_eq!(seen.calls().len(), 1);
    server.remove().await;
}

/// A whole batch the server refuses (no stream captures any of its subjects) is held row by
/// row, as one such envelope is: the envelopes behind it go. It failed as if the server were
/// down before, every round, and nothing behind it was ever published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_no_stream_captures_does_not_hold_back_the_envelopes_behind_it() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let transport = stray_routed(&server);
    let runtime = store
        .builder(module(&seen, "a"), transport)
        .relay_batch(2)
        .build()
        .unwrap();
    listening(&runtime).await;
    // Published together, in one transaction: the relay's first read is the two strays.
    runtime
        .publish_batch(&[Stray { n: 1 }, Stray { n: 2 }])
        .await
        .unwrap();
    let ping = runtime.publish(&Ping { n: 3 }).await.unwrap();
    only_the_ping_went_and_strays_wait(&runtime, &seen, ping, 2).await;
    runtime.shutdown().await;
    server.remove().await;
}

/// The test's transport, with `Stray` routed to a subject no stream captures.
fn stray_routed(server: &Server) -> Nats {
    server
        .transport(&url())
        .route_to::<Stray>(format!("{}.stray", unique("nowhere")))
}

/// Waits until `ping` was handled, first, and `strays` envelopes wait in the outbox, held, not
/// refused (no dead letter).
async fn only_the_ping_went_and_strays_wait(
    runtime: &Runtime,
    seen: &Seen,
    ping: Uuid,
    strays: u64,
) {
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id, ping);
    wait_until_async(|| async { runtime.outbox_backlog().await.unwrap().unwrap().depth == strays })
        .await;
    assert!(
        dead_letters(runtime, 0).await.is_empty(),
        "held, not refused"
    );
}

/// Waits until the async `condition` holds, at most `WAIT`.
async fn wait_until_async<F, Fut>(condition: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {WAIT:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

impl RawPublisher for Server {
    const CLOUD_EVENTS: &'static str = "ce-";

    async fn publish_raw(&self, message_type: &str, headers: &[(&str, &str)], body: &[u8]) {
        // A name given twice is a header sent with two values.
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, *value);
        }
        self.jetstream
            .publish_with_headers(
                format!("{}.{message_type}", self.prefix),
                map,
                body.to_vec().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// A NATS server of this test's own that asks for a user and password, on a free port;
/// stopped when dropped.
struct GuardedServer {
    child: std::process::Child,
    port: u16,
}

impl GuardedServer {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Installed with the NATS service, which `.ci/run` starts.
        let binary = if std::path::Path::new("/usr/sbin/nats-server").exists() {
            "/usr/sbin/nats-server"
        } else {
            "nats-server"
        };
        let child = std::process::Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(["--user", "dacapo", "--pass", "right"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server, installed with the NATS service, starts");
        let server = Self { child, port };
        tokio::time::timeout(WAIT, async {
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the guarded NATS server listens");
        server
    }
}

impl Drop for GuardedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Credentials the server refuses stop listening with the reason, as RabbitMQ's do: no retry
/// changes them. Before, the transport tried again for ever and `listening` never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_listening_with_a_clear_error() {
    let guarded = GuardedServer::start().await;
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let wrong = format!("nats://dacapo:wrong@127.0.0.1:{}", guarded.port);
    let runtime = store.runtime(module(&seen, "a"), server.transport(&wrong));
    stops_listening(runtime, "refused").await;
}

/// `len` bytes of `a`, as a type name.
const fn a_name<const LEN: usize>() -> &'static str {
    match std::str::from_utf8(&[b'a'; LEN]) {
        Ok(name) => name,
        Err(_) => panic!("ASCII"),
    }
}

/// A type whose name, the longest a module registers, is too long for a JetStream consumer's
/// beside the service's (255 bytes for both).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct LongNamed {
    n: u32,
}

impl dacapo::Message for LongNamed {
    const TYPE: &'static str = a_name::<{ dacapo::MAX_MESSAGE_TYPE_LEN }>();
}

/// A type whose subject is longer than a NATS server reads in a line (4 KiB by default): it
/// cannot be registered, but it can be sent.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Oversized {
    n: u32,
}

impl dacapo::Message for Oversized {
    const TYPE: &'static str = a_name::<5000>();
}

/// Tells the test each message it handled.
struct Tells<M>(tokio::sync::mpsc::UnboundedSender<M>);

impl<M: dacapo::Message + Clone> dacapo::Handler<M> for Tells<M> {
    async fn handle(
        &self,
        message: &M,
        _: &dacapo::MessageContext,
    ) -> Result<(), dacapo::HandlerError> {
        let _ = self.0.send(message.clone());
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_too_long_for_a_consumer_name_crosses_jetstream() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let (told, mut handled) = tokio::sync::mpsc::unbounded_channel();
    let runtime = store.runtime(
        dacapo::Module::new("long").handle::<LongNamed, _>(Tells(told)),
        server.transport(&url()).route::<LongNamed>(),
    );
    listening(&runtime).await;
    runtime.publish(&LongNamed { n: 7 }).await.unwrap();
    let message = tokio::time::timeout(WAIT, handled.recv())
        .await
        .expect("handled within the wait")
        .unwrap();
    assert_eq!(message.n, 7);
    let names: Vec<String> = server
        .consumers()
        .await
        .into_iter()
        .map(|info| info.name)
        .collect();
    assert!(
        names.iter().any(|name| name.len() == 255),
        "the consumer's name is cut to JetStream's limit: {names:?}"
    );
    assert!(runtime.shutdown().await.is_clean());
    server.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_prefix_too_long_for_the_servers_line_stops_listening_with_a_clear_error() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(
        module(&seen, "a"),
        server
            .transport(&url())
            .subject_prefix(format!("{}.{}", server.prefix, "p".repeat(3100))),
    );
    stops_listening(runtime, "a NATS subject may have").await;
    server.remove().await;
}

/// Published, it is dead-lettered at once, and the connection stays up for the rest (a server
/// closes the connection on a line that long).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_whose_subject_passes_the_servers_line_is_dead_lettered_where_it_is_sent() {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(
        module(&seen, "a"),
        server.transport(&url()).route::<Oversized>(),
    );
    listening(&runtime).await;
    let oversized = runtime.send(&Oversized { n: 1 }).await.unwrap();
    let fine = runtime.publish(&Ping { n: 2 }).await.unwrap();
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].id, fine);
    let letters = dead_letters(&runtime, 1).await;
    assert_eq!(letters[0].envelope.id, oversized);
    assert!(
        letters[0]
            .reason
            .to_string()
            .contains("a NATS subject may have"),
        "{}",
        letters[0].reason
    );
    runtime.idle().await;
    assert_eq!(runtime.outbox_backlog().await.unwrap().unwrap().depth, 0);
    assert!(runtime.shutdown().await.is_clean());
    server.remove().await;
}

/// Publishes on `subject` a message whose header block is `headers` as they are, bytes the
/// NATS client itself may not read, through a connection of the test's own; returns once the
/// stream acknowledged it.
async fn publish_raw_bytes(subject: &str, headers: &[u8], body: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = url().trim_start_matches("nats://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut block = b"NATS/1.0\r\n".to_vec();
    block.extend_from_slice(headers);
    block.extend_from_slice(b"\r\n");
    let mut frame = format!(
        "CONNECT {{\"verbose\":false,\"pedantic\":false,\"headers\":true}}\r\n\
         SUB _INBOX.raw 1\r\nHPUB {subject} _INBOX.raw {} {}\r\n",
        block.len(),
        block.len() + body.len()
    )
    .into_bytes();
    frame.extend_from_slice(&block);
    frame.extend_from_slice(body);
    frame.extend_from_slice(b"\r\n");
    socket.write_all(&frame).await.unwrap();
    let mut answer = Vec::new();
    while !String::from_utf8_lossy(&answer).contains("\"seq\"") {
        let mut chunk = vec![0; 4096];
        let read = tokio::time::timeout(WAIT, socket.read(&mut chunk))
            .await
            .expect("the stream's acknowledgement")
            .unwrap();
        assert!(read > 0, "closed: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&chunk[..read]);
    }
}

/// A message whose headers the NATS client cannot read ends the client's connection at each
/// delivery, before the transport sees it, with the batch delivered beside it: found through
/// the stream's own API, it is dead-lettered, its header block kept exactly, and deleted from
/// the stream, and the message delivered with it is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_headers_the_client_cannot_read_is_dead_lettered_and_blocks_nothing() {
    unreadable_headers_are_dead_lettered(&["no colon here"]).await;
}

/// A value with a carriage return in it makes the client panic, not end its connection: the
/// consumer subscribes again, and looks there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_value_on_which_the_client_panics_is_dead_lettered_and_blocks_nothing() {
    unreadable_headers_are_dead_lettered(&["carriage: a\rb"]).await;
}

/// Both in one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_kinds_of_unreadable_headers_in_one_batch_are_both_dead_lettered() {
    unreadable_headers_are_dead_lettered(&["no colon here", "carriage: a\rb"]).await;
}

/// Publishes a message with each header `line` the client cannot read, then a readable one;
/// checks the readable one is handled and the others dead-lettered, kept exactly, and deleted.
async fn unreadable_headers_are_dead_lettered(lines: &[&str]) {
    let server = Server::new().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let transport = server
        .transport(&url())
        .ack_wait(std::time::Duration::from_secs(2));
    let runtime = store.runtime(module(&seen, "a"), transport);
    listening(&runtime).await;
    for (n, line) in (10..).zip(lines) {
        let headers = format!(
            "message-id: {}\r\nmessage-type: tests.ping\r\n{line}\r\n",
            Uuid::new_v4()
        );
        publish_raw_bytes(
            &format!("{}.tests.ping", server.prefix),
            headers.as_bytes(),
            format!(r#"{{"n":{n}}}"#).as_bytes(),
        )
        .await;
    }
    let good = Uuid::new_v4().to_string();
    let good = [
        ("message-id", good.as_str()),
        ("message-type", "tests.ping"),
    ];
    server.publish_raw("tests.ping", &good, br#"{"n":2}"#).await;

    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].n, 2);
    let letters = dead_letters(&runtime, lines.len()).await;
    let mut kept = Vec::new();
    for letter in &letters {
        let dacapo::DeadLetterReason::Unreadable(why) = &letter.reason else {
            panic!("{:?}", letter.reason);
        };
        assert!(why.contains("cannot read its headers"), "{why}");
        let block = base64_decoded(&letter.envelope.headers["nats-header-block-base64"]);
        let (n, line) = (10..)
            .zip(lines)
            .find(|(_, line)| block.windows(line.len()).any(|w| w == line.as_bytes()))
            .unwrap_or_else(|| panic!("{:?}", String::from_utf8_lossy(&block)));
        assert_eq!(
            letter.envelope.payload,
            format!(r#"{{"n":{n}}}"#).as_bytes(),
            "{line:?} kept as it arrived"
        );
        kept.push(n);
    }
    kept.sort_unstable();
    assert_eq!(kept, (10..10 + lines.len()).collect::<Vec<_>>());
    wait_until_async(|| async { server.kept().await == 1 }).await;
    assert!(runtime.shutdown().await.is_clean());
    server.remove().await;
}

/// Standard base64, decoded (the test's own reader, to check what a dead letter kept).
fn base64_decoded(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut count = 0;
    let mut out = Vec::new();
    for byte in text.bytes().filter(|b| *b != b'=') {
        let value = ALPHABET.iter().position(|a| *a == byte).expect("base64") as u32;
        bits = (bits << 6) | value;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
            bits &= (1 << count) - 1;
        }
    }
    out
}
