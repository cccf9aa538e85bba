//! One live process per node id: a store named with `node_id` holds its node before its first
//! write, a second process finds it held and writes nothing under it, and the hold goes with
//! the process that had it, `kill -9` included. The other process is this test binary running
//! the ignored `holder`, so its death is a real one.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/child.rs"]
mod support_child;
#[path = "support/manual_clock.rs"]
mod support_clock;
#[path = "support/proxy.rs"]
mod support_proxy;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::process::Child;
use std::time::Duration;

use dacapo::EngineError;
use dacapo::ports::{Claims, DurableInbox, OutboxStore};
use dacapo::prelude::*;
use serde::{Deserialize, Serialize};
use support::member_removed;
use support_stores::{Backend, TestDatabase};

/// What the holder is told, through its environment.
const HOLDER: &str = "DACAPO_NODE_HOLD_TEST";

/// The node both processes are given.
const NODE: &str = "orders-1";

/// How long a test waits for a process or an effect it expects.
const WAIT: Duration = Duration::from_secs(30);

#[derive(Serialize, Deserialize)]
struct Setup {
    postgres: bool,
    url: String,
}

/// The store at `url` under `node`, waiting `wait` for a node another process holds.
async fn store(postgres: bool, url: &str, node: &str, wait: Duration) -> Box<dyn DurableInbox> {
    if postgres {
        Box::new(
            dacapo::store::PostgresStore::connect(url)
                .await
                .unwrap()
                .node_id(node)
                .node_timeout(wait),
        )
    } else {
        Box::new(
            dacapo::store::SqliteStore::open(url)
                .await
                .unwrap()
                .node_id(node)
                .node_timeout(wait),
        )
    }
}

/// The other process: holds the node with a heartbeat (a write under it), says so, and
/// lives until it is killed or its standard input closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the other process of the node hold tests, which run it themselves"]
async fn holder() {
    let setup: Setup =
        serde_json::from_str(&std::env::var(HOLDER).expect("run by a node hold test")).unwrap();
    let store = store(setup.postgres, &setup.url, NODE, WAIT).await;
    store.heartbeat().await.unwrap();
    println!("held");
    tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
        .await
        .unwrap();
    drop(store);
}

/// Starts the holder on `url`, once it holds the node.
fn spawn_holder(postgres: bool, url: &str) -> Child {
    let setup = serde_json::to_string(&Setup {
        postgres,
        url: url.to_owned(),
    })
    .unwrap();
    support_child::spawn("holder", (HOLDER, &setup), "held", WAIT)
}

