//! Bad input gets a clear reason and loses nothing: dead letters, not panics or silent drops.

#[path = "support/messages.rs"]
mod support;

use dacapo::prelude::*;
use dacapo::testing::TestHarness;
use dacapo::{DeadLetterReason, DiscardReason, EngineError, Error, Outcome, UnknownMessageTypes};
use support::{Counter, MemberRemoved, member_removed};

fn harness_with(counter: &Counter) -> TestHarness {
    TestHarness::builder()
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", counter.clone()),
        )
        .configure(|runtime| runtime.max_envelope_size(256))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_payload_that_does_not_deserialize_is_dead_lettered_without_retries() {
    let counter = Counter::default();
    let harness = harness_with(&counter);
    let envelope = Envelope::new(
        "organization.member_removed",
        br#"{"organization_id":"one"}"#.to_vec(),
    );

    let report = harness.deliver(envelope.clone()).await.unwrap();

    let Outcome::DeadLettered(DeadLetterReason::MalformedPayload(reason)) = &report.outcome else {
        panic!(
            "expected a malformed payload dead letter, got {:?}",
            report.outcome
        );
    };
    assert!(reason.contains("invalid type"), "{reason}");
    assert_eq!(report.attempts, 0);
    assert_eq!(counter.count(), 0);
    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(envelope.id)
        .await
        .unwrap();
    assert_eq!(dead.envelope, envelope, "the envelope is kept as received");
    assert!(dead.reason.to_string().starts_with("malformed payload: "));
}

#[tokio::test]
async fn an_unknown_message_type_is_dead_lettered_with_the_type_in_the_reason() {
    let harness = harness_with(&Counter::default());
    let envelope = Envelope::new("billing.invoice_paid", b"{}".to_vec());

    let report = harness.deliver(envelope.clone()).await.unwrap();

    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::NoHandler("billing.invoice_paid".into()))
    );
    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(envelope.id)
        .await
        .unwrap();
    assert_eq!(
        dead.reason.to_string(),
        "no handler for billing.invoice_paid"
    );
}

#[tokio::test]
async fn an_unknown_message_type_can_be_discarded_instead() {
    let harness = TestHarness::builder()
        .configure(|runtime| runtime.unknown_message_types(UnknownMessageTypes::Discard))
        .build()
        .unwrap();
    let report = harness
        .deliver(Envelope::new("billing.invoice_paid", b"{}".to_vec()))
        .await
        .unwrap();
    assert_eq!(report.outcome, Outcome::Discarded(DiscardReason::NoHandler));
    assert!(
        harness
            .runtime()
            .dead_letters()
            .list()
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(harness.runtime().stats().discarded, 1);
}

#[tokio::test]
async fn an_oversized_message_is_refused_at_publish_and_handed_back() {
    let counter = Counter::default();
    let harness = harness_with(&counter);
    let big = SendOptions::new().header("padding", "x".repeat(300));

    let error = harness
        .runtime()
        .publish_with(&member_removed(), big)
        .await
        .unwrap_err();

    let Error::Engine(EngineError::TooLarge {
        envelope,
        size,
        limit,
    }) = error
    else {
        panic!("expected TooLarge, got {error}");
    };
    assert_eq!(limit, 256);
    assert!(size > 256);
    assert_eq!(envelope.message_type, "organization.member_removed");
    assert_eq!(counter.count(), 0);
}

#[tokio::test]
async fn an_oversized_envelope_is_dead_lettered_at_receive() {
    let counter = Counter::default();
    let harness = harness_with(&counter);
    let mut envelope = Envelope::for_message(&member_removed()).unwrap();
    envelope.headers.insert("padding".into(), "x".repeat(300));

    let report = harness.deliver(envelope).await.unwrap();

    let Outcome::DeadLettered(DeadLetterReason::TooLarge { size, limit }) = report.outcome else {
        panic!("expected TooLarge, got {:?}", report.outcome);
    };
    assert_eq!(limit, 256);
    assert!(size > limit);
    assert_eq!(counter.count(), 0);
}

#[tokio::test]
async fn send_refuses_a_type_without_handler_at_the_call_site() {
    let harness = TestHarness::builder().build().unwrap();
    let error = harness.runtime().send(&member_removed()).await.unwrap_err();
    let Error::Engine(EngineError::NoRoute(envelope)) = error else {
        panic!("expected NoRoute, got {error}")
    };
    assert_eq!(envelope.message_type, "organization.member_removed");
}

#[test]
fn registering_a_handler_twice_or_a_policy_for_no_handler_is_refused() {
    let twice = Runtime::builder()
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("h", Counter::default())
                .handle_named::<MemberRemoved, _>("h", Counter::default()),
        )
        .build();
    assert!(matches!(twice, Err(Error::Registry(_))));

    let orphan = Runtime::builder()
        .message_retry_policy::<MemberRemoved>(RetryPolicy::default())
        .build();
    assert!(matches!(orphan, Err(Error::Registry(_))));
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct SameNameOtherShape {
    member: String,
}

impl Message for SameNameOtherShape {
    const TYPE: &'static str = "organization.member_removed";
}

#[test]
fn two_rust_types_for_one_message_type_are_refused() {
    let result = Runtime::builder()
        .module(Module::new("a").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .module(Module::new("b").handle_named::<SameNameOtherShape, _>("h", Counter::default()))
        .build();
    let Err(Error::Registry(error)) = result else {
        panic!("expected a registry error");
    };
    let text = error.to_string();
    assert!(
        text.contains("MemberRemoved") && text.contains("SameNameOtherShape"),
        "{text}"
    );
}

#[test]
fn a_fault_for_an_unknown_handler_is_refused() {
    let result = TestHarness::builder()
        .fault("nobody", "nothing", dacapo::testing::Fault::always_fail())
        .build();
    assert!(matches!(result, Err(Error::UnknownHandler(_))));
}
