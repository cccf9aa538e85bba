//! The test harness's own capabilities: virtual time, injected faults, duplicate deliveries,
//! tracked publishing.

#[path = "support/messages.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use dacapo::ports::{
    DeadLetterStore, Fenced, Handled, Inbox, Receipt, Replay, ReplayTo, RetryRecord,
    ScheduledEnvelope,
};
use dacapo::prelude::*;
use dacapo::store::MemoryInbox;
use dacapo::testing::{Fault, Recorder, TestHarness};
use dacapo::{
    DeadLetter, DeadLetterFilter, DeadLetterReason, DiscardReason, EngineError, Error, FailureKind,
    Outcome,
};
use support::{Counter, MemberRemoved, member_removed};
use uuid::Uuid;

#[tokio::test]
async fn virtual_time_passes_a_sixty_second_cooldown_exactly() {
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 1,
            min_retry_interval: Duration::from_secs(60),
            ..RetryPolicy::default()
        })
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .fault("m", "h", Fault::fail_times(1))
        .settle_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    // The settle timeout is real time (5 s): this settles only because the 60 s are virtual.
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled());
    assert_eq!(
        report.attempt_offsets,
        [Duration::ZERO, Duration::from_secs(60)]
    );
}

#[tokio::test]
async fn a_delivery_of_many_attempts_reports_the_first_and_latest_ninety_nine_only() {
    let every_second = Duration::from_secs(1);
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 149,
            min_retry_interval: every_second,
            retry_interval_delta: Duration::ZERO,
            max_retry_interval: every_second,
        })
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .fault("m", "h", Fault::always_fail())
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    );
    assert_eq!(report.attempts, 150);
    let attempts: Vec<u32> = report.failures.iter().map(|f| f.attempt).collect();
    let kept: Vec<u32> = std::iter::once(1).chain(52..=150).collect();
    assert_eq!(attempts, kept);
    // Each attempt fails at once and cools down a second: attempt k starts k - 1 s in.
    let offsets: Vec<Duration> = kept
        .iter()
        .map(|k| Duration::from_secs(u64::from(k - 1)))
        .collect();
    assert_eq!(report.attempt_offsets, offsets);
    assert_eq!(report.cooldowns(), vec![every_second; 99]);
}

#[tokio::test]
async fn a_panicking_handler_fails_alone_and_the_runtime_keeps_going() {
    let sibling = Counter::default();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("panics", Counter::default()))
        .module(Module::new("n").handle_named::<MemberRemoved, _>("fine", sibling.clone()))
        .fault("m", "panics", Fault::always_panic())
        .retry_policy(RetryPolicy::no_retries())
        .build()
        .unwrap();

    let first = harness.publish(&member_removed()).await.unwrap();
    let second = harness.publish(&member_removed()).await.unwrap();

    for report in [&first, &second] {
        assert_eq!(
            report.outcome,
            Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
        );
        let failure = &report.failures[0].failures[0];
        assert_eq!(failure.kind, FailureKind::Panicked);
        assert!(
            failure.error.contains("injected panic"),
            "{}",
            failure.error
        );
    }
    assert_eq!(
        sibling.count(),
        2,
        "the sibling handler ran for both messages"
    );
}

#[tokio::test]
async fn a_hanging_handler_times_out_at_its_timeout() {
    let harness = TestHarness::builder()
        .handler_timeout(Duration::from_secs(30))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .module(
            Module::new("slow")
                .handler_timeout(Duration::from_secs(120))
                .handle_named::<MemberRemoved, _>("h", Recorder::new()),
        )
        .fault("m", "h", Fault::hang_times(1))
        .fault("slow", "h", Fault::hang_times(1))
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert!(report.is_handled());
    let kinds: Vec<FailureKind> = report.failures[0].failures.iter().map(|f| f.kind).collect();
    assert_eq!(
        kinds,
        [
            FailureKind::TimedOut(Duration::from_secs(30)),
            FailureKind::TimedOut(Duration::from_secs(120))
        ]
    );
    // The attempt lasted as long as its slowest handler's timeout, then cooled down 1 s.
    assert_eq!(report.attempt_offsets[1], Duration::from_secs(121));
    assert_eq!(report.cooldowns(), [Duration::from_secs(1)]);
}

