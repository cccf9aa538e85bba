//! A failing delivery is retried as a whole on the policy's cooldowns, then dead-lettered.

#[path = "support/messages.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, TestHarness};
use dacapo::{DeadLetterReason, FailureKind, Outcome};
use support::{Counter, MemberRemoved, member_removed, secs};

#[tokio::test]
async fn failing_handler_is_retried_on_the_default_cooldowns_then_dead_lettered() {
    let other = Counter::default();
    let harness = TestHarness::builder()
        .module(
            Module::new("workspaces")
                .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
        )
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", other.clone()))
        .fault("workspaces", "revoke", Fault::always_fail())
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    );
    assert_eq!(report.attempts, 6, "retry_limit 5 means at most 6 attempts");
    assert_eq!(report.cooldowns(), secs(&[1, 6, 16, 36, 60]));
    assert_eq!(report.failures.len(), 6);
    // Every attempt reran every handler: the healthy one ran six times.
    assert_eq!(other.count(), 6);
    let first = &report.failures[0];
    assert_eq!(first.failures.len(), 1);
    assert_eq!(&*first.failures[0].module, "workspaces");
    assert_eq!(
        first.to_string(),
        format!(
            "1 handler(s) failed for event organization.member_removed with MessageId {}.",
            report.envelope_id
        )
    );

    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(report.envelope_id)
        .await
        .unwrap();
    assert_eq!(dead.attempts, 6);
    assert_eq!(dead.failures.len(), 6);
    assert_eq!(dead.reason, DeadLetterReason::RetriesExhausted);
    assert!(dead.first_failure_at <= dead.last_failure_at);
}

#[tokio::test]
async fn a_handler_failing_once_succeeds_on_the_retry_after_one_second() {
    let calls = Recorder::<MemberRemoved>::new();
    let harness = TestHarness::builder()
        .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", calls.clone()))
        .fault("workspaces", "revoke", Fault::fail_times(1))
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert!(report.is_handled());
    assert_eq!(report.attempts, 2);
    assert_eq!(report.cooldowns(), secs(&[1]));
    let calls = calls.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].attempt, 2);
    assert_eq!(calls[0].message_id, Some(report.envelope_id));
}

#[tokio::test]
async fn all_failures_of_an_attempt_are_aggregated_in_registration_order() {
    let harness = TestHarness::builder()
        // The first handler finishes last, so the order of the aggregate cannot come from the
        // order in which the handlers finished.
        .module(Module::new("a").handle_named::<MemberRemoved, _>("one", Slow))
        .module(Module::new("b").handle_named::<MemberRemoved, _>("two", Counter::default()))
        .module(Module::new("c").handle_named::<MemberRemoved, _>("three", Counter::default()))
        .fault("c", "three", Fault::panic_times(1))
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert!(report.is_handled());
    let failed = &report.failures[0];
    assert_eq!(failed.to_string().split(' ').next(), Some("2"));
    let names: Vec<&str> = failed.failures.iter().map(|f| &*f.handler).collect();
    assert_eq!(names, ["one", "three"]);
    assert_eq!(failed.failures[0].kind, FailureKind::Error);
    assert_eq!(failed.failures[1].kind, FailureKind::Panicked);
}

/// Lets other work run a few times, then fails on the first attempt.
struct Slow;

impl Handler<MemberRemoved> for Slow {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        if context.attempt() == 1 {
            return Err("slow and failing".into());
        }
        Ok(())
    }
}

/// Fails the first call for each message, then succeeds.
#[derive(Clone, Default)]
struct FailsFirstCall(Arc<std::sync::Mutex<std::collections::HashSet<uuid::Uuid>>>);

impl Handler<MemberRemoved> for FailsFirstCall {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let id = ctx.message_id().unwrap_or_default();
        if self.0.lock().unwrap().insert(id) {
            return Err("first call fails".into());
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_due_at_once_is_never_lost_between_the_timer_and_its_supervisor() {
    // A zero cooldown makes the timer answer while the supervisor is still finishing the step
    // that asked for it: the supervisor must not stop with that answer in its mailbox.
    let no_pause = RetryPolicy {
        min_retry_interval: Duration::ZERO,
        retry_interval_delta: Duration::ZERO,
        ..RetryPolicy::default()
    };
    let runtime = Runtime::builder()
        .retry_policy(no_pause)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", FailsFirstCall::default()))
        .build()
        .unwrap();
    for _ in 0..2000 {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(30), runtime.idle())
        .await
        .expect("every retried delivery settled");
    let stats = runtime.stats();
    assert_eq!(stats.handled, 2000);
    assert_eq!(stats.retried, 2000);
    runtime.shutdown().await;
}
