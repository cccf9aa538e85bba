//! On real threads: deliveries spread over several worker arbiters, and a panicking handler
//! never takes a worker down.

#[path = "support/messages.rs"]
mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use dacapo::prelude::*;
use support::{Counter, MemberRemoved};

#[derive(Clone, Default)]
struct Threads(Arc<Mutex<HashSet<ThreadId>>>);

impl Handler<MemberRemoved> for Threads {
    async fn handle(
        &self,
        message: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.0.lock().unwrap().insert(std::thread::current().id());
        if message.member_id.is_multiple_of(10) && context.attempt() == 1 {
            panic!("member {} makes this handler panic once", message.member_id);
        }
        Ok(())
    }
}

#[tokio::test]
async fn deliveries_use_every_worker_and_survive_panics() {
    let threads = Threads::default();
    let (a, b) = (Counter::default(), Counter::default());
    let runtime = Runtime::builder()
        .workers(2)
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_millis(5),
            retry_interval_delta: Duration::from_millis(5),
            ..RetryPolicy::default()
        })
        .module(Module::new("threads").handle_named::<MemberRemoved, _>("record", threads.clone()))
        .module(Module::new("a").handle_named::<MemberRemoved, _>("count", a.clone()))
        .module(Module::new("b").handle_named::<MemberRemoved, _>("count", b.clone()))
        .build()
        .unwrap();

    for member_id in 1..=200 {
        runtime
            .publish(&MemberRemoved {
                organization_id: 1,
                member_id,
            })
            .await
            .unwrap();
    }
    tokio::time::timeout(Duration::from_secs(30), runtime.idle())
        .await
        .unwrap();

    let stats = runtime.stats();
    assert_eq!(stats.handled, 200);
    assert_eq!(stats.retried, 20, "every tenth message panicked once");
    assert_eq!(stats.dead_lettered, 0);
    // Each retry reruns every handler: 200 first attempts + 20 retries.
    assert_eq!((a.count(), b.count()), (220, 220));
    assert_eq!(
        threads.0.lock().unwrap().len(),
        2,
        "both workers ran handlers"
    );
    assert!(runtime.shutdown().await.is_clean());
}
