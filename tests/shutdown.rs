//! Graceful shutdown drains deliveries in flight and hands back retries still waiting.

#[path = "support/messages.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dacapo::Error;
use dacapo::prelude::*;
use support::{MemberRemoved, member_removed};
use tokio::sync::{Notify, oneshot};

/// Signals when it starts, then waits for the gate before finishing.
struct Gated {
    started: std::sync::Mutex<Option<oneshot::Sender<()>>>,
    gate: Arc<Notify>,
    finished: Arc<AtomicBool>,
}

impl Handler<MemberRemoved> for Gated {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        self.gate.notified().await;
        self.finished.store(true, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test]
async fn shutdown_waits_for_running_deliveries_and_refuses_new_ones() {
    let (started_tx, started_rx) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let finished = Arc::new(AtomicBool::new(false));
    let handler = Gated {
        started: std::sync::Mutex::new(Some(started_tx)),
        gate: Arc::clone(&gate),
        finished: Arc::clone(&finished),
    };
    let runtime = Runtime::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("gated", handler))
        .build()
        .unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started_rx)
        .await
        .unwrap()
        .unwrap();

    // join! polls the shutdown first: from then on the runtime refuses new messages, while
    // the running delivery is let through the gate and finishes.
    let (report, refused) = tokio::join!(runtime.shutdown(), async {
        let refused = runtime.publish(&member_removed()).await;
        gate.notify_one();
        refused
    });

    assert!(report.is_clean(), "{report:?}");
    assert!(
        finished.load(Ordering::SeqCst),
        "the running delivery finished before the engine stopped"
    );
    let Err(Error::ShuttingDown(envelope)) = refused else {
        panic!("expected ShuttingDown, got {refused:?}");
    };
    assert_eq!(envelope.message_type, "organization.member_removed");
    assert_eq!(runtime.stats().handled, 1);
}

#[tokio::test]
async fn retries_waiting_for_their_cooldown_are_handed_back_not_dropped() {
    let runtime = failing_an_hour_apart().build().unwrap();
    let id = runtime.publish(&member_removed()).await.unwrap();

    // The drain lets the first attempt run and fail; the retry it schedules is handed back.
    let report = runtime.shutdown().await;

    assert_eq!(report.pending_retries.len(), 1);
    let pending = &report.pending_retries[0];
    assert_eq!(pending.envelope.id, id);
    assert_eq!(pending.envelope.attempts, 1);
    assert_eq!(pending.failures.len(), 1);
    assert!(pending.due_at > chrono::Utc::now() + chrono::Duration::minutes(59));
    assert!(report.still_running.is_empty());
}

#[tokio::test]
async fn a_delivery_still_running_after_the_drain_timeout_is_reported() {
    let gate = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let handler = Gated {
        started: std::sync::Mutex::new(Some(started_tx)),
        gate,
        finished: Arc::default(),
    };
    let runtime = Runtime::builder()
        .drain_timeout(Duration::from_millis(50))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("gated", handler))
        .build()
        .unwrap();
    let id = runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started_rx)
        .await
        .unwrap()
        .unwrap();

    let report = runtime.shutdown().await;

    assert_eq!(report.still_running, [id]);
    assert!(
        runtime.shutdown().await.is_clean(),
        "a second shutdown has nothing left to report"
    );
}

#[tokio::test]
async fn a_publish_waiting_for_room_when_the_shutdown_begins_is_handed_back() {
    // The only slot goes to a delivery whose retry cools down for an hour: nothing frees it
    // before the shutdown hands that retry back.
    let runtime = failing_an_hour_apart()
        .max_in_flight(1)
        .drain_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let first = runtime.publish(&member_removed()).await.unwrap();
    let message = member_removed();
    let (report, waited) = shut_down_beside(&runtime, runtime.publish(&message)).await;

    // Accepted, it would have started on a worker that had stopped, and been lost unreported.
    let Err(Error::ShuttingDown(envelope)) = waited else {
        panic!("expected the waiting envelope handed back, got {waited:?}");
    };
    assert_ne!(envelope.id, first);
    assert_eq!(envelope.message_type, "organization.member_removed");
    let pending: Vec<_> = report
        .pending_retries
        .iter()
        .map(|p| p.envelope.id)
        .collect();
    assert_eq!(pending, [first]);
    assert!(report.still_running.is_empty(), "{report:?}");
}

