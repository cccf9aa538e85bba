//! Group commit: concurrent accepts share one transaction, each caller returns once its own
//! envelope committed, a failed group commit fails every caller in it and stores none, and a
//! write the database refuses fails alone — on a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::time::Duration;

#[path = "support/stores.rs"]
mod support_stores;

use dacapo::prelude::*;
use dacapo::store::{Dialect, SqlStore};
use dacapo::testing::{Recorder, ScratchDatabase, StoreFault, TestHarness};
use dacapo::transaction::HandlerTransactions;
use dacapo::{Envelope, Error};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct TicketSold {
    ticket: u64,
}

impl Message for TicketSold {
    const TYPE: &'static str = "group_commit.ticket_sold";
}

const CALLERS: u64 = 16;

/// Two tests running `$body` on a fresh store: a SQLite file, and a PostgreSQL database.
macro_rules! on_both_stores {
    ($sqlite:ident, $postgres:ident, $body:ident) => {
        #[tokio::test]
        async fn $sqlite() {
            let db = ScratchDatabase::sqlite();
            $body(db.sqlite_store().await.unwrap()).await;
        }

        #[tokio::test]
        async fn $postgres() {
            let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
            $body(db.postgres_store().await.unwrap()).await;
        }
    };
}

/// What `$sql` counts, on `$pool`, each time it is called.
macro_rules! count_rows {
    ($pool:ident, $sql:expr) => {
        async || -> i64 { sqlx::query_scalar($sql).fetch_one(&$pool).await.unwrap() }
    };
}
const COUNT_INBOX: &str = "SELECT count(*) FROM dacapo_inbox";

/// How long the tests' groups linger for company, unless a test says otherwise.
const LINGER: Duration = Duration::from_millis(50);

/// A harness whose store groups up to 64 writes, lingering `linger` for company.
fn harness<D: Dialect>(
    store: SqlStore<D>,
    recorder: &Recorder<TicketSold>,
    linger: Duration,
) -> TestHarness {
    TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store.group_commit(64, linger))
        .module(Module::new("box_office").handle_named::<TicketSold, _>("count", recorder.clone()))
        .build()
        .unwrap()
}

fn envelopes(harness: &TestHarness) -> Vec<Envelope> {
    (0..CALLERS)
        .map(|ticket| {
            harness
                .runtime()
                .envelope(&TicketSold { ticket }, SendOptions::default())
                .unwrap()
        })
        .collect()
}

/// Accepts every envelope concurrently: the receives of one poll, queued before the first
/// commit starts.
async fn accept_all(harness: &TestHarness, envelopes: &[Envelope]) -> Vec<Result<(), Error>> {
    futures::future::join_all(
        envelopes
            .iter()
            .map(|envelope| harness.runtime().receive(envelope.clone())),
    )
    .await
}

async fn failed_group_commit<D: Dialect>(store: SqlStore<D>, stored: impl AsyncFn() -> i64) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder, LINGER);
    let envelopes = envelopes(&harness);
    harness.idle().await.unwrap();

    // The one commit of the group fails.
    harness
        .store_fault(StoreFault::failing_commits().times(1))
        .unwrap();
    let accepted = accept_all(&harness, &envelopes).await;
    assert_eq!(
        harness.store_faults().unwrap().struck(),
        1,
        "one commit for all"
    );
    for answer in &accepted {
        assert!(
            matches!(answer, Err(error) if error.is_retryable()),
            "every caller in the group fails, retryably: {answer:?}"
        );
    }
    assert_eq!(stored().await, 0, "none of the group is stored");
    assert_eq!(recorder.count(), 0);

    // Tried again (a broker's redelivery), every one is taken, once.
    let accepted = accept_all(&harness, &envelopes).await;
    assert!(accepted.iter().all(Result::is_ok), "{accepted:?}");
    harness.idle().await.unwrap();
    assert_eq!(stored().await, CALLERS as i64);
    assert_eq!(recorder.count(), CALLERS as usize);
}

#[tokio::test]
async fn a_failed_group_commit_fails_every_caller_and_stores_none_sqlite() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let pool = store.pool().clone();
    failed_group_commit(store, count_rows!(pool, COUNT_INBOX)).await;
}

fn admin_url() -> String {
    std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

#[tokio::test]
async fn a_failed_group_commit_fails_every_caller_and_stores_none_postgres() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    failed_group_commit(store, count_rows!(pool, COUNT_INBOX)).await;
}

