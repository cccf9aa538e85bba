//! Reproducible orders: where the runtime chooses which of several deliveries runs first (retries
//! due at the same virtual instant), a harness's seed decides, the same seed gives the same
//! order, and a failing test prints its seed.
#![cfg(feature = "testing")]

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, SEED_VARIABLE, TestHarness, TestHarnessBuilder};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct SeatReleased {
    seat: u64,
}

impl Message for SeatReleased {
    const TYPE: &'static str = "seeds.seat_released";
}

const SEATS: u64 = 6;

fn builder(recorder: &Recorder<SeatReleased>) -> TestHarnessBuilder {
    TestHarness::builder()
        .module(Module::new("venue").handle_named::<SeatReleased, _>("seats", recorder.clone()))
        .fault("venue", "seats", Fault::fail_times(1))
}

/// The order in which the retries of six deliveries, all due one second after their first
/// attempts (at the same virtual instant), ran under `seed`.
async fn retry_order(seed: u64) -> Vec<u64> {
    let recorder = Recorder::<SeatReleased>::new();
    let harness = builder(&recorder).seed(seed).build().unwrap();
    assert_eq!(harness.seed(), seed);
    let seats: Vec<SeatReleased> = (0..SEATS).map(|seat| SeatReleased { seat }).collect();
    let reports = futures::future::join_all(seats.iter().map(|seat| harness.publish(seat))).await;
    for report in reports {
        let report = report.unwrap();
        assert!(report.is_handled() && report.attempts == 2, "{report:?}");
        assert_eq!(
            report.attempt_offsets,
            [Duration::ZERO, Duration::from_secs(1)]
        );
    }
    // The faults fail each first attempt before the handler: it saw the retries only.
    let order: Vec<u64> = recorder
        .calls()
        .iter()
        .map(|call| call.message.seat)
        .collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..SEATS).collect::<Vec<_>>(),
        "every retry ran once"
    );
    order
}

#[tokio::test]
async fn the_same_seed_gives_the_same_order() {
    let first = retry_order(7).await;
    for _ in 0..3 {
        assert_eq!(retry_order(7).await, first);
    }
}

/// The order in which six deliveries whose handlers hang, all timed out at the same virtual
/// instant, were dead-lettered under `seed`.
async fn timeout_order(seed: u64) -> Vec<uuid::Uuid> {
    let recorder = Recorder::<SeatReleased>::new();
    let harness = TestHarness::builder()
        .module(Module::new("venue").handle_named::<SeatReleased, _>("seats", recorder.clone()))
        .fault("venue", "seats", Fault::always_hang())
        .retry_policy(RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        })
        .seed(seed)
        .build()
        .unwrap();
    let seats: Vec<SeatReleased> = (0..SEATS).map(|seat| SeatReleased { seat }).collect();
    let envelopes: Vec<_> = seats
        .iter()
        .enumerate()
        .map(|(n, seat)| {
            let mut envelope = harness
                .runtime()
                .envelope(seat, SendOptions::new())
                .unwrap();
            // The same ids in every run, so that the orders of two runs compare.
            envelope.id = uuid::Uuid::from_u128(0x7000 + n as u128);
            envelope
        })
        .collect();
    let reports =
        futures::future::join_all(envelopes.into_iter().map(|e| harness.deliver(e))).await;
    for report in reports {
        let report = report.unwrap();
        assert!(
            matches!(report.outcome, dacapo::Outcome::DeadLettered(_)),
            "{report:?}"
        );
    }
    assert!(recorder.calls().is_empty(), "every attempt hung");
    harness
        .reports()
        .iter()
        .map(|report| report.envelope_id)
        .collect()
}

#[tokio::test]
async fn the_same_seed_times_out_handlers_due_together_in_the_same_order() {
    let first = timeout_order(7).await;
    assert_eq!(first.len(), SEATS as usize);
    for _ in 0..20 {
        assert_eq!(timeout_order(7).await, first);
    }
}

#[tokio::test]
async fn other_seeds_give_other_orders() {
    let mut orders = Vec::new();
    for seed in 1..=6 {
        orders.push(retry_order(seed).await);
    }
    orders.sort();
    orders.dedup();
    assert!(orders.len() > 1, "six seeds, one order: {orders:?}");
}

/// Fails on purpose, with a harness whose seed comes from the environment: run by
/// `a_failing_test_prints_its_seed` in a process of its own.
#[tokio::test]
#[ignore = "fails on purpose; run by a_failing_test_prints_its_seed"]
async fn fails_with_a_harness() {
    let harness = builder(&Recorder::new()).build().unwrap();
    let _ = &harness;
    panic!("this test fails on purpose");
}

#[test]
fn a_failing_test_prints_its_seed() {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "fails_with_a_harness",
            "--nocapture",
        ])
        .env(SEED_VARIABLE, "4242")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("seed 4242 (rerun with DACAPO_SEED=4242)"),
        "{stderr}"
    );
}

