//! The PostgreSQL queue that nodes share, on the real server (`DACAPO_TEST_POSTGRES`).

#[path = "support/brokers.rs"]
mod brokers;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/warnings.rs"]
mod support_warnings;

use brokers::*;
use dacapo::DeadLetterReason;
use dacapo::prelude::{HandlerError, MessageContext, Module};
use dacapo::transport::{PostgresQueue, Transport};
use proxy::Proxy;

fn queue_on(store: &TestStore, queue: &str) -> PostgresQueue {
    PostgresQueue::connect(store.url(), queue)
        .unwrap()
        .route::<Ping>()
        .prefetch(20)
}

/// Rows of the queue table of the database at `url` that a transaction holds locked (a
/// consumer's batch, taken and not yet acknowledged).
async fn locked_rows(url: &str) -> i64 {
    let pool = dacapo::sqlx::PgPool::connect(url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let (all,): (i64,) = dacapo::sqlx::query_as("SELECT count(*) FROM dacapo_queue")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let (free,): (i64,) = dacapo::sqlx::query_as(
        "SELECT count(*) FROM (SELECT seq FROM dacapo_queue FOR UPDATE SKIP LOCKED) AS free",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    pool.close().await;
    all - free
}

/// Rows left in the queue table of the database at `url`.
async fn rows_left(url: &str) -> i64 {
    let pool = dacapo::sqlx::PgPool::connect(url).await.unwrap();
    let (count,): (i64,) = dacapo::sqlx::query_as("SELECT count(*) FROM dacapo_queue")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_messages_cross_the_queue_once() {
    let store = TestStore::postgres().await;
    let url = store.url().to_owned();
    let store = routed_messages_cross_the_broker_once(store, || {
        PostgresQueue::connect(&url, "pings")
            .unwrap()
            .route::<Ping>()
            .prefetch(20)
            .into()
    })
    .await;
    assert_eq!(
        rows_left(store.url()).await,
        0,
        "every taken row was deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_node_can_take_from_a_queue_in_postgresql() {
    let queue_database = TestStore::postgres().await;
    routed_messages_cross_the_broker_once(TestStore::sqlite().await, || {
        queue_on(&queue_database, "pings").into()
    })
    .await;
    assert_eq!(rows_left(queue_database.url()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_on_one_queue_handle_every_envelope_once() {
    let database = TestStore::postgres().await;
    let url = database.url().to_owned();
    two_nodes_share_the_queue(
        || {
            Transport::from(
                PostgresQueue::connect(&url, "pings")
                    .unwrap()
                    .route::<Ping>()
                    .prefetch(10),
            )
        },
        false,
    )
    .await;
    assert_eq!(rows_left(&url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_queue_connection_resumes_and_loses_nothing() {
    let queue_database = TestStore::postgres().await;
    let (proxy, through) = Proxy::to(queue_database.url()).await;
    let transport = PostgresQueue::connect(&through, "pings")
        .unwrap()
        .route::<Ping>()
        .poll_interval(std::time::Duration::from_millis(100));
    a_cut_connection_resumes_by_itself(
        TestStore::sqlite().await,
        transport.into(),
        || proxy.cut(),
        || proxy.restore(),
        true,
    )
    .await;
    assert_eq!(rows_left(queue_database.url()).await, 0);
}

/// A server that goes silent without closing the connection (a host down, packets dropped):
/// the node's take or acknowledgement gives up after its reply timeout, the node connects
/// again, and once the server answers again everything published meanwhile arrives, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_gone_silent_is_a_lost_connection_not_a_wait_for_ever() {
    let queue_database = TestStore::postgres().await;
    let (proxy, through) = Proxy::to(queue_database.url()).await;
    let transport = PostgresQueue::connect(&through, "pings")
        .unwrap()
        .route::<Ping>()
        .poll_interval(std::time::Duration::from_millis(100))
        .reply_timeout(std::time::Duration::from_secs(1));
    a_cut_connection_resumes_by_itself(
        TestStore::sqlite().await,
        transport.into(),
        || proxy.stall(),
        || proxy.restore(),
        true,
    )
    .await;
    assert_eq!(rows_left(queue_database.url()).await, 0);
}

/// A take that finds the queue empty ends its transaction with a rollback. A server gone
/// silent right then, on that connection only, holds the consumer no longer than its reply
/// timeout (it waited for as long as TCP took to notice): the node connects again, and what
/// is published after arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_the_server_never_answers_is_given_up_after_the_reply_timeout() {
    let queue_database = TestStore::postgres().await;
    let (proxy, through) = Proxy::to(queue_database.url()).await;
    proxy.stall_the_connection_that_sends(b"ROLLBACK");
    let transport = PostgresQueue::connect(&through, "pings")
        .unwrap()
        .route::<Ping>()
        .poll_interval(std::time::Duration::from_millis(100))
        .reply_timeout(std::time::Duration::from_secs(1));
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), transport);
    wait_until(WAIT, || proxy.stalled_connections() == 1).await;
    let ids = publish_pings(&runtime, 0, 3).await;
    seen.wait_for(3, WAIT).await;
    runtime.idle().await;
    let counts = seen.counts();
    assert!(ids.iter().all(|id| counts.get(id) == Some(&1)), "each once");
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(rows_left(queue_database.url()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_is_no_envelope_is_dead_lettered_and_taken_off_the_queue() {
    let store = TestStore::postgres().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), queue_on(&store, "pings"));
    listening(&runtime).await;
    // Another writer's rows: an id that is no UUID; two with the nil UUID, which a writer
    // that never sets its ids gives every row (all but the first would be discarded as
    // redeliveries); and one without a type.
    let pool = dacapo::sqlx::PgPool::connect(store.url()).await.unwrap();
    dacapo::sqlx::query(
        "INSERT INTO dacapo_queue (queue, id, message_type, payload, headers, sent_at, \
         enqueued_at) VALUES ('pings', 'not-a-uuid', 'tests.ping', '\\x7b7d', '{}', 0, 0), \
         ('pings', '00000000-0000-0000-0000-000000000000', 'tests.ping', '\\x7b7d', '{}', 0, 0), \
         ('pings', '00000000-0000-0000-0000-000000000000', 'tests.ping', '\\x7b7e', '{}', 0, 0), \
         ('pings', '0195e3f4-1c4a-7c3e-8d2b-5a6f7e8d9c0b', '', '\\x7b7d', '{}', 0, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    // And one whose correlation id is no UUID: its dead letter keeps the rest of the row.
    dacapo::sqlx::query(
        "INSERT INTO dacapo_queue (queue, id, message_type, payload, headers, deduplication_id, \
         correlation_id, sent_at, enqueued_at) VALUES ('pings', \
         '0195e3f4-1c4a-7c3e-8d2b-5a6f7e8d9c0c', 'tests.ping', '\\x7b226e223a317d', \
         '{\"tenant\":\"t-1\"}', 'order-7', 'not-a-correlation', 1700000000000, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    dacapo::sqlx::query("SELECT pg_notify('dacapo_queue', 'pings')")
        .execute(&pool)
        .await
        .unwrap();
    let letters = dead_letters(&runtime, 5).await;
    let mut reasons: Vec<String> = letters
        .iter()
        .map(|letter| match &letter.reason {
            DeadLetterReason::Unreadable(why) => why.clone(),
            other => panic!("not unreadable: {other:?}"),
        })
        .collect();
    reasons.sort();
    assert!(reasons[0].contains("not-a-correlation"), "{reasons:?}");
    assert!(reasons[1].contains("not-a-uuid"), "{reasons:?}");
    assert!(reasons[2].contains("nil UUID"), "{reasons:?}");
    assert!(reasons[3].contains("nil UUID"), "{reasons:?}");
    assert!(reasons[4].contains("message type is empty"), "{reasons:?}");
    let kept = letters
        .iter()
        .find(|letter| letter.reason.to_string().contains("not-a-correlation"))
        .unwrap();
    assert_eq!(kept.envelope.payload, br#"{"n":1}"#, "its payload");
    assert_eq!(kept.envelope.message_type, "tests.ping");
    let header = |name: &str| kept.envelope.headers.get(name).map(String::as_str);
    assert_eq!(header("queue-row-headers"), Some(r#"{"tenant":"t-1"}"#));
    assert_eq!(header("queue-row-deduplication-id"), Some("order-7"));
    assert_eq!(
        header("queue-row-correlation-id"),
        Some("not-a-correlation")
    );
    assert_eq!(header("queue-row-sent-at"), Some("1700000000000"));
    assert_eq!(
        header("message-id"),
        Some("0195e3f4-1c4a-7c3e-8d2b-5a6f7e8d9c0c")
    );
    assert!(seen.counts().is_empty(), "no handler ran");
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(
        rows_left(store.url()).await,
        0,
        "taken off, not left to fail forever"
    );
    pool.close().await;
}

/// A notification sent while the listening connection is down is lost with it: a node that
/// never polls looks at the queue once its listener is cut, instead of listening again
/// past the row that came meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_polls_takes_what_came_while_its_listener_was_cut() {
    let store = TestStore::postgres().await;
    let seen = Seen::default();
    let queue = PostgresQueue::connect(store.url(), "pings")
        .unwrap()
        .route::<Ping>()
        .poll_interval(std::time::Duration::MAX);
    let runtime = store.runtime(module(&seen, "a"), queue);
    listening(&runtime).await;
    let pool = dacapo::sqlx::PgPool::connect(store.url()).await.unwrap();
    // Its notification was lost: the row alone is there.
    dacapo::sqlx::query(
        "INSERT INTO dacapo_queue (queue, id, message_type, payload, headers, sent_at, \
         enqueued_at) VALUES ('pings', $1, 'tests.ping', '\\x7b226e223a377d', '{}', 0, 0)",
    )
    .bind(uuid::Uuid::new_v4().to_string())
    .execute(&pool)
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (cut,): (i64,) = dacapo::sqlx::query_as(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%' \
             AND pid <> pg_backend_pid()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if cut > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node's listening connection was found"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].n, 7);
    assert!(runtime.shutdown().await.is_clean());
    assert_eq!(rows_left(store.url()).await, 0);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_only_checked_and_missing_stops_listening_with_a_clear_error() {
    let store = TestStore::sqlite().await;
    let queue_database = TestStore::postgres().await;
    let seen = Seen::default();
    let runtime = store.runtime(
        module(&seen, "a"),
        queue_on(&queue_database, "pings").declare(false),
    );
    stops_listening(runtime, "dacapo_queue").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_postgresql_cannot_hold_dead_letters_its_envelope_only() {
    let queue_database = TestStore::postgres().await;
    what_the_broker_can_never_take_is_dead_lettered(
        queue_on(&queue_database, "pings").into(),
        dacapo::SendOptions::new().deduplication_id("nul\0inside"),
    )
    .await;
}

/// A poll interval too long to add to the clock: an idle node waits for notifications alone,
/// and takes what they announce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_polls_takes_what_it_is_notified_of() {
    let store = TestStore::postgres().await;
    let url = store.url().to_owned();
    routed_messages_cross_the_broker_once(store, || {
        PostgresQueue::connect(&url, "pings")
            .unwrap()
            .route::<Ping>()
            .poll_interval(std::time::Duration::MAX)
            .into()
    })
    .await;
}

/// Waits at its gate once it counted its call: the engine stays full until the test opens it.
struct Gated {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
    seen: PingHandler,
}

impl dacapo::Handler<Ping> for Gated {
    async fn handle(
        &self,
        ping: &Ping,
        ctx: &dacapo::MessageContext,
    ) -> Result<(), dacapo::HandlerError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        drop(self.gate.acquire().await.unwrap());
        dacapo::Handler::<Ping>::handle(&self.seen, ping, ctx).await
    }
}

/// A node on `store` whose engine is full: one delivery held at its gate, a second batch
/// (of one) taken from the queue and waiting for room, the other three pings on the queue.
struct FullEngine {
    runtime: dacapo::Runtime,
    publisher: dacapo::Runtime,
    _elsewhere: TestStore,
    seen: Seen,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
    ids: Vec<uuid::Uuid>,
}

impl FullEngine {
    async fn on(store: &TestStore) -> Self {
        let TestStore::Postgres(postgres, _) = store else {
            unreachable!("a PostgreSQL store");
        };
        let seen = Seen::default();
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let runtime = dacapo::Runtime::builder()
            .module(dacapo::Module::new("pings").handle::<Ping, _>(Gated {
                calls: std::sync::Arc::clone(&calls),
                gate: std::sync::Arc::clone(&gate),
                seen: seen.handler("a"),
            }))
            // One row a batch: the first runs, the second waits for room, three stay queued.
            .transport(queue_on(store, "pings").prefetch(1))
            .max_in_flight(1)
            .store(postgres.clone())
            .build()
            .unwrap();
        listening(&runtime).await;
        let elsewhere = TestStore::sqlite().await;
        let publisher =
            elsewhere.runtime(dacapo::Module::new("elsewhere"), queue_on(store, "pings"));
        listening(&publisher).await;
        let ids = publish_pings(&publisher, 0, 5).await;
        wait_until(WAIT, || {
            calls.load(std::sync::atomic::Ordering::SeqCst) == 1 && runtime.stats().received >= 2
        })
        .await;
        Self {
            runtime,
            publisher,
            _elsewhere: elsewhere,
            seen,
            calls,
            gate,
            ids,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A node whose engine is full acknowledges what it took from the queue once its inbox
/// recorded it, not once there is room to start it: its transaction on the queue (with the
/// rows it locked) does not stay open for as long as the engine stays full, where a server's
/// `idle_in_transaction_session_timeout` would end it, over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_engine_acknowledges_what_its_inbox_recorded_without_waiting_for_room() {
    let store = TestStore::postgres().await;
    let full = FullEngine::on(&store).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let locked = locked_rows(store.url()).await;
        if locked == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{locked} rows still locked on the queue after {WAIT:?} with the engine full: the \
             batch waiting for room was not acknowledged"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        full.calls(),
        1,
        "acknowledged while the engine was still full"
    );
    assert_eq!(
        rows_left(store.url()).await,
        3,
        "the consumer keeps the engine's pace: it takes no further batch while one waits"
    );

    full.gate.add_permits(full.ids.len());
    full.seen.wait_for(full.ids.len(), WAIT).await;
    let counts = full.seen.counts();
    for id in &full.ids {
        assert_eq!(counts.get(id), Some(&1), "envelope {id} handled once");
    }
    assert!(full.publisher.shutdown().await.is_clean());
    assert!(full.runtime.shutdown().await.is_clean());
}

/// A shutdown while an acknowledged batch waits for room leaves it in the durable inbox, its
/// first attempt taken back: the shutdown does not wait for room, and the next node starts it
/// as new — not as an attempt that failed, which `no_retries` would dead-letter unrun. The
/// rest stays on the queue for that node; every envelope is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_batch_waiting_for_room_at_shutdown_starts_afresh_on_the_next_node() {
    let store = TestStore::postgres().await;
    let full = FullEngine::on(&store).await;
    let stopped = || {
        full.runtime
            .transports()
            .iter()
            .all(|(_, state)| matches!(state, dacapo::transport::TransportState::Stopped))
    };
    // The gate opens only once the consumer stopped: the waiting batch never gets room here.
    let open_once_stopped = async {
        wait_until(WAIT, stopped).await;
        full.gate.add_permits(full.ids.len());
    };
    let (report, ()) = tokio::join!(full.runtime.shutdown(), open_once_stopped);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(full.calls(), 1, "the waiting batch was not started here");

    let TestStore::Postgres(postgres, _) = &store else {
        unreachable!("a PostgreSQL store");
    };
    let next = dacapo::Runtime::builder()
        .module(module(&full.seen, "b"))
        .transport(queue_on(&store, "pings"))
        .retry_policy(dacapo::RetryPolicy::no_retries())
        .recovery_interval(std::time::Duration::from_millis(100))
        .store(postgres.clone())
        .build()
        .unwrap();
    listening(&next).await;
    full.seen.wait_for(full.ids.len(), WAIT).await;
    next.idle().await;
    let counts = full.seen.counts();
    for id in &full.ids {
        assert_eq!(counts.get(id), Some(&1), "envelope {id} handled once");
    }
    assert!(
        next.dead_letters().list().await.unwrap().is_empty(),
        "none taken for an attempt that failed"
    );
    assert!(full.publisher.shutdown().await.is_clean());
    assert!(next.shutdown().await.is_clean());
    assert_eq!(rows_left(store.url()).await, 0);
}

/// Turns each `Local` into a `Ping`, sent with `ctx.send`.
struct Forwards;

impl dacapo::Handler<Local> for Forwards {
    async fn handle(&self, local: &Local, ctx: &MessageContext) -> Result<(), HandlerError> {
        ctx.send(&Ping { n: local.n }).await?;
        Ok(())
    }
}

/// `ctx.send` refuses a type nothing would take; a type a transport routes is taken by the
/// broker, handler or not on this node (it was refused with `NoRoute` before, and the delivery
/// dead-lettered after its retries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_sends_a_type_only_the_queue_carries() {
    let store = TestStore::postgres().await;
    let seen = Seen::default();
    let consumer = store.runtime(module(&seen, "a"), queue_on(&store, "pings"));
    listening(&consumer).await;
    let elsewhere = TestStore::sqlite().await;
    let sender = elsewhere.runtime(
        Module::new("forwarding").handle::<Local, _>(Forwards),
        queue_on(&store, "pings"),
    );
    listening(&sender).await;

    let local = sender.publish(&Local { n: 7 }).await.unwrap();

    let calls = seen.wait_for(1, WAIT).await;
    assert_eq!(calls[0].n, 7);
    assert_eq!(calls[0].causation_id, Some(local));
    sender.idle().await;
    assert!(sender.dead_letters().list().await.unwrap().is_empty());
    assert!(sender.shutdown().await.is_clean());
    assert!(consumer.shutdown().await.is_clean());
}

/// A queue whose database does not exist stops listening with the reason: no retry creates
/// it. Before, the transport tried again for ever and `listening` never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_in_a_database_that_does_not_exist_stops_listening_with_a_clear_error() {
    let store = TestStore::sqlite().await;
    let admin = admin_url();
    let (server, _) = admin.rsplit_once('/').expect("a database in the admin URL");
    let missing = format!("{server}/{}", unique("dacapo_missing_"));
    let seen = Seen::default();
    let runtime = store.runtime(
        module(&seen, "a"),
        PostgresQueue::connect(&missing, "pings")
            .unwrap()
            .route::<Ping>(),
    );
    stops_listening(runtime, "refused").await;
}

/// A queue in a database whose encoding lacks characters (WIN1252 here) is refused before any
/// row is taken: one row holding a byte WIN1252 has no character for fails every take there
/// (each node would reconnect for ever), and a header with a character it lacks fails every
/// publication of its batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_in_a_database_that_cannot_hold_every_character_stops_listening() {
    use dacapo::sqlx::Connection;
    let store = TestStore::sqlite().await;
    let admin = admin_url();
    let (server, _) = admin.rsplit_once('/').expect("a database in the admin URL");
    let name = unique("dacapo_win1252_");
    let mut connection = dacapo::sqlx::PgConnection::connect(&admin).await.unwrap();
    dacapo::sqlx::query(dacapo::sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {name} ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C' \
         TEMPLATE template0"
    )))
    .execute(&mut connection)
    .await
    .unwrap();
    let seen = Seen::default();
    let runtime = store.runtime(
        module(&seen, "a"),
        PostgresQueue::connect(&format!("{server}/{name}"), "pings")
            .unwrap()
            .route::<Ping>(),
    );
    stops_listening(runtime, "WIN1252").await;
    dacapo::sqlx::query(dacapo::sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&mut connection)
    .await
    .unwrap();
}

/// A role that may read the queue's rows but not delete them stops listening with the grant
/// it lacks: it would take the same batch after each failed acknowledgement, and run its
/// handlers again once the inbox forgot it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_delete_the_queues_rows_stops_listening() {
    let queue_database = TestStore::postgres().await;
    let pool = dacapo::sqlx::PgPool::connect(queue_database.url())
        .await
        .unwrap();
    // The table, made as the owner would.
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let owner = store.runtime(module(&seen, "a"), queue_on(&queue_database, "pings"));
    listening(&owner).await;
    owner.shutdown().await;
    let role = unique("dacapo_reader_");
    let run = |statements: Vec<String>| {
        let pool = pool.clone();
        async move {
            for statement in statements {
                dacapo::sqlx::query(dacapo::sqlx::AssertSqlSafe(statement))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
    run(vec![
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT SELECT, UPDATE ON dacapo_queue TO {role}"),
    ])
    .await;
    // The queue database's URL, as the role (trust authentication: no password).
    let (scheme, rest) = queue_database.url().split_once("://").unwrap();
    let server = rest.rsplit_once('@').map_or(rest, |(_, server)| server);
    let as_role = format!("{scheme}://{role}@{server}");
    let node_as_role = || {
        let seen = seen.clone();
        let as_role = as_role.clone();
        async move {
            let store = TestStore::sqlite().await;
            let runtime = store.runtime(
                module(&seen, "a"),
                PostgresQueue::connect(&as_role, "pings")
                    .unwrap()
                    .declare(false)
                    .route::<Ping>(),
            );
            (store, runtime)
        }
    };
    let (_store, runtime) = node_as_role().await;
    stops_listening(runtime, "GRANT SELECT, UPDATE, DELETE").await;
    // Taking needs UPDATE on one column only, and deleting DELETE: such a role listens.
    run(vec![
        format!("REVOKE UPDATE ON dacapo_queue FROM {role}"),
        format!("GRANT UPDATE (seq), DELETE ON dacapo_queue TO {role}"),
        // And publishing, for the test's own message.
        format!("GRANT INSERT ON dacapo_queue TO {role}"),
        format!("GRANT USAGE ON SEQUENCE dacapo_queue_seq_seq TO {role}"),
    ])
    .await;
    let (_store, runtime) = node_as_role().await;
    listening(&runtime).await;
    let id = publish_pings(&runtime, 0, 1).await[0];
    seen.wait_for(1, WAIT).await;
    until_rows(queue_database.url(), 0).await;
    assert_eq!(seen.counts().get(&id), Some(&1));
    assert!(runtime.shutdown().await.is_clean());
    run(vec![
        format!("REVOKE ALL ON dacapo_queue FROM {role}"),
        format!("REVOKE ALL ON SEQUENCE dacapo_queue_seq_seq FROM {role}"),
        format!("DROP ROLE {role}"),
    ])
    .await;
    pool.close().await;
}

/// A delete that leaves the acknowledged rows (a trigger that keeps them) stops the consumer
/// with the reason: before, it counted as done, and the node took the same rows again at
/// once, for ever, running them again each time its inbox had forgotten them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledgement_that_deletes_nothing_stops_listening_with_the_reason() {
    let store = TestStore::postgres().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), queue_on(&store, "pings"));
    listening(&runtime).await;
    let pool = dacapo::sqlx::PgPool::connect(store.url()).await.unwrap();
    for statement in [
        "CREATE FUNCTION keep_rows() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RETURN NULL; END $$",
        "CREATE TRIGGER keep_rows BEFORE DELETE ON dacapo_queue \
         FOR EACH ROW EXECUTE FUNCTION keep_rows()",
    ] {
        dacapo::sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let ids = publish_pings(&runtime, 0, 1).await;
    seen.wait_for(1, WAIT).await;
    let stopped = || {
        runtime.transports().iter().any(|(_, state)| {
            matches!(state, dacapo::transport::TransportState::Failed(why)
                if why.contains("deleted 0 of the 1 rows"))
        })
    };
    wait_until(WAIT, stopped).await;
    assert_eq!(seen.counts().get(&ids[0]), Some(&1), "handled once");
    assert_eq!(rows_left(store.url()).await, 1, "kept by the trigger");
    assert!(runtime.shutdown().await.is_clean());
    pool.close().await;
}

/// Rows in the queue table of the database at `url`; none while it does not exist.
async fn rows_if_any(url: &str) -> i64 {
    let pool = dacapo::sqlx::PgPool::connect(url).await.unwrap();
    let (present,): (bool,) =
        dacapo::sqlx::query_as("SELECT to_regclass('dacapo_queue') IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    let count = if present { rows_left(url).await } else { 0 };
    pool.close().await;
    count
}

/// Waits until the queue table of the database at `url` holds `count` rows.
async fn until_rows(url: &str, count: i64) {
    tokio::time::timeout(WAIT, async {
        while rows_if_any(url).await != count {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{count} rows in the queue within the wait"));
}

/// A node that only publishes declares the queue's table again when it finds it gone
/// (dropped by an operator, a restore). Before, it failed every publication for ever: only a
/// consumer declared it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_declares_the_table_again_when_it_is_gone() {
    let queue_database = TestStore::postgres().await;
    let store = TestStore::sqlite().await;
    let publisher = store.runtime(
        Module::new("publishes only"),
        queue_on(&queue_database, "pings"),
    );
    publisher.publish(&Ping { n: 1 }).await.unwrap();
    until_rows(queue_database.url(), 1).await;

    let pool = dacapo::sqlx::PgPool::connect(queue_database.url())
        .await
        .unwrap();
    dacapo::sqlx::query("DROP TABLE dacapo_queue")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    publisher.publish(&Ping { n: 2 }).await.unwrap();

    until_rows(queue_database.url(), 1).await;
    assert!(publisher.shutdown().await.is_clean());
}

/// Rows routed to a queue no node takes are warned of, as RabbitMQ warns of a message no queue
/// takes: a queue table takes any row, and they used to wait there unsaid. The publisher looks
/// at its queues' oldest rows once a minute, the first time at its first publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_no_node_takes_are_warned_of() {
    let _ = support_warnings::warnings();
    let queue_database = TestStore::postgres().await;
    let nobody = unique("nobody_");
    let (first_store, second_store) = (TestStore::sqlite().await, TestStore::sqlite().await);
    let first = first_store.runtime(
        Module::new("publishes only"),
        queue_on(&queue_database, &nobody),
    );
    first.publish(&Ping { n: 1 }).await.unwrap();
    until_rows(queue_database.url(), 1).await;
    assert!(first.shutdown().await.is_clean());
    // That row has waited an hour.
    let pool = dacapo::sqlx::PgPool::connect(queue_database.url())
        .await
        .unwrap();
    dacapo::sqlx::query("UPDATE dacapo_queue SET enqueued_at = enqueued_at - 3600000")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;

    let second = second_store.runtime(
        Module::new("publishes only"),
        queue_on(&queue_database, &nobody),
    );
    second.publish(&Ping { n: 2 }).await.unwrap();
    until_rows(queue_database.url(), 2).await;

    let warned = || {
        support_warnings::warnings()
            .lock()
            .unwrap()
            .iter()
            .any(|warning| warning.contains(&nobody) && warning.contains("older than a minute"))
    };
    tokio::time::timeout(WAIT, async {
        while !warned() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the hour-old row is warned of");
    assert!(second.shutdown().await.is_clean());
}

/// A row the queue can never take is dead-lettered and marked sent in one transaction: when
/// the mark fails (a trigger here; a crash between the two in life), no letter is left beside
/// a row still to send — which a later round could send after all, and a replay of the letter
/// send again. Once the mark can be written, the next round keeps both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_queue_refuses_is_dead_lettered_and_marked_together() {
    let _ = support_warnings::warnings();
    let queue_database = TestStore::postgres().await;
    let store = TestStore::sqlite().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), queue_on(&queue_database, "pings"));
    listening(&runtime).await;
    let TestStore::Sqlite(sqlite, _) = &store else {
        unreachable!("made on SQLite")
    };
    let refusal = unique("the_mark_fails_");
    dacapo::sqlx::query(dacapo::sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER refuse_marks BEFORE UPDATE ON dacapo_outbox \
         BEGIN SELECT RAISE(ABORT, '{refusal}'); END"
    )))
    .execute(sqlite.pool())
    .await
    .unwrap();
    // PostgreSQL's text holds no NUL: the queue can never take this one.
    let broken = runtime
        .publish_with(
            &Ping { n: 1 },
            dacapo::SendOptions::new().deduplication_id("nul\0inside"),
        )
        .await
        .unwrap();
    let refused = || {
        support_warnings::warnings()
            .lock()
            .unwrap()
            .iter()
            .any(|warning| warning.contains(&refusal))
    };
    wait_until(WAIT, refused).await;
    let letters: i64 = dacapo::sqlx::query_scalar("SELECT count(*) FROM dacapo_dead_letters")
        .fetch_one(sqlite.pool())
        .await
        .unwrap();
    assert_eq!(letters, 0, "the letter went with the mark that failed");
    dacapo::sqlx::query("DROP TRIGGER refuse_marks")
        .execute(sqlite.pool())
        .await
        .unwrap();
    let letters = dead_letters(&runtime, 1).await;
    assert_eq!(letters[0].envelope.id, broken);
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(runtime.outbox_backlog().await.unwrap().unwrap().depth, 0);
    assert!(runtime.shutdown().await.is_clean());
    assert!(seen.calls().is_empty());
}
