//! Nothing lost when a runtime dies between two steps of a delivery, on a real SQLite file and a
//! real PostgreSQL server: what a succeeded handler published survives the crash, a replay
//! never deletes the dead letter it made, a crashed last attempt frees its logical id, and a
//! node that lost a delivery writes nothing more of it.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use dacapo::transaction::HandlerTransactions;
use dacapo::{DiscardReason, Outcome, RetryScope};
use serde::{Deserialize, Serialize};
use support::{Counter, MemberRemoved, member_removed};
use support_stores::Backend;
use tokio::sync::{Notify, oneshot};

const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Announced {
    member_id: u64,
}

impl Message for Announced {
    const TYPE: &'static str = "nothing_lost.announced";
}

/// Signals once that it was called, then never finishes: the runtime dies under it.
#[derive(Clone)]
struct Stuck {
    started: Arc<Mutex<Option<oneshot::Sender<()>>>>,
}

impl Stuck {
    fn new() -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                started: Arc::new(Mutex::new(Some(tx))),
            },
            rx,
        )
    }
}

impl<M: Message> Handler<M> for Stuck {
    async fn handle(&self, _: &M, _: &MessageContext) -> Result<(), HandlerError> {
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// Publishes an announcement inside its handler transaction, then commits: the seed's
/// "rows already there → return early" handler, which publishes nothing on a rerun.
struct AnnounceInTransaction {
    backend: Backend,
    committed: Arc<Notify>,
}

impl Handler<MemberRemoved> for AnnounceInTransaction {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let announced = Announced {
            member_id: event.member_id,
        };
        match self.backend {
            Backend::Sqlite => {
                let Some(tx) = ctx.transaction::<sqlx::Sqlite>().await? else {
                    return Ok(());
                };
                ctx.publish(&announced).await?;
                tx.commit().await?;
            }
            Backend::Postgres => {
                let Some(tx) = ctx.transaction::<sqlx::Postgres>().await? else {
                    return Ok(());
                };
                ctx.publish(&announced).await?;
                tx.commit().await?;
            }
        }
        self.committed.notify_one();
        Ok(())
    }
}

/// Publishes an announcement without a transaction and succeeds.
struct Announce;

impl Handler<MemberRemoved> for Announce {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        ctx.publish(&Announced {
            member_id: event.member_id,
        })
        .await?;
        Ok(())
    }
}

/// Fails its first call and signals it; succeeds after.
struct FailFirst(Mutex<Option<oneshot::Sender<()>>>);

impl Handler<MemberRemoved> for FailFirst {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if let Some(failed) = self.0.lock().unwrap().take() {
            let _ = failed.send(());
            return Err("the first attempt fails".into());
        }
        Ok(())
    }
}

async fn until(mut done: impl FnMut() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("in time");
}

on_both_backends!(
    what_a_handler_transaction_published_survives_a_crash_before_the_delivery_settles_sqlite,
    what_a_handler_transaction_published_survives_a_crash_before_the_delivery_settles_postgres,
    |db| {
        let committed = Arc::new(Notify::new());
        let (stuck, stuck_started) = Stuck::new();
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_millis(600))
            .await
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>(
                "queue",
                AnnounceInTransaction {
                    backend: db.backend,
                    committed: Arc::clone(&committed),
                },
            ))
            .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", stuck))
            // Had its relay already handed the announcement to this node, the survivor takes
            // that delivery over.
            .module(Module::new("audit").handle_named::<Announced, _>("ignore", Stuck::new().0))
            .build()
            .unwrap();
        crashed.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, committed.notified())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, stuck_started)
            .await
            .unwrap()
            .unwrap();
        // Gone without a shutdown, its delivery unsettled.
        drop(crashed);

        let announcements = Recorder::<Announced>::new();
        let survivor = db
            .store(Runtime::builder(), "node-b", Duration::from_millis(600))
            .await
            .recovery_interval(Duration::from_millis(100))
            .relay_interval(Duration::from_millis(50))
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>(
                "queue",
                AnnounceInTransaction {
                    backend: db.backend,
                    committed: Arc::new(Notify::new()),
                },
            ))
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
            )
            .module(
                Module::new("audit").handle_named::<Announced, _>("ignore", announcements.clone()),
            )
            .build()
            .unwrap();
        until(|| announcements.count() >= 1).await;
        tokio::time::timeout(WAIT, survivor.idle()).await.unwrap();
        assert_eq!(
            announcements.count(),
            1,
            "published once, not lost, not twice"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox").await,
            1,
            "one outbox row: the transaction's"
        );
        survivor.shutdown().await;
    }
);

