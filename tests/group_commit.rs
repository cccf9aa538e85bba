//! Group commit: concurrent accepts share one transaction, each caller returns once its own
//! envelope committed, a failed group commit fails every caller in it and stores none, and a
//! write the database refuses fails alone — on a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::store::{Dialect, SqlStore};
use dacapo::testing::{Recorder, ScratchDatabase, StoreFault, TestHarness};
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
const COUNT_INBOX: &str = "SELECT count(*) FROM dacapo_inbox";

/// A harness whose store groups up to 64 writes, lingering 50 ms for company.
fn harness<D: Dialect>(store: SqlStore<D>, recorder: &Recorder<TicketSold>) -> TestHarness {
    TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store.group_commit(64, Duration::from_millis(50)))
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
    let harness = harness(store, &recorder);
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
    failed_group_commit(store, async || {
        sqlx::query_scalar(COUNT_INBOX)
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
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
    failed_group_commit(store, async || {
        sqlx::query_scalar(COUNT_INBOX)
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test]
async fn a_write_the_database_refuses_fails_alone_and_the_rest_of_its_group_commits() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder);
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

#[tokio::test]
async fn a_redelivery_in_the_same_group_is_a_duplicate() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let recorder = Recorder::<TicketSold>::new();
    let harness = harness(store, &recorder);
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