#[tokio::test]
async fn the_default_handler_timeout_is_thirty_seconds() {
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .fault("m", "h", Fault::hang_times(1))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled());
    assert_eq!(
        report.failures[0].failures[0].kind,
        FailureKind::TimedOut(Duration::from_secs(30))
    );
    assert_eq!(report.attempt_offsets[1], Duration::from_secs(31));
}

/// One fault given to two handlers counts for each alone: its clones share one count.
#[tokio::test]
async fn one_counted_fault_given_to_two_handlers_strikes_each() {
    let fault = Fault::fail_times(1);
    let harness = TestHarness::builder()
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("a", Recorder::new())
                .handle_named::<MemberRemoved, _>("b", Recorder::new()),
        )
        .fault("m", "a", fault.clone())
        .fault("m", "b", fault)
        .retry_policy(RetryPolicy {
            retry_limit: 3,
            ..RetryPolicy::default()
        })
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled());
    assert_eq!(report.attempts, 2);
    let mut failed: Vec<String> = report.failures[0]
        .failures
        .iter()
        .map(|f| f.handler.clone())
        .collect();
    failed.sort();
    assert_eq!(failed, ["a", "b"], "each handler's first attempt failed");
}

#[tokio::test]
async fn a_fault_can_strike_only_matching_messages() {
    let calls = Recorder::<MemberRemoved>::new();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .fault(
            "m",
            "h",
            Fault::always_fail().only_when(|m: &MemberRemoved| m.member_id == 13),
        )
        .retry_policy(RetryPolicy::no_retries())
        .build()
        .unwrap();

    let unlucky = harness
        .publish(&MemberRemoved {
            organization_id: 1,
            member_id: 13,
        })
        .await
        .unwrap();
    let lucky = harness
        .publish(&MemberRemoved {
            organization_id: 1,
            member_id: 14,
        })
        .await
        .unwrap();

    assert!(matches!(unlucky.outcome, Outcome::DeadLettered(_)));
    assert!(lucky.is_handled());
    assert_eq!(
        calls
            .calls()
            .iter()
            .map(|c| c.message.member_id)
            .collect::<Vec<_>>(),
        [14]
    );
}

#[tokio::test]
async fn counted_faults_count_per_message() {
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .fault("m", "h", Fault::fail_times(2))
        .build()
        .unwrap();
    for _ in 0..2 {
        let report = harness.publish(&member_removed()).await.unwrap();
        assert_eq!(report.attempts, 3);
    }
}

#[tokio::test]
async fn the_same_envelope_delivered_twice_is_handled_once() {
    let counter = Counter::default();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", counter.clone()))
        .build()
        .unwrap();
    let envelope = Envelope::for_message(&member_removed()).unwrap();

    let first = harness.deliver(envelope.clone()).await.unwrap();
    let second = harness.deliver(envelope).await.unwrap();

    assert!(first.is_handled());
    assert_eq!(
        second.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope)
    );
    assert_eq!(counter.count(), 1);
    assert_eq!(harness.runtime().stats().deduplicated, 1);
}

#[tokio::test]
async fn the_same_envelope_delivered_concurrently_is_handled_once() {
    let counter = Counter::default();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", counter.clone()))
        .fault("m", "h", Fault::fail_times(1))
        .build()
        .unwrap();
    let envelope = Envelope::for_message(&member_removed()).unwrap();

    let reports = harness.deliver_concurrently(envelope, 4).await.unwrap();

    let handled = reports.iter().filter(|r| r.is_handled()).count();
    let discarded = reports
        .iter()
        .filter(|r| r.outcome == Outcome::Discarded(DiscardReason::DuplicateEnvelope))
        .count();
    assert_eq!((handled, discarded), (1, 3));
    assert_eq!(counter.count(), 1);
}

#[tokio::test]
async fn a_delivery_that_cannot_settle_in_time_is_reported_not_awaited_forever() {
    // The inbox never answers the dead letter, so the dead-lettered delivery never settles; no
    // timer is pending, so virtual time cannot move it along either.
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .fault("m", "h", Fault::fail_permanently())
        .configure(|runtime| runtime.inbox(Arc::new(SilentDeadLetters::default())))
        .settle_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let error = harness.publish(&member_removed()).await.unwrap_err();
    assert!(matches!(error, Error::NotSettled { .. }), "{error}");
}

/// An inbox in memory whose dead-letter transition never answers.
struct SilentDeadLetters(MemoryInbox);

