//! Handlers that do real I/O under the harness: a query through the store's pool, a reply from
//! another thread, a real sleep. The harness's clock is the runtime's own and moves only for
//! the runtime's timers, never while a handler runs, so none of this times out or races —
//! while cooldowns still pass at once, at their exact virtual times.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::{Fault, TestHarness};
use support::{Counter, MemberRemoved, member_removed};
use support_stores::{Backend, TestDatabase};

/// Queries the store, waits for a reply from a thread of its own, and sleeps a little: all in
/// real time, with a timeout (2 s) far above what that takes and far below a cooldown.
struct RealIo<P>(P);

async fn reply_from_a_thread() -> u64 {
    let (reply, replied) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(2));
        let _ = reply.send(42);
    });
    replied.await.unwrap_or_default()
}

impl Handler<MemberRemoved> for RealIo<dacapo::sqlx::SqlitePool> {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        let one: i64 = dacapo::sqlx::query_scalar("SELECT 1")
            .fetch_one(&self.0)
            .await?;
        assert_eq!(reply_from_a_thread().await, 42);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(one, 1);
        Ok(())
    }
}

impl Handler<MemberRemoved> for RealIo<dacapo::sqlx::PgPool> {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        let one: i32 = dacapo::sqlx::query_scalar("SELECT 1")
            .fetch_one(&self.0)
            .await?;
        assert_eq!(reply_from_a_thread().await, 42);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(one, 1);
        Ok(())
    }
}

/// Publishes 100 messages, one after another, and expects each handled on its first attempt.
async fn check(harness: &TestHarness) {
    for run in 0..100 {
        let report = harness.publish(&member_removed()).await.unwrap();
        assert!(
            report.is_handled() && report.attempts == 1,
            "run {run}: {report:?}"
        );
    }
}