#[tokio::test]
async fn a_write_the_database_refuses_fails_alone_and_the_rest_of_its_group_commits() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder, LINGER);
    let mut envelopes = envelopes(&harness);
    // PostgreSQL refuses a NUL byte in text: this envelope's row can never be written.
    envelopes[5].deduplication_id = Some("ticket\0five".into());

    let accepted = accept_all(&harness, &envelopes).await;
    for (index, answer) in accepted.iter().enumerate() {
        if index == 5 {
            assert!(
                matches!(answer, Err(Error::Rejected(_))),
                "the refused write gets its own answer: {answer:?}"
            );
        } else {
            assert!(answer.is_ok(), "{index}: {answer:?}");
        }
    }
    harness.idle().await.unwrap();
    let stored: i64 = sqlx::query_scalar(COUNT_INBOX)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, CALLERS as i64 - 1);
    assert_eq!(recorder.count(), CALLERS as usize - 1);
}

on_both_stores!(
    a_redelivery_in_the_same_group_is_a_duplicate_sqlite,
    a_redelivery_in_the_same_group_is_a_duplicate_postgres,
    redelivery_in_the_same_group
);

/// Four receives of one envelope in one group commit: one statement inserts it once.
async fn redelivery_in_the_same_group<D: Dialect>(store: SqlStore<D>) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder, LINGER);
    let envelope = harness
        .runtime()
        .envelope(&TicketSold { ticket: 1 }, SendOptions::default())
        .unwrap();
    let reports = harness.deliver_concurrently(envelope, 4).await.unwrap();
    let handled = reports.iter().filter(|r| r.is_handled()).count();
    let discarded = reports
        .iter()
        .filter(|r| r.outcome == Outcome::Discarded(dacapo::DiscardReason::DuplicateEnvelope))
        .count();
    assert_eq!((handled, discarded), (1, 3), "{reports:?}");
    assert_eq!(recorder.count(), 1);
}

/// Sixteen deliveries failing their first attempt at once: their retries are recorded
/// together, and each runs once, as its second attempt.
async fn retries_recorded_together<D: Dialect>(store: SqlStore<D>, handled: impl AsyncFn() -> i64) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store.group_commit(64, Duration::from_millis(20)))
        .module(Module::new("box_office").handle_named::<TicketSold, _>("count", recorder.clone()))
        .fault("box_office", "count", dacapo::testing::Fault::fail_times(1))
        .build()
        .unwrap();
    let envelopes = envelopes(&harness);
    let accepted = accept_all(&harness, &envelopes).await;
    assert!(accepted.iter().all(Result::is_ok), "{accepted:?}");
    harness.idle().await.unwrap();
    let calls = recorder.calls();
    assert_eq!(calls.len(), CALLERS as usize, "{calls:?}");
    assert!(calls.iter().all(|call| call.attempt == 2), "{calls:?}");
    assert_eq!(handled().await, CALLERS as i64);
}

const COUNT_HANDLED: &str = "SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'";

#[tokio::test]
async fn retries_scheduled_at_once_are_recorded_together_sqlite() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let pool = store.pool().clone();
    retries_recorded_together(store, count_rows!(pool, COUNT_HANDLED)).await;
}

#[tokio::test]
async fn retries_scheduled_at_once_are_recorded_together_postgres() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    retries_recorded_together(store, count_rows!(pool, COUNT_HANDLED)).await;
}

/// Records each ticket in a handler transaction, with its completion record.
#[derive(Clone)]
struct RecordTicket;

