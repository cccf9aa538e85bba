//! What a handler learns from its `MessageContext`, and how cascaded messages leave.

#[path = "support/messages.rs"]
mod support;

use std::sync::{Arc, Mutex};

use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, TestHarness};
use dacapo::{EngineError, Outcome};
use support::{MemberRemoved, WebhookQueued, member_removed};
use uuid::Uuid;

#[derive(Clone, Debug, Default, PartialEq)]
struct Seen {
    message_id: Option<Uuid>,
    message_type: Option<String>,
    attempt: u32,
    correlation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    deduplication_id: Option<String>,
    tenant: Option<String>,
    handler: Option<String>,
}

#[derive(Clone, Default)]
struct Observe(Arc<Mutex<Vec<Seen>>>);

impl Handler<MemberRemoved> for Observe {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(Seen {
            message_id: context.message_id(),
            message_type: context.message_type().map(str::to_owned),
            attempt: context.attempt(),
            correlation_id: context.correlation_id(),
            causation_id: context.causation_id(),
            deduplication_id: context.deduplication_id().map(str::to_owned),
            tenant: context.headers().get("tenant").cloned(),
            handler: context.handler().map(ToString::to_string),
        });
        Ok(())
    }
}

#[tokio::test]
async fn a_consumer_sees_its_message_identity_in_the_context() {
    let seen = Observe::default();
    let harness = TestHarness::builder()
        .module(Module::new("audit").handle_named::<MemberRemoved, _>("record", seen.clone()))
        .fault("audit", "record", Fault::fail_times(2))
        .build()
        .unwrap();
    let correlation = Uuid::new_v4();
    let options = SendOptions::new()
        .deduplication_id("remove-7")
        .header("tenant", "acme")
        .correlation_id(correlation);

    // The fault strikes in front of the handler, which therefore first runs on attempt 3.
    let report = harness
        .publish_with(&member_removed(), options)
        .await
        .unwrap();

    assert!(report.is_handled());
    let seen = seen.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0],
        Seen {
            message_id: Some(report.envelope_id),
            message_type: Some("organization.member_removed".into()),
            attempt: 3,
            correlation_id: Some(correlation),
            causation_id: None,
            deduplication_id: Some("remove-7".into()),
            tenant: Some("acme".into()),
            handler: Some("audit/record".into()),
        }
    );
}

#[tokio::test]
async fn every_attempt_reruns_every_handler_with_the_same_message_id() {
    let seen = Observe::default();
    let harness = TestHarness::builder()
        .module(Module::new("audit").handle_named::<MemberRemoved, _>("record", seen.clone()))
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", Recorder::new()),
        )
        .fault("workspaces", "revoke", Fault::fail_times(2))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    let seen = seen.0.lock().unwrap().clone();
    let attempts: Vec<u32> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [1, 2, 3]);
    assert!(
        seen.iter()
            .all(|s| s.message_id == Some(report.envelope_id))
    );
}

#[test]
fn a_detached_context_has_no_message() {
    let context = MessageContext::detached();
    assert_eq!(context.message_id(), None);
    assert_eq!(context.attempt(), 0);
    assert!(context.headers().is_empty());
    assert_eq!(context.deduplication_id(), None);
    // Outside a consumer, ids fall back to random ones.
    assert_ne!(
        ids::derive_or_random(context.message_id(), "k"),
        ids::derive_or_random(context.message_id(), "k")
    );
}

#[tokio::test]
async fn a_detached_context_cannot_cascade() {
    let error = MessageContext::detached()
        .publish(&WebhookQueued {
            delivery_id: "x".into(),
        })
        .await
        .unwrap_err();
    assert!(matches!(error, EngineError::Detached), "{error}");
}

/// Cascades one `WebhookQueued` per attempt, and fails the first attempt after cascading.
struct QueueAndMaybeFail;

impl Handler<MemberRemoved> for QueueAndMaybeFail {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        let delivery_id = format!("attempt-{}", context.attempt());
        context.publish(&WebhookQueued { delivery_id }).await?;
        if context.attempt() == 1 {
            return Err("the database hiccuped after queueing".into());
        }
        Ok(())
    }
}

#[tokio::test]
async fn cascaded_messages_leave_only_when_the_delivery_succeeds() {
    let downstream = Recorder::<WebhookQueued>::new();
    let harness = TestHarness::builder()
        .module(
            Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", QueueAndMaybeFail),
        )
        .module(Module::new("sender").handle_named::<WebhookQueued, _>("send", downstream.clone()))
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert!(report.is_handled());
    assert_eq!(report.attempts, 2);
    // Only the successful attempt's message was cascaded; the failed attempt's was dropped.
    assert_eq!(report.cascaded.len(), 1);
    let cascaded = &report.cascaded[0];
    assert_eq!(cascaded.message_type, "webhooks.delivery_queued");
    assert_eq!(cascaded.causation_id, Some(report.envelope_id));
    assert_eq!(cascaded.correlation_id, Some(report.envelope_id));

    // The cascaded message is delivered to its own handlers.
    harness.idle().await.unwrap();
    let calls = downstream.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].message.delivery_id, "attempt-2");
    assert_eq!(calls[0].message_id, Some(cascaded.id));
}