fn kill(mut child: Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

fn is_held_elsewhere(error: &EngineError) -> bool {
    matches!(error, EngineError::NodeHeld { node, .. } if node == NODE) && error.is_retryable()
}

async fn a_node_is_held_by_one_live_process_at_a_time(db: TestDatabase) {
    let postgres = matches!(db.backend, Backend::Postgres);
    // The schema, before two processes race to create it.
    drop(store(postgres, &db.url, "schema", WAIT).await);
    let holder = spawn_holder(postgres, &db.url);

    let second = store(postgres, &db.url, NODE, Duration::from_millis(500)).await;
    let envelope = Envelope::for_message(&member_removed()).unwrap();
    let refused = second.receive(&envelope).await.unwrap_err();
    assert!(is_held_elsewhere(&refused), "{refused}");
    let recovering = second
        .recover(100, chrono::Utc::now(), true)
        .await
        .unwrap_err();
    assert!(is_held_elsewhere(&recovering), "{recovering}");
    // Provisioning claims releases the node's own, and the outbox lease is the node's.
    let (claims, outbox): (Box<dyn Claims>, Box<dyn OutboxStore>) = if postgres {
        let store = dacapo::store::PostgresStore::connect(&db.url)
            .await
            .unwrap()
            .node_id(NODE)
            .node_timeout(Duration::from_millis(500));
        (Box::new(store.clone()), Box::new(store))
    } else {
        let store = dacapo::store::SqliteStore::open(&db.url)
            .await
            .unwrap()
            .node_id(NODE)
            .node_timeout(Duration::from_millis(500));
        (Box::new(store.clone()), Box::new(store))
    };
    let provisioning = claims.provision().await.unwrap_err();
    assert!(is_held_elsewhere(&provisioning), "{provisioning}");
    let now = chrono::Utc::now();
    let leasing = outbox
        .lease(now, now + chrono::Duration::seconds(5))
        .await
        .unwrap_err();
    assert!(is_held_elsewhere(&leasing), "{leasing}");
    assert_eq!(
        db.inbox_rows().await,
        0,
        "nothing written under a held node"
    );
    // Writes queued behind a refused take share its answer: one wait of 500 ms, not eight.
    let started = std::time::Instant::now();
    let writes = dacapo::futures::future::join_all((0..8).map(|_| second.heartbeat())).await;
    assert!(
        writes
            .iter()
            .all(|write| write.as_ref().is_err_and(is_held_elsewhere))
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // Another node of the same database is free.
    let other = store(postgres, &db.url, "orders-2", WAIT).await;
    other
        .receive(&Envelope::for_message(&member_removed()).unwrap())
        .await
        .unwrap();

    // The system lets go of a killed process's hold: the node is taken on the next write.
    kill(holder);
    let second = store(postgres, &db.url, NODE, WAIT).await;
    second.receive(&envelope).await.unwrap();
    assert_eq!(
        db.inbox_status(envelope.id).await.as_deref(),
        Some("incoming")
    );
    // Another store of this process under the node shares its hold.
    let again = store(postgres, &db.url, NODE, Duration::from_millis(500)).await;
    again.heartbeat().await.unwrap();
}

on_both_backends!(
    a_node_is_held_by_one_live_process_at_a_time_sqlite,
    a_node_is_held_by_one_live_process_at_a_time_postgres,
    |db| a_node_is_held_by_one_live_process_at_a_time(db).await
);

/// A runtime under a node another process holds publishes nothing: the publish fails with the
/// typed error, and the envelope is not in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_under_a_held_node_refuses_to_publish_sqlite() {
    let db = TestDatabase::new(Backend::Sqlite).await;
    drop(store(false, &db.url, "schema", WAIT).await);
    let holder = spawn_holder(false, &db.url);
    let runtime = Runtime::builder()
        .store(
            dacapo::store::SqliteStore::open(&db.url)
                .await
                .unwrap()
                .node_id(NODE)
                .node_timeout(Duration::from_millis(500)),
        )
        .module(Module::new("m").handle::<support::MemberRemoved, _>(support::Counter::default()))
        .build()
        .unwrap();
    let refused = runtime.publish(&member_removed()).await.unwrap_err();
    assert!(
        matches!(&refused, dacapo::Error::NodeHeld { node, .. } if node == NODE)
            && refused.is_retryable(),
        "{refused}"
    );
    assert_eq!(db.inbox_rows().await, 0);
    kill(holder);
    runtime.publish(&member_removed()).await.unwrap();
    runtime.idle().await;
    assert_eq!(runtime.stats().handled, 1);
    runtime.shutdown().await;
}

/// A PostgreSQL session holding a node, cut off the server: the server lets its lock go, so
/// another process may take the node; the store finds its session lost and, with the node held
/// elsewhere, writes nothing more under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_session_loses_the_node_to_the_process_that_took_it_postgres() {
    let db = TestDatabase::new(Backend::Postgres).await;
    let (proxy, through) = support_proxy::Proxy::to(&db.url).await;
    let first = store(true, &through, NODE, Duration::from_millis(500)).await;
    first.heartbeat().await.unwrap();

    proxy.cut();
    // The holder can only take the node once the server dropped the cut session.
    let holder = spawn_holder(true, &db.url);
    proxy.restore();
    let deadline = tokio::time::Instant::now() + WAIT;
    let refused = loop {
        // Until the store's check of its session ran (every 2 s), it may still write.
        match first.heartbeat().await {
            Err(error) if matches!(error, EngineError::NodeHeld { .. }) => break error,
            // Written, or failed on a connection the cut left the pool.
            _ => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the lost session was never noticed"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(is_held_elsewhere(&refused), "{refused}");

    // Once the holder is gone (and the server noticed), the store takes its node back.
    kill(holder);
    let deadline = tokio::time::Instant::now() + WAIT;
    while let Err(error) = first.heartbeat().await {
        assert!(
            is_held_elsewhere(&error) && tokio::time::Instant::now() < deadline,
            "{error}"
        );
    }
}

/// A listener whose node another process holds waits, as it waits out a store that is down,
/// and records the envelope once that process ended: nothing refused for good, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_waits_out_a_node_held_elsewhere_postgres() {
    use dacapo::store::PostgresStore;
    use dacapo::transport::PostgresQueue;
    let warnings = support_warnings::warnings();
    let db = TestDatabase::new(Backend::Postgres).await;
    drop(store(true, &db.url, "schema", WAIT).await);
    let holder = spawn_holder(true, &db.url);
    let queue = || {
        PostgresQueue::connect(&db.url, "held")
            .unwrap()
            .route::<support::MemberRemoved>()
    };
    let handled = support::Counter::default();
    let receiver = Runtime::builder()
        .store(
            PostgresStore::connect(&db.url)
                .await
                .unwrap()
                .node_id(NODE)
                .node_timeout(Duration::from_millis(300)),
        )
        .module(Module::new("m").handle::<support::MemberRemoved, _>(handled.clone()))
        .transport(queue())
        .build()
        .unwrap();
    let sender = Runtime::builder()
        .store(
            PostgresStore::connect(&db.url)
                .await
                .unwrap()
                .node_id("sender"),
        )
        .transport(queue())
        .relay_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    sender.publish(&member_removed()).await.unwrap();

    let deadline = tokio::time::Instant::now() + WAIT;
    while !warnings.lock().unwrap().iter().any(|warning| {
        warning.contains("cannot record a received envelope")
            && warning.contains("held by another live process")
    }) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener never met the held node"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handled.count(), 0);

    kill(holder);
    let deadline = tokio::time::Instant::now() + WAIT;
    while handled.count() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never handled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    receiver.idle().await;
    assert_eq!(handled.count(), 1);
    assert!(receiver.dead_letters().list().await.unwrap().is_empty());
    sender.shutdown().await;
    receiver.shutdown().await;
}

/// Another name of the database: the PostgreSQL server through a proxy on another port, the
/// SQLite file through a symbolic link; what keeps that name working, to be dropped after.
async fn another_name(db: &TestDatabase) -> (String, Box<dyn std::any::Any>) {
    match db.backend {
        Backend::Postgres => {
            let (proxy, through) = support_proxy::Proxy::to(&db.url).await;
            (through, Box::new(proxy))
        }
        Backend::Sqlite => {
            let link = Symlink::to(std::path::Path::new(&db.url));
            (link.0.display().to_string(), Box::new(link))
        }
    }
}

/// A symbolic link, removed when dropped.
struct Symlink(std::path::PathBuf);

impl Symlink {
    fn to(target: &std::path::Path) -> Self {
        let name = format!("{}-link.db", uuid::Uuid::new_v4().simple());
        let link = std::env::temp_dir().join(name);
        std::os::unix::fs::symlink(target, &link).unwrap();
        Self(link)
    }
}

impl Drop for Symlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Two stores of one process reaching one database by two names share their node's hold: the
/// second writes at once instead of waiting for its own process.
async fn two_names_of_one_database_share_the_hold(db: TestDatabase) {
    let postgres = matches!(db.backend, Backend::Postgres);
    let (other_name, _keeps_it) = another_name(&db).await;
    let first = store(postgres, &db.url, NODE, WAIT).await;
    first.heartbeat().await.unwrap();
    let second = store(postgres, &other_name, NODE, Duration::from_millis(500)).await;
    second.heartbeat().await.unwrap();
    second
        .receive(&Envelope::for_message(&member_removed()).unwrap())
        .await
        .unwrap();
    assert_eq!(db.inbox_rows().await, 1);
}

on_both_backends!(
    two_names_of_one_database_share_the_hold_sqlite,
    two_names_of_one_database_share_the_hold_postgres,
    |db| two_names_of_one_database_share_the_hold(db).await
);

/// A node is held per schema: a process holding it in one schema does not hold it in another
/// for its other stores, which another process holds there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_held_in_each_schema_by_its_own_holder_postgres() {
    let db = TestDatabase::new(Backend::Postgres).await;
    db.execute("CREATE SCHEMA other").await;
    let in_other = format!("{}?options=-c%20search_path%3Dother", db.url);
    drop(store(true, &in_other, "schema", WAIT).await);
    drop(store(true, &db.url, "schema", WAIT).await);
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'other' AND tablename = 'dacapo_inbox'")
            .await,
        1,
        "the URL's search_path puts the store's tables in the schema"
    );
    let holder = spawn_holder(true, &in_other);

    // A pool whose sessions set their schema as they start, which the node's own session
    // does not: the lock is taken in the schema the pool's tables are in.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .after_connect(|session, _| {
            Box::pin(async move {
                sqlx::Executor::execute(session, "SET search_path = other").await?;
                Ok(())
            })
        })
        .connect(&db.url)
        .await
        .unwrap();
    let set_on_start = dacapo::store::PostgresStore::with_pool(pool)
        .await
        .unwrap()
        .node_id(NODE)
        .node_timeout(Duration::from_millis(500));
    let refused = set_on_start.heartbeat().await.unwrap_err();
    assert!(is_held_elsewhere(&refused), "{refused}");

    let public = store(true, &db.url, NODE, WAIT).await;
    public.heartbeat().await.unwrap();
    let other = store(true, &in_other, NODE, Duration::from_millis(500)).await;
    let refused = other.heartbeat().await.unwrap_err();
    assert!(is_held_elsewhere(&refused), "{refused}");
    assert!(refused.to_string().contains("schema other"), "{refused}");

    kill(holder);
    let deadline = tokio::time::Instant::now() + WAIT;
    while let Err(error) = other.heartbeat().await {
        assert!(
            is_held_elsewhere(&error) && tokio::time::Instant::now() < deadline,
            "{error}"
        );
    }
}

