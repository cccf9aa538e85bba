//! Publishing waits once the bound of deliveries in flight is reached, instead of queueing
//! without limit.

#[path = "support/messages.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use dacapo::prelude::*;
use support::{MemberRemoved, member_removed};
use tokio::sync::Semaphore;

/// Waits for one permit per call.
struct Gated(Arc<Semaphore>);

impl Handler<MemberRemoved> for Gated {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.acquire().await?.forget();
        Ok(())
    }
}

#[tokio::test]
async fn publish_waits_while_the_in_flight_bound_is_reached() {
    let gate = Arc::new(Semaphore::new(0));
    let runtime = Runtime::builder()
        .max_in_flight(2)
        .module(
            Module::new("m").handle_named::<MemberRemoved, _>("gated", Gated(Arc::clone(&gate))),
        )
        .build()
        .unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    runtime.publish(&member_removed()).await.unwrap();

    let message = member_removed();
    let mut third = Box::pin(runtime.publish(&message));
    assert!(
        futures::poll!(&mut third).is_pending(),
        "two deliveries hold both slots"
    );

    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(5), &mut third)
        .await
        .unwrap()
        .unwrap();
    gate.add_permits(2);
    tokio::time::timeout(Duration::from_secs(5), runtime.idle())
        .await
        .unwrap();
    assert_eq!(runtime.stats().handled, 3);
    assert!(runtime.shutdown().await.is_clean());
}

#[tokio::test]
async fn a_publish_cancelled_while_waiting_leaves_nothing_behind() {
    let gate = Arc::new(Semaphore::new(0));
    let runtime = Runtime::builder()
        .max_in_flight(1)
        .module(
            Module::new("m").handle_named::<MemberRemoved, _>("gated", Gated(Arc::clone(&gate))),
        )
        .build()
        .unwrap();
    runtime.publish(&member_removed()).await.unwrap();
    let message = member_removed();
    {
        let mut waiting = Box::pin(runtime.publish(&message));
        assert!(futures::poll!(&mut waiting).is_pending());
        // Dropped here: the caller gave up waiting for capacity.
    }
    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(5), runtime.idle())
        .await
        .expect("the cancelled publish is not counted as in flight");
    assert_eq!(runtime.stats().handled, 1);
    assert!(runtime.shutdown().await.is_clean());
}

/// Fails the first `cooling` messages (their retries are an hour away), holds the next one
/// until the gate opens, and handles the rest.
struct CoolsThenHolds {
    calls: std::sync::atomic::AtomicUsize,
    cooling: usize,
    gate: Arc<Semaphore>,
}

impl Handler<MemberRemoved> for CoolsThenHolds {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if call < self.cooling {
            return Err(HandlerError::retry("down for an hour"));
        }
        if call == self.cooling {
            self.gate.acquire().await?.forget();
        }
        Ok(())
    }
}

/// Waiting publishers are woken once a quarter of the slots is free, but a slot whose delivery
/// cools down frees nothing for an hour: the quarter counts only the slots at work. Before,
/// with seven of eight slots cooling, the one freed by the eighth delivery woke no one.
#[tokio::test]
async fn a_publisher_waiting_beside_cooling_retries_gets_the_slot_that_frees() {
    let gate = Arc::new(Semaphore::new(0));
    let runtime = Runtime::builder()
        .max_in_flight(8)
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_secs(3600),
            ..RetryPolicy::default()
        })
        .module(Module::new("m").handle_named::<MemberRemoved, _>(
            "h",
            CoolsThenHolds {
                calls: Default::default(),
                cooling: 7,
                gate: Arc::clone(&gate),
            },
        ))
        .build()
        .unwrap();
    support::publish_until_cooling(&runtime, 7).await;
    runtime.publish(&member_removed()).await.unwrap();

    let message = member_removed();
    let mut waiting = Box::pin(runtime.publish(&message));
    assert!(
        futures::poll!(&mut waiting).is_pending(),
        "seven cooling deliveries and a held one take all eight slots"
    );
    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(5), &mut waiting)
        .await
        .expect("the publisher got the freed slot")
        .unwrap();

    let report = runtime.shutdown().await;
    assert_eq!(report.pending_retries.len(), 7);
}
