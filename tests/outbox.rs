//! The transactional outbox on a real SQLite file and a real PostgreSQL server: enlisted in the
//! caller's transaction, published by the relay in order, once, even across a crash between
//! publishing and marking, and with two nodes relaying.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/manual_clock.rs"]
mod support_clock;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::MemberRemoved;

const WAIT: Duration = Duration::from_secs(20);

fn removed(member_id: u64) -> MemberRemoved {
    MemberRemoved {
        organization_id: 1,
        member_id,
    }
}

async fn until(mut done: impl FnMut() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("reached in time");
}

/// A runtime on `db`'s store under the node name `local`, whose `webhooks` module records in
/// `calls` the messages the relay brings it; the test adds its own settings.
async fn recording(
    db: &support_stores::TestDatabase,
    calls: &Recorder<MemberRemoved>,
) -> dacapo::RuntimeBuilder {
    db.store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()))
}

on_both_backends!(
    committed_messages_are_published_in_order_and_rolled_back_ones_never_sqlite,
    committed_messages_are_published_in_order_and_rolled_back_ones_never_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = recording(&db, &calls)
            .await
            .relay_interval(Duration::from_millis(50))
            .workers(1)
            .build()
            .unwrap();
        db.outbox_transaction(&[removed(1), removed(2), removed(3)], true)
            .await;
        db.outbox_transaction(&[removed(100)], false).await;
        db.outbox_transaction(&[removed(4), removed(5)], true).await;
        until(|| calls.count() >= 5).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        let members: Vec<u64> = calls.calls().iter().map(|c| c.message.member_id).collect();
        assert_eq!(
            members,
            [1, 2, 3, 4, 5],
            "in commit order, and the rolled-back one never"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL")
                .await,
            0
        );
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_crash_between_publishing_and_marking_ends_with_exactly_one_effect_sqlite,
    a_crash_between_publishing_and_marking_ends_with_exactly_one_effect_postgres,
    |db| {
        db.outbox_transaction(&[removed(7)], true).await;
        // A relay read the row and published it, then died before marking it published.
        let crashed = db
            .store(Runtime::builder(), "crashed", Duration::from_secs(30))
            .await;
        let outbox = db.sqlite_or_postgres_outbox().await;
        let rows = outbox.unpublished(i64::MIN, 10).await.unwrap();
        assert_eq!(rows.len(), 1);
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = crashed
            .relay_interval(Duration::from_millis(50))
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()),
            )
            .build()
            .unwrap();
        runtime
            .receive(rows[0].1.as_ref().unwrap().clone())
            .await
            .unwrap();
        // The relay finds the row unpublished and publishes the same envelope again.
        tokio::time::timeout(WAIT, async {
            while db
                .scalar("SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL")
                .await
                > 0
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the relay marked it published");
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            calls.count(),
            1,
            "the inbox discarded the second publication"
        );
        assert_eq!(runtime.stats().deduplicated, 1);
        runtime.shutdown().await;
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_relay_each_row_once_in_order() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let mut nodes = Vec::new();
    for name in ["node-a", "node-b"] {
        nodes.push(
            // A relay's lease lasts ten polls: 2 s, so a loaded machine's pause does not hand it
            // to the other node mid-run (handling order across two nodes is not promised, only
            // publication order). NOTIFY wakes the relay at once, whatever the poll.
            db.store(Runtime::builder(), name, Duration::from_secs(30))
                .await
                .relay_interval(Duration::from_millis(200))
                .workers(1)
                .module(
                    Module::new("webhooks")
                        .handle_named::<MemberRemoved, _>("queue", calls.clone()),
                )
                .build()
                .unwrap(),
        );
    }
    for batch in 0..6u64 {
        let messages: Vec<MemberRemoved> = (0..5).map(|i| removed(batch * 5 + i)).collect();
        db.outbox_transaction(&messages, true).await;
    }
    until(|| calls.count() >= 30).await;
    for node in &nodes {
        tokio::time::timeout(WAIT, node.idle()).await.unwrap();
    }
    let members: Vec<u64> = calls.calls().iter().map(|c| c.message.member_id).collect();
    assert_eq!(
        members,
        (0..30).collect::<Vec<_>>(),
        "each row once, in outbox order"
    );
    for node in nodes {
        node.shutdown().await;
    }
}

/// Cascades one message naming the member it was told about.
struct Announce;

impl Handler<MemberRemoved> for Announce {
    async fn handle(
        &self,
        event: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        context
            .publish(&support::WebhookQueued {
                delivery_id: format!("member-{}", event.member_id),
            })
            .await?;
        Ok(())
    }
}

on_both_backends!(
    a_durable_delivery_writes_its_cascades_to_the_outbox_with_its_completion_sqlite,
    a_durable_delivery_writes_its_cascades_to_the_outbox_with_its_completion_postgres,
    |db| {
        let sent = Recorder::<support::WebhookQueued>::new();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("announce", Announce))
            .module(
                Module::new("sender")
                    .handle_named::<support::WebhookQueued, _>("send", sent.clone()),
            )
            .build()
            .unwrap();
        let id = runtime.publish(&removed(9)).await.unwrap();
        until(|| sent.count() == 1).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(sent.calls()[0].message.delivery_id, "member-9");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox").await,
            1,
            "it went through the outbox"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL")
                .await,
            0
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        runtime.shutdown().await;
    }
);