#[tokio::test]
async fn cascaded_messages_of_a_dead_lettered_delivery_never_leave() {
    let downstream = Recorder::<WebhookQueued>::new();
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 1,
            ..RetryPolicy::default()
        })
        .module(
            Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", QueueAndMaybeFail),
        )
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", Recorder::new()))
        .module(Module::new("sender").handle_named::<WebhookQueued, _>("send", downstream.clone()))
        .fault("billing", "charge", Fault::always_fail())
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();

    assert!(matches!(report.outcome, Outcome::DeadLettered(_)));
    assert!(report.cascaded.is_empty());
    let report = harness.shutdown().await;
    assert!(report.is_clean());
    assert_eq!(downstream.count(), 0);
}

/// Cascades one message on its first run only, as an idempotent handler that finds its work
/// already done on a retry does.
#[derive(Default)]
struct CascadeOnce(std::sync::atomic::AtomicBool);

impl Handler<MemberRemoved> for CascadeOnce {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        if !self.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
            context
                .publish(&WebhookQueued {
                    delivery_id: "first-run".into(),
                })
                .await?;
        }
        Ok(())
    }
}

/// Cascades the same message on every attempt, as a naive handler does.
struct CascadeAlways;

impl Handler<MemberRemoved> for CascadeAlways {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        context
            .publish(&WebhookQueued {
                delivery_id: "every-run".into(),
            })
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn what_a_succeeding_handler_cascaded_survives_a_sibling_failure() {
    let downstream = Recorder::<WebhookQueued>::new();
    let harness = TestHarness::builder()
        .module(
            Module::new("webhooks")
                .handle_named::<MemberRemoved, _>("once", CascadeOnce::default()),
        )
        .module(Module::new("naive").handle_named::<MemberRemoved, _>("always", CascadeAlways))
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", Recorder::new()),
        )
        .module(Module::new("sender").handle_named::<WebhookQueued, _>("send", downstream.clone()))
        .fault("workspaces", "revoke", Fault::fail_times(2))
        .build()
        .unwrap();

    let report = harness.publish(&member_removed()).await.unwrap();
    harness.idle().await.unwrap();

    assert_eq!(report.attempts, 3);
    let mut sent: Vec<String> = downstream
        .calls()
        .into_iter()
        .map(|c| c.message.delivery_id)
        .collect();
    sent.sort();
    // The first run's cascade was not lost when the retry cascaded nothing, and the naive
    // handler's three identical cascades (same deterministic id) were sent once.
    assert_eq!(sent, ["every-run", "first-run"]);
    assert_eq!(report.cascaded.len(), 2);
}

/// Cascades a message naming the attempt, and succeeds.
struct CascadeByAttempt;

impl Handler<MemberRemoved> for CascadeByAttempt {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        let delivery_id = format!("attempt-{}", context.attempt());
        context.publish(&WebhookQueued { delivery_id }).await?;
        Ok(())
    }
}

#[tokio::test]
async fn different_messages_cascaded_on_different_attempts_are_all_kept() {
    let harness = TestHarness::builder()
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", CascadeByAttempt))
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", Recorder::new()),
        )
        .fault("workspaces", "revoke", Fault::fail_times(1))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    let mut sent: Vec<String> = report
        .cascaded
        .iter()
        .map(|e| {
            serde_json::from_slice::<WebhookQueued>(&e.payload)
                .unwrap()
                .delivery_id
        })
        .collect();
    sent.sort();
    assert_eq!(sent, ["attempt-1", "attempt-2"]);
    assert_ne!(report.cascaded[0].id, report.cascaded[1].id);
}

/// Keeps its context, to publish after the attempt is over.
#[derive(Clone, Default)]
struct KeepContext(Arc<Mutex<Option<MessageContext>>>);

impl Handler<MemberRemoved> for KeepContext {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        *self.0.lock().unwrap() = Some(context.clone());
        Ok(())
    }
}

#[tokio::test]
async fn cascading_after_the_attempt_is_over_fails_instead_of_vanishing() {
    let kept = KeepContext::default();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", kept.clone()))
        .build()
        .unwrap();
    assert!(
        harness
            .publish(&member_removed())
            .await
            .unwrap()
            .is_handled()
    );
    let context = kept.0.lock().unwrap().clone().expect("the handler ran");
    let late = context
        .publish(&WebhookQueued {
            delivery_id: "late".into(),
        })
        .await;
    assert!(matches!(late, Err(EngineError::Detached)), "{late:?}");
}

#[tokio::test]
async fn send_refuses_a_type_this_runtime_does_not_handle() {
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", SendUnrouted))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(report.is_handled(), "{:?}", report.failures);
}

/// Sends a type nobody handles and checks the refusal.
struct SendUnrouted;

