//! Store trouble against the real PostgreSQL server, reached through a proxy the test can cut:
//! while the database is unreachable nothing is accepted that is not persisted, the engine's
//! own writes wait and retry with backoff, and handling resumes by itself when it comes back.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/proxy.rs"]
mod support_proxy;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::Arc;
use std::time::Duration;

use dacapo::Error;
use dacapo::prelude::*;
use dacapo::store::PostgresStore;
use support::{MemberRemoved, member_removed};
use support_proxy::Proxy;
use tokio::sync::Semaphore;

const WAIT: Duration = Duration::from_secs(30);

/// A proxy to `db`'s server, and a pool that reaches `db` through it.
async fn proxied(
    db: &support_stores::TestDatabase,
    acquire_timeout: Duration,
) -> (Proxy, sqlx::PgPool) {
    let (proxy, through_proxy) = Proxy::to(&db.url).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(acquire_timeout)
        .connect(&through_proxy)
        .await
        .unwrap();
    (proxy, pool)
}

/// Waits for one permit per call.
struct Gated(Arc<Semaphore>);

impl Handler<MemberRemoved> for Gated {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.acquire().await?.forget();
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_loses_nothing_and_handling_resumes_by_itself() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (proxy, pool) = proxied(&db, Duration::from_secs(2)).await;
    let gate = Arc::new(Semaphore::new(0));
    let runtime = Runtime::builder()
        .store(PostgresStore::with_pool(pool).await.unwrap())
        .module(
            Module::new("m").handle_named::<MemberRemoved, _>("gated", Gated(Arc::clone(&gate))),
        )
        .build()
        .unwrap();
    let running = runtime.publish(&member_removed()).await.unwrap();

    proxy.cut();
    // Unreachable: a publish is refused with the store's error, and nothing of it is stored.
    let refused = tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
        .await
        .unwrap();
    let Err(Error::Store(_)) = refused else {
        panic!("expected a store error, got {refused:?}");
    };
    // The running delivery finishes its handler; marking it handled now fails and is retried.
    gate.add_permits(1);
    let settled = tokio::time::timeout(Duration::from_secs(3), runtime.idle()).await;
    assert!(
        settled.is_err(),
        "the delivery cannot settle while its store is unreachable"
    );

    proxy.restore();
    tokio::time::timeout(WAIT, runtime.idle())
        .await
        .expect("it settled once the store came back");
    assert_eq!(db.inbox_status(running).await.as_deref(), Some("handled"));
    assert_eq!(
        db.inbox_rows().await,
        1,
        "the refused envelope was never stored"
    );

    gate.add_permits(1);
    let after = tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(db.inbox_status(after).await.as_deref(), Some("handled"));
    runtime.shutdown().await;
}

