//! The durable local queue: published messages survive a crash and a restart; handled ones are
//! cleaned up after their retention; several nodes share one database without handling an
//! envelope twice; a connection killed under the runtime does not stop it.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::{MemberRemoved, member_removed};
use tokio::sync::Notify;

const WAIT: Duration = Duration::from_secs(20);

/// The runtime's default: far longer than any stall of a loaded test machine.
const NODE_TIMEOUT: Duration = Duration::from_secs(30);

async fn until(mut done: impl FnMut() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("reached in time");
}

/// Counts its starts, then never finishes.
#[derive(Clone, Default)]
struct Stuck(Arc<AtomicUsize>, Arc<Notify>);

impl Handler<MemberRemoved> for Stuck {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1.notified().await;
        Ok(())
    }
}

on_both_backends!(
    published_messages_survive_a_crash_and_resume_under_the_same_node_sqlite,
    published_messages_survive_a_crash_and_resume_under_the_same_node_postgres,
    |db| {
        let stuck = Stuck::default();
        let crashed = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", stuck.clone()))
            .build()
            .unwrap();
        let mut ids = HashSet::new();
        for _ in 0..3 {
            ids.insert(crashed.publish(&member_removed()).await.unwrap());
        }
        until(|| stuck.0.load(Ordering::SeqCst) == 3).await;
        drop(crashed);

        // Same node name: the restart takes its own deliveries back at once, without waiting for
        // a heartbeat to expire (30 s here).
        let calls = Recorder::<MemberRemoved>::new();
        let restarted = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::from_millis(10),
                ..RetryPolicy::default()
            })
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        until(|| calls.count() == 3).await;
        let handled: HashSet<_> = calls.calls().iter().filter_map(|c| c.message_id).collect();
        assert_eq!(handled, ids);
        assert!(
            calls.calls().iter().all(|c| c.attempt == 2),
            "the interrupted attempt counted"
        );
        restarted.shutdown().await;
    }
);

on_both_backends!(
    handled_envelopes_are_removed_after_their_retention_sqlite,
    handled_envelopes_are_removed_after_their_retention_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .keep_after_handling(Duration::from_millis(1500))
            .cleanup_interval(Duration::from_millis(100))
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
            .build()
            .unwrap();
        for _ in 0..5 {
            runtime.publish(&member_removed()).await.unwrap();
        }
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(db.inbox_rows().await, 5, "kept for the retention");
        tokio::time::timeout(WAIT, async {
            while db.inbox_rows().await > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the cleanup actor removed them");
        runtime.shutdown().await;
    }
);

on_both_backends!(
    the_same_envelopes_on_two_nodes_at_once_are_each_handled_once_sqlite,
    the_same_envelopes_on_two_nodes_at_once_are_each_handled_once_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let node = |name: &'static str| {
            let calls = calls.clone();
            let db = &db;
            async move {
                db.store(Runtime::builder(), name, Duration::from_secs(30))
                    .await
                    .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls))
                    .build()
                    .unwrap()
            }
        };
        let (a, b) = (node("node-a").await, node("node-b").await);
        let envelopes: Vec<Envelope> = (0..40)
            .map(|_| Envelope::for_message(&member_removed()).unwrap())
            .collect();
        let (left, right) = tokio::join!(
            async {
                for envelope in &envelopes {
                    a.receive(envelope.clone()).await.unwrap();
                }
            },
            async {
                for envelope in envelopes.iter().rev() {
                    b.receive(envelope.clone()).await.unwrap();
                }
            }
        );
        let _ = (left, right);
        tokio::time::timeout(WAIT, async { tokio::join!(a.idle(), b.idle()) })
            .await
            .unwrap();
        let handled: Vec<_> = calls.calls().iter().filter_map(|c| c.message_id).collect();
        let unique: HashSet<_> = handled.iter().copied().collect();
        assert_eq!(
            handled.len(),
            40,
            "each envelope handled exactly once across both nodes"
        );
        assert_eq!(unique.len(), 40);
        assert_eq!(a.stats().deduplicated + b.stats().deduplicated, 40);
        a.shutdown().await;
        b.shutdown().await;
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_do_not_stop_the_runtime() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = db
        .store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();

    // Kill every connection the runtime holds, as a failover or an operator would.
    let admin = db.postgres().await;
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let killed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    )))
    .fetch_one(admin.pool())
    .await
    .unwrap();
    assert!(
        killed > 0,
        "the runtime's connections were found and killed"
    );

    // The next messages are persisted and handled on fresh connections.
    for _ in 0..3 {
        tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
            .await
            .unwrap()
            .unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(calls.count(), 4);
    runtime.shutdown().await;
}