/// A runtime whose one handler always fails, its retries an hour apart.
fn failing_an_hour_apart() -> dacapo::RuntimeBuilder {
    Runtime::builder()
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_secs(3600),
            max_retry_interval: Duration::from_secs(3600),
            ..RetryPolicy::default()
        })
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", AlwaysFails))
}

struct AlwaysFails;

impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

/// Asks to be retried in a practically infinite time.
struct RetryNever;

impl Handler<MemberRemoved> for RetryNever {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err(HandlerError::retry_after(Duration::MAX, "come back never"))
    }
}

#[tokio::test]
async fn a_retry_after_beyond_the_calendar_saturates_instead_of_panicking() {
    let runtime = Runtime::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", RetryNever))
        .build()
        .unwrap();
    let id = runtime.publish(&member_removed()).await.unwrap();
    let report = runtime.shutdown().await;
    assert_eq!(report.pending_retries.len(), 1);
    assert_eq!(report.pending_retries[0].envelope.id, id);
    assert_eq!(
        report.pending_retries[0].due_at,
        chrono::DateTime::<chrono::Utc>::MAX_UTC
    );
}

/// A message whose handler always fails: its retry, an hour away, holds a slot.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Flaky;

impl Message for Flaky {
    const TYPE: &'static str = "tests.flaky";
}

/// Cascades two webhooks.
struct CascadesTwo;

impl Handler<MemberRemoved> for CascadesTwo {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        for n in 0..2 {
            ctx.publish(&support::WebhookQueued {
                delivery_id: format!("hook-{n}"),
            })
            .await?;
        }
        Ok(())
    }
}

/// Says it started, then never finishes.
struct Hangs(Arc<Notify>);

impl Handler<support::WebhookQueued> for Hangs {
    async fn handle(
        &self,
        _: &support::WebhookQueued,
        _: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.0.notify_one();
        std::future::pending().await
    }
}

#[tokio::test]
async fn a_cascade_still_waiting_for_room_when_the_engine_stops_is_handed_back() {
    // Two slots: a retry an hour away holds one, the first cascade (hanging) the other, so the
    // second cascade waits for room when the drain ends. It was dropped with an error in the
    // log, in no list of the report.
    struct FlakyFails;
    impl Handler<Flaky> for FlakyFails {
        async fn handle(&self, _: &Flaky, _: &MessageContext) -> Result<(), HandlerError> {
            Err("the downstream service is down".into())
        }
    }
    let started = Arc::new(Notify::new());
    let runtime = Runtime::builder()
        .max_in_flight(2)
        .drain_timeout(Duration::from_millis(100))
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_secs(3600),
            max_retry_interval: Duration::from_secs(3600),
            ..RetryPolicy::default()
        })
        .module(
            Module::new("m")
                .handle_named::<Flaky, _>("flaky", FlakyFails)
                .handle_named::<MemberRemoved, _>("cascades", CascadesTwo)
                .handle_named::<support::WebhookQueued, _>("hangs", Hangs(Arc::clone(&started))),
        )
        .build()
        .unwrap();
    let flaky = runtime.publish(&Flaky).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while runtime.stats().retried == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first attempt failed and its retry waits");
    runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .expect("the first cascade started");

    let report = runtime.shutdown().await;

    assert_eq!(report.pending_retries.len(), 1);
    assert_eq!(report.pending_retries[0].envelope.id, flaky);
    assert_eq!(report.still_running.len(), 1, "{report:?}");
    assert_eq!(report.unstarted_cascades.len(), 1, "{report:?}");
    let handed_back = &report.unstarted_cascades[0];
    assert_eq!(handed_back.message_type, "webhooks.delivery_queued");
    assert_ne!(report.still_running[0], handed_back.id);
    assert!(!report.is_clean());
}

/// Fails its first message for good (it is dead-lettered) and every later one for a retry.
#[derive(Default)]
struct DeadLettersThenCools {
    calls: std::sync::atomic::AtomicUsize,
}