on_both_backends!(
    what_a_succeeded_handler_published_survives_a_crash_during_the_cooldown_sqlite,
    what_a_succeeded_handler_published_survives_a_crash_during_the_cooldown_postgres,
    |db| {
        let policy = RetryPolicy {
            min_retry_interval: Duration::from_secs(3600),
            max_retry_interval: Duration::from_secs(3600),
            ..RetryPolicy::default()
        };
        let (failed, failed_rx) = oneshot::channel();
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_millis(600))
            .await
            .retry_scope(RetryScope::FailedHandlers)
            .retry_policy(policy)
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", Announce))
            .module(
                Module::new("workspaces").handle_named::<MemberRemoved, _>(
                    "revoke",
                    FailFirst(Mutex::new(Some(failed))),
                ),
            )
            .module(Module::new("audit").handle_named::<Announced, _>("ignore", Counter::default()))
            .build()
            .unwrap();
        let id = crashed.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, failed_rx)
            .await
            .unwrap()
            .unwrap();
        until_scheduled(&db, id).await;
        drop(crashed);
        // The cooldown is over: due now.
        db.execute("UPDATE dacapo_inbox SET execute_at = 0").await;

        let announcements = Recorder::<Announced>::new();
        let queue = Counter::default();
        let survivor = db
            .store(Runtime::builder(), "node-b", Duration::from_millis(600))
            .await
            .retry_scope(RetryScope::FailedHandlers)
            .recovery_interval(Duration::from_millis(100))
            .relay_interval(Duration::from_millis(50))
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", queue.clone()),
            )
            .module(
                Module::new("workspaces")
                    .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
            )
            .module(
                Module::new("audit").handle_named::<Announced, _>("ignore", announcements.clone()),
            )
            .build()
            .unwrap();
        until(|| announcements.count() >= 1).await;
        tokio::time::timeout(WAIT, survivor.idle()).await.unwrap();
        assert_eq!(
            queue.count(),
            0,
            "the handler that succeeded is not run again"
        );
        assert_eq!(announcements.count(), 1, "what it published is sent once");
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        survivor.shutdown().await;
    }
);

async fn until_scheduled(db: &support_stores::TestDatabase, id: uuid::Uuid) {
    tokio::time::timeout(WAIT, async {
        while db.inbox_status(id).await.as_deref() != Some("scheduled") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the retry was recorded");
}

struct Permanent;

impl Handler<MemberRemoved> for Permanent {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err(HandlerError::permanent("this can never pass"))
    }
}

on_both_backends!(
    a_replay_that_fails_again_at_once_leaves_its_new_dead_letter_sqlite,
    a_replay_that_fails_again_at_once_leaves_its_new_dead_letter_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", Permanent))
            .build()
            .unwrap();
        let id = runtime.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        for round in 0..20 {
            runtime.dead_letters().replay(id).await.unwrap();
            tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
            let letter = runtime.dead_letters().inspect(id).await;
            assert!(
                letter.is_ok(),
                "round {round}: the replay's own dead letter is kept"
            );
            assert_eq!(
                letter.unwrap().attempts,
                1,
                "round {round}: a fresh attempt count"
            );
        }
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_replay_while_the_envelope_is_being_delivered_is_refused_and_changes_nothing_sqlite,
    a_replay_while_the_envelope_is_being_delivered_is_refused_and_changes_nothing_postgres,
    |db| {
        let (stuck, started) = Stuck::new();
        let first = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", Permanent))
            .build()
            .unwrap();
        let id = first.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, first.idle()).await.unwrap();
        first.shutdown().await;

        let second = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", stuck))
            .build()
            .unwrap();
        second.dead_letters().replay(id).await.unwrap();
        tokio::time::timeout(WAIT, started).await.unwrap().unwrap();
        let error = second.dead_letters().replay(id).await.unwrap_err();
        assert!(
            matches!(error, dacapo::Error::ReplayInProgress(e) if e == id),
            "{error}"
        );
        assert_eq!(
            db.inbox_status(id).await.as_deref(),
            Some("incoming"),
            "the running delivery's row is untouched"
        );
        assert!(second.dead_letters().list().await.unwrap().is_empty());
    }
);

