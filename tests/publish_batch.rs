//! `Runtime::publish_batch`: many messages in one store transaction, all or nothing, each then
//! delivered once — on a real SQLite file, a real PostgreSQL server, and in memory.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::store::{Dialect, SqlStore};
use dacapo::testing::{Recorder, ScratchDatabase, StoreFault, TestHarness};
use dacapo::{Error, Runtime};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct SeatBooked {
    seat: u64,
    note: String,
}

impl Message for SeatBooked {
    const TYPE: &'static str = "publish_batch.seat_booked";
}

const COUNT_INBOX: &str = "SELECT count(*) FROM dacapo_inbox";

fn seats(count: u64) -> Vec<SeatBooked> {
    (0..count)
        .map(|seat| SeatBooked {
            seat,
            note: String::new(),
        })
        .collect()
}

fn harness<D: Dialect>(store: SqlStore<D>, recorder: &Recorder<SeatBooked>) -> TestHarness {
    TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store)
        .module(Module::new("venue").handle_named::<SeatBooked, _>("book", recorder.clone()))
        .build()
        .unwrap()
}

/// A failed commit stores none of the batch; the batch published again is delivered whole,
/// each message once, under the ids the call returned.
async fn all_or_nothing<D: Dialect>(store: SqlStore<D>, stored: impl AsyncFn() -> i64) {
    let recorder = Recorder::<SeatBooked>::new();
    let harness = harness(store, &recorder);
    harness.idle().await.unwrap();
    let seats = seats(50);

    harness
        .store_fault(StoreFault::failing_commits().times(1))
        .unwrap();
    let failed = harness.runtime().publish_batch(&seats).await;
    assert!(
        matches!(&failed, Err(error) if error.is_retryable()),
        "{failed:?}"
    );
    assert_eq!(stored().await, 0, "none of the batch is stored");

    let ids = harness.runtime().publish_batch(&seats).await.unwrap();
    harness.idle().await.unwrap();
    assert_eq!(stored().await, 50);
    let mut calls = recorder.calls();
    assert_eq!(calls.len(), 50);
    calls.sort_by_key(|call| call.message.seat);
    for (call, id) in calls.iter().zip(&ids) {
        assert_eq!(
            call.message_id,
            Some(*id),
            "ids in the order of the messages"
        );
    }
}

#[tokio::test]
async fn a_batch_is_stored_all_or_nothing_and_delivered_once_sqlite() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let pool = store.pool().clone();
    all_or_nothing(store, async || {
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
async fn a_batch_is_stored_all_or_nothing_and_delivered_once_postgres() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    all_or_nothing(store, async || {
        sqlx::query_scalar(COUNT_INBOX)
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test]
async fn one_refused_message_refuses_the_whole_batch() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    let recorder = Recorder::<SeatBooked>::new();
    let harness = TestHarness::builder()
        .settle_timeout(Duration::from_secs(20))
        .store(store)
        .configure(|runtime| runtime.deduplicate_by::<SeatBooked>(|seat| Some(seat.note.clone())))
        .module(Module::new("venue").handle_named::<SeatBooked, _>("book", recorder.clone()))
        .build()
        .unwrap();
    let mut seats = seats(10);
    // Its logical id holds a NUL byte, which PostgreSQL refuses in text.
    seats[3].note = "seat\0three".into();
    let refused = harness.runtime().publish_batch(&seats).await;
    assert!(matches!(refused, Err(Error::Rejected(_))), "{refused:?}");
    harness.idle().await.unwrap();
    let rows: i64 = sqlx::query_scalar(COUNT_INBOX)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "none of the batch is stored");
    assert_eq!(recorder.count(), 0);
}

#[tokio::test]
async fn an_oversized_message_sends_none_of_the_batch() {
    let recorder = Recorder::<SeatBooked>::new();
    let runtime = Runtime::builder()
        .max_envelope_size(1024)
        .module(Module::new("venue").handle_named::<SeatBooked, _>("book", recorder.clone()))
        .build()
        .unwrap();
    let mut seats = seats(5);
    seats[4].note = "x".repeat(4096);
    let refused = runtime.publish_batch(&seats).await;
    assert!(
        matches!(refused, Err(Error::TooLarge { .. })),
        "{refused:?}"
    );
    runtime.idle().await;
    assert_eq!(recorder.count(), 0);
    assert_eq!(runtime.stats().received, 0);
}

#[tokio::test]
async fn in_memory_a_batch_is_delivered_once_each() {
    let recorder = Recorder::<SeatBooked>::new();
    let runtime = Runtime::builder()
        .module(Module::new("venue").handle_named::<SeatBooked, _>("book", recorder.clone()))
        .build()
        .unwrap();
    let ids = runtime.publish_batch(&seats(20)).await.unwrap();
    assert_eq!(ids.len(), 20);
    assert!(
        runtime
            .publish_batch::<SeatBooked>(&[])
            .await
            .unwrap()
            .is_empty()
    );
    runtime.idle().await;
    assert_eq!(recorder.count(), 20);
}

#[tokio::test]
async fn a_listener_accepts_a_prefetched_batch_through_an_outage_and_its_redelivery_is_discarded() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let recorder = Recorder::<SeatBooked>::new();
    let harness = harness(store, &recorder);
    harness.idle().await.unwrap();
    let envelopes: Vec<_> = seats(10)
        .iter()
        .map(|seat| {
            harness
                .runtime()
                .envelope(seat, SendOptions::default())
                .unwrap()
        })
        .collect();
    let listener = harness
        .runtime()
        .listener()
        .backoff(dacapo::transport::Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(5),
        ));

    harness
        .store_fault(StoreFault::unavailable().times(3))
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(20),
        listener.accept_batch(envelopes.clone()),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(listener.pauses() >= 1, "the outage was waited out");
    harness.idle().await.unwrap();
    assert_eq!(recorder.count(), 10);

    // The broker delivers the whole prefetch again: every copy is discarded.
    listener.accept_batch(envelopes).await.unwrap();
    harness.idle().await.unwrap();
    assert_eq!(recorder.count(), 10);
    let discarded = harness
        .reports()
        .iter()
        .filter(|r| r.outcome == Outcome::Discarded(dacapo::DiscardReason::DuplicateEnvelope))
        .count();
    assert_eq!(discarded, 10, "each copy is reported discarded");
}
