//! The retry policy: its intervals, its decisions, and where it can be set.

#[path = "support/messages.rs"]
mod support;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::{Fault, TestHarness};
use dacapo::{DeadLetterReason, Outcome};
use support::{Counter, MemberRemoved, WebhookQueued, member_removed, secs};

#[test]
fn default_policy_has_the_documented_values_and_intervals() {
    let policy = RetryPolicy::default();
    assert_eq!(policy.retry_limit, 5);
    assert_eq!(policy.min_retry_interval, Duration::from_secs(1));
    assert_eq!(policy.retry_interval_delta, Duration::from_secs(5));
    assert_eq!(policy.max_retry_interval, Duration::from_secs(60));
    assert_eq!(policy.intervals(), secs(&[1, 6, 16, 36, 60]));
}

#[test]
fn intervals_follow_the_formula_and_cap_at_the_max() {
    let policy = RetryPolicy {
        retry_limit: 6,
        min_retry_interval: Duration::from_millis(100),
        retry_interval_delta: Duration::from_millis(10),
        max_retry_interval: Duration::from_millis(500),
    };
    let millis: Vec<u128> = policy.intervals().iter().map(Duration::as_millis).collect();
    // 100 + 10 * (2^k - 1): 100, 110, 130, 170, 250, 410
    assert_eq!(millis, [100, 110, 130, 170, 250, 410]);
}

#[test]
fn intervals_never_overflow() {
    let policy = RetryPolicy {
        retry_limit: 200,
        max_retry_interval: Duration::MAX,
        retry_interval_delta: Duration::from_secs(u64::MAX / 4),
        ..RetryPolicy::default()
    };
    let intervals = policy.intervals();
    assert_eq!(intervals.len(), 200);
    assert!(intervals.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(*intervals.last().unwrap(), Duration::MAX);
    assert_eq!(
        RetryPolicy::default().interval(u32::MAX),
        Duration::from_secs(60)
    );
    assert!(
        RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        }
        .intervals()
        .is_empty()
    );
}

#[tokio::test]
async fn runtime_policy_applies_to_every_module() {
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 2,
            ..RetryPolicy::default()
        })
        .module(
            Module::new("workspaces")
                .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
        )
        .module(
            Module::new("billing").handle_named::<WebhookQueued, _>("charge", Counter::default()),
        )
        .fault("workspaces", "revoke", Fault::always_fail())
        .fault("billing", "charge", Fault::always_fail())
        .build()
        .unwrap();
    let member = harness.publish(&member_removed()).await.unwrap();
    let webhook = harness
        .publish(&WebhookQueued {
            delivery_id: "d".into(),
        })
        .await
        .unwrap();
    for report in [member, webhook] {
        assert_eq!(report.attempts, 3);
        assert_eq!(report.cooldowns(), secs(&[1, 6]));
    }
}

#[tokio::test]
async fn module_policy_overrides_the_runtime_policy() {
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 5,
            ..RetryPolicy::default()
        })
        .module(
            Module::new("workspaces")
                .retry_policy(RetryPolicy {
                    retry_limit: 1,
                    ..RetryPolicy::default()
                })
                .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
        )
        .fault("workspaces", "revoke", Fault::always_fail())
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(report.attempts, 2);
}

#[tokio::test]
async fn message_type_policy_wins_over_module_policy() {
    let quick = RetryPolicy {
        retry_limit: 3,
        min_retry_interval: Duration::from_secs(2),
        retry_interval_delta: Duration::from_secs(1),
        max_retry_interval: Duration::from_secs(3),
    };
    let harness = TestHarness::builder()
        .module(
            Module::new("workspaces")
                .retry_policy(RetryPolicy::no_retries())
                .handle_named::<MemberRemoved, _>("revoke", Counter::default()),
        )
        .configure(|runtime| runtime.message_retry_policy::<MemberRemoved>(quick))
        .fault("workspaces", "revoke", Fault::always_fail())
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(report.attempts, 4);
    assert_eq!(report.cooldowns(), secs(&[2, 3, 3]));
}

#[tokio::test]
async fn when_modules_disagree_the_most_patient_failing_module_decides() {
    let harness = TestHarness::builder()
        .module(
            Module::new("impatient")
                .retry_policy(RetryPolicy::no_retries())
                .handle_named::<MemberRemoved, _>("h", Counter::default()),
        )
        .module(
            Module::new("patient")
                .retry_policy(RetryPolicy {
                    retry_limit: 2,
                    ..RetryPolicy::default()
                })
                .handle_named::<MemberRemoved, _>("h", Counter::default()),
        )
        .fault("impatient", "h", Fault::always_fail())
        .fault("patient", "h", Fault::always_fail())
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(report.attempts, 3);
}

#[tokio::test]
async fn permanent_failure_dead_letters_without_retry() {
    let healthy = Counter::default();
    let harness = TestHarness::builder()
        .module(
            Module::new("billing").handle_named::<MemberRemoved, _>("charge", Counter::default()),
        )
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", healthy.clone()))
        .fault("billing", "charge", Fault::fail_permanently())
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::Permanent)
    );
    assert_eq!(report.attempts, 1);
    assert_eq!(healthy.count(), 1, "the other handlers still ran");
}

struct RateLimited;

impl Handler<WebhookQueued> for RateLimited {
    async fn handle(
        &self,
        _: &WebhookQueued,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        if context.attempt() == 1 {
            return Err(HandlerError::retry_after(
                Duration::from_secs(90),
                "429 Too Many Requests",
            ));
        }
        Ok(())
    }
}

#[tokio::test]
async fn retry_after_waits_at_least_as_long_as_the_handler_asked() {
    let harness = TestHarness::builder()
        .module(Module::new("webhooks").handle::<WebhookQueued, _>(RateLimited))
        .build()
        .unwrap();
    let report = harness
        .publish(&WebhookQueued {
            delivery_id: "d1".into(),
        })
        .await
        .unwrap();
    assert!(report.is_handled());
    assert_eq!(report.cooldowns(), secs(&[90]));
}