on_both_backends!(
    a_crash_during_the_last_attempt_frees_the_deduplication_id_sqlite,
    a_crash_during_the_last_attempt_frees_the_deduplication_id_postgres,
    |db| {
        let last_attempt = RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        };
        let (stuck, started) = Stuck::new();
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_millis(600))
            .await
            .enable_deduplication()
            .retry_policy(last_attempt)
            .module(
                Module::new("projections")
                    .handle_named::<MemberRemoved, _>("rebuild", stuck)
                    .deduplicate("rebuild", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        let intent = SendOptions::new().deduplication_id("rebuild|tonight");
        let crashed_id = crashed
            .publish_with(&member_removed(), intent.clone())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, started).await.unwrap().unwrap();
        drop(crashed);

        let effects = Counter::default();
        let survivor = db
            .store(Runtime::builder(), "node-b", Duration::from_millis(600))
            .await
            .enable_deduplication()
            .retry_policy(last_attempt)
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("projections")
                    .handle_named::<MemberRemoved, _>("rebuild", effects.clone())
                    .deduplicate("rebuild", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while survivor.dead_letters().inspect(crashed_id).await.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the interrupted last attempt is dead-lettered");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            0,
            "its claim was released with the dead letter"
        );

        survivor
            .publish_with(&member_removed(), intent)
            .await
            .unwrap();
        tokio::time::timeout(WAIT, survivor.idle()).await.unwrap();
        assert_eq!(
            effects.count(),
            1,
            "a new envelope with the same intent does the work"
        );
        survivor.shutdown().await;
    }
);

/// Reports that it started, waits to be released, then succeeds — or fails for good.
#[derive(Clone)]
struct Gate {
    started: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    open: Arc<Notify>,
    fails_for_good: bool,
}

impl Gate {
    fn new(started: oneshot::Sender<()>, open: Arc<Notify>) -> Self {
        Self {
            started: Arc::new(Mutex::new(Some(started))),
            open,
            fails_for_good: false,
        }
    }
}

impl Handler<MemberRemoved> for Gate {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        self.open.notified().await;
        if self.fails_for_good {
            return Err(HandlerError::permanent("this can never pass"));
        }
        Ok(())
    }
}

