//! Logical deduplication on a real SQLite file and a real PostgreSQL server: claims only when
//! enabled, held across restarts and nodes, one effect when two nodes claim at once, per
//! handler, released by a failed handler, fingerprinted against conflicts, taken over after the
//! window, reaped in batches.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/manual_clock.rs"]
mod support_clock;
#[path = "support/stores.rs"]
mod support_stores;

use support_clock::ManualClock;

use std::time::Duration;

use dacapo::prelude::*;
use support::{Counter, MemberRemoved, member_removed};

const WAIT: Duration = Duration::from_secs(20);

fn deduplicated(effects: &Counter) -> Module {
    Module::new("workspaces")
        .handle_named::<MemberRemoved, _>("revoke", effects.clone())
        .deduplicate("revoke", Deduplication::from_envelope())
}

fn keyed(id: &str) -> SendOptions {
    SendOptions::new().deduplication_id(id)
}

on_both_backends!(
    with_deduplication_off_there_is_no_claims_table_sqlite,
    with_deduplication_off_there_is_no_claims_table_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
            .build()
            .unwrap();
        runtime.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        runtime.shutdown().await;
        assert!(db.has_table("dacapo_inbox").await);
        assert!(!db.has_table("dacapo_deduplication").await);
    }
);

on_both_backends!(
    a_claim_holds_across_restarts_and_nodes_sqlite,
    a_claim_holds_across_restarts_and_nodes_postgres,
    |db| {
        let effects = Counter::default();
        let node = |name: &'static str| {
            let (db, effects) = (&db, effects.clone());
            async move {
                db.store(Runtime::builder(), name, Duration::from_secs(30))
                    .await
                    .enable_deduplication()
                    .module(deduplicated(&effects))
                    .build()
                    .unwrap()
            }
        };
        let first = node("node-a").await;
        first
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, first.idle()).await.unwrap();
        first.shutdown().await;
        assert!(
            db.has_table("dacapo_deduplication").await,
            "enabling provisioned the table"
        );

        let second = node("node-b").await;
        second
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        second
            .publish_with(&member_removed(), keyed("remove-8"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, second.idle()).await.unwrap();
        assert_eq!(effects.count(), 2, "remove-7 once, remove-8 once");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            2
        );
        let (key, hash): (String, String) = match db.backend {
            support_stores::Backend::Sqlite => sqlx::query_as(
                "SELECT key, key_hash FROM dacapo_deduplication ORDER BY key LIMIT 1",
            )
            .fetch_one(db.sqlite().await.pool())
            .await
            .unwrap(),
            support_stores::Backend::Postgres => sqlx::query_as(
                "SELECT key, key_hash FROM dacapo_deduplication ORDER BY key LIMIT 1",
            )
            .fetch_one(db.postgres().await.pool())
            .await
            .unwrap(),
        };
        assert_eq!(key, "remove-7", "kept in clear for people");
        assert_eq!(hash.len(), 64, "compared hashed");
        second.shutdown().await;
    }
);

on_both_backends!(
    two_nodes_claiming_one_id_at_the_same_moment_make_one_effect_sqlite,
    two_nodes_claiming_one_id_at_the_same_moment_make_one_effect_postgres,
    |db| {
        let effects = Counter::default();
        let mut nodes = Vec::new();
        for name in ["node-a", "node-b"] {
            nodes.push(
                db.store(Runtime::builder(), name, Duration::from_secs(30))
                    .await
                    .enable_deduplication()
                    .module(deduplicated(&effects))
                    .build()
                    .unwrap(),
            );
        }
        // Different envelopes (the inbox cannot help), one intent, on both nodes at once.
        for round in 0..10 {
            let key = format!("intent-{round}");
            let message = member_removed();
            let (a, b) = tokio::join!(
                nodes[0].publish_with(&message, keyed(&key)),
                nodes[1].publish_with(&message, keyed(&key)),
            );
            a.unwrap();
            b.unwrap();
        }
        for node in &nodes {
            tokio::time::timeout(WAIT, node.idle()).await.unwrap();
        }
        assert_eq!(effects.count(), 10, "one effect per intent");
        for node in nodes {
            node.shutdown().await;
        }
    }
);