#[test]
fn the_listener_backoff_doubles_up_to_its_cap_and_never_overflows() {
    use dacapo::transport::Backoff;
    let backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let pauses: Vec<u64> = (1..=7)
        .map(|failures| backoff.pause(failures).as_millis() as u64)
        .collect();
    assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000]);
    assert_eq!(backoff.pause(u32::MAX), Duration::from_secs(1));
    let huge = Backoff::new(Duration::MAX, Duration::MAX);
    assert_eq!(huge.pause(40), Duration::MAX);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_pauses_with_backoff_acks_nothing_unpersisted_and_resumes_by_itself() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (proxy, pool) = proxied(&db, Duration::from_secs(1)).await;
    let handled = dacapo::testing::Recorder::<MemberRemoved>::new();
    let runtime = Runtime::builder()
        .store(PostgresStore::with_pool(pool).await.unwrap())
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", handled.clone()))
        .build()
        .unwrap();
    let listener = runtime.listener().backoff(dacapo::transport::Backoff::new(
        Duration::from_millis(20),
        Duration::from_millis(200),
    ));
    // What a broker delivered, and what the listener acknowledged back.
    let delivered: Vec<Envelope> = (0..5)
        .map(|_| {
            runtime
                .envelope(&member_removed(), SendOptions::default())
                .unwrap()
        })
        .collect();
    let acked = Arc::new(std::sync::Mutex::new(Vec::new()));

    proxy.cut();
    let pump = {
        let (listener, acked, delivered) =
            (listener.clone(), Arc::clone(&acked), delivered.clone());
        tokio::spawn(async move {
            for envelope in delivered {
                let id = envelope.id;
                listener.accept(envelope).await.unwrap();
                acked.lock().unwrap().push(id);
            }
        })
    };
    // Unreachable: the listener keeps pausing and trying, and acknowledges nothing.
    tokio::time::timeout(WAIT, async {
        while listener.pauses() < 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the listener retries with backoff");
    assert!(acked.lock().unwrap().is_empty(), "nothing acknowledged");
    assert_eq!(db.inbox_rows().await, 0, "and nothing stored");

    proxy.restore();
    tokio::time::timeout(WAIT, pump)
        .await
        .expect("listening resumed by itself")
        .unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let ids: Vec<_> = delivered.iter().map(|e| e.id).collect();
    assert_eq!(
        *acked.lock().unwrap(),
        ids,
        "every envelope acknowledged, in order"
    );
    assert_eq!(handled.count(), 5, "and each handled once");

    // A connection killed under the runtime: the pool replaces it, and the next envelope is
    // accepted (after a pause if the killed connection was the one it tried first).
    let admin = db.postgres().await;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(admin.pool())
    .await
    .unwrap();
    let after = runtime
        .envelope(&member_removed(), SendOptions::default())
        .unwrap();
    let after_id = after.id;
    tokio::time::timeout(WAIT, listener.accept(after))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(db.inbox_status(after_id).await.as_deref(), Some("handled"));
    runtime.shutdown().await;
}

/// Counts the calls it started, then waits for one permit per call.
#[derive(Clone)]
struct Holds(Arc<std::sync::atomic::AtomicUsize>, Arc<Semaphore>);

impl Handler<MemberRemoved> for Holds {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.1.acquire().await?.forget();
        Ok(())
    }
}

/// Now, in milliseconds since the epoch, as the nodes stamp their heartbeats.
fn now_millis() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(since.as_millis()).unwrap()
}