/// Node a starts a delivery with `stale` (which reports on `started`, then waits); node b,
/// to which node a looks silent, takes it over and runs it (and waits too).
/// Returns node a, the report of node a's delivery, node b, and the envelope id.
async fn taken_over<H: Handler<MemberRemoved>>(
    db: &support_stores::TestDatabase,
    stale: H,
    started: oneshot::Receiver<()>,
) -> (
    Runtime,
    oneshot::Receiver<dacapo::DeliveryReport>,
    Runtime,
    uuid::Uuid,
) {
    // Node a heartbeats every 10 s.
    let slow = db
        .store(Runtime::builder(), "node-a", Duration::from_secs(30))
        .await
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", stale))
        .build()
        .unwrap();
    let envelope = Envelope::for_message(&member_removed()).unwrap();
    let id = envelope.id;
    let report = slow.receive_tracked(envelope).await.unwrap();
    tokio::time::timeout(WAIT, started).await.unwrap().unwrap();

    let (b_started, b_started_rx) = oneshot::channel();
    let new_owner = db
        .store(Runtime::builder(), "node-b", Duration::from_millis(300))
        .await
        .recovery_interval(Duration::from_millis(100))
        .module(Module::new("billing").handle_named::<MemberRemoved, _>(
            "charge",
            Gate::new(b_started, Arc::new(Notify::new())),
        ))
        .build()
        .unwrap();
    // To node b, node a stops beating (as if paused): its heartbeat is made old, again until
    // node b runs the delivery, should a beat of node a's land in between.
    let mut b_started_rx = b_started_rx;
    tokio::time::timeout(WAIT, async {
        loop {
            db.execute(
                "UPDATE dacapo_nodes SET heartbeat_at = 0, alive_until = 0 WHERE id = 'node-a'",
            )
            .await;
            tokio::select! {
                started = &mut b_started_rx => break started.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    })
    .await
    .expect("node b takes the delivery over");
    (slow, report, new_owner, id)
}

on_both_backends!(
    a_node_taken_for_dead_cannot_settle_the_delivery_its_new_owner_runs_sqlite,
    a_node_taken_for_dead_cannot_settle_the_delivery_its_new_owner_runs_postgres,
    |db| {
        let (started, started_rx) = oneshot::channel();
        let open = Arc::new(Notify::new());
        let stale = Gate::new(started, Arc::clone(&open));
        let (slow, report, new_owner, id) = taken_over(&db, stale, started_rx).await;

        // Node a wakes up and finishes its attempt late.
        open.notify_one();
        let report = tokio::time::timeout(WAIT, report).await.unwrap().unwrap();
        assert_eq!(
            report.outcome,
            Outcome::Discarded(DiscardReason::OwnedElsewhere),
            "the stale node's settle changed nothing"
        );
        assert_eq!(
            db.inbox_status(id).await.as_deref(),
            Some("incoming"),
            "the new owner's delivery is still running"
        );
        slow.shutdown().await;
        drop(new_owner);
    }
);

on_both_backends!(
    a_node_resumes_its_own_unsettled_row_that_nothing_in_it_runs_sqlite,
    a_node_resumes_its_own_unsettled_row_that_nothing_in_it_runs_postgres,
    |db| {
        let quick = RetryPolicy {
            min_retry_interval: Duration::from_millis(10),
            ..RetryPolicy::default()
        };
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = db
            .store(Runtime::builder(), "node-a", Duration::from_millis(300))
            .await
            .retry_policy(quick)
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        // An accept whose commit landed although its caller saw an error: the row is this
        // node's, and nothing in the process runs it.
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let inbox = match db.backend {
            Backend::Sqlite => Box::new(db.sqlite().await.node_id("node-a"))
                as Box<dyn dacapo::ports::DurableInbox>,
            Backend::Postgres => Box::new(db.postgres().await.node_id("node-a")),
        };
        inbox.receive(&envelope).await.unwrap();
        until(|| calls.count() >= 1).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        let calls = calls.calls();
        assert_eq!(calls.len(), 1, "run once");
        assert_eq!(calls[0].message_id, Some(envelope.id));
        assert_eq!(
            calls[0].attempt, 2,
            "the attempt its row counted as started counts as interrupted"
        );
        assert_eq!(
            db.inbox_status(envelope.id).await.as_deref(),
            Some("handled")
        );
        runtime.shutdown().await;
    }
);

/// Counts its calls, then waits until the gate opens.
#[derive(Clone)]
struct Gated {
    calls: Counter,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Handler<MemberRemoved> for Gated {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        Handler::<MemberRemoved>::handle(&self.calls, event, ctx).await?;
        let _open = self.gate.acquire().await?;
        Ok(())
    }
}

const ORPHANS: i64 = 400;

on_both_backends!(
    recovery_claims_no_more_of_a_dead_nodes_backlog_than_the_engine_can_run_sqlite,
    recovery_claims_no_more_of_a_dead_nodes_backlog_than_the_engine_can_run_postgres,
    |db| {
        // A dead node's backlog, never heartbeaten.
        db.execute(match db.backend {
            Backend::Sqlite => {
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400) \
                 INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
                 attempts, owner, received_at) \
                 SELECT printf('%032x', i), 'organization.member_removed', \
                 CAST('{\"organization_id\":1,\"member_id\":7}' AS BLOB), '{}', 0, 'incoming', 0, \
                 'dead-node', 0 FROM n"
            }
            Backend::Postgres => {
                "INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
                 attempts, owner, received_at) \
                 SELECT lpad(to_hex(i), 32, '0'), 'organization.member_removed', \
                 convert_to('{\"organization_id\":1,\"member_id\":7}', 'UTF8'), '{}', 0, \
                 'incoming', 0, 'dead-node', 0 FROM generate_series(1, 400) AS i"
            }
        })
        .await;
        let gated = Gated {
            calls: Counter::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        };
        let runtime = db
            .store(Runtime::builder(), "node-b", Duration::from_millis(300))
            .await
            .max_in_flight(16)
            .recovery_batch(100)
            .recovery_interval(Duration::from_millis(50))
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", gated.clone()),
            )
            .build()
            .unwrap();
        until(|| gated.calls.count() >= 16).await;
        // Every slot is taken by a running delivery: no round can claim more until one ends.
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_inbox WHERE owner = 'node-b'")
                .await,
            16,
            "claimed exactly what the engine runs; the rest stays for later or other nodes"
        );
        gated.gate.add_permits(usize::MAX >> 4);
        tokio::time::timeout(Duration::from_secs(60), async {
            while db
                .scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'")
                .await
                < ORPHANS
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the whole backlog drains, a capacity's worth at a time");
        assert_eq!(gated.calls.count(), ORPHANS as usize, "each once");
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_node_taken_for_dead_writes_no_dead_letter_for_the_delivery_its_new_owner_runs_sqlite,
    a_node_taken_for_dead_writes_no_dead_letter_for_the_delivery_its_new_owner_runs_postgres,
    |db| {
        let (started, started_rx) = oneshot::channel();
        let open = Arc::new(Notify::new());
        let stale = Gate {
            fails_for_good: true,
            ..Gate::new(started, Arc::clone(&open))
        };
        let (slow, report, new_owner, id) = taken_over(&db, stale, started_rx).await;

        // Node a's late attempt fails for good: its dead-letter transition is fenced whole.
        open.notify_one();
        let report = tokio::time::timeout(WAIT, report).await.unwrap().unwrap();
        assert_eq!(
            report.outcome,
            Outcome::Discarded(DiscardReason::OwnedElsewhere)
        );
        assert!(
            new_owner.dead_letters().inspect(id).await.is_err(),
            "no dead letter for a delivery another node runs"
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("incoming"));
        slow.shutdown().await;
        drop(new_owner);
    }
);

/// One node's view of the database's stores, under the node name `node`.
async fn node_store(
    db: &support_stores::TestDatabase,
    node: &str,
) -> (
    Box<dyn dacapo::ports::DurableInbox>,
    Box<dyn dacapo::ports::Claims>,
) {
    match db.backend {
        Backend::Sqlite => (
            Box::new(db.sqlite().await.node_id(node)),
            Box::new(db.sqlite().await.node_id(node)),
        ),
        Backend::Postgres => (
            Box::new(db.postgres().await.node_id(node)),
            Box::new(db.postgres().await.node_id(node)),
        ),
    }
}

fn claim_for(envelope: &Envelope) -> dacapo::ports::Claim {
    dacapo::ports::Claim::new(
        "projections/rebuild".into(),
        "rebuild|tonight".into(),
        envelope.id,
        &envelope.payload,
        chrono::Utc::now(),
        Duration::from_secs(3600),
    )
}

on_both_backends!(
    a_dead_letter_leaves_a_claim_a_live_node_holds_for_its_envelope_sqlite,
    a_dead_letter_leaves_a_claim_a_live_node_holds_for_its_envelope_postgres,
    |db| {
        use dacapo::ports::ClaimOutcome;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let (a_inbox, a_claims) = node_store(&db, "node-a").await;
        let (b_inbox, _) = node_store(&db, "node-b").await;
        a_inbox.heartbeat().await.unwrap();
        b_inbox.heartbeat().await.unwrap();
        // Node b holds the delivery; node a, alive, runs an attempt of the same envelope (a
        // broker delivered it to both) and holds its claim.
        b_inbox.receive(&envelope).await.unwrap();
        assert_eq!(
            a_claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Claimed
        );
        // Node b gives up on it: its dead letter frees what its own or a dead node's attempt
        // left, not the claim of an attempt still running elsewhere, which a new envelope of
        // the same intent would otherwise take and run beside it.
        let letter = dacapo::DeadLetter::rejected(
            envelope.clone(),
            dacapo::DeadLetterReason::Permanent,
            chrono::Utc::now(),
        );
        b_inbox.dead_letter(&letter, true).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication WHERE node = 'node-a'")
                .await,
            1,
            "node a's claim stands"
        );
        // Node a is taken for dead: a dead letter of the envelope frees its claim.
        db.execute("UPDATE dacapo_nodes SET heartbeat_at = 0, alive_until = 0 WHERE id = 'node-a'")
            .await;
        db.execute("UPDATE dacapo_inbox SET status = 'incoming', owner = 'node-b'")
            .await;
        b_inbox.dead_letter(&letter, true).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            0,
            "a dead node's claim is freed"
        );
    }
);