on_both_backends!(
    two_nodes_taking_over_a_dead_nodes_rows_each_resume_a_row_once_sqlite,
    two_nodes_taking_over_a_dead_nodes_rows_each_resume_a_row_once_postgres,
    |db| {
        // Warnings (a store write retried, a recovery round failed) show if this test fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter("warn")
            .with_test_writer()
            .try_init();
        let stuck = Stuck::default();
        let dead = db
            .store(Runtime::builder(), "dead", NODE_TIMEOUT)
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", stuck.clone()))
            .build()
            .unwrap();
        let mut ids = HashSet::new();
        for _ in 0..30 {
            ids.insert(dead.publish(&member_removed()).await.unwrap());
        }
        until(|| stuck.0.load(Ordering::SeqCst) == 30).await;
        drop(dead);

        // Two survivors race to claim the dead node's rows (FOR UPDATE SKIP LOCKED on PostgreSQL,
        // SQLite's single writer otherwise), in batches of a few rows.
        let calls = Recorder::<MemberRemoved>::new();
        let mut survivors = Vec::new();
        for name in ["survivor-a", "survivor-b"] {
            survivors.push(
                db.store(Runtime::builder(), name, NODE_TIMEOUT)
                    .await
                    .recovery_interval(Duration::from_millis(50))
                    .recovery_batch(3)
                    .retry_policy(RetryPolicy {
                        min_retry_interval: Duration::from_millis(10),
                        ..RetryPolicy::default()
                    })
                    .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
                    .build()
                    .unwrap(),
            );
        }
        // The dead node went silent long ago, its rows received long ago: they are taken over
        // at once, while the survivors, on the default timeout, never take each other's over
        // when a loaded machine holds up a heartbeat of theirs (on a timeout of half a second,
        // they once did). Set again until its rows are resumed, in case a heartbeat of the
        // dead node's was still on its way.
        db.execute("UPDATE dacapo_inbox SET received_at = 0 WHERE owner = 'dead'")
            .await;
        tokio::time::timeout(WAIT, async {
            while calls.count() < 30 {
                db.execute(
                    "UPDATE dacapo_nodes SET heartbeat_at = 0, alive_until = 0 WHERE id = 'dead'",
                )
                .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("the dead node's rows resumed in time");
        for survivor in &survivors {
            tokio::time::timeout(WAIT, survivor.idle()).await.unwrap();
        }
        let handled: Vec<_> = calls.calls().iter().filter_map(|c| c.message_id).collect();
        assert_eq!(handled.len(), 30, "every row resumed exactly once");
        assert_eq!(handled.into_iter().collect::<HashSet<_>>(), ids);
        for survivor in survivors {
            survivor.shutdown().await;
        }
    }
);

on_both_backends!(
    a_live_node_is_never_taken_for_dead_between_far_apart_recovery_rounds_sqlite,
    a_live_node_is_never_taken_for_dead_between_far_apart_recovery_rounds_postgres,
    |db| {
        // Recovery every 10 s (the default), and presumed dead after 3 s without a heartbeat:
        // the heartbeat has a timer of its own, every second. (With 1 s, a test machine busy
        // with the tests around it once stalled a beat past the timeout.)
        let timeout = Duration::from_secs(3);
        let busy = Stuck::default();
        let live = db
            .store(Runtime::builder(), "live", timeout)
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", busy.clone()))
            .build()
            .unwrap();
        live.publish(&member_removed()).await.unwrap();
        until(|| busy.0.load(Ordering::SeqCst) == 1).await;

        let calls = Recorder::<MemberRemoved>::new();
        let watcher = db
            .store(Runtime::builder(), "watcher", timeout)
            .await
            .recovery_interval(Duration::from_millis(50))
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        // The live node's own heartbeats, read from its row, mark the time: once it has beaten
        // for two node timeouts while the watcher looked every 50 ms, the watcher had every
        // chance to take the delivery over.
        live_beats_for_two_timeouts(&db, timeout).await;
        assert!(
            calls.calls().is_empty(),
            "the watcher took over a delivery its live owner was still running"
        );
        busy.1.notify_one();
        tokio::time::timeout(WAIT, live.idle()).await.unwrap();
        watcher.shutdown().await;
        live.shutdown().await;
        assert_eq!(calls.calls().len(), 0);
    }
);

/// A recovery round that cannot go on (another process holds the inbox table's lock) does not
/// hold up the node's heartbeat: its timer beats on its own, whatever the rounds do. With the
/// recovery interval no longer than a third of the node timeout, only the rounds heartbeat
/// before, and a round stuck past the node timeout let others take the node for dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_recovery_round_does_not_stop_the_heartbeat_postgres() {
    use sqlx::Connection;
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let timeout = Duration::from_secs(3);
    let live = db
        .store(Runtime::builder(), "live", timeout)
        .await
        .recovery_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    live.first_recovery().await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    sqlx::query("LOCK TABLE dacapo_inbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *held)
        .await
        .unwrap();
    // The next round's heartbeat comes before it reads the inbox: once a beat is written
    // after the lock, a round is stuck behind it, and every beat after that is the timer's.
    live_beats_for_two_timeouts(&db, timeout).await;
    let stuck: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE relation = 'dacapo_inbox'::regclass AND NOT granted",
    )
    .fetch_one(&mut *held)
    .await
    .unwrap();
    assert!(stuck >= 1, "a round waits for the inbox table");
    held.rollback().await.unwrap();
    live.shutdown().await;
}

on_both_backends!(
    a_delivery_claimed_back_while_this_node_still_runs_it_is_not_run_twice_sqlite,
    a_delivery_claimed_back_while_this_node_still_runs_it_is_not_run_twice_postgres,
    |db| {
        let _ = support_warnings::warnings();
        let fails = FailsCounting::default();
        let live = db
            .store(Runtime::builder(), "live", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(50))
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::from_secs(600),
                ..RetryPolicy::default()
            })
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", fails.clone()))
            .build()
            .unwrap();
        let id = live.publish(&member_removed()).await.unwrap();
        until(|| fails.0.load(Ordering::SeqCst) == 1).await;
        // Its retry cools down here for ten minutes. Meanwhile, as after this node was taken for
        // dead (paused past its heartbeat), another node claimed it and died: the row is a dead
        // node's, claimable now, and this node's next round claims it back.
        db.execute(
            "UPDATE dacapo_inbox SET owner = 'gone', received_at = 0, execute_at = 0 \
             WHERE status = 'scheduled'",
        )
        .await;
        let claimed_back = || {
            support_warnings::warnings()
                .lock()
                .unwrap()
                .iter()
                .any(|w| w.contains("still runs") && w.contains(&id.to_string()))
        };
        until(claimed_back).await;
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_inbox WHERE owner = 'live'")
                .await,
            1
        );
        // Left to the supervisor cooling it down: not run again meanwhile.
        let report = live.shutdown().await;
        assert_eq!(fails.0.load(Ordering::SeqCst), 1);
        assert_eq!(report.pending_retries.len(), 1);
    }
);

