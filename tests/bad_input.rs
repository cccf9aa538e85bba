//! Bad input gets a clear reason and loses nothing: dead letters, not panics or silent drops.

#[path = "support/messages.rs"]
mod support;

use dacapo::prelude::*;
use dacapo::testing::TestHarness;
use dacapo::{DeadLetterReason, DiscardReason, Error, Outcome, UnknownMessageTypes};
use std::time::Duration;
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

    let Error::TooLarge {
        envelope,
        size,
        limit,
    } = error
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
    let Error::NoRoute(envelope) = error else {
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

/// A timeout of zero, the runtime's default or a module's, times every handler out at its
/// first await: refused at build, not found out as every message is dead-lettered.
#[test]
fn a_handler_timeout_of_zero_is_refused() {
    let refused = [
        Runtime::builder()
            .handler_timeout(Duration::ZERO)
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
            .build(),
        Runtime::builder()
            .module(
                Module::new("m")
                    .handle_named::<MemberRemoved, _>("h", Counter::default())
                    .handler_timeout(Duration::ZERO),
            )
            .build(),
    ];
    for result in refused {
        let Err(Error::Registry(error)) = result else {
            panic!("expected a registry error");
        };
        assert!(
            error.to_string().contains("m/h has a timeout of zero"),
            "{error}"
        );
    }
    // A module's own timeout stands in for a default of zero.
    let module_decides = Runtime::builder()
        .handler_timeout(Duration::ZERO)
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("h", Counter::default())
                .handler_timeout(Duration::from_secs(1)),
        )
        .build();
    assert!(module_decides.is_ok());
}