#[test]
fn an_unreadable_seed_is_refused() {
    // A value that is no number is an error at build, not a silent 0.
    let refused = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "fails_with_a_harness",
            "--nocapture",
        ])
        .env(SEED_VARIABLE, "seven")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("DACAPO_SEED")
            && stderr.contains("seven")
            && stderr.contains("is neither a number"),
        "{stderr}"
    );
}

/// The order in which a recovery round started a batch of deliveries that all came due
/// together, under `seed`: six messages scheduled for the same time, on a real store.
#[cfg(feature = "sqlite")]
async fn recovered_order(seed: u64) -> Vec<u64> {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let recorder = Recorder::<SeatReleased>::new();
    let harness = TestHarness::builder()
        .store(db.sqlite_store().await.unwrap())
        .module(Module::new("venue").handle_named::<SeatReleased, _>("seats", recorder.clone()))
        .seed(seed)
        .build()
        .unwrap();
    let due = chrono::Utc::now() + chrono::Duration::seconds(30);
    for seat in 0..SEATS {
        let report = harness
            .publish_with(&SeatReleased { seat }, SendOptions::new().deliver_at(due))
            .await
            .unwrap();
        assert!(
            matches!(report.outcome, Outcome::Scheduled(_)),
            "{report:?}"
        );
    }
    // The recovery rounds tick as the clock passes them; the one past the due time claims
    // all six in one batch.
    harness.advance(Duration::from_secs(60)).await.unwrap();
    harness.idle().await.unwrap();
    let order: Vec<u64> = recorder
        .calls()
        .iter()
        .map(|call| call.message.seat)
        .collect();
    assert_eq!(order.len(), SEATS as usize, "{order:?}");
    order
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn a_recovered_batch_starts_in_the_seeds_order() {
    let first = recovered_order(11).await;
    assert_eq!(recovered_order(11).await, first);
    let mut orders = vec![first];
    for seed in 12..=16 {
        orders.push(recovered_order(seed).await);
    }
    orders.sort();
    orders.dedup();
    assert!(orders.len() > 1, "six seeds, one order: {orders:?}");
}

#[tokio::test]
async fn what_is_published_together_past_the_engines_capacity_lets_the_clock_move() {
    // One slot: the second publish waits for it while the first cools down, which only the
    // clock moving ends. The harness's hold on the clock must not stop it.
    let recorder = Recorder::<SeatReleased>::new();
    let harness = builder(&recorder)
        .configure(|runtime| runtime.max_in_flight(1))
        .seed(3)
        .build()
        .unwrap();
    let (first, second) = tokio::join!(
        harness.publish(&SeatReleased { seat: 1 }),
        harness.publish(&SeatReleased { seat: 2 })
    );
    for report in [first.unwrap(), second.unwrap()] {
        assert!(report.is_handled() && report.attempts == 2, "{report:?}");
    }
    assert_eq!(recorder.count(), 2);
}

/// Two nodes' harnesses on one store, under one seed: their seeded envelope ids are drawn for
/// their nodes, so neither publishes an id the other did (the second node's first message was
/// discarded as the first's duplicate before).
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_harnesses_on_one_store_under_one_seed_publish_different_ids() {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let node = |name: &'static str, recorder: &Recorder<SeatReleased>| {
        TestHarness::builder()
            .seed(5)
            .store(store.clone().node_id(name))
            .module(Module::new("venue").handle_named::<SeatReleased, _>("seats", recorder.clone()))
            .build()
            .unwrap()
    };
    let (on_a, on_b) = (Recorder::new(), Recorder::new());
    let (a, b) = (node("a", &on_a), node("b", &on_b));

    let first = a.publish(&SeatReleased { seat: 1 }).await.unwrap();
    let second = b.publish(&SeatReleased { seat: 2 }).await.unwrap();

    assert_ne!(first.envelope_id, second.envelope_id);
    assert!(first.is_handled() && second.is_handled(), "{second:?}");
    assert_eq!((on_a.count(), on_b.count()), (1, 1));
    a.shutdown().await;
    b.shutdown().await;
    // The same seed and node draw the same ids in every run: on a store of its own, node a's
    // first id again.
    let other = dacapo::testing::ScratchDatabase::sqlite();
    let rerun = TestHarness::builder()
        .seed(5)
        .store(other.sqlite_store().await.unwrap().node_id("a"))
        .module(Module::new("venue").handle_named::<SeatReleased, _>("seats", Recorder::new()))
        .build()
        .unwrap();
    let replayed = rerun.publish(&SeatReleased { seat: 1 }).await.unwrap();
    assert_eq!(replayed.envelope_id, first.envelope_id);
    rerun.shutdown().await;
}