on_both_backends!(
    a_claim_a_live_node_holds_for_the_same_delivery_is_neither_taken_nor_reported_done_sqlite,
    a_claim_a_live_node_holds_for_the_same_delivery_is_neither_taken_nor_reported_done_postgres,
    |db| {
        use dacapo::ports::ClaimOutcome;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let (a_inbox, a_claims) = node_store(&db, "node-a").await;
        let (b_inbox, b_claims) = node_store(&db, "node-b").await;
        a_inbox.heartbeat().await.unwrap();
        b_inbox.heartbeat().await.unwrap();
        assert_eq!(
            a_claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Claimed
        );

        // Node b resumes the same delivery while node a's attempt may still run.
        assert_eq!(
            b_claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::RunningElsewhere,
            "not Completed, not taken: this attempt fails and waits for its retry"
        );

        // Node a stops heartbeating: it is taken for dead, and its claim taken over.
        db.execute("UPDATE dacapo_nodes SET heartbeat_at = 0, alive_until = 0 WHERE id = 'node-a'")
            .await;
        assert_eq!(
            b_claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Claimed
        );
        // Node a wakes up: it can neither complete nor release what it lost, and what its
        // handler cascaded is not enlisted with a completion that did not happen.
        let cascaded = || Envelope::for_message(&member_removed()).unwrap();
        let lost = a_claims
            .complete(&claim_for(&envelope), &[cascaded()])
            .await
            .unwrap_err();
        assert!(!lost.is_retryable(), "{lost}");
        assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 0);
        a_claims.release(&claim_for(&envelope)).await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication WHERE node = 'node-b'")
                .await,
            1,
            "node b's claim stands"
        );
        let b_cascaded = [cascaded()];
        assert!(
            b_claims
                .complete(&claim_for(&envelope), &b_cascaded)
                .await
                .unwrap(),
            "enlisted with the completion"
        );
        // A retry of the completion (its answer lost) enlists nothing twice.
        assert!(
            b_claims
                .complete(&claim_for(&envelope), &b_cascaded)
                .await
                .unwrap()
        );
        assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
        assert_eq!(
            b_claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Completed,
            "completed by this delivery: its work is done"
        );
    }
);