impl Default for SilentDeadLetters {
    fn default() -> Self {
        Self(MemoryInbox::new(
            Duration::from_secs(300),
            Arc::new(dacapo::ports::SystemClock),
        ))
    }
}

#[async_trait::async_trait]
impl Inbox for SilentDeadLetters {
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, EngineError> {
        self.0.receive(envelope).await
    }
    async fn begin_attempt(&self, id: Uuid, attempt: u32) -> Result<Fenced, EngineError> {
        self.0.begin_attempt(id, attempt).await
    }
    async fn schedule_retry(&self, record: RetryRecord<'_>) -> Result<Fenced, EngineError> {
        self.0.schedule_retry(record).await
    }
    async fn settle_handled(
        &self,
        id: Uuid,
        attempts: u32,
        cascaded: &[Envelope],
    ) -> Result<Handled, EngineError> {
        self.0.settle_handled(id, attempts, cascaded).await
    }
    async fn dead_letter(&self, _: &DeadLetter, _: bool) -> Result<Fenced, EngineError> {
        std::future::pending().await
    }
    async fn replay(&self, id: Uuid, to: ReplayTo) -> Result<Replay, EngineError> {
        self.0.replay(id, to).await
    }
    async fn scheduled(&self, limit: usize) -> Result<Vec<ScheduledEnvelope>, EngineError> {
        self.0.scheduled(limit).await
    }
    async fn cancel_scheduled(&self, id: Uuid) -> Result<bool, EngineError> {
        self.0.cancel_scheduled(id).await
    }
}

#[async_trait::async_trait]
impl DeadLetterStore for SilentDeadLetters {
    async fn put(&self, letter: DeadLetter) -> Result<(), EngineError> {
        self.0.put(letter).await
    }
    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, EngineError> {
        self.0.list(filter).await
    }
    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, EngineError> {
        self.0.get(id).await
    }
    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, EngineError> {
        self.0.remove(id).await
    }
    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, EngineError> {
        self.0.purge(filter).await
    }
}

/// Cascades a `WebhookQueued` per call, then fails its first attempt.
struct CascadesThenFailsOnce(Arc<std::sync::atomic::AtomicUsize>);

impl Handler<MemberRemoved> for CascadesThenFailsOnce {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        ctx.publish(&support::WebhookQueued {
            delivery_id: format!("member-{}", event.member_id),
        })
        .await?;
        if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err("the first attempt fails".into());
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_report_gives_its_failures_flat_and_its_cascaded_messages_typed() {
    let harness = TestHarness::builder()
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("cascades", CascadesThenFailsOnce(Arc::default()))
                .handle_named::<MemberRemoved, _>("flaky", Recorder::new()),
        )
        .fault("m", "flaky", Fault::fail_times(2))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled());
    let failures: Vec<(u32, String)> = report
        .failures()
        .map(|(attempt, f)| (attempt, f.handler.clone()))
        .collect();
    assert_eq!(
        failures,
        [
            (1, "cascades".to_owned()),
            (1, "flaky".to_owned()),
            (2, "flaky".to_owned())
        ]
    );
    let queued: Vec<support::WebhookQueued> = report.cascaded().unwrap();
    assert_eq!(
        queued,
        [support::WebhookQueued {
            delivery_id: "member-7".to_owned()
        }],
        "the cascade of the attempt that succeeded, once"
    );
    assert!(report.cascaded::<MemberRemoved>().unwrap().is_empty());
    harness.shutdown().await;
}

/// Fails its first attempt of each message.
#[derive(Clone, Default)]
struct FailsFirst(Arc<std::sync::Mutex<std::collections::HashSet<Option<Uuid>>>>);

impl Handler<support::WebhookQueued> for FailsFirst {
    async fn handle(
        &self,
        _: &support::WebhookQueued,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        if self.0.lock().unwrap().insert(ctx.message_id()) {
            return Err("first attempt".into());
        }
        Ok(())
    }
}

#[tokio::test]
async fn cascaded_deliveries_are_tracked_and_reported_too() {
    let harness = TestHarness::builder()
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>(
                    "cascades",
                    CascadesThenFailsOnce(Arc::new(1.into())),
                )
                .handle_named::<support::WebhookQueued, _>("sends", FailsFirst::default()),
        )
        .build()
        .unwrap();
    let parent = harness.publish(&member_removed()).await.unwrap();
    harness.idle().await.unwrap();
    let reports = harness.reports();
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert_eq!(reports[0].envelope_id, parent.envelope_id);
    let child = &reports[1];
    assert_eq!(child.envelope_id, parent.cascaded[0].id);
    assert_eq!(child.message_type, "webhooks.delivery_queued");
    assert!(child.is_handled());
    assert_eq!(child.attempts, 2);
    assert_eq!(child.cooldowns(), [Duration::from_secs(1)]);
    harness.shutdown().await;
}

