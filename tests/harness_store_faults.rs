//! Store faults without a proxy: `harness.store_fault(StoreFault::unavailable())` fails the
//! runtime's statements until it ends, and `StoreFault::slow_commits` slows its commits; a
//! tester sees the listener's pauses and the engine's retried writes, and what the
//! application sees does not change — on a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dacapo::Envelope;
use dacapo::prelude::*;
use dacapo::testing::{
    Fault, ScratchDatabase, StoreFault, StoreFaults, TestHarness, TestHarnessBuilder,
};
use dacapo::transport::Backoff;
use serde::{Deserialize, Serialize};

const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct InvoicePaid {
    invoice: u64,
}

impl Message for InvoicePaid {
    const TYPE: &'static str = "store_faults.invoice_paid";
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A harness on a fresh database of `backend`, configured further by `configure`.
async fn harness(
    backend: Backend,
    configure: impl FnOnce(TestHarnessBuilder) -> TestHarnessBuilder,
) -> (TestHarness, ScratchDatabase) {
    let builder = TestHarness::builder().settle_timeout(WAIT);
    match backend {
        Backend::Sqlite => {
            let db = ScratchDatabase::sqlite();
            let store = db.sqlite_store().await.unwrap();
            (configure(builder.store(store)).build().unwrap(), db)
        }
        Backend::Postgres => {
            let admin = std::env::var("DACAPO_TEST_POSTGRES")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
            let db = ScratchDatabase::postgres(&admin).await.unwrap();
            let store = db.postgres_store().await.unwrap();
            (configure(builder.store(store)).build().unwrap(), db)
        }
    }
}

/// Waits, boundedly, until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "waited {WAIT:?} for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Counts its calls; on its first, starts a store outage (the settle then meets it).
#[derive(Clone)]
struct StartsAnOutage {
    calls: Arc<AtomicUsize>,
    faults: StoreFaults,
}

impl Handler<InvoicePaid> for StartsAnOutage {
    async fn handle(&self, _: &InvoicePaid, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.faults.inject(StoreFault::unavailable());
        }
        Ok(())
    }
}

macro_rules! on_both_backends {
    ($sqlite:ident, $postgres:ident, $body:ident) => {
        #[tokio::test]
        async fn $sqlite() {
            $body(Backend::Sqlite).await;
        }

        #[tokio::test]
        async fn $postgres() {
            $body(Backend::Postgres).await;
        }
    };
}

on_both_backends!(
    the_listener_pauses_through_an_outage_and_acknowledges_once_the_envelope_is_stored_sqlite,
    the_listener_pauses_through_an_outage_and_acknowledges_once_the_envelope_is_stored_postgres,
    listener_through_an_outage
);

async fn listener_through_an_outage(backend: Backend) {
    let recorder = dacapo::testing::Recorder::<InvoicePaid>::new();
    let (harness, _db) = harness(backend, |b| {
        b.module(Module::new("billing").handle_named::<InvoicePaid, _>("ledger", recorder.clone()))
    })
    .await;
    let faults = harness.store_faults().unwrap();
    let envelope: Envelope = harness
        .runtime()
        .envelope(&InvoicePaid { invoice: 1 }, SendOptions::default())
        .unwrap();
    let listener = harness.runtime().listener().backoff(Backoff::new(
        Duration::from_millis(5),
        Duration::from_millis(20),
    ));

    harness.store_fault(StoreFault::unavailable()).unwrap();
    let accepting = tokio::spawn({
        let listener = listener.clone();
        async move { listener.accept(envelope).await }
    });
    until("two pauses of the listener", || listener.pauses() >= 2).await;
    assert!(
        !accepting.is_finished(),
        "nothing is acknowledged while the store is down"
    );
    assert!(faults.struck() >= 2);
    assert_eq!(recorder.count(), 0);

    faults.end();
    tokio::time::timeout(WAIT, accepting)
        .await
        .expect("the listener resumes by itself")
        .unwrap()
        .unwrap();
    harness.idle().await.unwrap();
    assert_eq!(recorder.count(), 1);
    let report = harness.reports().pop().unwrap();
    assert!(report.is_handled() && report.attempts == 1, "{report:?}");
}

on_both_backends!(
    an_outage_at_the_settle_is_retried_by_the_engine_not_by_the_handler_sqlite,
    an_outage_at_the_settle_is_retried_by_the_engine_not_by_the_handler_postgres,
    settle_through_an_outage
);

