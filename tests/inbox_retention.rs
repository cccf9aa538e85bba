//! The in-memory inbox discards a redelivered envelope for `keep_after_handling`, then
//! forgets it.

#[path = "support/messages.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use dacapo::ports::{Clock, Inbox, Receipt};
use dacapo::prelude::*;
use dacapo::store::MemoryInbox;
use dacapo::testing::TestHarness;
use dacapo::{DiscardReason, Outcome};
use support::{Counter, MemberRemoved, member_removed};

#[derive(Clone)]
struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    fn advance(&self, by: Duration) {
        *self.0.lock().unwrap() += chrono::Duration::from_std(by).unwrap();
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap()
    }
}

#[tokio::test]
async fn a_redelivery_is_discarded_within_the_retention_and_handled_after_it() {
    let clock = ManualClock(Arc::new(Mutex::new(Utc::now())));
    let counter = Counter::default();
    let harness = TestHarness::builder()
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", counter.clone()))
        .configure(|runtime| runtime.clock(Arc::new(clock.clone())))
        .build()
        .unwrap();
    let envelope = Envelope::for_message(&member_removed()).unwrap();

    assert!(
        harness
            .deliver(envelope.clone())
            .await
            .unwrap()
            .is_handled()
    );
    clock.advance(Duration::from_secs(4 * 60 + 59));
    let within = harness.deliver(envelope.clone()).await.unwrap();
    clock.advance(Duration::from_secs(2));
    let after = harness.deliver(envelope).await.unwrap();

    assert_eq!(
        within.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope)
    );
    assert!(after.is_handled(), "the default retention is 5 minutes");
    assert_eq!(counter.count(), 2);
}

#[tokio::test]
async fn an_envelope_still_incoming_is_never_expired() {
    let clock = ManualClock(Arc::new(Mutex::new(Utc::now())));
    let inbox = MemoryInbox::new(Duration::from_secs(1), Arc::new(clock.clone()));
    let envelope = Envelope::for_message(&member_removed()).unwrap();
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::New);
    clock.advance(Duration::from_secs(3600));
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::Duplicate);
    inbox.settle_handled(envelope.id, 1, &[]).await.unwrap();
    clock.advance(Duration::from_secs(2));
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::New);
}

/// A retention too long to add to a date (`Duration::MAX`: "for ever") keeps handled ids, as
/// it says; it forgot them at the next receive before.
#[tokio::test]
async fn a_retention_too_long_to_add_keeps_handled_ids_for_ever() {
    let clock = ManualClock(Arc::new(Mutex::new(Utc::now())));
    let inbox = MemoryInbox::new(Duration::MAX, Arc::new(clock.clone()));
    let envelope = Envelope::for_message(&member_removed()).unwrap();
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::New);
    inbox.settle_handled(envelope.id, 1, &[]).await.unwrap();
    clock.advance(Duration::from_secs(100 * 365 * 24 * 3600));
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::Duplicate);
}