/// A runtime whose node another process holds: every recovery round is refused, and
/// `first_recovery` waits for one that gets through — past two refusals here (it returned
/// after the first before) — until the holder dies; and a second such runtime's shutdown ends
/// its wait (a refused round then retried after the close began never counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_recovery_waits_out_a_held_node_or_ends_with_a_shutdown_sqlite() {
    let db = TestDatabase::new(Backend::Sqlite).await;
    drop(store(false, &db.url, "schema", WAIT).await);
    let holder = spawn_holder(false, &db.url);
    let runtime = |url: String| async move {
        std::sync::Arc::new(
            Runtime::builder()
                .store(
                    dacapo::store::SqliteStore::open(&url)
                        .await
                        .unwrap()
                        .node_id(NODE)
                        .node_timeout(Duration::from_millis(300)),
                )
                .build()
                .unwrap(),
        )
    };
    let (waiting, ended) = (runtime(db.url.clone()).await, runtime(db.url.clone()).await);
    let recovered = tokio::spawn({
        let waiting = std::sync::Arc::clone(&waiting);
        async move { waiting.first_recovery().await }
    });
    let shut_down = tokio::spawn({
        let ended = std::sync::Arc::clone(&ended);
        async move { ended.first_recovery().await }
    });
    // Two refusals of the node's own writes, each after its 300 ms wait: the first rounds,
    // begun before them, were refused by then.
    for _ in 0..2 {
        let refused = waiting.publish(&member_removed()).await.unwrap_err();
        assert!(
            matches!(refused, dacapo::Error::NodeHeld { .. }),
            "{refused}"
        );
    }
    assert!(!recovered.is_finished() && !shut_down.is_finished());

    let report = tokio::time::timeout(WAIT, ended.shutdown()).await.unwrap();
    assert!(report.pending_retries.is_empty());
    tokio::time::timeout(WAIT, shut_down)
        .await
        .expect("the shutdown ended the wait")
        .unwrap();
    kill(holder);
    tokio::time::timeout(WAIT, recovered)
        .await
        .expect("a round got through once the holder died")
        .unwrap();
    waiting.shutdown().await;
}