on_both_backends!(
    a_node_restarted_under_its_name_frees_the_claims_its_previous_run_left_uncompleted_sqlite,
    a_node_restarted_under_its_name_frees_the_claims_its_previous_run_left_uncompleted_postgres,
    |db| {
        use dacapo::ports::ClaimOutcome;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let (_, before_crash) = node_store(&db, "node-a").await;
        before_crash.claim(&claim_for(&envelope)).await.unwrap();
        drop(before_crash);
        let (inbox, restarted) = node_store(&db, "node-a").await;
        inbox.heartbeat().await.unwrap();
        restarted.provision().await.unwrap();
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            0
        );
        let (_, other) = node_store(&db, "node-b").await;
        assert_eq!(
            other.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Claimed,
            "another node resuming the delivery gets the claim at once"
        );
    }
);

// The claims a crashed run left are released once per process that holds the node: another
// store of the live process under the same node (an HTTP layer's, say), opened later, used to
// release the claims of handlers running now.
on_both_backends!(
    a_second_store_of_a_live_node_leaves_the_claims_in_flight_sqlite,
    a_second_store_of_a_live_node_leaves_the_claims_in_flight_postgres,
    |db| {
        use dacapo::ports::ClaimOutcome;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let (inbox, claims) = node_store(&db, "node-a").await;
        inbox.heartbeat().await.unwrap();
        assert_eq!(
            claims.claim(&claim_for(&envelope)).await.unwrap(),
            ClaimOutcome::Claimed
        );

        let (_, later) = node_store(&db, "node-a").await;
        later.provision().await.unwrap();

        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            1,
            "the claim of the handler running now stands"
        );
        let again = Envelope::for_message(&member_removed()).unwrap();
        assert_eq!(
            later.claim(&claim_for(&again)).await.unwrap(),
            ClaimOutcome::Held { same_payload: true },
            "a second message of the intent finds it claimed"
        );
    }
);

// A node paused past its heartbeat loses a delivery to another node, which runs a later
// attempt and records its retry (with a message a handler cascaded) before it dies; the first
// node claims the delivery back while its stale runner of the earlier attempt still runs. That
// runner's retry record and settle are refused: the owner is the same, but the count of attempts
// tells them apart. They overwrote the other node's record before, losing its cascaded message.
on_both_backends!(
    a_stale_runner_of_an_earlier_attempt_overwrites_nothing_sqlite,
    a_stale_runner_of_an_earlier_attempt_overwrites_nothing_postgres,
    |db| {
        use dacapo::ports::{Fenced, Handled, RetryRecord};
        let (a_inbox, _) = node_store(&db, "node-a").await;
        let (b_inbox, _) = node_store(&db, "node-b").await;
        let first = Envelope::for_message(&member_removed()).unwrap();
        a_inbox.receive(&first).await.unwrap();
        let due = chrono::Utc::now() + chrono::Duration::seconds(60);

        // Node b claims it and runs attempt 2, which fails after a handler cascaded a message.
        db.execute("UPDATE dacapo_inbox SET owner = 'node-b'").await;
        assert_eq!(
            b_inbox.begin_attempt(first.id, 2).await.unwrap(),
            Fenced::Written
        );
        let mut second = first.clone();
        second.attempts = 2;
        let cascaded = [Envelope::for_message(&member_removed()).unwrap()];
        let record = RetryRecord::new(&second, due, &[], &[], &cascaded);
        assert_eq!(
            b_inbox.schedule_retry(record).await.unwrap(),
            Fenced::Written
        );
        // Node b dies; node a claims the delivery back.
        db.execute("UPDATE dacapo_inbox SET owner = 'node-a'").await;

        let mut stale = first.clone();
        stale.attempts = 1;
        let record = RetryRecord::new(&stale, due, &[], &[], &[]);
        assert_eq!(
            a_inbox.schedule_retry(record).await.unwrap(),
            Fenced::OwnedElsewhere,
            "the stale runner's retry record"
        );
        assert_eq!(
            a_inbox.settle_handled(first.id, 1, &[]).await.unwrap(),
            Handled::OwnedElsewhere,
            "the stale runner's settle"
        );
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_inbox WHERE attempts = 2 AND cascaded IS NOT NULL"
            )
            .await,
            1,
            "node b's record stands"
        );
        // The delivery resumed from that record runs attempt 3, and settles.
        assert_eq!(
            a_inbox.begin_attempt(first.id, 3).await.unwrap(),
            Fenced::Written
        );
        assert!(matches!(
            a_inbox
                .settle_handled(first.id, 3, &cascaded)
                .await
                .unwrap(),
            Handled::Written { .. }
        ));
    }
);