on_both_backends!(
    past_the_window_an_unreaped_claim_is_taken_over_and_expired_claims_are_reaped_sqlite,
    past_the_window_an_unreaped_claim_is_taken_over_and_expired_claims_are_reaped_postgres,
    |db| {
        let effects = Counter::default();
        let clock = ManualClock::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .clock(std::sync::Arc::new(clock.clone()))
            .enable_deduplication()
            .deduplication_window(Duration::from_secs(3600))
            .deduplication_reap_interval(Duration::from_secs(3600))
            .module(deduplicated(&effects))
            .build()
            .unwrap();
        runtime
            .publish_with(&member_removed(), keyed("k"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        clock.advance(chrono::Duration::minutes(61));
        runtime
            .publish_with(&member_removed(), keyed("k"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            effects.count(),
            2,
            "taken over atomically, though no reaper ran"
        );
        runtime.shutdown().await;

        let reaping = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .clock(std::sync::Arc::new(clock.clone()))
            .enable_deduplication()
            .deduplication_window(Duration::from_secs(3600))
            .deduplication_reap_interval(Duration::from_millis(100))
            .module(deduplicated(&effects))
            .build()
            .unwrap();
        for round in 0..3 {
            let message = member_removed();
            reaping
                .publish_with(&message, keyed(&format!("r{round}")))
                .await
                .unwrap();
        }
        tokio::time::timeout(WAIT, reaping.idle()).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            4
        );
        clock.advance(chrono::Duration::hours(3));
        tokio::time::timeout(WAIT, async {
            while db.scalar("SELECT count(*) FROM dacapo_deduplication").await > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the reaper removed every expired claim");
        reaping.shutdown().await;
    }
);

/// Counts its starts; never finishes while `stuck`.
#[derive(Clone, Default)]
struct Stuck {
    starts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    never: std::sync::Arc<tokio::sync::Notify>,
}

impl Handler<MemberRemoved> for Stuck {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.starts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.never.notified().await;
        Ok(())
    }
}

on_both_backends!(
    a_crash_inside_a_deduplicated_handler_does_not_lose_its_effect_sqlite,
    a_crash_inside_a_deduplicated_handler_does_not_lose_its_effect_postgres,
    |db| {
        let stuck = Stuck::default();
        let crashed = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", stuck.clone())
                    .deduplicate("revoke", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        crashed
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while stuck.starts.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
        // The claim is taken, the effect not done, and the process is gone.
        drop(crashed);

        let effects = Counter::default();
        let restarted = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::from_millis(10),
                ..RetryPolicy::default()
            })
            .module(deduplicated(&effects))
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while effects.count() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the recovered delivery took over its own uncompleted claim");
        // A new delivery of the same intent is still a duplicate.
        restarted
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, restarted.idle()).await.unwrap();
        assert_eq!(effects.count(), 1);
        restarted.shutdown().await;
    }
);

/// Fails while it has failures left; counts its calls and the calls that succeed.
#[derive(Clone, Default)]
struct Failing {
    failures_left: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    effects: Counter,
}

impl Failing {
    fn failures(count: usize) -> Self {
        let failing = Self::default();
        failing.set_failures(count);
        failing
    }

    fn set_failures(&self, count: usize) {
        self.failures_left
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Handler<MemberRemoved> for Failing {
    async fn handle(
        &self,
        message: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        if self
            .failures_left
            .fetch_update(SeqCst, SeqCst, |left| left.checked_sub(1))
            .is_ok()
        {
            return Err("the directory service is down".into());
        }
        self.effects.handle(message, context).await
    }
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy {
        retry_limit: 2,
        min_retry_interval: Duration::from_millis(10),
        retry_interval_delta: Duration::from_millis(10),
        max_retry_interval: Duration::from_millis(50),
    }
}

on_both_backends!(
    claims_are_per_handler_and_a_retry_gets_through_its_own_sqlite,
    claims_are_per_handler_and_a_retry_gets_through_its_own_postgres,
    |db| {
        let (revoke, audit) = (Failing::failures(1), Counter::default());
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .retry_policy(quick_retries())
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", revoke.clone())
                    .deduplicate("revoke", Deduplication::from_envelope()),
            )
            .module(
                Module::new("compliance")
                    .handle_named::<MemberRemoved, _>("audit", audit.clone())
                    .deduplicate("audit", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            revoke.calls.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "the retry was not discarded as a duplicate of its own failure"
        );
        assert_eq!(
            (revoke.effects.count(), audit.count()),
            (1, 1),
            "the retry reran every handler, and the one that had succeeded found its claim held"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            2,
            "one claim per handler for the one logical id"
        );
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!((revoke.effects.count(), audit.count()), (1, 1));
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            0
        );
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_claimed_id_with_a_different_payload_is_a_conflict_sqlite,
    a_claimed_id_with_a_different_payload_is_a_conflict_postgres,
    |db| {
        let (logged, strict) = (Counter::default(), Counter::default());
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("logged", logged.clone())
                    .handle_named::<MemberRemoved, _>("strict", strict.clone())
                    .deduplicate("logged", Deduplication::from_envelope())
                    .deduplicate(
                        "strict",
                        Deduplication::from_envelope().dead_letter_conflicts(),
                    ),
            )
            .build()
            .unwrap();
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            0,
            "the same payload again is a plain duplicate"
        );
        let other = MemberRemoved {
            member_id: 8,
            ..member_removed()
        };
        runtime
            .publish_with(&other, keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            1,
            "the strict handler dead-letters the conflict"
        );
        assert_eq!((logged.count(), strict.count()), (1, 1));
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_key_the_store_cannot_hold_is_dead_lettered_at_once_not_retried_sqlite,
    a_key_the_store_cannot_hold_is_dead_lettered_at_once_not_retried_postgres,
    |db| {
        let revoke = Counter::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .retry_policy(quick_retries())
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", revoke.clone())
                    .deduplicate(
                        "revoke",
                        // PostgreSQL's text holds no NUL; SQLite's does.
                        Deduplication::by_key(|m: &MemberRemoved| {
                            Some(format!("member\0{}", m.member_id))
                        }),
                    ),
            )
            .build()
            .unwrap();
        runtime.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        match db.backend {
            support_stores::Backend::Sqlite => {
                assert_eq!(revoke.count(), 1, "SQLite keeps the key");
                assert_eq!(
                    db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
                    0
                );
            }
            support_stores::Backend::Postgres => {
                assert_eq!(revoke.count(), 0, "the claim comes before the handler");
                let letters = runtime.dead_letters().list().await.unwrap();
                assert_eq!(letters.len(), 1);
                assert_eq!(
                    (letters[0].attempts, &letters[0].reason),
                    (1, &DeadLetterReason::Permanent),
                    "dead-lettered after its first attempt: every retry would be refused alike"
                );
                let failures = format!("{:?}", letters[0].failures);
                assert!(failures.contains("refused by the store"), "{failures}");
            }
        }
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_dead_lettered_message_releases_its_claim_for_a_new_delivery_sqlite,
    a_dead_lettered_message_releases_its_claim_for_a_new_delivery_postgres,
    |db| {
        let revoke = Failing::failures(usize::MAX);
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .retry_policy(RetryPolicy {
                retry_limit: 1,
                ..quick_retries()
            })
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", revoke.clone())
                    .deduplicate("revoke", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            1
        );
        // The intent was never carried out, so a new delivery of it must get through.
        revoke.set_failures(0);
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(revoke.effects.count(), 1);
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_claim_a_dead_node_never_completed_is_taken_over_by_a_new_delivery_sqlite,
    a_claim_a_dead_node_never_completed_is_taken_over_by_a_new_delivery_postgres,
    |db| {
        let effects = Counter::default();
        let runtime = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .module(deduplicated(&effects))
            .build()
            .unwrap();
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        // As a node that died while its handler ran leaves it: claimed, never completed, by a
        // node with no heartbeat. Its envelope may never come back (acknowledged, in an inbox
        // of that node's own), so the intent, sent again, must get through.
        db.execute("UPDATE dacapo_deduplication SET completed = 0, node = 'gone'")
            .await;
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(effects.count(), 2, "the intent sent again ran");
        assert_eq!(runtime.stats().duplicate_intents, 0);
        // Now held by a live node: the next copy is a duplicate.
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(effects.count(), 2);
        assert_eq!(runtime.stats().duplicate_intents, 1);
        // A claim of a version before claims named their node names none to judge: only its
        // own envelope takes it over, and a new one is a duplicate while it holds.
        db.execute("UPDATE dacapo_deduplication SET completed = 0, node = ''")
            .await;
        runtime
            .publish_with(&member_removed(), keyed("remove-7"))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(effects.count(), 2);
        assert_eq!(runtime.stats().duplicate_intents, 2);
        runtime.shutdown().await;
    }
);

/// A claim taken over (it had expired, and another message claims its id anew) while the
/// reaper waits for that row's lock: the reaper, on PostgreSQL, checks the row again and
/// leaves the new claim, which keeps stopping the intent's duplicates. (It chose the row while
/// it was expired; checked against its choice alone, it deleted the fresh claim.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_leaves_a_claim_taken_over_while_it_waited() {
    use dacapo::ports::Claims;
    use sqlx::Connection;
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let store = std::sync::Arc::new(db.postgres().await);
    store.provision().await.unwrap();
    db.execute(
        "INSERT INTO dacapo_deduplication \
         (handler, key_hash, key, fingerprint, envelope_id, node, completed, claimed_at, expires_at) \
         VALUES ('h', 'k', 'order-1', 'f', 'first', 'node-a', 1, 0, 1)",
    )
    .await;

    let mut takeover = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut takeover).await.unwrap();
    sqlx::query(
        "UPDATE dacapo_deduplication SET envelope_id = 'second', completed = 0, \
         claimed_at = 2, expires_at = 9000000000000000 WHERE handler = 'h' AND key_hash = 'k'",
    )
    .execute(&mut takeover)
    .await
    .unwrap();
    let reaping = tokio::spawn({
        let store = std::sync::Arc::clone(&store);
        async move { store.reap(chrono::Utc::now(), 100).await }
    });
    db.until_a_session_waits_for_a_lock(WAIT, "the reaper waits for the claim's lock")
        .await;
    sqlx::query("COMMIT").execute(&mut takeover).await.unwrap();
    let reaped = tokio::time::timeout(WAIT, reaping)
        .await
        .expect("the reaper ends once the takeover committed")
        .unwrap()
        .unwrap();
    assert_eq!(reaped, 0);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_deduplication WHERE envelope_id = 'second'")
            .await,
        1,
        "the new claim is kept"
    );
}