/// After an outage of the database longer than the node timeout, every node's heartbeat is
/// old. The first node back claims none of the others' deliveries until they have had a node
/// timeout to beat again: it took a live node's running delivery at once before, and ran it a
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_the_first_node_back_does_not_take_a_live_nodes_deliveries() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let timeout = Duration::from_secs(4);
    let store = |pool, node: &'static str| async move {
        PostgresStore::with_pool(pool)
            .await
            .unwrap()
            .node_id(node)
            .node_timeout(timeout)
    };
    let (to_a, pool_a) = proxied(&db, Duration::from_secs(1)).await;
    let (to_b, pool_b) = proxied(&db, Duration::from_secs(1)).await;
    let on_a = Holds(Arc::default(), Arc::new(Semaphore::new(0)));
    let on_b = Holds(Arc::default(), Arc::new(Semaphore::new(100)));
    let a = Runtime::builder()
        .store(store(pool_a, "a").await)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", on_a.clone()))
        .build()
        .unwrap();
    let b = Runtime::builder()
        .store(store(pool_b, "b").await)
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", on_b.clone()))
        .build()
        .unwrap();
    // Both have heartbeaten before the outage.
    tokio::time::timeout(WAIT, async {
        tokio::join!(a.first_recovery(), b.first_recovery())
    })
    .await
    .unwrap();
    let running = a.publish(&member_removed()).await.unwrap();
    let started = || on_a.0.load(std::sync::atomic::Ordering::SeqCst) == 1;
    tokio::time::timeout(WAIT, async {
        while !started() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a runs its delivery");

    to_a.cut();
    to_b.cut();
    let beat_of = |node: &'static str| {
        let db = &db;
        async move {
            match node {
                "a" => {
                    db.scalar("SELECT heartbeat_at FROM dacapo_nodes WHERE id = 'a'")
                        .await
                }
                _ => {
                    db.scalar("SELECT heartbeat_at FROM dacapo_nodes WHERE id = 'b'")
                        .await
                }
            }
        }
    };
    let span = i64::try_from(timeout.as_millis()).unwrap();
    tokio::time::timeout(WAIT, async {
        while now_millis() - beat_of("a").await.max(beat_of("b").await) <= span + 500 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("both heartbeats older than the node timeout");

    // b comes back first: a looks dead, and its delivery claimable, until a beats again.
    let back = now_millis();
    to_b.restore();
    tokio::time::timeout(WAIT, async {
        while beat_of("b").await < back {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("b heartbeats once back");
    to_a.restore();
    tokio::time::timeout(WAIT, async {
        while beat_of("a").await < back {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a heartbeats once back");
    // a is alive again from here on: b can no longer take its delivery.
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_inbox WHERE owner = 'a'")
            .await,
        1
    );
    assert_eq!(on_b.0.load(std::sync::atomic::Ordering::SeqCst), 0);

    on_a.1.add_permits(1);
    tokio::time::timeout(WAIT, a.idle()).await.unwrap();
    assert_eq!(db.inbox_status(running).await.as_deref(), Some("handled"));
    b.shutdown().await;
    a.shutdown().await;
    assert_eq!(on_a.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(on_b.0.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// While a node claims no other node's deliveries after its heartbeat was interrupted, it still
/// claims the rows no node owns: a scheduled message runs on time, not a node timeout late,
/// while a dead node's delivery waits out the hold-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_a_scheduled_message_runs_on_time() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (proxy, pool) = proxied(&db, Duration::from_secs(1)).await;
    let calls = dacapo::testing::Recorder::<MemberRemoved>::new();
    // Rounds every 100 ms, each heartbeating first: the outage fails one at once.
    let runtime = Runtime::builder()
        .store(
            PostgresStore::with_pool(pool)
                .await
                .unwrap()
                .node_id("alone"),
        )
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap();
    tokio::time::timeout(WAIT, runtime.first_recovery())
        .await
        .unwrap();
    let beat = || db.scalar("SELECT heartbeat_at FROM dacapo_nodes WHERE id = 'alone'");
    proxy.cut();
    let cut_at = now_millis();
    // A second without a beat written: ten rounds' heartbeats failed.
    tokio::time::timeout(WAIT, async {
        while now_millis() - cut_at < 1000 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();
    assert!(beat().await < cut_at, "no heartbeat while cut off");
    let back = now_millis();
    proxy.restore();
    tokio::time::timeout(WAIT, async {
        while beat().await < back {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the node beats again, and holds back claims of others' rows for 30 s");
    // A dead node's delivery, old enough to take over, which the hold-back keeps from it.
    let dead = PostgresStore::connect(&db.url).await.unwrap();
    let orphan = dacapo::Envelope::for_message(&member_removed()).unwrap();
    dacapo::ports::Inbox::receive(&dead, &orphan).await.unwrap();
    db.execute("UPDATE dacapo_inbox SET received_at = 0").await;
    runtime
        .publish_after(&member_removed(), Duration::from_millis(100))
        .await
        .unwrap();
    // Well inside the 30 s of the hold-back.
    tokio::time::timeout(Duration::from_secs(15), async {
        while calls.count() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the scheduled message ran during the hold-back");
    assert_eq!(calls.count(), 1, "the dead node's delivery waits");
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_inbox WHERE owner = 'alone' AND received_at = 0")
            .await,
        0,
        "nothing of the dead node's claimed"
    );
    runtime.shutdown().await;
}