on_both_backends!(
    an_attempt_starts_once_even_when_two_runners_of_one_node_ask_sqlite,
    an_attempt_starts_once_even_when_two_runners_of_one_node_ask_postgres,
    |db| {
        use dacapo::ports::Fenced;
        let (inbox, _) = node_store(&db, "node-a").await;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        inbox.receive(&envelope).await.unwrap();
        assert_eq!(
            inbox.begin_attempt(envelope.id, 2).await.unwrap(),
            Fenced::Written
        );
        assert_eq!(
            inbox.begin_attempt(envelope.id, 2).await.unwrap(),
            Fenced::OwnedElsewhere,
            "the second runner of attempt 2 finds it started"
        );
    }
);

on_both_backends!(
    an_unreadable_row_does_not_stop_the_recovery_of_the_others_sqlite,
    an_unreadable_row_does_not_stop_the_recovery_of_the_others_postgres,
    |db| {
        let (dead, _) = node_store(&db, "dead-node").await;
        let first = Envelope::for_message(&member_removed()).unwrap();
        let second = Envelope::for_message(&member_removed()).unwrap();
        dead.receive(&first).await.unwrap();
        dead.receive(&second).await.unwrap();
        // One row's recorded failures were damaged by hand.
        db.execute("UPDATE dacapo_inbox SET received_at = 0, failures = 'not json'")
            .await;
        db.execute("UPDATE dacapo_inbox SET failures = NULL WHERE received_at = 0 AND id = (SELECT max(id) FROM dacapo_inbox)")
            .await;
        let (survivor, _) = node_store(&db, "survivor").await;
        survivor.heartbeat().await.unwrap();
        let resumed = survivor
            .recover(10, chrono::DateTime::<chrono::Utc>::MAX_UTC, true)
            .await
            .unwrap();
        assert_eq!(resumed.len(), 1, "the readable row resumes");
    }
);

on_both_backends!(
    an_envelope_counted_elsewhere_starts_its_own_count_here_sqlite,
    an_envelope_counted_elsewhere_starts_its_own_count_here_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        // Another system's broker delivered it three times already.
        let mut envelope = Envelope::for_message(&member_removed()).unwrap();
        envelope.attempts = 3;
        let report = runtime
            .receive_tracked(envelope)
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(report.outcome, Outcome::Handled);
        assert_eq!(report.attempts, 1);
        assert_eq!(calls.calls()[0].attempt, 1);
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_resumed_delivery_whose_handlers_all_succeeded_settles_without_running_them_sqlite,
    a_resumed_delivery_whose_handlers_all_succeeded_settles_without_running_them_postgres,
    |db| {
        // A node recorded a retry in which every handler had succeeded (its failure was the
        // runtime's), then died.
        let (dead, _) = node_store(&db, "dead-node").await;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        dead.receive(&envelope).await.unwrap();
        let succeeded = ["billing/charge".to_owned()];
        let record =
            dacapo::ports::RetryRecord::new(&envelope, chrono::Utc::now(), &[], &succeeded, &[]);
        dead.schedule_retry(record).await.unwrap();

        let calls = Recorder::<MemberRemoved>::new();
        let survivor = db
            .store(Runtime::builder(), "survivor", Duration::from_millis(300))
            .await
            .retry_scope(RetryScope::FailedHandlers)
            .recovery_interval(Duration::from_millis(50))
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while db.inbox_status(envelope.id).await.as_deref() != Some("handled") {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("settled");
        assert_eq!(calls.count(), 0, "nothing left to run");
        survivor.shutdown().await;
    }
);

on_both_backends!(
    a_node_restarted_under_its_id_has_resumed_its_unsettled_deliveries_once_its_first_recovery_returns_sqlite,
    a_node_restarted_under_its_id_has_resumed_its_unsettled_deliveries_once_its_first_recovery_returns_postgres,
    |db| {
        let (stuck, stuck_started) = Stuck::new();
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(60))
            .await
            .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", stuck))
            .build()
            .unwrap();
        crashed.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, stuck_started)
            .await
            .unwrap()
            .unwrap();
        // Gone without a shutdown (a kill -9), its delivery unsettled.
        drop(crashed);

        let counter = Counter::default();
        // The next recovery interval is an hour away: only the first round can resume it.
        let restarted = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(60))
            .await
            .recovery_interval(Duration::from_secs(3600))
            .module(
                Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", counter.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, restarted.first_recovery())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, restarted.idle()).await.unwrap();
        assert_eq!(
            counter.count(),
            1,
            "idle after the first recovery waits for what the killed run left"
        );
        assert!(restarted.shutdown().await.is_clean());
    }
);