impl Handler<MemberRemoved> for SendUnrouted {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        match context
            .send(&WebhookQueued {
                delivery_id: "x".into(),
            })
            .await
        {
            Err(EngineError::NoRoute(envelope))
                if envelope.message_type == "webhooks.delivery_queued" =>
            {
                Ok(())
            }
            other => Err(format!("expected NoRoute, got {other:?}").into()),
        }
    }
}

/// Publishes one `WebhookQueued` per member removed.
struct QueuesWebhook;

impl Handler<MemberRemoved> for QueuesWebhook {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        assert_eq!(ctx.attempt(), 3);
        assert_eq!(
            ctx.headers().get("tenant").map(String::as_str),
            Some("acme")
        );
        assert_eq!(ctx.deduplication_id(), Some("remove-7"));
        ctx.publish(&support::WebhookQueued {
            delivery_id: format!("member-{}", event.member_id),
        })
        .await?;
        Ok(())
    }
}

#[tokio::test]
async fn a_handler_is_unit_tested_with_a_context_of_the_tests_choosing() {
    let message_id = uuid::Uuid::new_v4();
    let correlation = uuid::Uuid::new_v4();
    let ctx = MessageContext::for_test()
        .message_id(message_id)
        .attempt(3)
        .header("tenant", "acme")
        .deduplication_id("remove-7")
        .correlation_id(correlation)
        .handler("webhooks", "queue")
        .build();
    assert_eq!(ctx.message_id(), Some(message_id));
    assert_eq!(
        ctx.handler().map(ToString::to_string).as_deref(),
        Some("webhooks/queue")
    );
    QueuesWebhook.handle(&member_removed(), &ctx).await.unwrap();
    let published = ctx.published();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].message_type, "webhooks.delivery_queued");
    assert_eq!(published[0].causation_id, Some(message_id));
    assert_eq!(published[0].correlation_id, Some(correlation));

    // The id is the one a delivery of the same message gives the same handler's cascade.
    let harness = dacapo::testing::TestHarness::builder()
        .module(
            Module::new("webhooks")
                .handle_named::<MemberRemoved, _>("queue", QueuesWebhookAnyAttempt),
        )
        .build()
        .unwrap();
    let mut envelope = harness
        .runtime()
        .envelope(&member_removed(), SendOptions::new())
        .unwrap();
    envelope.id = message_id;
    let report = harness.deliver(envelope).await.unwrap();
    assert_eq!(report.cascaded[0].id, published[0].id);
    harness.shutdown().await;

    assert!(MessageContext::detached().published().is_empty());
}

/// As [`QueuesWebhook`], on any attempt and without expectations.
struct QueuesWebhookAnyAttempt;

impl Handler<MemberRemoved> for QueuesWebhookAnyAttempt {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        ctx.publish(&support::WebhookQueued {
            delivery_id: format!("member-{}", event.member_id),
        })
        .await?;
        Ok(())
    }
}

/// Tells, when dropped, whether the runtime had given up on the handler that held it.
struct Held<'a> {
    context: &'a MessageContext,
    told: Arc<Mutex<Vec<(u32, bool)>>>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.told
            .lock()
            .unwrap()
            .push((self.context.attempt(), self.context.given_up()));
    }
}

/// Outlasts its timeout on the first attempt, returns on the second.
struct OutlastsItsFirstTimeout(Arc<Mutex<Vec<(u32, bool)>>>);

impl Handler<MemberRemoved> for OutlastsItsFirstTimeout {
    async fn handle(
        &self,
        _: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        let _held = Held {
            context,
            told: Arc::clone(&self.0),
        };
        if context.attempt() == 1 {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// What a handler holds can tell, when it is dropped, a run the runtime gave up on (its
/// timeout passed) from one that ended: the adapter of handler connections stops what a
/// handler given up on left running by this. Told alike for a handler that deduplicates,
/// which runs behind its claim.
#[tokio::test]
async fn what_a_handler_holds_tells_when_dropped_whether_the_runtime_gave_up_on_it() {
    for deduplicated in [false, true] {
        let told = Arc::new(Mutex::new(Vec::new()));
        let mut module = Module::new("m")
            .handle_named::<MemberRemoved, _>("h", OutlastsItsFirstTimeout(Arc::clone(&told)));
        let mut builder = Runtime::builder()
            .handler_timeout(std::time::Duration::from_millis(50))
            .retry_policy(RetryPolicy {
                min_retry_interval: std::time::Duration::from_millis(10),
                ..RetryPolicy::default()
            });
        let mut options = SendOptions::new();
        if deduplicated {
            module = module.deduplicate("h", Deduplication::from_envelope());
            builder = builder.enable_deduplication();
            options = options.deduplication_id("member-1|removed");
        }
        let runtime = builder.module(module).build().unwrap();
        runtime
            .publish_with(&member_removed(), options)
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(10), runtime.idle())
            .await
            .unwrap();
        assert_eq!(runtime.stats().handled, 1, "deduplicated: {deduplicated}");
        assert_eq!(
            *told.lock().unwrap(),
            [(1, true), (2, false)],
            "deduplicated: {deduplicated}"
        );
        assert!(runtime.shutdown().await.is_clean());
    }
}