/// Opens its SQLite handler transaction, which holds the store's turn to write, says so, and
/// commits it once the gate opens.
struct HoldsTheTurn {
    opened: std::sync::Arc<tokio::sync::Notify>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Handler<support::MemberRemoved> for HoldsTheTurn {
    async fn handle(
        &self,
        _: &support::MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        use dacapo::transaction::HandlerTransactions;
        let Some(tx) = ctx.transaction::<dacapo::sqlx::Sqlite>().await? else {
            return Err(HandlerError::permanent("no handler transaction"));
        };
        self.opened.notify_one();
        self.gate.acquire().await?.forget();
        tx.commit().await?;
        Ok(())
    }
}

/// A heartbeat is stamped once its write has SQLite's turn, not before it waited behind a
/// handler transaction: stamped before, it said the node was last alive when it began to wait,
/// and other nodes could take a working node for dead. Nor does a beat stamped a little
/// earlier move the node's heartbeat back, while a clock stepped back does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_is_stamped_when_it_writes_and_never_moves_back_sqlite() {
    let clock = support_clock::ManualClock::default();
    let start = dacapo::ports::Clock::now(&clock);
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db
        .sqlite_store()
        .await
        .unwrap()
        .node_id(NODE)
        .clock(std::sync::Arc::new(clock.clone()));
    let opened = std::sync::Arc::new(tokio::sync::Notify::new());
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let runtime = Runtime::builder()
        .store(store.clone())
        .module(Module::new("m").handle_named::<support::MemberRemoved, _>(
            "holds",
            HoldsTheTurn {
                opened: std::sync::Arc::clone(&opened),
                gate: std::sync::Arc::clone(&gate),
            },
        ))
        .build()
        .unwrap();
    // The node is held from here: the beat below goes straight to its write.
    store.heartbeat().await.unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(WAIT, opened.notified())
        .await
        .expect("the handler opened its transaction");