impl Handler<MemberRemoved> for DeadLettersThenCools {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(HandlerError::permanent("no retry fixes this"));
        }
        Err(HandlerError::retry("down for an hour"))
    }
}

/// A dead letter replayed while the engine is full waits for room; a shutdown then hands it
/// back in its report, at once. Before, the shutdown waited out its whole drain for it and
/// the report left it out, so a replay on a runtime in memory was lost without a word.
#[tokio::test]
async fn a_replay_waiting_for_room_when_the_shutdown_begins_is_handed_back() {
    let runtime = Runtime::builder()
        .max_in_flight(2)
        .drain_timeout(Duration::from_secs(30))
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_secs(3600),
            ..RetryPolicy::default()
        })
        .module(
            Module::new("m").handle_named::<MemberRemoved, _>("h", DeadLettersThenCools::default()),
        )
        .build()
        .unwrap();
    let dead = runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), runtime.idle())
        .await
        .unwrap();
    support::publish_until_cooling(&runtime, 2).await;
    runtime.dead_letters().replay(dead).await.unwrap();

    let report = tokio::time::timeout(Duration::from_secs(10), runtime.shutdown())
        .await
        .expect("the shutdown does not wait out its drain for a replay that has no room");

    assert_eq!(report.pending_retries.len(), 3);
    assert!(
        report.pending_retries.iter().any(|p| p.envelope.id == dead),
        "the replayed envelope is handed back"
    );
    assert!(report.still_running.is_empty());
}

#[tokio::test]
async fn a_batch_still_waiting_for_room_when_the_drain_ends_is_handed_back() {
    a_batch_waits_for_room_past_the_drain(failing_an_hour_apart()).await;
}

/// On SQLite, the batch's rows stay, their first attempt, which never ran, taken back: the
/// next node runs them as new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_still_waiting_for_room_when_the_drain_ends_stays_in_the_store_unattempted() {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let ids =
        a_batch_waits_for_room_past_the_drain(failing_an_hour_apart().store(store.clone())).await;
    for id in ids {
        let (attempts, owner): (i64, Option<String>) =
            dacapo::sqlx::query_as("SELECT attempts, owner FROM dacapo_inbox WHERE id = $1")
                .bind(id.simple().to_string())
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!((attempts, owner), (0, None), "{id}");
    }
}

/// Publishes a batch behind a delivery that holds the only slot for an hour, shuts down, and
/// checks the batch is answered and handed back; returns the batch's ids.
async fn a_batch_waits_for_room_past_the_drain(builder: dacapo::RuntimeBuilder) -> Vec<uuid::Uuid> {
    // The only slot goes to a delivery whose retry cools down for an hour: nothing frees it
    // before the shutdown hands that retry back.
    let runtime = builder
        .max_in_flight(1)
        .drain_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let first = runtime.publish(&member_removed()).await.unwrap();
    let batch = [member_removed(), member_removed()];
    let (report, waited) = shut_down_beside(&runtime, runtime.publish_batch(&batch)).await;

    // Accepted (persisted) before it waited: answered as such, and handed back unstarted.
    let ids = waited.unwrap();
    let mut pending: Vec<_> = report
        .pending_retries
        .iter()
        .map(|p| p.envelope.id)
        .collect();
    pending.sort_unstable();
    let mut expected = vec![first, ids[0], ids[1]];
    expected.sort_unstable();
    assert_eq!(pending, expected, "{report:?}");
    assert!(report.still_running.is_empty(), "{report:?}");
    ids
}

/// Shuts `runtime` down beside `waiting`, a publication that waits for the only slot (checked
/// by polling it once first); both end within 10 s.
async fn shut_down_beside<F: std::future::Future>(
    runtime: &Runtime,
    waiting: F,
) -> (dacapo::ShutdownReport, F::Output) {
    let mut waiting = Box::pin(waiting);
    assert!(
        futures::poll!(&mut waiting).is_pending(),
        "the first delivery holds the only slot"
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(runtime.shutdown(), waiting)
    })
    .await
    .expect("the shutdown and the waiting publication end")
}
