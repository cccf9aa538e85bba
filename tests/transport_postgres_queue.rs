//! The PostgreSQL queue that nodes share, on the real server (`DACAPO_TEST_POSTGRES`).

#[path = "support/brokers.rs"]
mod brokers;
#[path = "support/proxy.rs"]
mod proxy;

use brokers::*;
use dacapo::DeadLetterReason;
use dacapo::transport::{PostgresQueue, Transport};
use proxy::Proxy;

fn queue_on(store: &TestStore, queue: &str) -> PostgresQueue {
    PostgresQueue::connect(store.url(), queue)
        .unwrap()
        .route::<Ping>()
        .prefetch(20)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_is_no_envelope_is_dead_lettered_and_taken_off_the_queue() {
    let store = TestStore::postgres().await;
    let seen = Seen::default();
    let runtime = store.runtime(module(&seen, "a"), queue_on(&store, "pings"));
    listening(&runtime).await;
    // Another writer's row: its id is no UUID.
    let pool = dacapo::sqlx::PgPool::connect(store.url()).await.unwrap();
    dacapo::sqlx::query(
        "INSERT INTO dacapo_queue (queue, id, message_type, payload, headers, sent_at, \
         enqueued_at) VALUES ('pings', 'not-a-uuid', 'tests.ping', '\\x7b7d', '{}', 0, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    dacapo::sqlx::query("SELECT pg_notify('dacapo_queue', 'pings')")
        .execute(&pool)
        .await
        .unwrap();
    let letters = dead_letters(&runtime, 1).await;
    assert!(
        matches!(&letters[0].reason, DeadLetterReason::Unreadable(why) if why.contains("not-a-uuid")),
        "{:?}",
        letters[0].reason
    );
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
    let error = tokio::time::timeout(WAIT, runtime.listening())
        .await
        .expect("answers within the wait")
        .unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    assert!(error.to_string().contains("dacapo_queue"), "{error}");
    runtime.shutdown().await;
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