    let mut beat = Box::pin(store.heartbeat());
    assert!(
        futures::poll!(&mut beat).is_pending(),
        "the beat waits for the handler transaction's turn"
    );
    let later = start + chrono::Duration::seconds(20);
    clock.set(later);
    gate.add_permits(1);
    tokio::time::timeout(WAIT, &mut beat)
        .await
        .unwrap()
        .unwrap();
    let stamped = || async {
        let (at,): (i64,) =
            dacapo::sqlx::query_as("SELECT heartbeat_at FROM dacapo_nodes WHERE id = $1")
                .bind(NODE)
                .fetch_one(store.pool())
                .await
                .unwrap();
        at
    };
    assert!(
        stamped().await >= later.timestamp_millis(),
        "stamped when it wrote"
    );

    // Two beats committed out of order: by less than a beat's interval (10 s of a node
    // timeout of 30 s).
    clock.set(later - chrono::Duration::seconds(5));
    store.heartbeat().await.unwrap();
    assert!(
        stamped().await >= later.timestamp_millis(),
        "a beat stamped a little earlier does not move it back"
    );
    // A clock stepped back a minute: the stamp follows it, or the node would stay alive to
    // the others for a minute after it stopped.
    let stepped_back = later - chrono::Duration::seconds(60);
    clock.set(stepped_back);
    store.heartbeat().await.unwrap();
    assert_eq!(stamped().await, stepped_back.timestamp_millis());
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    runtime.shutdown().await;
}

