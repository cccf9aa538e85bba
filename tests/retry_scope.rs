//! `RetryScope`: rerun every handler (the default) or only those that failed, also across a
//! restart on a durable store.

#[path = "support/messages.rs"]
mod support;
#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::RetryScope;
use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, TestHarness};
use support::{Counter, MemberRemoved, member_removed};

async fn runs_of_the_healthy_handler(scope: RetryScope) -> (usize, u32) {
    let healthy = Counter::default();
    let harness = TestHarness::builder()
        .configure(|runtime| runtime.retry_scope(scope))
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", healthy.clone()))
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", Recorder::new()),
        )
        .fault("workspaces", "revoke", Fault::fail_times(2))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled());
    (healthy.count(), report.attempts)
}

#[tokio::test]
async fn by_default_every_handler_runs_on_every_attempt() {
    assert_eq!(
        runs_of_the_healthy_handler(RetryScope::AllHandlers).await,
        (3, 3)
    );
}

#[tokio::test]
async fn failed_handlers_scope_reruns_only_the_handlers_that_failed() {
    assert_eq!(
        runs_of_the_healthy_handler(RetryScope::FailedHandlers).await,
        (1, 3)
    );
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
struct AlwaysFails;

#[cfg(all(feature = "sqlite", feature = "postgres"))]
impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("down".into())
    }
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
on_both_backends!(
    handlers_that_succeeded_are_not_rerun_after_a_restart_sqlite,
    handlers_that_succeeded_are_not_rerun_after_a_restart_postgres,
    |db| {
        let policy = RetryPolicy {
            min_retry_interval: Duration::from_millis(300),
            ..RetryPolicy::default()
        };
        let healthy_before = Counter::default();
        let first = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .retry_scope(RetryScope::FailedHandlers)
            .retry_policy(policy)
            .module(
                Module::new("webhooks")
                    .handle_named::<MemberRemoved, _>("queue", healthy_before.clone()),
            )
            .module(
                Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", AlwaysFails),
            )
            .build()
            .unwrap();
        first.publish(&member_removed()).await.unwrap();
        let report = first.shutdown().await;
        assert_eq!(report.pending_retries.len(), 1);
        assert_eq!(healthy_before.count(), 1);

        let healthy_after = Counter::default();
        let fixed = Recorder::<MemberRemoved>::new();
        let second = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .retry_scope(RetryScope::FailedHandlers)
            .retry_policy(policy)
            .module(
                Module::new("webhooks")
                    .handle_named::<MemberRemoved, _>("queue", healthy_after.clone()),
            )
            .module(
                Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", fixed.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(Duration::from_secs(20), async {
            while fixed.count() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the failed handler was retried after the restart");
        tokio::time::timeout(Duration::from_secs(20), second.idle())
            .await
            .unwrap();
        assert_eq!(fixed.calls()[0].attempt, 2);
        assert_eq!(
            healthy_after.count(),
            0,
            "the handler that succeeded before the restart did not run again"
        );
        second.shutdown().await;
    }
);