/// A deduplication window no longer than a handler's timeout would let a claim expire while
/// its handler runs, and the same logical id run again beside it: refused at build.
#[test]
fn a_deduplication_window_within_a_handler_timeout_is_refused() {
    let with_window = |window, module_timeout: Option<Duration>| {
        let module = Module::new("m")
            .handle_named::<MemberRemoved, _>("h", Counter::default())
            .deduplicate("h", Deduplication::from_envelope());
        Runtime::builder()
            .enable_deduplication()
            .deduplication_window(window)
            .module(match module_timeout {
                Some(timeout) => module.handler_timeout(timeout),
                None => module,
            })
            .build()
    };
    for (window, module_timeout) in [
        (Duration::ZERO, None),
        (Duration::from_secs(30), None),
        (Duration::from_secs(3600), Some(Duration::from_secs(7200))),
    ] {
        let Err(Error::Configuration(error)) = with_window(window, module_timeout) else {
            panic!("a window of {window:?} is refused");
        };
        assert!(error.contains("m/h's is"), "{error}");
    }
    assert!(with_window(Duration::from_secs(31), None).is_ok());
    // A handler that does not deduplicate holds no claim: its timeout does not count.
    let other_handler = Runtime::builder()
        .enable_deduplication()
        .deduplication_window(Duration::from_secs(3600))
        .module(
            Module::new("m")
                .handle_named::<MemberRemoved, _>("h", Counter::default())
                .deduplicate("h", Deduplication::from_envelope()),
        )
        .module(
            Module::new("reports")
                .handle_named::<MemberRemoved, _>("nightly", Counter::default())
                .handler_timeout(Duration::from_secs(7200)),
        )
        .build();
    assert!(other_handler.is_ok(), "{other_handler:?}");
    // Without deduplication the window is not used.
    let unused = Runtime::builder()
        .deduplication_window(Duration::ZERO)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Counter::default()))
        .build();
    assert!(unused.is_ok());
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
fn a_fault_for_an_unknown_handler_is_refused_naming_the_registered_ones() {
    let result = TestHarness::builder()
        .module(
            Module::new("billing")
                .handle_named::<MemberRemoved, _>("charge", Counter::default())
                .handle_named::<MemberRemoved, _>("refund", Counter::default()),
        )
        .fault("billing", "chrage", dacapo::testing::Fault::always_fail())
        .build();
    let Err(error @ Error::UnknownHandler { .. }) = result else {
        panic!("expected UnknownHandler");
    };
    assert_eq!(
        error.to_string(),
        "no handler billing/chrage is registered; the registered ones are: billing/charge, \
         billing/refund"
    );
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Untyped;

impl Message for Untyped {
    const TYPE: &'static str = "";
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Spaced;

impl Message for Spaced {
    const TYPE: &'static str = "billing charge";
}

#[derive(serde::Serialize, serde::Deserialize)]
struct LongNamed;

impl Message for LongNamed {
    const TYPE: &'static str = concat!(
        "a.type.name.that.goes.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.",
        "on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.",
        "and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.on.and.",
        "on.and.on.and.on.and.on.and.on"
    );
}

struct Ignores;

impl<M: Message> Handler<M> for Ignores {
    async fn handle(&self, _: &M, _: &MessageContext) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[test]
fn a_message_type_name_that_is_empty_too_long_or_spaced_is_refused_at_build() {
    assert!(LongNamed::TYPE.len() > dacapo::MAX_MESSAGE_TYPE_LEN);
    let refused = [
        Runtime::builder()
            .module(Module::new("m").handle::<Untyped, _>(Ignores))
            .build(),
        Runtime::builder()
            .module(Module::new("m").handle::<Spaced, _>(Ignores))
            .build(),
        Runtime::builder()
            .module(Module::new("m").handle::<LongNamed, _>(Ignores))
            .build(),
    ];
    for result in refused {
        let Err(Error::Registry(error)) = result else {
            panic!("expected a registry error");
        };
        assert!(
            error.to_string().contains("a type name is 1 to 255 bytes"),
            "{error}"
        );
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Tiny;

impl Message for Tiny {
    const TYPE: &'static str = concat!(
        "tiny.payload.with.a.long.type.name.long.type.name.long.type.name.long.type.name.",
        "long.type.name.long.type.name.long.type.name"
    );
}

#[tokio::test]
async fn the_size_limit_counts_the_type_name() {
    let runtime = Runtime::builder()
        .max_envelope_size(64)
        .module(Module::new("m").handle::<Tiny, _>(Ignores))
        .build()
        .unwrap();
    // The payload (`null`) is 4 bytes; the type name is over the limit by itself.
    let error = runtime.publish(&Tiny).await.unwrap_err();
    let Error::TooLarge { size, limit, .. } = &error else {
        panic!("expected TooLarge, got {error}");
    };
    assert_eq!((*size, *limit), (Tiny::TYPE.len() + 4, 64));
    assert!(!error.is_retryable());
    assert_eq!(error.into_envelope().unwrap().message_type, Tiny::TYPE);
    runtime.shutdown().await;
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Blob(String);

impl Message for Blob {
    const TYPE: &'static str = "tests.blob";
}

#[tokio::test]
async fn an_error_that_hands_back_a_large_envelope_prints_its_size_not_its_bytes() {
    let runtime = Runtime::builder()
        .max_envelope_size(1024)
        .module(Module::new("m").handle::<Blob, _>(Ignores))
        .build()
        .unwrap();
    let blob = Blob("x".repeat(2 * 1024 * 1024));
    let error = runtime.publish(&blob).await.unwrap_err();
    let debug = format!("{error:?}");
    assert!(debug.len() < 2_000, "{} bytes of Debug", debug.len());
    let payload = serde_json::to_vec(&blob).unwrap();
    assert!(
        debug.contains(&format!("<{} bytes>", payload.len())),
        "{debug}"
    );
    runtime.shutdown().await;
}

#[tokio::test]
async fn an_empty_sqlite_path_is_refused() {
    for path in ["", "sqlite:", "sqlite://", "  "] {
        let error = dacapo::store::SqliteStore::open(path).await.unwrap_err();
        assert!(
            matches!(&error, Error::Configuration(text) if text.contains("empty SQLite path")),
            "{path:?}: {error}"
        );
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_url_that_is_not_postgresql_is_refused_by_postgres_store() {
    for url in [
        "mysql://root@127.0.0.1/app",
        "sqlite://app.db",
        "127.0.0.1:5432",
    ] {
        let error = dacapo::store::PostgresStore::connect(url)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, Error::Configuration(text) if text.contains("is not a PostgreSQL URL")),
            "{url}: {error}"
        );
        assert!(!error.is_retryable());
    }
    let unreachable = dacapo::store::PostgresStore::connect("postgres://app:pw@127.0.0.1:1/app")
        .await
        .unwrap_err();
    assert!(unreachable.is_retryable(), "{unreachable}");
    let text = unreachable.to_string();
    assert!(
        text.contains("127.0.0.1:1") && !text.contains(":pw@"),
        "{text}"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn an_interval_of_zero_is_refused_with_its_name() {
    use std::time::Duration;
    let zero = Duration::ZERO;
    for (builder, name) in [
        (
            Runtime::builder().recovery_interval(zero),
            "recovery_interval",
        ),
        (Runtime::builder().relay_interval(zero), "relay_interval"),
        (
            Runtime::builder().cleanup_interval(zero),
            "cleanup_interval",
        ),
        (
            Runtime::builder().deduplication_reap_interval(zero),
            "deduplication_reap_interval",
        ),
    ] {
        let error = builder.build().expect_err("refused");
        assert!(
            matches!(&error, Error::Configuration(text) if text.starts_with(name)),
            "{name}: {error}"
        );
    }
    let scratch = dacapo::testing::ScratchDatabase::sqlite();
    let store = scratch.sqlite_store().await.unwrap().node_timeout(zero);
    let error = Runtime::builder()
        .store(store)
        .build()
        .expect_err("refused");
    assert!(
        matches!(&error, Error::Configuration(text) if text.contains("node_timeout")),
        "{error}"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn intervals_too_long_to_add_to_the_clock_are_waited_out_not_a_panic() {
    use std::time::Duration;
    let scratch = dacapo::testing::ScratchDatabase::sqlite();
    let store = scratch
        .sqlite_store()
        .await
        .unwrap()
        .node_id("forever")
        .node_timeout(Duration::MAX);
    let pool = store.pool().clone();
    let counter = Counter::default();
    let runtime = Runtime::builder()
        .store(store)
        .recovery_interval(Duration::MAX)
        .relay_interval(Duration::MAX)
        .cleanup_interval(Duration::MAX)
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", counter.clone()),
        )
        .build()
        .unwrap();
    // The node's hold, with a wait as long as its timeout.
    runtime.publish(&member_removed()).await.unwrap();
    // The relay, with a lease ten times its interval.
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    runtime
        .outbox()
        .enlist(&mut tx, &member_removed())
        .await
        .unwrap();
    runtime.outbox().commit(tx).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        while counter.count() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both handled");
    runtime.shutdown().await;
}

/// Panics when dropped: a handler local whose destructor insists on being completed.
struct PanicsWhenDropped;

impl Drop for PanicsWhenDropped {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("dropped before it was completed");
        }
    }
}

/// Hangs holding a [`PanicsWhenDropped`] on its first call, succeeds on the next.
#[derive(Clone, Default)]
struct HangsHoldingABomb {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Handler<MemberRemoved> for HangsHoldingABomb {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            let _bomb = PanicsWhenDropped;
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// A timed-out handler's future is dropped, and its locals with it: a destructor that panics
/// there is caught, like a panic while it runs, instead of taking the arbiter's thread and the
/// delivery with it (the retry never came before). Real time: on the harness's virtual clock a
/// handler waiting on its own future holds the clock still.
#[tokio::test]
async fn a_handler_whose_future_panics_when_dropped_at_its_timeout_is_retried() {
    let handler = HangsHoldingABomb::default();
    let runtime = Runtime::builder()
        .handler_timeout(Duration::from_millis(50))
        .retry_policy(RetryPolicy {
            min_retry_interval: Duration::from_millis(10),
            ..RetryPolicy::default()
        })
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", handler.clone()))
        .build()
        .unwrap();

    let id = runtime.publish(&member_removed()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), runtime.idle())
        .await
        .expect("the delivery settled");

    assert_eq!(handler.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(
        matches!(
            runtime.dead_letters().inspect(id).await,
            Err(Error::DeadLetterNotFound(_))
        ),
        "the retry handled it"
    );
    let report = runtime.shutdown().await;
    assert!(report.pending_retries.is_empty());
}

/// An error whose `Display` returns `Err`, or panics, and whose destructor panics.
#[derive(Debug)]
struct UnprintableError {
    display_panics: bool,
}

impl std::fmt::Display for UnprintableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("partly written")?;
        if self.display_panics {
            panic!("the error cannot say what it is");
        }
        Err(std::fmt::Error)
    }
}

impl std::error::Error for UnprintableError {}

impl Drop for UnprintableError {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("the error's destructor panics");
        }
    }
}

/// Fails permanently (so its message is dead-lettered at once) with an [`UnprintableError`].
#[derive(Clone)]
struct FailsUnprintably {
    display_panics: bool,
}

impl Handler<MemberRemoved> for FailsUnprintably {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err(HandlerError::permanent(UnprintableError {
            display_panics: self.display_panics,
        }))
    }
}

/// The handler's error is read for its text by the runtime: a `Display` that fails or panics,
/// and a destructor that panics, are the handler's failure, not the end of its actor (which
/// left the delivery unsettled for good, its slot taken).
#[tokio::test]
async fn a_handler_error_that_cannot_be_displayed_or_dropped_still_dead_letters_its_message() {
    for display_panics in [false, true] {
        for deduplicated in [false, true] {
            // A deduplicated handler runs on a path of its own.
            let mut module = Module::new("m")
                .handle_named::<MemberRemoved, _>("h", FailsUnprintably { display_panics });
            if deduplicated {
                module = module.deduplicate("h", Deduplication::from_envelope());
            }
            let harness = TestHarness::builder()
                .configure(dacapo::RuntimeBuilder::enable_deduplication)
                .module(module)
                .build()
                .unwrap();
            let case = format!("display panics: {display_panics}, deduplicated: {deduplicated}");

            let report = harness
                .publish_with(
                    &member_removed(),
                    SendOptions::new().deduplication_id("one intent"),
                )
                .await
                .expect(&case);

            assert_eq!(
                report.outcome,
                Outcome::DeadLettered(DeadLetterReason::Permanent),
                "{case}"
            );
            let error = &report.failures[0].failures[0].error;
            let expected = if display_panics {
                "(the error's Display panicked)"
            } else {
                "partly written (the error's Display failed)"
            };
            assert_eq!(error, expected, "{case}");
        }
    }
}