/// Runs until its gate opens, telling `started` once it runs.
struct WaitsAtTheGate {
    started: std::sync::Arc<tokio::sync::Notify>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Handler<support::MemberRemoved> for WaitsAtTheGate {
    async fn handle(
        &self,
        _: &support::MemberRemoved,
        _: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.started.notify_one();
        self.gate.acquire().await?.forget();
        Ok(())
    }
}

/// A node beats on through its shutdown's drain, while a handler still runs: lapsed, another
/// node would take the delivery (and its claims) for a dead node's and run it beside the
/// handler. The beats end before the node is released, so the stopped node leaves no row that
/// would make it look alive.
async fn a_node_keeps_its_heartbeat_through_a_shutdowns_drain(db: TestDatabase) {
    const HEARTBEAT: &str =
        "SELECT coalesce(max(heartbeat_at), 0) FROM dacapo_nodes WHERE id = 'orders-1'";
    let node_timeout = Duration::from_millis(300);
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let builder = Runtime::builder().drain_timeout(WAIT).module(
        Module::new("m").handle_named::<support::MemberRemoved, _>(
            "waits",
            WaitsAtTheGate {
                started: std::sync::Arc::clone(&started),
                gate: std::sync::Arc::clone(&gate),
            },
        ),
    );
    let runtime = db.store(builder, NODE, node_timeout).await.build().unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the handler started");

    let mut shutdown = Box::pin(runtime.shutdown());
    assert!(
        futures::poll!(&mut shutdown).is_pending(),
        "the drain waits for the handler"
    );
    assert!(
        runtime.publish(&member_removed()).await.is_err(),
        "the shutdown began"
    );
    let closed_at = db.scalar(HEARTBEAT).await;
    assert!(closed_at > 0, "the node beat before its shutdown");
    let lapse = i64::try_from(node_timeout.as_millis()).unwrap();
    tokio::time::timeout(WAIT, async {
        while db.scalar(HEARTBEAT).await <= closed_at + lapse {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the node's heartbeat went on past a node timeout into the drain");

    gate.add_permits(1);
    let report = tokio::time::timeout(WAIT, shutdown).await.unwrap();
    assert!(report.still_running.is_empty(), "{report:?}");
    assert_eq!(
        db.scalar(HEARTBEAT).await,
        0,
        "the stopped node is forgotten"
    );
}

on_both_backends!(
    a_node_keeps_its_heartbeat_through_a_shutdowns_drain_sqlite,
    a_node_keeps_its_heartbeat_through_a_shutdowns_drain_postgres,
    |db| a_node_keeps_its_heartbeat_through_a_shutdowns_drain(db).await
);

/// The store of `node` on `db`, with its own `node_timeout` and clock.
async fn timed_store(
    db: &TestDatabase,
    node: &str,
    node_timeout: Duration,
    clock: &support_clock::ManualClock,
) -> Box<dyn TimedStore> {
    let clock = std::sync::Arc::new(clock.clone());
    match db.backend {
        Backend::Sqlite => Box::new(
            db.sqlite()
                .await
                .node_id(node)
                .node_timeout(node_timeout)
                .clock(clock),
        ),
        Backend::Postgres => Box::new(
            db.postgres()
                .await
                .node_id(node)
                .node_timeout(node_timeout)
                .clock(clock),
        ),
    }
}

trait TimedStore: DurableInbox + Claims {}
impl<S: DurableInbox + Claims> TimedStore for S {}

/// A node is taken for alive for its own `node_timeout` after each beat, whatever the node
/// judging it was given: a node with a shorter timeout took a live node, beating on time for
/// its longer one, for dead, and ran its deliveries and claims beside it.
async fn a_node_is_alive_for_its_own_node_timeout(db: TestDatabase) {
    let (clock_a, clock_b) = (
        support_clock::ManualClock::default(),
        support_clock::ManualClock::default(),
    );
    let start = dacapo::ports::Clock::now(&clock_a);
    clock_b.set(start);
    let a = timed_store(&db, "a", Duration::from_secs(60), &clock_a).await;
    let b = timed_store(&db, "b", Duration::from_secs(1), &clock_b).await;
    let envelope = dacapo::Envelope::for_message(&member_removed()).unwrap();
    a.receive(&envelope).await.unwrap();
    a.heartbeat().await.unwrap();
    let claim = |now| {
        dacapo::ports::Claim::new(
            "m/h".to_owned(),
            "order-1".to_owned(),
            envelope.id,
            &envelope.payload,
            now,
            Duration::from_secs(3600),
        )
    };
    assert_eq!(
        a.claim(&claim(start)).await.unwrap(),
        dacapo::ports::ClaimOutcome::Claimed
    );
    // Older than `b`'s timeout, the delivery and the claim alike.
    db.execute("UPDATE dacapo_inbox SET received_at = 0").await;
    let never = chrono::DateTime::<chrono::Utc>::MAX_UTC;

    // 30 s on: past `b`'s timeout of 1 s, within `a`'s own 60 s.
    let within = start + chrono::Duration::seconds(30);
    clock_b.set(within);
    assert!(
        b.recover(10, never, true).await.unwrap().is_empty(),
        "a's delivery stays a's"
    );
    assert_eq!(
        b.claim(&claim(within)).await.unwrap(),
        dacapo::ports::ClaimOutcome::RunningElsewhere,
        "a's claim stays a's"
    );

    // Past a's own timeout too.
    let past = start + chrono::Duration::seconds(61);
    clock_b.set(past);
    let taken = b.recover(10, never, true).await.unwrap();
    assert_eq!(taken.len(), 1, "a's delivery is taken over");
    assert_eq!(
        b.claim(&claim(past)).await.unwrap(),
        dacapo::ports::ClaimOutcome::Claimed,
        "a's claim is taken over"
    );
}

on_both_backends!(
    a_node_is_alive_for_its_own_node_timeout_sqlite,
    a_node_is_alive_for_its_own_node_timeout_postgres,
    |db| a_node_is_alive_for_its_own_node_timeout(db).await
);
