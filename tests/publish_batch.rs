//! `Runtime::publish_batch`: many messages in one store transaction, all or nothing, each then
//! delivered once — on a real SQLite file, a real PostgreSQL server, and in memory.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::sync::Arc;
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

/// Books a seat: a seat noted "slow" tells `entered` and waits for `release`; any other
/// counts its run in `runs`.
#[derive(Clone)]
struct Booking {
    entered: Arc<tokio::sync::Semaphore>,
    release: Arc<tokio::sync::Semaphore>,
    runs: Arc<std::sync::atomic::AtomicUsize>,
}

impl Booking {
    fn new() -> Self {
        Self {
            entered: Arc::new(tokio::sync::Semaphore::new(0)),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
            runs: Arc::default(),
        }
    }
}

impl Handler<SeatBooked> for Booking {
    async fn handle(&self, seat: &SeatBooked, _: &MessageContext) -> Result<(), HandlerError> {
        if seat.note == "slow" {
            self.entered.add_permits(1);
            self.release.acquire().await.unwrap().forget();
        } else {
            self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }
}

/// The last seat of a batch waits for room longer than the node timeout, while its caller's
/// thread is too busy to take the room that frees up: the node's orphan sweep, which finds a
/// free slot and a row of this node's that nothing runs, must not start it a second time.
const NODE_TIMEOUT: Duration = Duration::from_millis(300);

/// A SQLite store and a runtime on it with two slots, a short node timeout, rounds of
/// recovery every 20 ms and retries at once.
async fn two_slots() -> (Scratch, Arc<Runtime>, Booking) {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap().node_timeout(NODE_TIMEOUT);
    let pool = store.pool().clone();
    let booking = Booking::new();
    let runtime = Arc::new(
        Runtime::builder()
            .store(store)
            .max_in_flight(2)
            .recovery_interval(Duration::from_millis(20))
            // An orphan resumed as interrupted retries at once.
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::ZERO,
                retry_interval_delta: Duration::ZERO,
                ..RetryPolicy::default()
            })
            .module(Module::new("venue").handle_named::<SeatBooked, _>("book", booking.clone()))
            .build()
            .unwrap(),
    );
    runtime.first_recovery().await;
    (Scratch { pool, _db: db }, runtime, booking)
}

/// A scratch database and a pool on it.
struct Scratch {
    pool: dacapo::sqlx::SqlitePool,
    _db: ScratchDatabase,
}

fn slow_slow_then(last: &str) -> [SeatBooked; 3] {
    let seat = |seat, note: &str| SeatBooked {
        seat,
        note: note.into(),
    };
    [seat(0, "slow"), seat(1, "slow"), seat(2, last)]
}

/// Waits until the three rows of the batch are older than the node timeout.
async fn aged(pool: &dacapo::sqlx::SqlitePool) {
    let aged = "SELECT count(*) FROM dacapo_inbox WHERE status = 'incoming' AND received_at < $1";
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let before = chrono::Utc::now() - NODE_TIMEOUT;
            let count: i64 = dacapo::sqlx::query_scalar(aged)
                .bind(before.timestamp_millis())
                .fetch_one(pool)
                .await
                .unwrap();
            if count == 3 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the rows age within 20s");
}

/// A batch whose caller gave up while its last delivery waited for room: that delivery, its
/// row stored, is resumed by the node's orphan sweep once room frees up, and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cancelled_while_waiting_for_room_leaves_the_rest_to_the_orphan_sweep() {
    use std::sync::atomic::Ordering;
    let (db, runtime, booking) = two_slots().await;
    let caller = tokio::spawn({
        let runtime = Arc::clone(&runtime);
        async move { runtime.publish_batch(&slow_slow_then("")).await }
    });
    let _ = tokio::time::timeout(Duration::from_secs(20), booking.entered.acquire_many(2))
        .await
        .expect("the slow seats start within 20s");
    aged(&db.pool).await;
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());

    booking.release.add_permits(2);
    tokio::time::timeout(Duration::from_secs(20), async {
        while booking.runs.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the sweep resumes the last seat within 20s");
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .expect("every seat settles within 20s");
    assert_eq!(booking.runs.load(Ordering::SeqCst), 1, "the seat ran once");
    runtime.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waiting_for_room_is_not_taken_for_orphans() {
    use std::sync::atomic::Ordering;
    let (db, runtime, booking) = two_slots().await;
    let pool = db.pool.clone();
    // The batch's caller runs on a thread of its own, which the test can block.
    let block = Arc::new(tokio::sync::Notify::new());
    let (blocked_tx, blocked_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let publisher = std::thread::spawn({
        let (runtime, block) = (Arc::clone(&runtime), Arc::clone(&block));
        move || {
            let caller = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            caller.spawn(async move {
                block.notified().await;
                blocked_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            });
            caller.block_on(runtime.publish_batch(&slow_slow_then("")))
        }
    });
    // Two slow seats hold both slots; the third waits for room, its row stored.
    let _ = tokio::time::timeout(Duration::from_secs(20), booking.entered.acquire_many(2))
        .await
        .expect("the slow seats start within 20s");
    block.notify_one();
    tokio::time::timeout(Duration::from_secs(20), blocked_rx)
        .await
        .expect("the caller's thread blocks within 20s")
        .unwrap();
    // Its row ages past the node timeout: an orphan, were nothing running it.
    aged(&pool).await;

    // A slot frees up that the blocked caller cannot take; three full recovery rounds (each
    // heartbeats, then sweeps) pass with it free.
    booking.release.add_permits(1);
    tokio::time::timeout(Duration::from_secs(20), async {
        while runtime.stats().handled < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first slow seat settles within 20s");
    let heartbeat = || async {
        dacapo::sqlx::query_scalar::<_, i64>("SELECT heartbeat_at FROM dacapo_nodes")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let mut last = heartbeat().await;
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let now = heartbeat().await;
                if now > last {
                    last = now;
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("a recovery round within 20s");
    }
    assert_eq!(
        booking.runs.load(Ordering::SeqCst),
        0,
        "the sweep left the waiting seat to its batch"
    );

    go_tx.send(()).unwrap();
    booking.release.add_permits(1);
    let ids = publisher.join().unwrap().unwrap();
    assert_eq!(ids.len(), 3);
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .expect("the batch settles within 20s");
    assert_eq!(booking.runs.load(Ordering::SeqCst), 1, "the seat ran once");
    let attempts: i64 = dacapo::sqlx::query_scalar("SELECT max(attempts) FROM dacapo_inbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(attempts, 1, "no attempt counted that never ran");
    runtime.shutdown().await;
}

/// A broker redelivers a batch while every slot is taken by the deliveries it started the
/// first time: its copies are discarded at once, without waiting for room they do not need
/// (a broker's prefetch, or a PostgreSQL queue's open transaction, would wait with them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_batch_is_answered_without_waiting_for_room() {
    let (_db, runtime, booking) = two_slots().await;
    let seats: Vec<_> = slow_slow_then("")[..2]
        .iter()
        .map(|seat| dacapo::Envelope::for_message(seat).unwrap())
        .collect();
    let listener = runtime.listener();
    listener.accept_batch(seats.clone()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), booking.entered.acquire_many(2))
        .await
        .expect("the slow seats start within 20s")
        .unwrap()
        .forget();
    // Both slots are held until the test releases them.
    tokio::time::timeout(Duration::from_secs(20), listener.accept_batch(seats))
        .await
        .expect("the copies are answered for while both slots are taken")
        .unwrap();
    booking.release.add_permits(2);
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .expect("every seat settles within 20s");
    runtime.shutdown().await;
}