async fn settle_through_an_outage(backend: Backend) {
    let calls = Arc::new(AtomicUsize::new(0));
    let (harness, _db) = harness(backend, |b| {
        let handler = StartsAnOutage {
            calls: Arc::clone(&calls),
            faults: b.store_faults(),
        };
        b.module(Module::new("billing").handle_named::<InvoicePaid, _>("ledger", handler))
    })
    .await;
    let faults = harness.store_faults().unwrap();
    let harness = Arc::new(harness);
    let publishing = tokio::spawn({
        let harness = Arc::clone(&harness);
        async move { harness.publish(&InvoicePaid { invoice: 2 }).await }
    });
    // The handler started the outage; the settle fails on it and is retried with backoff.
    until("the settle to meet the outage twice", || {
        faults.struck() >= 2
    })
    .await;
    assert!(!publishing.is_finished());
    faults.end();

    let report = tokio::time::timeout(WAIT, publishing)
        .await
        .expect("the settle goes through once the store is back")
        .unwrap()
        .unwrap();
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(report.attempts, 1, "the write was retried, not the attempt");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

on_both_backends!(
    slow_commits_slow_the_store_and_leave_virtual_time_exact_sqlite,
    slow_commits_slow_the_store_and_leave_virtual_time_exact_postgres,
    slow_commits
);

async fn slow_commits(backend: Backend) {
    let recorder = dacapo::testing::Recorder::<InvoicePaid>::new();
    let (harness, _db) = harness(backend, |b| {
        b.module(Module::new("billing").handle_named::<InvoicePaid, _>("ledger", recorder.clone()))
            .fault("billing", "ledger", Fault::fail_times(1))
            .handler_timeout(Duration::from_millis(50))
    })
    .await;
    let slow = Duration::from_millis(60);
    harness.store_fault(StoreFault::slow_commits(slow)).unwrap();
    let started = Instant::now();
    let report = harness.publish(&InvoicePaid { invoice: 3 }).await.unwrap();
    let took = started.elapsed();
    let struck = harness.store_faults().unwrap().struck();

    assert!(report.is_handled(), "{report:?}");
    // Accept, retry record, attempt begin, settle: each commit waited.
    assert!(struck >= 3, "{struck} commits slowed");
    assert!(took >= slow * 3, "{took:?}");
    // The store's slowness is real time: no handler timed out (their timeout is shorter than
    // one commit), and the cooldown stays exactly the policy's.
    assert_eq!(report.cooldowns(), [Duration::from_secs(1)]);
    assert_eq!(recorder.count(), 1);
}

#[tokio::test]
async fn a_counted_outage_ends_by_itself() {
    let recorder = dacapo::testing::Recorder::<InvoicePaid>::new();
    let (harness, _db) = harness(Backend::Sqlite, |b| {
        b.module(Module::new("billing").handle_named::<InvoicePaid, _>("ledger", recorder.clone()))
    })
    .await;
    let listener = harness.runtime().listener().backoff(Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
    ));
    let faults = harness.store_faults().unwrap();
    faults.inject(StoreFault::unavailable().times(3));
    let envelope = harness
        .runtime()
        .envelope(&InvoicePaid { invoice: 4 }, SendOptions::default())
        .unwrap();
    tokio::time::timeout(WAIT, listener.accept(envelope))
        .await
        .unwrap()
        .unwrap();
    assert!(!faults.is_on());
    assert_eq!(faults.struck(), 3);
    // The runtime's own background statements may have met some of the three.
    assert!(listener.pauses() <= 3);
    harness.idle().await.unwrap();
    assert_eq!(recorder.count(), 1);
}

/// The settle timeout bounds a tracked call whole: its accept and its settle together (each
/// had a timeout of its own before, so a call could wait twice as long as it was told).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settle_timeout_bounds_the_accept_and_the_settle_together() {
    let timeout = Duration::from_millis(400);
    let calls = Arc::new(AtomicUsize::new(0));
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let harness = TestHarness::builder()
        .settle_timeout(timeout)
        .store(store)
        .module(
            Module::new("billing")
                .handle_named::<InvoicePaid, _>("count", Counts(Arc::clone(&calls))),
        )
        .build()
        .unwrap();
    // The accept's commit and the settle's each take 250 ms: each within the timeout, not
    // both.
    harness
        .store_fault(StoreFault::slow_commits(Duration::from_millis(250)))
        .unwrap();

    let result = harness.publish(&InvoicePaid { invoice: 1 }).await;

    match result {
        Err(dacapo::Error::NotSettled { waited, .. }) => assert_eq!(waited, timeout),
        other => panic!("expected NotSettled after {timeout:?}, got {other:?}"),
    }
    harness.store_faults().unwrap().end();
    harness.idle().await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Counts its calls.
struct Counts(Arc<AtomicUsize>);

impl Handler<InvoicePaid> for Counts {
    async fn handle(&self, _: &InvoicePaid, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