/// Returns once node `live` has written heartbeats spanning two node timeouts (`timeout`),
/// as read from its row: the time others had to take it for dead, had it stopped beating.
async fn live_beats_for_two_timeouts(db: &support_stores::TestDatabase, timeout: Duration) {
    const BEAT: &str = "SELECT heartbeat_at FROM dacapo_nodes WHERE id = 'live'";
    let first = db.scalar(BEAT).await;
    let span = i64::try_from(2 * timeout.as_millis()).unwrap();
    tokio::time::timeout(WAIT, async {
        while db.scalar(BEAT).await < first + span {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("node live heartbeats for two node timeouts");
}

/// Counts its calls and fails every one.
#[derive(Clone, Default)]
struct FailsCounting(Arc<AtomicUsize>);

impl Handler<MemberRemoved> for FailsCounting {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err("down".into())
    }
}

on_both_backends!(
    a_node_whose_delivery_was_taken_over_does_not_attempt_it_again_sqlite,
    a_node_whose_delivery_was_taken_over_does_not_attempt_it_again_postgres,
    |db| {
        let calls = FailsCounting::default();
        let late = db
            .store(Runtime::builder(), "late", Duration::from_secs(30))
            .await
            // Long enough for the takeover below to land before the retry is due.
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::from_secs(2),
                ..RetryPolicy::default()
            })
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        let envelope = late
            .envelope(&member_removed(), SendOptions::default())
            .unwrap();
        let id = envelope.id;
        let report = late.receive_tracked(envelope).await.unwrap();
        tokio::time::timeout(WAIT, async {
            while db.inbox_status(id).await.as_deref() != Some("scheduled") {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the first attempt failed and its retry was recorded");
        // During the cooldown another node recovers the delivery, as it does once this node's
        // heartbeat has expired (a long pause, a partition).
        db.execute("UPDATE dacapo_inbox SET owner = 'other', attempts = 5, status = 'incoming'")
            .await;
        let report = tokio::time::timeout(WAIT, report).await.unwrap().unwrap();
        assert_eq!(
            report.outcome,
            dacapo::Outcome::Discarded(dacapo::DiscardReason::OwnedElsewhere)
        );
        assert_eq!(calls.0.load(Ordering::SeqCst), 1, "no second attempt here");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_inbox WHERE owner = 'other' AND attempts = 5 AND status = 'incoming'")
                .await,
            1,
            "the new owner's state is left as it wrote it"
        );
        late.shutdown().await;
    }
);

/// Runs a runtime on `store` through enough concurrent work that it opens connections of its
/// own, shuts it down, then queries the application's pool 100 times.
async fn use_the_pool_after_a_shutdown<D: dacapo::store::Dialect>(store: dacapo::store::SqlStore<D>)
where
    for<'c> &'c sqlx::Pool<D>: sqlx::Executor<'c, Database = D>,
    <D as sqlx::Database>::Arguments: sqlx::IntoArguments<D>,
{
    let calls = Recorder::<MemberRemoved>::new();
    let pool = store.pool().clone();
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap();
    let message = member_removed();
    let publishes: Vec<_> = (0..64).map(|_| runtime.publish(&message)).collect();
    for published in futures::future::join_all(publishes).await {
        published.unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(calls.count(), 64);
    runtime.shutdown().await;
    drop(runtime);
    for _ in 0..100 {
        sqlx::query("SELECT 1")
            .execute(&pool)
            .await
            .expect("the pool works after the shutdown");
    }
}

on_both_backends!(
    the_applications_pool_outlives_the_runtime_sqlite,
    the_applications_pool_outlives_the_runtime_postgres,
    |db| {
        match db.backend {
            support_stores::Backend::Sqlite => {
                use_the_pool_after_a_shutdown(db.sqlite().await).await
            }
            support_stores::Backend::Postgres => {
                use_the_pool_after_a_shutdown(db.postgres().await).await
            }
        }
    }
);

/// Its first call blocks its worker's thread until `unblock` is sent, as synchronous work does
/// (no shutdown can stop it); its second waits for ever, and says when it is dropped.
#[derive(Clone)]
struct BlockingThenWaiting {
    calls: Arc<AtomicUsize>,
    unblock: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>,
    dropped: Arc<Notify>,
}

/// Tells `dropped` when the future holding it is dropped.
struct OnDrop(Arc<Notify>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

impl Handler<MemberRemoved> for BlockingThenWaiting {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            let unblock = self.unblock.lock().unwrap();
            unblock
                .recv_timeout(WAIT)
                .expect("the test unblocks the first call");
        } else {
            let _dropped = OnDrop(Arc::clone(&self.dropped));
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

on_both_backends!(
    a_shutdown_past_its_drain_releases_no_delivery_whose_handler_still_runs_sqlite,
    a_shutdown_past_its_drain_releases_no_delivery_whose_handler_still_runs_postgres,
    |db| {
        // Released while its handler still ran, a delivery would be claimed at once by another
        // node sharing the database and run on both. The blocked call holds its worker past
        // the drain; the other worker's stop drops the second call, which marks the moment the
        // engine began to stop, after the release.
        let (unblock, blocked) = std::sync::mpsc::channel();
        let handler = BlockingThenWaiting {
            calls: Arc::default(),
            unblock: Arc::new(std::sync::Mutex::new(blocked)),
            dropped: Arc::default(),
        };
        let runtime = db
            .store(Runtime::builder(), "local", NODE_TIMEOUT)
            .await
            .workers(2)
            .drain_timeout(Duration::from_millis(50))
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", handler.clone()))
            .build()
            .unwrap();
        let blocking = runtime.publish(&member_removed()).await.unwrap();
        until(|| handler.calls.load(Ordering::SeqCst) == 1).await;
        // The first call holds one worker's thread: the second runs on the other.
        let dropped = runtime.publish(&member_removed()).await.unwrap();
        until(|| handler.calls.load(Ordering::SeqCst) == 2).await;
        let owner = async {
            tokio::time::timeout(WAIT, handler.dropped.notified())
                .await
                .expect("the engine stops the worker that is not blocked");
            let owner: Option<String> = db
                .value_for(
                    "SELECT owner FROM dacapo_inbox WHERE id = $1",
                    blocking.simple().to_string(),
                )
                .await;
            unblock.send(()).unwrap();
            owner
        };
        let (report, owner) = tokio::join!(runtime.shutdown(), owner);
        assert_eq!(report.still_running.len(), 2, "{report:?}");
        assert_eq!(
            owner.as_deref(),
            Some("local"),
            "released while its handler ran"
        );
        // Neither was released: the one whose handler the stop dropped stays this node's, as
        // after a crash, until its heartbeat, still there, expires (a restart under its name
        // takes it at once); the blocked one, unblocked, may have settled as the engine stopped.
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_inbox WHERE owner IS NULL AND status <> 'handled'"
            )
            .await,
            0
        );
        let owner: Option<String> = db
            .value_for(
                "SELECT owner FROM dacapo_inbox WHERE id = $1",
                dropped.simple().to_string(),
            )
            .await;
        assert_eq!(owner.as_deref(), Some("local"));
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_nodes WHERE id = 'local'")
                .await,
            1
        );
    }
);
