//! Retries survive restarts: a runtime stopped during a cooldown, or dropped while a handler
//! runs, leaves the delivery in the store, and the next runtime resumes it with the right
//! attempt count, no earlier than it was due.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::{MemberRemoved, member_removed};
use tokio::sync::{Notify, oneshot};

const WAIT: Duration = Duration::from_secs(20);

struct AlwaysFails;

impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

/// An attempt number and when it ran.
type Call = (u32, chrono::DateTime<Utc>);

/// Records when it was called, so a test can tell whether a retry ran early.
#[derive(Clone, Default)]
struct Timed(Arc<std::sync::Mutex<Vec<Call>>>);

impl Handler<MemberRemoved> for Timed {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push((context.attempt(), Utc::now()));
        Ok(())
    }
}

on_both_backends!(
    a_restart_during_a_cooldown_resumes_on_time_with_the_attempt_count_sqlite,
    a_restart_during_a_cooldown_resumes_on_time_with_the_attempt_count_postgres,
    |db| {
        let policy = RetryPolicy {
            min_retry_interval: Duration::from_millis(1500),
            max_retry_interval: Duration::from_millis(1500),
            ..RetryPolicy::default()
        };
        let first = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .retry_policy(policy)
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", AlwaysFails))
            .build()
            .unwrap();
        let id = first.publish(&member_removed()).await.unwrap();
        // The drain lets attempt 1 fail; its retry is recorded, handed back and released.
        let report = first.shutdown().await;
        assert_eq!(report.pending_retries.len(), 1);
        let due_at = report.pending_retries[0].due_at;
        assert_eq!(report.pending_retries[0].envelope.attempts, 1);

        let calls = Timed::default();
        let second = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .retry_policy(policy)
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while calls.0.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the retry resumed on the second runtime");
        let calls = calls.0.lock().unwrap().clone();
        assert_eq!(calls.len(), 1);
        let (attempt, at) = calls[0];
        assert_eq!(attempt, 2, "the attempt count survived the restart");
        assert!(
            at >= due_at,
            "resumed at {at}, before it was due at {due_at}"
        );
        tokio::time::timeout(WAIT, second.idle()).await.unwrap();
        assert_eq!(second.stats().handled, 1);
        let _ = id;
        second.shutdown().await;
    }
);

/// Signals that it started, then never finishes.
struct Stuck {
    started: std::sync::Mutex<Option<oneshot::Sender<()>>>,
    never: Arc<Notify>,
}

impl Handler<MemberRemoved> for Stuck {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        self.never.notified().await;
        Ok(())
    }
}

on_both_backends!(
    a_crash_while_a_handler_runs_counts_that_attempt_sqlite,
    a_crash_while_a_handler_runs_counts_that_attempt_postgres,
    |db| {
        let quick = RetryPolicy {
            min_retry_interval: Duration::from_millis(10),
            ..RetryPolicy::default()
        };
        let (started, started_rx) = oneshot::channel();
        let stuck = Stuck {
            started: std::sync::Mutex::new(Some(started)),
            never: Arc::new(Notify::new()),
        };
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_millis(600))
            .await
            .retry_policy(quick)
            .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", stuck))
            .build()
            .unwrap();
        let id = crashed.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, started_rx)
            .await
            .unwrap()
            .unwrap();
        // Gone without a shutdown: its row stays owned by node-a until node-a's heartbeat expires.
        drop(crashed);

        let calls = Recorder::<MemberRemoved>::new();
        let survivor = db
            .store(Runtime::builder(), "node-b", Duration::from_millis(600))
            .await
            .retry_policy(quick)
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while calls.count() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the other node took the delivery over");
        let calls = calls.calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].message_id, Some(id));
        assert_eq!(calls[0].attempt, 2, "the interrupted attempt counted");
        survivor.shutdown().await;
    }
);

on_both_backends!(
    a_runtime_dropped_during_a_cooldown_resumes_it_when_restarted_sqlite,
    a_runtime_dropped_during_a_cooldown_resumes_it_when_restarted_postgres,
    |db| {
        let policy = RetryPolicy {
            min_retry_interval: Duration::from_millis(1200),
            max_retry_interval: Duration::from_millis(1200),
            ..RetryPolicy::default()
        };
        let (failed, failed_rx) = oneshot::channel();
        let dropped = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(policy)
            .module(Module::new("webhooks").handle_named::<MemberRemoved, _>(
                "queue",
                FailOnce(std::sync::Mutex::new(Some(failed))),
            ))
            .build()
            .unwrap();
        let published_at = Utc::now();
        let id = dropped.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, failed_rx)
            .await
            .unwrap()
            .unwrap();
        // Once the retry is recorded in the store, vanish without a shutdown.
        tokio::time::timeout(WAIT, async {
            while db.inbox_status(id).await.as_deref() != Some("scheduled") {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the retry was recorded");
        drop(dropped);

        let calls = Timed::default();
        let restarted = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(policy)
            .module(
                Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while calls.0.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the retry resumed after the restart");
        let (attempt, at) = calls.0.lock().unwrap()[0];
        assert_eq!(attempt, 2);
        assert!(
            at >= published_at + chrono::Duration::milliseconds(1200),
            "resumed before its cooldown ended"
        );
        restarted.shutdown().await;
    }
);

/// Fails its first call and says so.
struct FailOnce(std::sync::Mutex<Option<oneshot::Sender<()>>>);

impl Handler<MemberRemoved> for FailOnce {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        match self.0.lock().unwrap().take() {
            Some(failed) => {
                let _ = failed.send(());
                Err("first call fails".into())
            }
            None => Ok(()),
        }
    }
}