/// Tells which member each call is for, then waits for its gate.
struct TellsAndWaits {
    started: tokio::sync::mpsc::UnboundedSender<u64>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Handler<MemberRemoved> for TellsAndWaits {
    async fn handle(
        &self,
        removed: &MemberRemoved,
        _: &MessageContext,
    ) -> Result<(), HandlerError> {
        let _ = self.started.send(removed.member_id);
        self.gate.acquire().await?.forget();
        Ok(())
    }
}

/// A delivery that gets its room only after a shutdown's drain — a batch waiting behind a
/// handler that outlasted the drain and then finished — does not start: the shutdown is
/// releasing this node's rows, and another node may claim it at once and run it beside this
/// one. It is handed back in the report, and its row waits, released, for the next node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_given_room_after_the_drain_does_not_start_while_the_node_is_released() {
    use sqlx::{Connection, Executor};
    let warned = |text: &str| {
        support_warnings::warnings()
            .lock()
            .unwrap()
            .iter()
            .any(|warning| warning.contains(text))
    };
    warned("");
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    let (started, mut starts) = tokio::sync::mpsc::unbounded_channel();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let runtime = Arc::new(
        Runtime::builder()
            .store(
                db.postgres()
                    .await
                    .node_id("a")
                    .node_timeout(Duration::from_millis(300)),
            )
            .max_in_flight(1)
            // Past the drain, the shutdown waits as long again for the heartbeat the test
            // holds up: the window in which the second gets its room.
            .drain_timeout(Duration::from_secs(3))
            .module(Module::new("m").handle_named::<MemberRemoved, _>(
                "h",
                TellsAndWaits {
                    started,
                    gate: Arc::clone(&gate),
                },
            ))
            .build()
            .unwrap(),
    );
    let member = |member_id| MemberRemoved {
        organization_id: 1,
        member_id,
    };
    runtime.publish(&member(1)).await.unwrap();
    assert_eq!(starts.recv().await, Some(1));
    // Persisted, both waiting for the room the first holds.
    let batch = tokio::spawn({
        let runtime = Arc::clone(&runtime);
        async move { runtime.publish_batch(&[member(2), member(3)]).await }
    });
    wait_for(
        || async { db.inbox_rows().await == 3 },
        "the batch is persisted",
    )
    .await;
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    locker.execute("BEGIN").await.unwrap();
    locker
        .execute("SELECT id FROM dacapo_nodes WHERE id = 'a' FOR UPDATE")
        .await
        .unwrap();
    wait_for(
        || async {
            db.scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
                .await
                > 0
        },
        "a heartbeat waits for the locked row",
    )
    .await;

    let shutdown = tokio::spawn({
        let runtime = Arc::clone(&runtime);
        async move { runtime.shutdown().await }
    });
    wait_for(
        || async { warned("still running after the drain") },
        "the drain ends",
    )
    .await;
    gate.add_permits(1);
    // The first settles, and the second gets its room: it starts, or hands itself back.
    let mut started_late = None;
    wait_for(
        || {
            started_late = started_late.or(starts.try_recv().ok());
            let over = started_late.is_some() || warned("did not start");
            async move { over }
        },
        "the second got its room",
    )
    .await;
    assert_eq!(started_late, None, "started once the drain was over");
    locker.execute("ROLLBACK").await.unwrap();

    let report = tokio::time::timeout(WAIT, shutdown).await.unwrap().unwrap();
    batch.abort();
    assert!(starts.try_recv().is_err(), "nothing more started");
    let ids = batch_ids(&db).await;
    assert!(
        report
            .pending_retries
            .iter()
            .any(|pending| pending.envelope.id == ids[0]),
        "the second is handed back: {report:?}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'incoming' AND owner IS NULL")
            .await,
        2,
        "both wait, released, for the next node"
    );
    assert_eq!(
        db.scalar(
            "SELECT attempts::bigint FROM dacapo_inbox \
             WHERE convert_from(payload, 'UTF8') LIKE '%\"member_id\":2}'"
        )
        .await,
        0,
        "the second's first attempt, which never ran, is taken back: the next node runs it as new"
    );
}

/// Waits, at most `WAIT`, until `condition` holds.
async fn wait_for<F: std::future::Future<Output = bool>>(
    mut condition: impl FnMut() -> F,
    what: &str,
) {
    tokio::time::timeout(WAIT, async {
        while !condition().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {WAIT:?}: {what}"));
}

/// The ids of the second and the third member's envelopes, in that order.
async fn batch_ids(db: &support_stores::TestDatabase) -> Vec<uuid::Uuid> {
    let store = db.postgres().await;
    let mut ids = Vec::new();
    for member_id in [2, 3] {
        let (id,): (String,) = sqlx::query_as(
            "SELECT id FROM dacapo_inbox \
             WHERE convert_from(payload, 'UTF8') LIKE '%\"member_id\":' || $1 || '}'",
        )
        .bind(member_id.to_string())
        .fetch_one(store.pool())
        .await
        .unwrap();
        ids.push(id.parse().unwrap());
    }
    ids
}