on_both_backends!(
    the_backlog_is_visible_and_published_rows_leave_after_their_retention_sqlite,
    the_backlog_is_visible_and_published_rows_leave_after_their_retention_postgres,
    |db| {
        // Enlisted while no relay runs: a backlog builds up.
        db.outbox_transaction(&[removed(1), removed(2), removed(3)], true)
            .await;
        assert_eq!(
            db.sqlite_or_postgres_outbox()
                .await
                .backlog()
                .await
                .unwrap()
                .depth,
            3
        );

        let calls = Recorder::<MemberRemoved>::new();
        let runtime = recording(&db, &calls)
            .await
            .relay_interval(Duration::from_millis(20))
            .outbox_retention(Duration::from_millis(100))
            .build()
            .unwrap();
        until(|| calls.count() == 3).await;
        // Handled is not yet marked published: idle waits for the outbox to be empty.
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        let backlog = runtime.outbox_backlog().await.unwrap().unwrap();
        assert_eq!((backlog.depth, backlog.oldest_enlisted_at), (0, None));
        tokio::time::timeout(WAIT, async {
            while db.scalar("SELECT count(*) FROM dacapo_outbox").await > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("published rows were removed after their retention");
        runtime.shutdown().await;
    }
);

on_both_backends!(
    an_outbox_row_that_cannot_be_read_holds_back_no_other_sqlite,
    an_outbox_row_that_cannot_be_read_holds_back_no_other_postgres,
    |db| {
        db.outbox_transaction(&[removed(1), removed(2), removed(3)], true)
            .await;
        // The oldest row was damaged by hand: it can never be read as an envelope. Its id
        // names the backend: both variants log into one capture at once.
        let (damage, damaged) = match db.backend {
            support_stores::Backend::Sqlite => (
                "UPDATE dacapo_outbox SET id = 'not-a-uuid-sqlite' \
                 WHERE seq = (SELECT min(seq) FROM dacapo_outbox)",
                "not-a-uuid-sqlite",
            ),
            support_stores::Backend::Postgres => (
                "UPDATE dacapo_outbox SET id = 'not-a-uuid-postgres' \
                 WHERE seq = (SELECT min(seq) FROM dacapo_outbox)",
                "not-a-uuid-postgres",
            ),
        };
        db.execute(damage).await;
        let _ = support_warnings::warnings();
        let outbox = Observed::new(db.sqlite_or_postgres_outbox().await);
        let (leases, reads) = (Arc::clone(&outbox.leases), Arc::clone(&outbox.reads));
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = recording(&db, &calls)
            .await
            .outbox_store(Arc::new(outbox))
            .relay_interval(Duration::from_millis(20))
            .workers(1)
            .build()
            .unwrap();
        until(|| calls.count() == 2).await;
        // Rounds after it still publish what comes later, and never the damaged row.
        db.outbox_transaction(&[removed(4)], true).await;
        until(|| calls.count() == 3).await;
        let members: Vec<u64> = calls.calls().iter().map(|c| c.message.member_id).collect();
        assert_eq!(members, [2, 3, 4]);
        tokio::time::timeout(WAIT, async {
            while db
                .scalar("SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL")
                .await
                > 1
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the readable rows were marked");
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_outbox \
                 WHERE published_at IS NULL AND id LIKE 'not-a-uuid%'"
            )
            .await,
            1,
            "left for an operator, not marked as if sent"
        );
        assert_eq!(runtime.outbox_backlog().await.unwrap().unwrap().depth, 1);
        // Ten rounds more find nothing else to publish: none takes the lease (on SQLite a
        // commit and an fsync each), and the row is told of once, not every round.
        let (leased, read) = (leases.load(Ordering::SeqCst), reads.load(Ordering::SeqCst));
        until(|| reads.load(Ordering::SeqCst) >= read + 10).await;
        assert_eq!(
            leases.load(Ordering::SeqCst),
            leased,
            "an idle relay takes no lease"
        );
        let told = support_warnings::warnings()
            .lock()
            .unwrap()
            .iter()
            .filter(|logged| logged.contains("cannot be read") && logged.contains(damaged))
            .count();
        assert_eq!(told, 1);
        runtime.shutdown().await;
    }
);

#[tokio::test]
async fn the_backlog_counts_what_waits_and_how_old_it_is() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    db.outbox_transaction(&[removed(1), removed(2)], true).await;
    let outbox = db.sqlite_or_postgres_outbox().await;
    let backlog = outbox.backlog().await.unwrap();
    assert_eq!(backlog.depth, 2);
    let oldest = backlog.oldest_enlisted_at.expect("an oldest envelope");
    assert!(oldest <= chrono::Utc::now());
}

/// A relay that polls once an hour: whatever it publishes within the test was woken.
const NEVER_POLLS: Duration = Duration::from_secs(3600);

/// A runtime whose relay polls hourly, after its first round has published a sentinel and
/// ended: from then on only a wake publishes what is enlisted.
async fn relay_past_its_first_round(
    db: &support_stores::TestDatabase,
    calls: &Recorder<MemberRemoved>,
) -> Runtime {
    db.outbox_transaction(&[removed(0)], true).await;
    let runtime = db
        .store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .relay_interval(NEVER_POLLS)
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()))
        .build()
        .unwrap();
    // The first round published the sentinel and marked it: it reads the outbox no more.
    until(|| calls.count() == 1).await;
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    runtime
}