/// A harness on `store` whose one handler is `handler`, with a 2 s timeout.
fn harness_with<S, H>(store: S, handler: H) -> TestHarness
where
    S: dacapo::ports::DurableInbox
        + dacapo::ports::DeadLetterStore
        + dacapo::ports::Claims
        + dacapo::ports::OutboxStore,
    H: Handler<MemberRemoved>,
{
    TestHarness::builder()
        .configure(|builder| builder.store(store))
        .handler_timeout(Duration::from_secs(2))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("io", handler))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_doing_real_io_passes_a_hundred_runs_in_a_hundred_on_sqlite() {
    let db = TestDatabase::new(Backend::Sqlite).await;
    let store = db.sqlite().await;
    let pool = store.pool().clone();
    let harness = harness_with(store, RealIo(pool));
    check(&harness).await;
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_doing_real_io_passes_a_hundred_runs_in_a_hundred_on_postgres() {
    let db = TestDatabase::new(Backend::Postgres).await;
    let store = db.postgres().await;
    let pool = store.pool().clone();
    let harness = harness_with(store, RealIo(pool));
    check(&harness).await;
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cooldowns_beside_real_io_pass_at_once_at_their_exact_virtual_times() {
    let db = TestDatabase::new(Backend::Sqlite).await;
    let store = db.sqlite().await;
    let pool = store.pool().clone();
    let harness = TestHarness::builder()
        .configure(|builder| builder.store(store))
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("io", RealIo(pool))
                .handle_named::<MemberRemoved, _>("flaky", dacapo::testing::Recorder::new()),
        )
        .fault("m", "flaky", Fault::fail_times(3))
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(
        report.cooldowns(),
        [
            Duration::from_secs(1),
            Duration::from_secs(6),
            Duration::from_secs(16)
        ]
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "23 virtual seconds, not real ones"
    );
    assert!(harness.elapsed() >= Duration::from_secs(23));
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_times_out_at_its_exact_virtual_time() {
    let harness = TestHarness::builder()
        .handler_timeout(Duration::from_secs(30))
        .retry_policy(RetryPolicy::no_retries())
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("stuck", dacapo::testing::Recorder::new()),
        )
        .fault("m", "stuck", Fault::always_hang())
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let report = harness.publish(&member_removed()).await.unwrap();
    let failure = report.failures[0].failures[0].clone();
    assert_eq!(failure.kind, FailureKind::TimedOut(Duration::from_secs(30)));
    assert_eq!(harness.elapsed(), Duration::from_secs(30));
    assert!(started.elapsed() < Duration::from_secs(10));
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advancing_the_clock_moves_it_by_exactly_that() {
    let harness = TestHarness::builder().build().unwrap();
    assert_eq!(harness.elapsed(), Duration::ZERO);
    harness.advance(Duration::from_secs(90)).await.unwrap();
    assert_eq!(harness.elapsed(), Duration::from_secs(90));
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scratch_database_is_fresh_per_test_and_gone_afterwards() {
    use dacapo::testing::ScratchDatabase;

    let sqlite = ScratchDatabase::sqlite();
    let store = sqlite.sqlite_store().await.unwrap();
    let rows: i64 = dacapo::sqlx::query_scalar("SELECT count(*) FROM dacapo_inbox")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 0);
    let file = std::path::PathBuf::from(sqlite.url());
    assert!(file.exists());
    store.pool().close().await;
    drop(store);
    drop(sqlite);
    assert!(!file.exists(), "the file is removed with it");

    let admin = std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let postgres = ScratchDatabase::postgres(&admin).await.unwrap();
    let name = postgres.url().rsplit('/').next().unwrap().to_owned();
    let store = postgres.postgres_store().await.unwrap();
    store.pool().close().await;
    drop(store);
    drop(postgres);
    let admin_pool = dacapo::sqlx::PgPool::connect(&admin).await.unwrap();
    let left: i64 =
        dacapo::sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
            .bind(&name)
            .fetch_one(&admin_pool)
            .await
            .unwrap();
    assert_eq!(left, 0, "the database is dropped with it");
}

/// The inbox's cleanup round runs on the harness's clock: an `advance` past its tick returns
/// with its deletes made, so a test can look at once (the round ran on after `advance` had
/// returned before, and the handled row was still there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advance_past_a_cleanup_round_returns_with_its_deletes_made() {
    use dacapo::testing::{ScratchDatabase, StoreFault};

    let scratch = ScratchDatabase::sqlite();
    let store = scratch.sqlite_store().await.unwrap();
    let handled = |pool: dacapo::sqlx::SqlitePool| async move {
        dacapo::sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let harness = TestHarness::builder()
        .store(store.clone())
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .configure(|runtime| {
            runtime
                .keep_after_handling(Duration::from_secs(60))
                .cleanup_interval(Duration::from_secs(7))
        })
        .build()
        .unwrap();
    for _ in 0..50 {
        assert!(
            harness
                .publish(&member_removed())
                .await
                .unwrap()
                .is_handled()
        );
    }
    assert_eq!(handled(store.pool().clone()).await, 50);

    harness.advance(Duration::from_secs(61)).await.unwrap();
    assert_eq!(handled(store.pool().clone()).await, 50, "kept for 60 s");
    // A slow store: the round's delete outlasts the tick that started it. No other round is
    // due between 61 s and 64 s (recovery and the heartbeat come every 10 s).
    harness
        .store_fault(StoreFault::slow_commits(Duration::from_millis(300)))
        .unwrap();
    harness.advance(Duration::from_secs(3)).await.unwrap();
    assert_eq!(
        handled(store.pool().clone()).await,
        0,
        "removed by the round at 63 s"
    );
    harness.shutdown().await;
}

/// The cleanup forgets nodes silent for a day: killed nodes under random names (the default)
/// piled up in `dacapo_nodes` for good, read by every claim. A node with no row is as stopped
/// as one whose heartbeat expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_forgets_nodes_silent_for_a_day() {
    use dacapo::testing::ScratchDatabase;

    let scratch = ScratchDatabase::sqlite();
    let store = scratch.sqlite_store().await.unwrap();
    let harness = TestHarness::builder()
        .store(store.clone())
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .configure(|runtime| runtime.cleanup_interval(Duration::from_secs(7)))
        .build()
        .unwrap();
    // Its first recovery round heartbeats, which creates the table.
    harness.advance(Duration::from_secs(1)).await.unwrap();
    let pool = store.pool().clone();
    for (node, heartbeat_at) in [("killed long ago", 0_i64), ("beats later", i64::MAX)] {
        dacapo::sqlx::query("INSERT INTO dacapo_nodes (id, heartbeat_at) VALUES ($1, $2)")
            .bind(node)
            .bind(heartbeat_at)
            .execute(&pool)
            .await
            .unwrap();
    }

    harness.advance(Duration::from_secs(7)).await.unwrap();

    let nodes: Vec<String> = dacapo::sqlx::query_scalar("SELECT id FROM dacapo_nodes ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        !nodes.iter().any(|node| node == "killed long ago"),
        "{nodes:?}"
    );
    assert!(nodes.iter().any(|node| node == "beats later"), "{nodes:?}");
    assert!(
        nodes.iter().any(|node| node == store.node()),
        "the live node stays: {nodes:?}"
    );
    harness.shutdown().await;
}

/// `advance`'s bound is each wait's, not the span's: an hour of background rounds on a real
/// store (the relay polls every 200 ms) takes longer in real time than the settle timeout
/// allows a stuck wait, and is not cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_advance_of_quick_rounds_is_not_cut_short() {
    use dacapo::testing::ScratchDatabase;

    let scratch = ScratchDatabase::sqlite();
    let harness = TestHarness::builder()
        .store(scratch.sqlite_store().await.unwrap())
        .settle_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let started = std::time::Instant::now();

    harness.advance(Duration::from_secs(3600)).await.unwrap();

    assert_eq!(harness.elapsed(), Duration::from_secs(3600));
    // Not a bound on the test: what makes it a test of the span's bound.
    println!("an hour of rounds took {:?}", started.elapsed());
    harness.shutdown().await;
}

/// The claims kept in a store of their own are heartbeaten by the reaper, which forgets that
/// store's silent nodes on the store's own clock: under the harness, the runtime's clock is
/// virtual, and a day advanced on it took the live node itself for silent, and deleted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_their_own_keep_their_live_node_however_far_the_harness_advances() {
    use dacapo::testing::ScratchDatabase;

    let scratch = ScratchDatabase::sqlite();
    let claims = scratch
        .sqlite_store()
        .await
        .unwrap()
        .node_id("claims-node")
        .node_timeout(Duration::from_secs(3600));
    let pool = claims.pool().clone();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .configure(|runtime| {
            runtime
                .claims(std::sync::Arc::new(claims))
                .enable_deduplication()
        })
        .build()
        .unwrap();
    let beaten = || async {
        dacapo::sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM dacapo_nodes WHERE id = 'claims-node'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        while beaten().await == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the reaper heartbeats the claims' store");

    harness
        .advance(Duration::from_secs(25 * 3600))
        .await
        .unwrap();

    assert_eq!(beaten().await, 1, "the live node is not forgotten");
    harness.shutdown().await;
}
