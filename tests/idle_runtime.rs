//! A store opened on an application's runtime that is then left idle — a `block_on` of a
//! current-thread runtime that returned — still serves the runtime's deliveries made from
//! other threads: none of the connections the runtime goes on using waits for the idle
//! runtime to run again. Nor does a publish such a runtime gave up while its write waited to
//! commit, nor a batch it gave up halfway through its transaction.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::future::Future as _;
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use futures::FutureExt as _;
use support::{MemberRemoved, member_removed};
use support_stores::{Backend, TestDatabase};

const WAIT: Duration = Duration::from_secs(10);

/// How many publishes a runtime left idle gives up.
const GIVEN_UP: i64 = 5;

/// The multi-thread runtime the tests publish from once the application's runtime is idle,
/// and the current-thread one they leave idle.
fn runtimes() -> (tokio::runtime::Runtime, tokio::runtime::Runtime) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let application = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (main, application)
}

/// A runtime on `db`'s store of `backend`, whose handler counts its calls in `calls`.
async fn runtime_on(
    db: &TestDatabase,
    backend: Backend,
    calls: &Recorder<MemberRemoved>,
) -> Runtime {
    let builder = match backend {
        Backend::Sqlite => Runtime::builder().store(db.sqlite().await),
        Backend::Postgres => Runtime::builder().store(db.postgres().await),
    };
    builder
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap()
}

/// Publishes 20 messages, each within `WAIT`, then waits for every delivery to settle.
async fn publish_twenty(runtime: &Runtime) {
    for n in 0..20 {
        tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
            .await
            .unwrap_or_else(|_| panic!("publish {n} still waits after {WAIT:?}"))
            .unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle())
        .await
        .expect("every delivery settled");
}

fn delivers_after_the_runtime_that_opened_the_store_went_idle(backend: Backend) {
    let (main, application) = runtimes();
    let db = main.block_on(TestDatabase::new(backend));
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = application.block_on(async {
        let runtime = runtime_on(&db, backend, &calls).await;
        runtime.publish(&member_removed()).await.unwrap();
        runtime
    });
    // From here on the application's runtime runs nothing.
    main.block_on(async {
        publish_twenty(&runtime).await;
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

/// Publishes polled once in a `block_on` of a current-thread runtime and given up there (a
/// timeout), the runtime then left idle: their writes, queued to commit, commit all the same,
/// and the publishes made after them from another runtime are neither held behind them nor
/// wait for the idle runtime. The commits those writes started used to run on the idle
/// runtime, which never ran them again: with SQLite's one commit at a time every later write
/// of the store waited for the first, and on PostgreSQL each held one of its four.
fn a_publish_given_up_in_a_runtime_left_idle_holds_no_later_write(backend: Backend) {
    let (main, application) = runtimes();
    let db = main.block_on(TestDatabase::new(backend));
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = main.block_on(runtime_on(&db, backend, &calls));
    // Each polled once, as the first poll of a `block_on` whose timeout then gives it up,
    // without the application's runtime running a task meanwhile: its write is queued, and
    // the publish dropped. More of them than PostgreSQL's commits at once (four), each of
    // which such a publish held.
    {
        let _application = application.enter();
        for _ in 0..GIVEN_UP {
            let polled = runtime.publish(&member_removed()).now_or_never();
            assert!(polled.is_none(), "the publish waited for its commit");
        }
    }
    // From here on the application's runtime runs nothing.
    main.block_on(async {
        publish_twenty(&runtime).await;
        assert_eq!(
            db.inbox_rows().await,
            20 + GIVEN_UP,
            "the given-up publishes' writes committed too"
        );
        runtime.shutdown().await;
    });
    assert_eq!(calls.count(), 20);
    drop(application);
}

#[test]
fn a_publish_given_up_on_postgresql() {
    a_publish_given_up_in_a_runtime_left_idle_holds_no_later_write(Backend::Postgres);
}

#[test]
fn a_publish_given_up_on_sqlite() {
    a_publish_given_up_in_a_runtime_left_idle_holds_no_later_write(Backend::Sqlite);
}

/// As [`a_publish_given_up_in_a_runtime_left_idle_holds_no_later_write`], for batches: each
/// `publish_batch` is polled for a while (without the application's runtime running a task),
/// from a few microseconds to a few milliseconds, so that they are given up at every step of
/// their transaction — before it, holding SQLite's lock, committing. The end of each given-up
/// transaction, which SQLite's turn to write waits for, used to be spawned on the idle
/// runtime: every later write of the store waited for good. Whole batches or none are stored.
fn a_batch_given_up_in_a_runtime_left_idle_holds_no_later_write(backend: Backend) {
    let (main, application) = runtimes();
    let db = main.block_on(TestDatabase::new(backend));
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = main.block_on(runtime_on(&db, backend, &calls));
    let mut completed = 0;
    {
        let _application = application.enter();
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        for micros in [10, 100, 300, 600, 1_000, 1_500, 2_000, 3_000, 5_000, 8_000] {
            let batch = [member_removed(), member_removed(), member_removed()];
            let mut publish = Box::pin(runtime.publish_batch(&batch));
            let polled_for = std::time::Instant::now();
            while polled_for.elapsed() < Duration::from_micros(micros) {
                if publish.as_mut().poll(&mut context).is_ready() {
                    completed += 1;
                    break;
                }
            }
        }
    }
    assert!(completed < 10, "some batches were given up");
    main.block_on(async {
        publish_twenty(&runtime).await;
        let rows = db.inbox_rows().await;
        assert!(
            (rows - 20) % 3 == 0 && (rows - 20) / 3 >= completed,
            "{rows} rows, {completed} batches completed: whole batches or none"
        );
        runtime.shutdown().await;
    });
    drop(application);
}

#[test]
fn a_batch_given_up_on_postgresql() {
    a_batch_given_up_in_a_runtime_left_idle_holds_no_later_write(Backend::Postgres);
}

#[test]
fn a_batch_given_up_on_sqlite() {
    a_batch_given_up_in_a_runtime_left_idle_holds_no_later_write(Backend::Sqlite);
}

/// Batches published from a runtime that then stays idle, eight at once, so that the store's
/// pool opens connections for them: the connections, and their way back to the pool, are
/// not left to that runtime, which would have to run for the runtime's later statements on
/// them to be answered.
fn batches_from_a_runtime_then_left_idle_leave_no_connection_to_it(backend: Backend) {
    let (main, application) = runtimes();
    let db = main.block_on(TestDatabase::new(backend));
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = main.block_on(runtime_on(&db, backend, &calls));
    application.block_on(async {
        let batches = (0..8).map(|_| {
            let runtime = &runtime;
            async move {
                let batch = [member_removed(), member_removed(), member_removed()];
                runtime.publish_batch(&batch).await.unwrap();
            }
        });
        futures::future::join_all(batches).await;
    });
    // From here on the application's runtime runs nothing.
    main.block_on(async {
        for _ in 0..5 {
            publish_twenty(&runtime).await;
        }
        assert_eq!(db.inbox_rows().await, 24 + 100);
        runtime.shutdown().await;
    });
    assert_eq!(calls.count(), 124);
    drop(application);
}

#[test]
fn batches_then_idle_on_postgresql() {
    batches_from_a_runtime_then_left_idle_leave_no_connection_to_it(Backend::Postgres);
}

#[test]
fn batches_then_idle_on_sqlite() {
    batches_from_a_runtime_then_left_idle_leave_no_connection_to_it(Backend::Sqlite);
}