// On SQLite only the local wake can publish; on PostgreSQL the commit's NOTIFY may get there
// first, which the next test covers on its own.
on_both_backends!(
    a_commit_through_the_runtime_wakes_the_relay_at_once_sqlite,
    a_commit_through_the_runtime_wakes_the_relay_at_once_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = relay_past_its_first_round(&db, &calls).await;
        match db.backend {
            support_stores::Backend::Sqlite => {
                let store = db.sqlite().await;
                let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                runtime.outbox().enlist(&mut tx, &removed(1)).await.unwrap();
                runtime.outbox().commit(tx).await.unwrap();
            }
            support_stores::Backend::Postgres => {
                let store = db.postgres().await;
                let mut tx = store.pool().begin().await.unwrap();
                runtime.outbox().enlist(&mut tx, &removed(1)).await.unwrap();
                runtime.outbox().commit(tx).await.unwrap();
            }
        }
        until(|| calls.count() == 2).await;
        runtime.shutdown().await;
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wakes_the_relay_for_enlists_made_elsewhere() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = relay_past_its_first_round(&db, &calls).await;
    // Enlist only once the relay listens: a commit before would wait for the hourly poll.
    tokio::time::timeout(WAIT, async {
        while relays_listening(&db).await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the relay listens");
    // Another process's transaction: no runtime involved, so no local wake.
    db.outbox_transaction(&[removed(1), removed(2)], true).await;
    until(|| calls.count() == 3).await;
    runtime.shutdown().await;
}

on_both_backends!(
    a_stuck_relay_is_never_silent_sqlite,
    a_stuck_relay_is_never_silent_postgres,
    |db| {
        let _ = support_warnings::warnings();
        // A depth of its own per backend: both variants log into one capture at once.
        let depth = match db.backend {
            support_stores::Backend::Sqlite => 1,
            support_stores::Backend::Postgres => 2,
        };
        let rows: Vec<_> = (1..=depth).map(removed).collect();
        db.outbox_transaction(&rows, true).await;
        // Another node holds the relay lease and never publishes: the backlog only ages.
        db.execute(
            "INSERT INTO dacapo_outbox_lease (id, owner, expires_at) \
             VALUES (1, 'stuck-elsewhere', 9000000000000000)",
        )
        .await;
        let node = match db.backend {
            support_stores::Backend::Sqlite => "warned-sqlite",
            support_stores::Backend::Postgres => "warned-postgres",
        };
        let calls = Recorder::<MemberRemoved>::new();
        let since = support_warnings::warnings().lock().unwrap().len();
        let runtime = db
            .store(Runtime::builder(), node, Duration::from_secs(30))
            .await
            .relay_interval(Duration::from_millis(20))
            .outbox_retention(Duration::from_millis(100))
            .outbox_warn_after(Duration::from_millis(50))
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            loop {
                let warned = support_warnings::warnings().lock().unwrap()[since..]
                    .iter()
                    .any(|w| {
                        w.contains("is the relay stuck?")
                            && w.contains(&format!("outbox.depth={depth} "))
                    });
                if warned {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("a warning about the aged backlog");
        assert_eq!(
            calls.count(),
            0,
            "nothing published while the lease is held elsewhere"
        );
        runtime.shutdown().await;
    }
);

/// The store's outbox as the relay sees it, observed: lease requests, reads and enlist signals
/// are counted; every lease after the first can be refused (as if another node took it at
/// once), and one read can be slow.
struct Observed {
    inner: Box<dyn dacapo::ports::OutboxStore>,
    leases: Arc<AtomicUsize>,
    reads: Arc<AtomicUsize>,
    signals: Arc<AtomicUsize>,
    /// Told when a lease after the first is refused.
    lease_lost_after_first: Option<Arc<tokio::sync::Notify>>,
    /// The read (counted from 0) that takes this long.
    slow_read: Option<(usize, Duration)>,
    /// Fails the first mark when set.
    fail_first_mark: bool,
    /// The positions of each mark asked for, in order, failed or not.
    marks: Arc<std::sync::Mutex<Vec<Vec<i64>>>>,
    /// The first read of a batch that finds rows tells `.0` once it read them, then waits for
    /// a permit of `.1` before returning them: a relay paused between reading and publishing.
    paused_after_read: Option<(Arc<tokio::sync::Notify>, Arc<tokio::sync::Semaphore>)>,
}

impl Observed {
    fn new(inner: Box<dyn dacapo::ports::OutboxStore>) -> Self {
        Self {
            inner,
            leases: Arc::default(),
            reads: Arc::default(),
            signals: Arc::default(),
            lease_lost_after_first: None,
            slow_read: None,
            fail_first_mark: false,
            marks: Arc::default(),
            paused_after_read: None,
        }
    }
}

#[async_trait::async_trait]
impl dacapo::ports::OutboxStore for Observed {
    async fn lease(
        &self,
        now: chrono::DateTime<chrono::Utc>,
        until: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, dacapo::EngineError> {
        let before = self.leases.fetch_add(1, Ordering::SeqCst);
        if let Some(lost) = self.lease_lost_after_first.as_ref().filter(|_| before > 0) {
            lost.notify_one();
            return Ok(false);
        }
        self.inner.lease(now, until).await
    }
    async fn unpublished(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<dacapo::ports::OutboxRow>, dacapo::EngineError> {
        let read = self.reads.fetch_add(1, Ordering::SeqCst);
        if let Some((_, pause)) = self.slow_read.filter(|(slow, _)| *slow == read) {
            tokio::time::sleep(pause).await;
        }
        let rows = self.inner.unpublished(after, limit).await?;
        if let Some((read, gate)) = &self.paused_after_read
            && limit > 1
            && !rows.is_empty()
            && !gate.is_closed()
        {
            read.notify_one();
            gate.acquire().await.unwrap().forget();
            // Once only.
            gate.close();
        }
        Ok(rows)
    }
    async fn backlog(&self) -> Result<dacapo::ports::OutboxBacklog, dacapo::EngineError> {
        self.inner.backlog().await
    }
    async fn delete_published_before(
        &self,
        before: chrono::DateTime<chrono::Utc>,
        limit: usize,
    ) -> Result<u64, dacapo::EngineError> {
        self.inner.delete_published_before(before, limit).await
    }
    async fn mark_published(
        &self,
        positions: &[i64],
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), dacapo::EngineError> {
        let first = {
            let mut marks = self.marks.lock().unwrap();
            marks.push(positions.to_vec());
            marks.len() == 1
        };
        if first && self.fail_first_mark {
            return Err(dacapo::EngineError::store("the mark's commit failed"));
        }
        self.inner.mark_published(positions, at).await
    }
    async fn sync(&self) -> Result<(), dacapo::EngineError> {
        self.inner.sync().await
    }
    async fn enlist(&self, envelopes: &[dacapo::Envelope]) -> Result<(), dacapo::EngineError> {
        self.inner.enlist(envelopes).await
    }
    fn enlisted(
        &self,
    ) -> Option<futures::stream::BoxStream<'static, Result<(), dacapo::EngineError>>> {
        use futures::StreamExt;
        let signals = Arc::clone(&self.signals);
        let stream = self.inner.enlisted()?;
        Some(
            stream
                .inspect(move |_| {
                    signals.fetch_add(1, Ordering::SeqCst);
                })
                .boxed(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_without_the_lease_does_not_contend_for_it_on_every_wake() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    db.execute(
        "INSERT INTO dacapo_outbox_lease (id, owner, expires_at) \
         VALUES (1, 'relaying-elsewhere', 9000000000000000)",
    )
    .await;
    // Something waits, so the first round asks for the lease.
    db.outbox_transaction(&[removed(100)], true).await;
    let outbox = Observed::new(db.sqlite_or_postgres_outbox().await);
    let (leases, signals) = (Arc::clone(&outbox.leases), Arc::clone(&outbox.signals));
    let runtime = db
        .store(Runtime::builder(), "standby", Duration::from_secs(30))
        .await
        .outbox_store(Arc::new(outbox))
        .relay_interval(NEVER_POLLS)
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", Recorder::new()))
        .build()
        .unwrap();
    tokio::time::timeout(WAIT, async {
        while leases.load(Ordering::SeqCst) == 0 || relays_listening(&db).await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the first round asked for the lease, and the relay listens");
    for n in 0..10 {
        db.outbox_transaction(&[removed(n)], true).await;
    }
    tokio::time::timeout(WAIT, async {
        while signals.load(Ordering::SeqCst) < 10 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every commit signalled the relay");
    // Each signal is a wake, handled in turn: once ten were left to the lease holder, none of
    // them can still ask for the lease.
    tokio::time::timeout(WAIT, async {
        while runtime.stats().relay_wakes_deferred < 10 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the wakes were left to the lease holder: {} of 10 within {WAIT:?}, {} lease requests",
            runtime.stats().relay_wakes_deferred,
            leases.load(Ordering::SeqCst)
        )
    });
    let backlog = runtime.outbox_backlog().await.unwrap().unwrap();
    assert_eq!(backlog.depth, 11, "nothing published by this node");
    assert_eq!(
        leases.load(Ordering::SeqCst),
        1,
        "only the first round asked: another node holds the lease"
    );
    runtime.shutdown().await;
}

on_both_backends!(
    a_relay_renews_its_lease_during_a_long_round_and_stops_the_moment_it_is_lost_sqlite,
    a_relay_renews_its_lease_during_a_long_round_and_stops_the_moment_it_is_lost_postgres,
    |db| {
        let messages: Vec<MemberRemoved> = (0..300).map(removed).collect();
        db.outbox_transaction(&messages, true).await;
        let lost = Arc::new(tokio::sync::Notify::new());
        let outbox = Observed {
            lease_lost_after_first: Some(Arc::clone(&lost)),
            // Read 0 finds the outbox not empty, read 1 is the first batch, read 2 the second:
            // after it the lease (ten polls of 100 ms) is more than half gone, while the first
            // batch took a small part of it.
            slow_read: Some((2, Duration::from_millis(600))),
            ..Observed::new(db.sqlite_or_postgres_outbox().await)
        };
        let requests = Arc::clone(&outbox.leases);
        // The receiving inbox in memory: publishing a batch takes no time next to the read.
        let runtime = Runtime::builder()
            .outbox_store(Arc::new(outbox))
            .relay_interval(Duration::from_millis(100))
            .relay_batch(100)
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", Recorder::new()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, lost.notified())
            .await
            .expect("the relay asked to renew its lease during its second batch");
        // A round ends before the next begins: once the next round asked for the lease too,
        // the round that lost it has marked what it published (its first batch, marked while
        // the second was read) and published nothing once refused.
        tokio::time::timeout(WAIT, lost.notified())
            .await
            .expect("the relay's next round asked for the lease");
        let backlog = runtime.outbox_backlog().await.unwrap().unwrap();
        assert_eq!(
            backlog.depth, 200,
            "the first batch published, nothing after the lease was lost"
        );
        assert!(requests.load(Ordering::SeqCst) >= 2);
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_failed_mark_still_marks_the_batch_published_alongside_it_sqlite,
    a_failed_mark_still_marks_the_batch_published_alongside_it_postgres,
    |db| {
        let messages: Vec<MemberRemoved> = (0..250).map(removed).collect();
        db.outbox_transaction(&messages, true).await;
        let outbox = Observed {
            fail_first_mark: true,
            ..Observed::new(db.sqlite_or_postgres_outbox().await)
        };
        let marks = Arc::clone(&outbox.marks);
        let runtime = Runtime::builder()
            .outbox_store(Arc::new(outbox))
            .relay_interval(Duration::from_millis(50))
            .relay_batch(100)
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", Recorder::new()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while runtime.outbox_backlog().await.unwrap().unwrap().depth > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("everything published and marked");
        runtime.shutdown().await;
        let marks = marks.lock().unwrap().clone();
        let mut positions: Vec<i64> = marks.iter().flatten().copied().collect();
        positions.sort_unstable();
        positions.dedup();
        assert_eq!(positions.len(), 250);
        // The first batch's mark failed while the second batch went out: the round marks the
        // second before it ends, instead of leaving it to be published again.
        assert_eq!(marks[0], positions[..100]);
        assert_eq!(marks[1], positions[100..200]);
        assert_eq!(
            marks[2],
            positions[..100],
            "the next round publishes the first again"
        );
    }
);

on_both_backends!(
    an_idle_relay_reads_and_writes_nothing_sqlite,
    an_idle_relay_reads_and_writes_nothing_postgres,
    |db| {
        let outbox = Observed::new(db.sqlite_or_postgres_outbox().await);
        let (reads, leases) = (Arc::clone(&outbox.reads), Arc::clone(&outbox.leases));
        let runtime = Runtime::builder()
            .outbox_store(Arc::new(outbox))
            .relay_interval(Duration::from_millis(10))
            .build()
            .unwrap();
        until(|| reads.load(Ordering::SeqCst) >= 10).await;
        assert_eq!(
            leases.load(Ordering::SeqCst),
            0,
            "ten polls of an empty outbox took no lease (no write)"
        );
        // Something to publish: the next poll takes the lease and publishes it.
        db.outbox_transaction(&[removed(1)], true).await;
        until(|| leases.load(Ordering::SeqCst) >= 1).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_batch_of_rows_beyond_a_statements_parameters_is_marked_published_sqlite,
    a_batch_of_rows_beyond_a_statements_parameters_is_marked_published_postgres,
    |db| {
        // More positions than one statement binds on either database (32 766 on SQLite, 65 535
        // on PostgreSQL): a `relay_batch` this large marked nothing before, every round.
        let outbox = db.sqlite_or_postgres_outbox().await;
        db.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 70000) \
             INSERT INTO dacapo_outbox (id, message_type, payload, headers, sent_at, enlisted_at) \
             SELECT 'row-' || i, 'tests.many', '', '{}', 0, 0 FROM n",
        )
        .await;
        let positions: Vec<i64> = outbox
            .unpublished(0, 70_000)
            .await
            .unwrap()
            .into_iter()
            .map(|(position, _)| position)
            .collect();
        assert_eq!(positions.len(), 70_000);
        outbox
            .mark_published(&positions, chrono::Utc::now())
            .await
            .unwrap();
        assert_eq!(outbox.backlog().await.unwrap().depth, 0);
    }
);

on_both_backends!(
    a_dead_letter_the_broker_refused_is_replayed_through_the_outbox_sqlite,
    a_dead_letter_the_broker_refused_is_replayed_through_the_outbox_postgres,
    |db| {
        use dacapo::ports::DeadLetterStore;
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = recording(&db, &calls)
            .await
            .relay_interval(Duration::from_millis(50))
            .build()
            .unwrap();
        // As the relay keeps one the broker refused: never in an inbox.
        let envelope = Envelope::for_message(&removed(7)).unwrap();
        let now = chrono::Utc::now();
        let letter = dacapo::DeadLetter::rejected(
            envelope.clone(),
            dacapo::DeadLetterReason::Undeliverable("over the broker's max_payload".into()),
            now,
        );
        match db.backend {
            support_stores::Backend::Sqlite => db.sqlite().await.put(letter).await.unwrap(),
            support_stores::Backend::Postgres => db.postgres().await.put(letter).await.unwrap(),
        }

        runtime.dead_letters().replay(envelope.id).await.unwrap();
        assert_eq!(
            db.value_for::<i64>(
                "SELECT count(*) FROM dacapo_outbox WHERE id = $1",
                envelope.id.simple().to_string(),
            )
            .await,
            1,
            "back in the outbox, with its id"
        );
        // The relay sends it again (here to this node's own handler: no broker routes it).
        until(|| calls.count() == 1).await;
        assert_eq!(calls.calls()[0].message_id, Some(envelope.id));
        assert!(matches!(
            runtime.dead_letters().inspect(envelope.id).await,
            Err(dacapo::Error::DeadLetterNotFound(_))
        ));
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        runtime.shutdown().await;
    }
);

on_both_backends!(
    an_outbox_given_without_a_store_is_relayed_at_the_default_interval_sqlite,
    an_outbox_given_without_a_store_is_relayed_at_the_default_interval_postgres,
    |db| {
        // No store and no relay setting: the outbox alone starts the relay (it started none
        // before, and `idle` waited for the row for ever).
        db.outbox_transaction(&[removed(7)], true).await;
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = Runtime::builder()
            .outbox_store(Arc::from(db.sqlite_or_postgres_outbox().await))
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()),
            )
            .build()
            .unwrap();
        until(|| calls.count() == 1).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(calls.calls()[0].message.member_id, 7);
        runtime.shutdown().await;
    }
);

/// The relay gives up its hold on the harness's clock while an envelope waits for the
/// engine's room: the one slot is held by a delivery cooling down, whose retry only the clock
/// moving on brings. (The round held the clock, the cooldown never ended, and neither
/// delivery settled.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_waiting_for_room_lets_the_harness_clock_move() {
    use dacapo::testing::{Fault, ScratchDatabase, TestHarness};
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let (members, hooks) = (Recorder::<MemberRemoved>::new(), Recorder::new());
    let harness = TestHarness::builder()
        .store(store.clone())
        .settle_timeout(WAIT)
        .configure(|runtime| {
            runtime
                .max_in_flight(1)
                .relay_interval(Duration::from_secs(3))
        })
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("members", members.clone())
                .handle_named::<support::WebhookQueued, _>("hooks", hooks.clone()),
        )
        // Cooldowns of 1 s, 6 s and 16 s: the third comes after a relay tick (3 s, 6 s).
        .fault("m", "members", Fault::fail_times(3))
        .build()
        .unwrap();
    harness.idle().await.unwrap();
    // In the outbox without waking the relay: its next tick finds it.
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    dacapo::outbox::Outbox::enlist(
        &mut tx,
        &support::WebhookQueued {
            delivery_id: "hook-1".into(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let report = harness.publish(&removed(1)).await.unwrap();

    assert!(report.is_handled(), "{report:?}");
    assert_eq!(report.attempts, 4);
    harness.idle().await.unwrap();
    assert_eq!((members.count(), hooks.count()), (1, 1));
    harness.shutdown().await;
}

/// Enlists a webhook in the outbox, then holds the engine's one slot longer than the relay's
/// lease; before it lets go, the webhook's row is marked published behind the relay's back, as
/// the relay of another node that took the lease meanwhile would have done.
struct PublishedElsewhereWhileHeld {
    pool: dacapo::sqlx::SqlitePool,
    hold: Duration,
}

impl Handler<MemberRemoved> for PublishedElsewhereWhileHeld {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let hook = support::WebhookQueued {
            delivery_id: "published elsewhere".into(),
        };
        dacapo::outbox::Outbox::enlist(&mut tx, &hook).await?;
        tx.commit().await?;
        // Long enough for the relay, woken by the enlist and ticking every 20 ms, to read the
        // row and wait for the slot, and for its lease of 200 ms to run out.
        tokio::time::sleep(self.hold).await;
        dacapo::sqlx::query("UPDATE dacapo_outbox SET published_at = 1 WHERE published_at IS NULL")
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// A relay that waited for room longer than its lease does not publish what it read under
/// the lease: another node may have taken the lease and published those rows meanwhile (and
/// its inbox forgotten them past the retention). It reads them again on the next round. Before,
/// it published its stale copy as soon as room came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_waited_for_room_past_its_lease_reads_its_rows_again() {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let hooks = Recorder::<support::WebhookQueued>::new();
    let runtime = Runtime::builder()
        .store(store.clone())
        .max_in_flight(1)
        .relay_interval(Duration::from_millis(20))
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>(
                    "members",
                    PublishedElsewhereWhileHeld {
                        pool: store.pool().clone(),
                        hold: Duration::from_millis(600),
                    },
                )
                .handle_named::<support::WebhookQueued, _>("hooks", hooks.clone()),
        )
        .build()
        .unwrap();

    runtime.publish(&removed(1)).await.unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    // A later row is relayed after the round that waited: once it is handled, that round is
    // over, and whatever it published was handled first.
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let later = support::WebhookQueued {
        delivery_id: "later".into(),
    };
    dacapo::outbox::Outbox::enlist(&mut tx, &later)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    until(|| hooks.count() >= 1).await;
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();

    let handled: Vec<String> = hooks
        .calls()
        .into_iter()
        .map(|call| call.message.delivery_id)
        .collect();
    assert_eq!(
        handled,
        ["later"],
        "the row another node published is not published again"
    );
    runtime.shutdown().await;
}

/// Says it started, then holds the engine's one slot until the gate opens.
struct HoldsTheSlot {
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Handler<MemberRemoved> for HoldsTheSlot {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.started.notify_one();
        self.gate.acquire().await?.forget();
        Ok(())
    }
}

/// A relay whose lease ran out while it waited for room takes the lease again and publishes
/// the row it waited with, still unpublished, in the same round. Before, it gave its room up
/// and left the row to the next round, and an engine that stays full for longer than a lease
/// kept the outbox waiting as long. The relay polls once an hour here: only this round can
/// publish the row within the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lease_ran_out_while_it_waited_for_room_publishes_its_row() {
    let clock = support_clock::ManualClock::default();
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let (started, gate) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let hooks = Recorder::<support::WebhookQueued>::new();
    let runtime = Runtime::builder()
        .store(store.clone())
        .clock(Arc::new(clock.clone()))
        .max_in_flight(1)
        .relay_interval(Duration::from_secs(3600))
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>(
                    "holds",
                    HoldsTheSlot {
                        started: Arc::clone(&started),
                        gate: Arc::clone(&gate),
                    },
                )
                .handle_named::<support::WebhookQueued, _>("hooks", hooks.clone()),
        )
        .build()
        .unwrap();
    runtime.publish(&removed(1)).await.unwrap();
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the slot is held");
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let hook = support::WebhookQueued {
        delivery_id: "waited for room".into(),
    };
    runtime.outbox().enlist(&mut tx, &hook).await.unwrap();
    // Wakes the relay, which reads the row and waits for room. (Were it slower than this, the
    // test would show nothing, and pass.)
    runtime.outbox().commit(tx).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Its lease of ten polls runs out while it waits.
    clock.advance(chrono::Duration::hours(11));
    gate.add_permits(1);

    until(|| hooks.count() == 1).await;
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    runtime.shutdown().await;
}

/// A harness on SQLite whose outbox holds a row the application enlisted, waking no relay:
/// `idle` wakes it, the row is published and handled, and `idle` returns — it waited for the
/// relay's next poll, which the virtual clock never reached (`NotSettled`). A store outage
/// while it looks does not make it return early either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_waits_for_what_the_application_enlisted_even_through_an_outage() {
    use dacapo::testing::{ScratchDatabase, StoreFault, TestHarness};
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let hooks = Recorder::<support::WebhookQueued>::new();
    let harness = TestHarness::builder()
        .store(store.clone())
        .settle_timeout(WAIT)
        .module(Module::new("m").handle_named::<support::WebhookQueued, _>("hooks", hooks.clone()))
        .build()
        .unwrap();
    harness.idle().await.unwrap();
    for n in 1..=2 {
        let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        dacapo::outbox::Outbox::enlist(
            &mut tx,
            &support::WebhookQueued {
                delivery_id: format!("hook-{n}"),
            },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        if n == 2 {
            // The next statement fails: the look at the backlog, likely.
            harness
                .store_fault(StoreFault::unavailable().times(1))
                .unwrap();
        }
        harness.idle().await.unwrap();
        assert_eq!(hooks.count(), n, "handled before idle returned");
    }
    harness.shutdown().await;
}

/// Scheduling against the harness's own clock: after an hour of virtual time, `now()` is an
/// hour past the system's, and a delivery due thirty seconds from it is scheduled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_schedules_against_its_virtual_now() {
    use dacapo::testing::{ScratchDatabase, TestHarness};
    let db = ScratchDatabase::sqlite();
    let harness = TestHarness::builder()
        .store(db.sqlite_store().await.unwrap())
        .settle_timeout(WAIT)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .build()
        .unwrap();
    harness.advance(Duration::from_secs(3600)).await.unwrap();
    let ahead = harness.now() - chrono::Utc::now();
    assert!(ahead > chrono::Duration::minutes(59), "{ahead}");
    let report = harness
        .publish_with(
            &removed(1),
            SendOptions::new().deliver_at(harness.now() + chrono::Duration::seconds(30)),
        )
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Outcome::Scheduled(_)),
        "{report:?}"
    );
}

/// A relay paused between reading a batch for the broker and sending it — past its lease,
/// while another node took the lease and published those rows — reads the outbox again once
/// it took the lease back, and sends nothing it read before: the rows' receivers may have
/// forgotten them past their retention and would run them again. Before, it sent its stale
/// copy (only rows for the engine were read again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_paused_past_its_lease_sends_no_row_it_read_before_to_the_broker() {
    let clock = support_clock::ManualClock::default();
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (read, gate) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let mut outbox = Observed::new(db.sqlite_or_postgres_outbox().await);
    outbox.paused_after_read = Some((Arc::clone(&read), Arc::clone(&gate)));
    let queue = hooks_queue(&db);
    let runtime = db
        .store(Runtime::builder(), "paused", Duration::from_secs(30))
        .await
        .outbox_store(Arc::new(outbox))
        .clock(Arc::new(clock.clone()))
        .relay_interval(Duration::from_secs(3600))
        .transport(queue)
        .build()
        .unwrap();
    let hook = |id: &str| support::WebhookQueued {
        delivery_id: id.into(),
    };
    runtime
        .publish(&hook("read before the pause"))
        .await
        .unwrap();
    tokio::time::timeout(WAIT, read.notified())
        .await
        .expect("the relay read its batch");
    // Meanwhile another node took the lease, published the row and marked it; its lease of
    // ten polls ran out, and so did this one's.
    db.execute("UPDATE dacapo_outbox SET published_at = 1")
        .await;
    clock.advance(chrono::Duration::hours(11));
    gate.add_permits(1);
    // A later row, sent by the round after the paused one: once it is in the queue, the
    // paused round is over.
    runtime.publish(&hook("after")).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while queued(
            &db,
            "payload = convert_to('{\"delivery_id\":\"after\"}', 'UTF8')",
        )
        .await
            == 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the later row reached the queue");
    assert_eq!(
        queued(&db, "TRUE").await,
        1,
        "the row read before the pause was not sent again"
    );
    runtime.shutdown().await;
}

/// An engine full for longer than a poll (its one slot held here) holds back no row for a
/// broker behind rows waiting for room: the round sends the broker's rows of its later
/// batches (ten at most, the next round going on from there) and leaves the local ones for a
/// later round. Before, every row after a batch of
/// local rows waited for room, however long the engine stayed full (its deliveries cooling
/// down through an outage, say).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_engine_holds_back_no_row_for_a_broker() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (started, gate) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let queue = hooks_queue(&db);
    let runtime = db
        .store(Runtime::builder(), "full", Duration::from_secs(30))
        .await
        .max_in_flight(1)
        .relay_interval(Duration::from_millis(50))
        .relay_batch(2)
        .transport(queue)
        .module(Module::new("m").handle_named::<MemberRemoved, _>(
            "holds",
            HoldsTheSlot {
                started: Arc::clone(&started),
                gate: Arc::clone(&gate),
            },
        ))
        .build()
        .unwrap();
    runtime.publish(&removed(1)).await.unwrap();
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the slot is held");
    // More batches of local rows than a round reads on for the broker's (ten), then a row
    // for the broker: the rounds go on from where the last one stopped.
    let local: Vec<MemberRemoved> = (2..=26).map(removed).collect();
    db.outbox_transaction(&local, true).await;
    runtime
        .publish(&support::WebhookQueued {
            delivery_id: "behind".into(),
        })
        .await
        .unwrap();
    tokio::time::timeout(WAIT, async {
        while queued(&db, "TRUE").await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the broker's row left while the engine stayed full");
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_outbox WHERE published_at IS NULL")
            .await,
        25,
        "the local rows wait for room"
    );
    gate.add_permits(26);
    tokio::time::timeout(WAIT, runtime.idle())
        .await
        .expect("the local rows were handled once room came");
    runtime.shutdown().await;
}

/// Rows in the PostgreSQL queue table of `db` matching `condition` (`TRUE` for all); none
/// while the publisher has not made the table yet.
async fn queued(db: &support_stores::TestDatabase, condition: &str) -> i64 {
    let pool = dacapo::sqlx::PgPool::connect(&db.url).await.unwrap();
    let (present,): (bool,) =
        dacapo::sqlx::query_as("SELECT to_regclass('dacapo_queue') IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    let count = if present {
        dacapo::sqlx::query_scalar(dacapo::sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM dacapo_queue WHERE {condition}"
        )))
        .fetch_one(&pool)
        .await
        .unwrap()
    } else {
        0
    };
    pool.close().await;
    count
}

on_both_backends!(
    an_envelope_enlisted_again_is_kept_once_sqlite,
    an_envelope_enlisted_again_is_kept_once_postgres,
    |db| {
        // As a handler's cascades are enlisted again by its rerun after a crash, with the ids
        // of its first run (before, the second enlist failed on the outbox's key, and was
        // logged as an error of the store).
        let envelope = dacapo::Envelope::for_message(&removed(5)).unwrap();
        let outbox = db.sqlite_or_postgres_outbox().await;
        outbox
            .enlist(std::slice::from_ref(&envelope))
            .await
            .unwrap();
        let again = dacapo::Envelope::for_message(&removed(6)).unwrap();
        outbox
            .enlist(&[envelope.clone(), again])
            .await
            .expect("enlisted again, beside a new one");
        assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 2);
    }
);

