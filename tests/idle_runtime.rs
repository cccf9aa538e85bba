//! A store opened on an application's runtime that is then left idle — a `block_on` of a
//! current-thread runtime that returned — still serves the runtime's deliveries made from
//! other threads: none of the connections the runtime goes on using waits for the idle
//! runtime to run again.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::{MemberRemoved, member_removed};
use support_stores::{Backend, TestDatabase};

const WAIT: Duration = Duration::from_secs(10);

fn delivers_after_the_runtime_that_opened_the_store_went_idle(backend: Backend) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let db = main.block_on(TestDatabase::new(backend));
    let application = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = application.block_on(async {
        let builder = match backend {
            Backend::Sqlite => Runtime::builder().store(db.sqlite().await),
            Backend::Postgres => Runtime::builder().store(db.postgres().await),
        };
        let runtime = builder
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        runtime.publish(&member_removed()).await.unwrap();
        runtime
    });
    // From here on the application's runtime runs nothing.
    main.block_on(async {
        for n in 0..20 {
            tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
                .await
                .unwrap_or_else(|_| panic!("publish {n} still waits after {WAIT:?}"))
                .unwrap();
        }
        tokio::time::timeout(WAIT, runtime.idle())
            .await
            .expect("every delivery settled");
        runtime.shutdown().await;
    });
    assert_eq!(calls.count(), 21);
    drop(application);
}

#[test]
fn postgresql() {
    delivers_after_the_runtime_that_opened_the_store_went_idle(Backend::Postgres);
}

#[test]
fn sqlite() {
    delivers_after_the_runtime_that_opened_the_store_went_idle(Backend::Sqlite);
}