/// A message whose handler is struck by a fault: its retry is the next timer due.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Tick;

impl Message for Tick {
    const TYPE: &'static str = "tests.tick";
}

/// Notes the harness's virtual time whenever it handles a message.
#[derive(Clone, Default)]
struct NotesTheTime {
    harness: Arc<std::sync::OnceLock<Arc<TestHarness>>>,
    at: Arc<std::sync::Mutex<Vec<Duration>>>,
}

impl Handler<support::WebhookQueued> for NotesTheTime {
    async fn handle(
        &self,
        _: &support::WebhookQueued,
        _: &MessageContext,
    ) -> Result<(), HandlerError> {
        let elapsed = self.harness.get().expect("set once built").elapsed();
        self.at.lock().unwrap().push(elapsed);
        Ok(())
    }
}

#[tokio::test]
async fn a_cascade_starts_before_the_clock_moves_to_the_next_timer() {
    // Another delivery's retry is due a second later: the clock must not move to it between
    // the parent's settle and its cascade's start (the cascade ran a second late, beside the
    // retry, before the forward held the clock).
    for _ in 0..20 {
        let notes = NotesTheTime::default();
        let harness = Arc::new(
            TestHarness::builder()
                .module(
                    Module::new("m")
                        .handle_named::<MemberRemoved, _>(
                            "cascades",
                            CascadesThenFailsOnce(Arc::new(1.into())),
                        )
                        .handle_named::<support::WebhookQueued, _>("notes", notes.clone())
                        .handle_named::<Tick, _>("flaky", Recorder::new()),
                )
                .fault("m", "flaky", Fault::fail_times(1))
                .build()
                .unwrap(),
        );
        assert!(notes.harness.set(Arc::clone(&harness)).is_ok());
        let member = member_removed();
        let (tick, parent) = tokio::join!(harness.publish(&Tick), harness.publish(&member));
        assert_eq!(tick.unwrap().attempts, 2);
        assert!(parent.unwrap().is_handled());
        harness.idle().await.unwrap();
        assert_eq!(*notes.at.lock().unwrap(), [Duration::ZERO]);
        harness.shutdown().await;
    }
}

/// Waits, inside its delivery, until the test lets it go.
#[derive(Clone)]
struct HeldUntilLetGo {
    entered: Arc<tokio::sync::Notify>,
    let_go: Arc<tokio::sync::Notify>,
}

impl Handler<MemberRemoved> for HeldUntilLetGo {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.entered.notify_one();
        self.let_go.notified().await;
        Ok(())
    }
}

/// `advance` is bounded: a handler at work waits for something the test does only after it
/// returns, and it returns NotSettled after the settle timeout (it waited for ever before).
#[tokio::test]
async fn an_advance_that_cannot_get_idle_gives_up_after_the_settle_timeout() {
    let held = HeldUntilLetGo {
        entered: Arc::default(),
        let_go: Arc::default(),
    };
    let harness = TestHarness::builder()
        .settle_timeout(Duration::from_millis(300))
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", held.clone()))
        .build()
        .unwrap();
    let entered = held.entered.notified();
    let message = member_removed();
    let (published, advanced) = tokio::join!(harness.publish(&message), async {
        entered.await;
        let advanced = harness.advance(Duration::from_secs(60)).await;
        held.let_go.notify_one();
        advanced
    });

    assert!(
        matches!(advanced, Err(Error::NotSettled { waited, .. }) if waited == Duration::from_millis(300)),
        "{advanced:?}"
    );
    // The publish waited as long, from a little earlier: its own bound passed too, unless
    // the handler, let go on its own thread, answered before the publish looked again. The
    // delivery goes on either way, and ends once let go.
    assert!(
        matches!(&published, Err(Error::NotSettled { .. }))
            || published
                .as_ref()
                .is_ok_and(dacapo::DeliveryReport::is_handled),
        "{published:?}"
    );
    harness.idle().await.unwrap();
    assert!(harness.reports()[0].is_handled());
}