impl Handler<TicketSold> for RecordTicket {
    async fn handle(&self, sold: &TicketSold, ctx: &MessageContext) -> Result<(), HandlerError> {
        let Some(mut tx) = ctx.transaction::<sqlx::Sqlite>().await? else {
            return Ok(());
        };
        sqlx::query("INSERT INTO tickets (ticket) VALUES ($1)")
            .bind(sold.ticket as i64)
            .execute(&mut **tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// On SQLite the runtime's own writers, handler transactions included, take turns in the
/// process: sixteen batches published at once on four connections, each ticket written in a
/// handler transaction, never find the database locked, even with SQLite's busy timeout at
/// zero (a writer that found the lock taken would fail at once instead of polling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtimes_writers_take_turns_on_sqlite() {
    let db = ScratchDatabase::sqlite();
    let (pool, store) = support_stores::never_waiting_sqlite(
        db.url(),
        "CREATE TABLE tickets (ticket INTEGER PRIMARY KEY)",
    )
    .await;
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("box_office").handle_named::<TicketSold, _>("record", RecordTicket))
        .build()
        .unwrap();
    let batches = (0..16u64).map(|batch| {
        let tickets: Vec<TicketSold> = (0..20)
            .map(|n| TicketSold {
                ticket: batch * 20 + n,
            })
            .collect();
        let runtime = &runtime;
        async move { runtime.publish_batch(&tickets).await }
    });
    let published = futures::future::join_all(batches).await;
    assert!(published.iter().all(Result::is_ok), "{published:?}");
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .unwrap();
    let stats = runtime.stats();
    assert_eq!((stats.handled, stats.dead_lettered), (320, 0), "{stats:?}");
    for (sql, expected) in [
        (
            "SELECT count(*) FROM dacapo_inbox WHERE status = 'handled'",
            320,
        ),
        ("SELECT count(*) FROM tickets", 320),
    ] {
        let count: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
        assert_eq!(count, expected, "{sql}");
    }
    runtime.shutdown().await;
}

/// A lone write commits at once, whatever the linger, and so do two: only three or more
/// waiting together wait for more — and one or two settles, for the next write, 1 ms at most.
/// A linger of an hour would hold a lone accept or settle, or a publisher's accept beside its
/// last delivery's settle, for that hour.
async fn a_lone_write_never_lingers<D: Dialect>(store: SqlStore<D>) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder, Duration::from_secs(3600));
    harness.idle().await.unwrap();
    for ticket in 0..3 {
        let report = tokio::time::timeout(
            Duration::from_secs(30),
            harness.publish(&TicketSold { ticket }),
        )
        .await
        .expect("a lone write lingered")
        .unwrap();
        assert!(report.is_handled(), "{report:?}");
    }
    let pair: Vec<Envelope> = (3..5)
        .map(|ticket| {
            harness
                .runtime()
                .envelope(&TicketSold { ticket }, SendOptions::default())
                .unwrap()
        })
        .collect();
    let accepted = tokio::time::timeout(Duration::from_secs(30), accept_all(&harness, &pair))
        .await
        .expect("two writes lingered");
    assert!(accepted.iter().all(Result::is_ok), "{accepted:?}");
    tokio::time::timeout(Duration::from_secs(30), harness.idle())
        .await
        .expect("two settles lingered")
        .unwrap();
    assert_eq!(recorder.count(), 5);
}

on_both_stores!(
    a_lone_write_never_lingers_sqlite,
    a_lone_write_never_lingers_postgres,
    a_lone_write_never_lingers
);

/// A group lingering for company commits once it is full, not at the end of its linger: a
/// long linger held a full group for all of it.
async fn a_full_group_ends_its_linger<D: Dialect>(store: SqlStore<D>) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store.group_commit(4, Duration::from_secs(3600)))
        .module(Module::new("box_office").handle_named::<TicketSold, _>("count", recorder.clone()))
        .build()
        .unwrap();
    harness.idle().await.unwrap();
    let envelopes = envelopes(&harness);
    // Three start the linger; the fourth fills the group.
    let (three, fourth) = tokio::time::timeout(Duration::from_secs(30), async {
        futures::join!(accept_all(&harness, &envelopes[..3]), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            harness.runtime().receive(envelopes[3].clone()).await
        })
    })
    .await
    .expect("the full group lingered");
    assert!(three.iter().chain([&fourth]).all(Result::is_ok));
}

on_both_stores!(
    a_full_group_ends_its_linger_sqlite,
    a_full_group_ends_its_linger_postgres,
    a_full_group_ends_its_linger
);

/// Three writes waiting together wait `linger` for company: a fourth that comes during it
/// commits with them. A failing commit shows it: the one commit fails all four.
async fn three_waiting_writes_linger_for_a_fourth<D: Dialect>(store: SqlStore<D>) {
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder, Duration::from_secs(2));
    harness.idle().await.unwrap();
    let envelopes = envelopes(&harness);
    harness
        .store_fault(StoreFault::failing_commits().times(1))
        .unwrap();
    let (three, fourth) = futures::join!(accept_all(&harness, &envelopes[..3]), async {
        // Well inside the linger, whatever the machine's load.
        tokio::time::sleep(Duration::from_millis(100)).await;
        harness.runtime().receive(envelopes[3].clone()).await
    });
    assert_eq!(
        harness.store_faults().unwrap().struck(),
        1,
        "one commit for all"
    );
    for answer in three.iter().chain([&fourth]) {
        assert!(
            matches!(answer, Err(error) if error.is_retryable()),
            "the fourth joined the three's commit: {answer:?}"
        );
    }
    assert_eq!(recorder.count(), 0);
}

on_both_stores!(
    three_waiting_writes_linger_for_a_fourth_sqlite,
    three_waiting_writes_linger_for_a_fourth_postgres,
    three_waiting_writes_linger_for_a_fourth
);
