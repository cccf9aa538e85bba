//! `quiet_handler_panics`: a handler's panic stays off the panic hook (it is still reported
//! as the handler's failure); a panic anywhere else still reaches it. One test per binary:
//! the panic hook is the process's.
#![cfg(feature = "testing")]

#[path = "support/messages.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dacapo::prelude::*;
use support::{MemberRemoved, member_removed};

/// Panics at once, or after waiting, so both ways a handler is polled are covered.
struct Panics {
    wait_first: bool,
}

impl Handler<MemberRemoved> for Panics {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if self.wait_first {
            tokio::task::yield_now().await;
        }
        panic!("expected in this test")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panics_are_kept_off_the_hook_and_others_are_not() {
    let hooked = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hooked);
    std::panic::set_hook(Box::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    dacapo::quiet_handler_panics();

    let runtime = Runtime::builder()
        .retry_policy(RetryPolicy::no_retries())
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("at_once", Panics { wait_first: false })
                .handle_named::<MemberRemoved, _>("later", Panics { wait_first: true }),
        )
        .build()
        .unwrap();
    let envelope = runtime
        .envelope(&member_removed(), SendOptions::new())
        .unwrap();
    let report = runtime
        .receive_tracked(envelope)
        .await
        .unwrap()
        .await
        .unwrap();
    let failures: Vec<_> = report.failures.iter().flat_map(|a| &a.failures).collect();
    assert_eq!(failures.len(), 2, "{report:?}");
    assert!(failures.iter().all(|f| f.kind == FailureKind::Panicked));
    assert!(
        failures
            .iter()
            .all(|f| f.to_string().ends_with("panicked: expected in this test"))
    );
    assert_eq!(
        hooked.load(Ordering::SeqCst),
        0,
        "no handler panic reached the hook"
    );

    let elsewhere = std::panic::catch_unwind(|| panic!("not in a handler"));
    assert!(elsewhere.is_err());
    assert_eq!(
        hooked.load(Ordering::SeqCst),
        1,
        "a panic elsewhere reached the hook"
    );
    runtime.shutdown().await;
}