/// Counts its calls; the first waits for the gate, having said it started.
#[derive(Clone)]
struct FirstHeldOpen {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    started: std::sync::Arc<tokio::sync::Notify>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Handler<MemberRemoved> for FirstHeldOpen {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if call == 0 {
            self.started.notify_one();
            self.gate.acquire().await?.forget();
        }
        Ok(())
    }
}

/// Claims kept in a store that no recovery heartbeats (each node's inbox is a SQLite file of
/// its own; the claims are shared on PostgreSQL) are heartbeaten by the runtime: a node that
/// receives an envelope another still runs finds its claim held. Before, no node was alive to
/// the claims' store, and the second took the claim over and ran the handler beside the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_in_a_shared_store_is_not_taken_over_from_a_node_still_running_it() {
    use dacapo::ports::Claims;
    let shared = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (a_inbox, b_inbox) = (
        support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await,
        support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await,
    );
    let handler = FirstHeldOpen {
        calls: Default::default(),
        started: Default::default(),
        gate: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let node = |inbox: dacapo::store::SqliteStore, claims: dacapo::store::PostgresStore| {
        Runtime::builder()
            .store(inbox)
            .claims(std::sync::Arc::new(claims) as std::sync::Arc<dyn Claims>)
            .enable_deduplication()
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::from_millis(50),
                ..RetryPolicy::default()
            })
            .module(deduplicated_by(&handler))
            .build()
            .unwrap()
    };
    let a = node(
        a_inbox.sqlite().await,
        shared.postgres().await.node_id("node-a"),
    );
    tokio::time::timeout(WAIT, async {
        while !heartbeaten(&shared, "node-a").await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("node a heartbeats the claims' store");
    let b = node(
        b_inbox.sqlite().await,
        shared.postgres().await.node_id("node-b"),
    );
    let mut envelope = Envelope::for_message(&member_removed()).unwrap();
    envelope.deduplication_id = Some("revoke|member-7".into());

    a.receive(envelope.clone()).await.unwrap();
    tokio::time::timeout(WAIT, handler.started.notified())
        .await
        .expect("node a runs the handler");
    // The broker delivers it to node b too (a redelivery after its ack wait, say). Its
    // attempt either finds the claim held, fails and waits for a retry, or takes the claim
    // over and runs the handler beside node a's.
    b.receive(envelope).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while b.stats().retried == 0 && handler.calls.load(std::sync::atomic::Ordering::SeqCst) < 2
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("node b's attempt ran");
    handler.gate.add_permits(1);
    tokio::time::timeout(WAIT, async {
        a.idle().await;
        b.idle().await;
    })
    .await
    .expect("both settle");

    assert_eq!(
        handler.calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one effect of one intent"
    );
    a.shutdown().await;
    b.shutdown().await;
}

fn deduplicated_by(handler: &FirstHeldOpen) -> Module {
    Module::new("workspaces")
        .handle_named::<MemberRemoved, _>("revoke", handler.clone())
        .deduplicate("revoke", Deduplication::from_envelope())
}

/// Whether `node` has a heartbeat in the database of `db`.
async fn heartbeaten(db: &support_stores::TestDatabase, node: &str) -> bool {
    let pool = dacapo::sqlx::PgPool::connect(&db.url).await.unwrap();
    let present = dacapo::sqlx::query("SELECT 1 FROM dacapo_nodes WHERE id = $1")
        .bind(node)
        .fetch_optional(&pool)
        .await
        .ok()
        .flatten()
        .is_some();
    pool.close().await;
    present
}