/// An application's PostgreSQL transaction that a failed statement aborted is refused by
/// `runtime.outbox().commit`: the server answers its COMMIT with a rollback, which sqlx reports
/// as done, and the caller took its enlisted messages for sent. Nothing was enlisted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committing_an_aborted_postgres_transaction_through_the_runtime_fails() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = recording(&db, &calls).await.build().unwrap();
    let store = db.postgres().await;
    let mut tx = store.pool().begin().await.unwrap();
    runtime.outbox().enlist(&mut tx, &removed(1)).await.unwrap();
    // Failed, and carried on past.
    let _ = dacapo::sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
    let error = runtime.outbox().commit(tx).await.unwrap_err();
    assert!(error.to_string().contains("aborted"), "{error}");
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 0);
    runtime.shutdown().await;
}

/// `WebhookQueued` routed to a PostgreSQL queue in `db`'s database, which nothing takes from.
fn hooks_queue(db: &support_stores::TestDatabase) -> dacapo::transport::PostgresQueue {
    dacapo::transport::PostgresQueue::connect(&db.url, "hooks")
        .unwrap()
        .route::<support::WebhookQueued>()
}

/// A node that shuts down gives up its relay lease: the next node's relay publishes at its
/// next poll, not once the lease ran out — ten of the stopped node's polls, ten hours here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_shuts_down_gives_up_its_relay_lease() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let node = |name: &'static str, poll: Duration| {
        let (db, calls) = (&db, calls.clone());
        async move {
            db.store(Runtime::builder(), name, Duration::from_secs(30))
                .await
                .relay_interval(poll)
                .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls))
                .build()
                .unwrap()
        }
    };
    let first = node("polls-hourly", Duration::from_secs(3600)).await;
    // Published by the first node (its store's notification wakes it), under its lease.
    tokio::time::timeout(WAIT, async {
        while relays_listening(&db).await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the first node's relay listens");
    db.outbox_transaction(&[removed(1)], true).await;
    until(|| calls.count() == 1).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_outbox_lease WHERE owner = 'polls-hourly'")
            .await,
        1
    );
    first.shutdown().await;

    let second = node("polls-often", Duration::from_millis(50)).await;
    db.outbox_transaction(&[removed(2)], true).await;
    until(|| calls.count() == 2).await;
    second.shutdown().await;
}

/// How many relays listen for the enlists of `db`'s PostgreSQL database.
async fn relays_listening(db: &support_stores::TestDatabase) -> i64 {
    db.scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN %dacapo_outbox%'",
    )
    .await
}
