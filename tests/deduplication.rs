//! Logical deduplication: one intent, one effect, within the window — per handler, required by
//! default, released when the handler fails, loud when it cannot be enforced.

#[path = "support/messages.rs"]
mod support;
#[path = "support/counting_claims.rs"]
mod support_claims;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use dacapo::ports::{Claim, ClaimOutcome, Claims, Clock};
use dacapo::prelude::*;
use dacapo::store::MemoryClaims;
use dacapo::testing::{Fault, TestHarness};
use dacapo::{DeadLetterReason, FailureKind, Outcome};
use serde::{Deserialize, Serialize};
use support::{Counter, MemberRemoved};
use support_claims::CountingClaims;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct RebuildProjection {
    projection: String,
    occurrence: String,
}

impl Message for RebuildProjection {
    const TYPE: &'static str = "projections.rebuild";
}

fn rebuild(projection: &str) -> RebuildProjection {
    RebuildProjection {
        projection: projection.into(),
        occurrence: "2026-11-30T03:00:00Z".into(),
    }
}

fn keyed(id: &str) -> SendOptions {
    SendOptions::new().deduplication_id(id)
}

fn harness(module: Module) -> TestHarness {
    TestHarness::builder()
        .configure(RuntimeBuilder::enable_deduplication)
        .module(module)
        .build()
        .unwrap()
}

use dacapo::RuntimeBuilder;

#[tokio::test]
async fn a_duplicate_intent_within_the_window_never_reaches_the_handler() {
    let effects = Counter::default();
    let harness = harness(
        Module::new("projections")
            .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
            .deduplicate("rebuild", Deduplication::from_envelope()),
    );
    // Three deliveries of one intent: an operator double-click and a console republish.
    for _ in 0..3 {
        let report = harness
            .publish_with(&rebuild("orders"), keyed("orders|03:00"))
            .await
            .unwrap();
        assert!(report.is_handled(), "a duplicate is discarded, not failed");
    }
    let other = harness
        .publish_with(&rebuild("orders"), keyed("orders|04:00"))
        .await
        .unwrap();
    assert!(other.is_handled());
    assert_eq!(effects.count(), 2, "one effect per logical id");
}

#[tokio::test]
async fn claims_are_per_handler() {
    let (a, b) = (Counter::default(), Counter::default());
    let harness = harness(
        Module::new("projections")
            .handle_named::<RebuildProjection, _>("a", a.clone())
            .handle_named::<RebuildProjection, _>("b", b.clone())
            .deduplicate("a", Deduplication::from_envelope())
            .deduplicate("b", Deduplication::from_envelope()),
    );
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(
        (a.count(), b.count()),
        (1, 1),
        "neither handler took the other's claim"
    );
}

#[tokio::test]
async fn a_message_without_a_required_id_is_dead_lettered_with_a_clear_reason() {
    let effects = Counter::default();
    let harness = harness(
        Module::new("projections")
            .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
            .deduplicate("rebuild", Deduplication::from_envelope()),
    );
    let report = harness.publish(&rebuild("orders")).await.unwrap();
    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::MissingDeduplicationId(
            "projections/rebuild".into()
        ))
    );
    assert_eq!(
        DeadLetterReason::MissingDeduplicationId("projections/rebuild".into()).to_string(),
        "missing deduplication id (required by projections/rebuild)"
    );
    assert_eq!(effects.count(), 0);
}

#[tokio::test]
async fn optional_deduplication_costs_unkeyed_messages_no_store_round_trip() {
    let claims = Arc::new(CountingClaims::default());
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(|runtime| {
            runtime
                .enable_deduplication()
                .claims(Arc::clone(&claims) as Arc<dyn Claims>)
        })
        .module(
            Module::new("orders")
                .handle_named::<RebuildProjection, _>("create", effects.clone())
                .deduplicate("create", Deduplication::from_envelope().optional()),
        )
        .build()
        .unwrap();
    for _ in 0..3 {
        assert!(
            harness
                .publish(&rebuild("unkeyed"))
                .await
                .unwrap()
                .is_handled()
        );
    }
    assert_eq!(
        claims.calls(),
        0,
        "unkeyed: handled as if the feature were off"
    );
    assert_eq!(effects.count(), 3);
    harness
        .publish_with(&rebuild("keyed"), keyed("k"))
        .await
        .unwrap();
    harness
        .publish_with(&rebuild("keyed"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(claims.calls(), 2, "keyed: one claim each");
    assert_eq!(effects.count(), 4);
}

#[tokio::test]
async fn a_failed_handler_releases_its_claim_so_the_work_happens_exactly_once() {
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(RuntimeBuilder::enable_deduplication)
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .fault("projections", "rebuild", Fault::fail_times(1))
        .build()
        .unwrap();
    let report = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert!(report.is_handled());
    assert_eq!(
        report.attempts, 2,
        "the retry was not discarded as a duplicate of its own failure"
    );
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(effects.count(), 1);
}

/// Fails while broken; counts its successes.
#[derive(Clone, Default)]
struct Flaky {
    broken: Arc<std::sync::atomic::AtomicBool>,
    effects: Counter,
}

impl Handler<RebuildProjection> for Flaky {
    async fn handle(
        &self,
        message: &RebuildProjection,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        if self.broken.load(Ordering::SeqCst) {
            return Err("the projection store is down".into());
        }
        self.effects.handle(message, context).await
    }
}

/// A harness whose deduplicated `projections/rebuild` is `handler`, retried `retry_limit`
/// times.
fn rebuilding(
    handler: impl Handler<RebuildProjection>,
    retry_limit: u32,
) -> dacapo::testing::TestHarnessBuilder {
    TestHarness::builder()
        .configure(RuntimeBuilder::enable_deduplication)
        .retry_policy(RetryPolicy {
            retry_limit,
            ..RetryPolicy::default()
        })
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", handler)
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
}

#[tokio::test]
async fn a_claim_is_released_when_the_message_is_dead_lettered() {
    let flaky = Flaky::default();
    flaky.broken.store(true, Ordering::SeqCst);
    let harness = rebuilding(flaky.clone(), 1).build().unwrap();
    let dead = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert!(matches!(
        dead.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    ));
    // The intent was never carried out, so a new delivery of it gets through.
    flaky.broken.store(false, Ordering::SeqCst);
    let again = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert!(again.is_handled());
    assert_eq!(flaky.effects.count(), 1);
}

#[tokio::test]
async fn a_handler_asking_for_deduplication_on_a_runtime_without_it_fails_clearly() {
    let (deduplicated, plain) = (Counter::default(), Counter::default());
    let harness = TestHarness::builder()
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", deduplicated.clone())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .module(Module::new("orders").handle_named::<MemberRemoved, _>("plain", plain.clone()))
        .build()
        .expect("the rest of the runtime starts");
    let report = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::Permanent)
    );
    let failure = &report.failures[0].failures[0];
    assert_eq!(failure.kind, FailureKind::Permanent);
    assert!(
        failure.error.contains("which this runtime has not enabled"),
        "{}",
        failure.error
    );
    assert_eq!(deduplicated.count(), 0);
    assert!(
        harness
            .publish(&support::member_removed())
            .await
            .unwrap()
            .is_handled()
    );
    assert_eq!(plain.count(), 1);
}

/// A store that cannot enforce claims: it keeps the port's defaults.
struct CannotEnforce;

impl Claims for CannotEnforce {}

#[tokio::test]
async fn a_store_that_cannot_enforce_claims_never_answers_new() {
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(|runtime| {
            runtime
                .enable_deduplication()
                .claims(Arc::new(CannotEnforce))
        })
        .retry_policy(RetryPolicy::no_retries())
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .build()
        .unwrap();
    let report = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert!(matches!(report.outcome, Outcome::DeadLettered(_)));
    assert!(
        report.failures[0].failures[0]
            .error
            .contains("cannot enforce deduplication claims")
    );
    assert_eq!(effects.count(), 0);
}

#[derive(Clone)]
struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap()
    }
}

#[tokio::test]
async fn past_the_window_the_same_id_is_accepted_again_even_before_the_reaper_runs() {
    let clock = ManualClock(Arc::new(Mutex::new(Utc::now())));
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(|runtime| {
            runtime
                .enable_deduplication()
                .deduplication_window(Duration::from_secs(3600))
                .deduplication_reap_interval(Duration::from_secs(365 * 24 * 3600))
                .clock(Arc::new(clock.clone()))
        })
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .build()
        .unwrap();
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    *clock.0.lock().unwrap() += chrono::Duration::minutes(59);
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(effects.count(), 1, "within the window");
    *clock.0.lock().unwrap() += chrono::Duration::minutes(2);
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(
        effects.count(),
        2,
        "the window is the guarantee, not the reaper"
    );
}

/// Moves on a millisecond each time it is read, so that every reaping round has a `now` of its
/// own, and jumps when told.
#[derive(Clone)]
struct TickingClock(Arc<Mutex<DateTime<Utc>>>);

impl Clock for TickingClock {
    fn now(&self) -> DateTime<Utc> {
        let mut now = self.0.lock().unwrap();
        *now += chrono::Duration::milliseconds(1);
        *now
    }
}

/// Delegates to memory and records every reap: its `now`, its limit, and how many it removed.
#[derive(Default)]
struct RecordedReaps {
    inner: MemoryClaims,
    reaps: Mutex<Vec<(DateTime<Utc>, usize, u64)>>,
}

#[async_trait]
impl Claims for RecordedReaps {
    async fn provision(&self) -> Result<(), dacapo::EngineError> {
        Ok(())
    }
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, dacapo::EngineError> {
        self.inner.claim(claim).await
    }
    async fn release(&self, claim: &Claim) -> Result<(), dacapo::EngineError> {
        self.inner.release(claim).await
    }
    async fn complete(
        &self,
        claim: &Claim,
        cascaded: &[dacapo::Envelope],
    ) -> Result<bool, dacapo::EngineError> {
        self.inner.complete(claim, cascaded).await
    }
    async fn reap(&self, now: DateTime<Utc>, limit: usize) -> Result<u64, dacapo::EngineError> {
        let removed = self.inner.reap(now, limit).await?;
        self.reaps.lock().unwrap().push((now, limit, removed));
        Ok(removed)
    }
}

/// Takes five claims, lets them expire, and returns the first reaping round that removed any:
/// each statement's limit and how many it removed.
async fn first_reaping_round(batch: usize) -> Vec<(usize, u64)> {
    let clock = TickingClock(Arc::new(Mutex::new(Utc::now())));
    let claims = Arc::new(RecordedReaps::default());
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(|runtime| {
            runtime
                .enable_deduplication()
                .claims(Arc::clone(&claims) as Arc<dyn Claims>)
                .clock(Arc::new(clock.clone()))
                .deduplication_window(Duration::from_secs(3600))
                .deduplication_reap_interval(Duration::from_secs(60))
                .deduplication_reap_batch(batch)
        })
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .build()
        .unwrap();
    for key in ["a", "b", "c", "d", "e"] {
        harness
            .publish_with(&rebuild("orders"), keyed(key))
            .await
            .unwrap();
    }
    assert_eq!(effects.count(), 5);
    *clock.0.lock().unwrap() += chrono::Duration::hours(2);
    // The first reaping round comes at 60 s of the runtime's clock, which moves by itself
    // only for deliveries: `advance` moves it there, and returns once the round is over.
    harness.advance(Duration::from_secs(60)).await.unwrap();
    let round = {
        let reaps = claims.reaps.lock().unwrap();
        let now = reaps
            .iter()
            .find(|reap| reap.2 > 0)
            .expect("a reaping round removed the expired claims")
            .0;
        reaps
            .iter()
            .filter(|reap| reap.0 == now)
            .map(|reap| (reap.1, reap.2))
            .collect::<Vec<_>>()
    };
    harness.shutdown().await;
    round
}

#[tokio::test]
async fn expired_claims_are_reaped_in_configured_batches_until_one_comes_back_short() {
    assert_eq!(first_reaping_round(2).await, [(2, 2), (2, 2), (2, 1)]);
}

#[tokio::test]
async fn a_reap_batch_of_zero_is_taken_as_one_and_the_round_still_ends() {
    assert_eq!(
        first_reaping_round(0).await,
        [(1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 0)]
    );
}

#[tokio::test]
async fn the_id_can_come_from_the_message_or_a_header() {
    let (by_key, by_header) = (Counter::default(), Counter::default());
    let harness = harness(
        Module::new("projections")
            .handle_named::<RebuildProjection, _>("by_key", by_key.clone())
            .handle_named::<RebuildProjection, _>("by_header", by_header.clone())
            .deduplicate(
                "by_key",
                Deduplication::by_key(|m: &RebuildProjection| {
                    Some(format!("{}|{}", m.projection, m.occurrence))
                }),
            )
            .deduplicate(
                "by_header",
                Deduplication::from_header("idempotency-key").optional(),
            ),
    );
    let header = |key: &str| SendOptions::new().header("idempotency-key", key);
    harness
        .publish_with(&rebuild("orders"), header("h1"))
        .await
        .unwrap();
    harness
        .publish_with(&rebuild("orders"), header("h1"))
        .await
        .unwrap();
    harness
        .publish_with(&rebuild("invoices"), header("h2"))
        .await
        .unwrap();
    assert_eq!(by_key.count(), 2, "keyed on projection and occurrence");
    assert_eq!(by_header.count(), 2, "keyed on the header");
}

#[tokio::test]
async fn a_claimed_id_with_a_different_payload_is_discarded_or_dead_lettered_as_a_conflict() {
    let (logged, strict) = (Counter::default(), Counter::default());
    let harness = harness(
        Module::new("projections")
            .handle_named::<RebuildProjection, _>("logged", logged.clone())
            .handle_named::<RebuildProjection, _>("strict", strict.clone())
            .deduplicate("logged", Deduplication::from_envelope())
            .deduplicate(
                "strict",
                Deduplication::from_envelope().dead_letter_conflicts(),
            ),
    );
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    let conflict = harness
        .publish_with(&rebuild("invoices"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(
        conflict.outcome,
        Outcome::DeadLettered(DeadLetterReason::Permanent)
    );
    let failures = &conflict.failures[0].failures;
    assert_eq!(
        failures.len(),
        1,
        "only the strict handler reports the conflict"
    );
    assert_eq!(&*failures[0].handler, "strict");
    assert!(failures[0].error.contains("claimed by a different payload"));
    assert_eq!((logged.count(), strict.count()), (1, 1));
}

#[tokio::test]
async fn a_policy_opts_matching_handlers_in() {
    let (create, other) = (Counter::default(), Counter::default());
    let harness = TestHarness::builder()
        .configure(|runtime| {
            runtime.enable_deduplication().require_deduplication(
                |id, _message_type| id.name.starts_with("create"),
                Deduplication::from_envelope(),
            )
        })
        .module(
            Module::new("orders")
                .handle_named::<RebuildProjection, _>("create_order", create.clone())
                .handle_named::<RebuildProjection, _>("notify", other.clone()),
        )
        .build()
        .unwrap();
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!((create.count(), other.count()), (1, 2));
}

#[test]
fn deduplicating_a_handler_the_module_does_not_have_is_refused() {
    let result = Runtime::builder()
        .enable_deduplication()
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", Counter::default())
                .deduplicate("rebiuld", Deduplication::from_envelope()),
        )
        .build();
    let Err(dacapo::Error::Registry(error)) = result else {
        panic!("expected a registry error")
    };
    assert_eq!(
        error.to_string(),
        "module projections has no handler rebiuld to deduplicate"
    );
}

#[tokio::test]
async fn a_retry_of_the_same_message_is_not_counted_as_a_duplicate_intent() {
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .configure(RuntimeBuilder::enable_deduplication)
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("rebuild", effects.clone())
                .handle_named::<RebuildProjection, _>("notify", Counter::default())
                .deduplicate("rebuild", Deduplication::from_envelope()),
        )
        .fault("projections", "notify", Fault::fail_times(1))
        .build()
        .unwrap();
    let report = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert!(report.is_handled());
    assert_eq!(report.attempts, 2, "the sibling failed the first attempt");
    assert_eq!(
        effects.count(),
        1,
        "its own completed claim skips the rerun"
    );
    assert_eq!(harness.runtime().stats().duplicate_intents, 0);
    let second = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(effects.count(), 1);
    assert_eq!(
        harness.runtime().stats().duplicate_intents,
        u64::from(second.attempts),
        "a new message with the same id is a duplicate, once per attempt it skipped the handler"
    );
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct ProjectionRebuilt {
    projection: String,
}

impl Message for ProjectionRebuilt {
    const TYPE: &'static str = "projections.rebuilt";
}

/// Rebuilds, then announces it.
#[derive(Clone, Default)]
struct RebuildAndAnnounce(Counter);

impl Handler<RebuildProjection> for RebuildAndAnnounce {
    async fn handle(
        &self,
        message: &RebuildProjection,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.0.handle(message, context).await?;
        context
            .publish(&ProjectionRebuilt {
                projection: message.projection.clone(),
            })
            .await?;
        Ok(())
    }
}

/// Without a store, `rebuild` completes its claim while a sibling fails the only attempt: the
/// delivery is dead-lettered, and its replay skips `rebuild`, whose claim is completed. What
/// `rebuild` announced therefore leaves with the completion, not with the delivery.
#[tokio::test]
async fn a_completed_handler_announces_even_when_its_delivery_is_dead_lettered_and_replayed() {
    let rebuild_handler = RebuildAndAnnounce::default();
    let announced = dacapo::testing::Recorder::<ProjectionRebuilt>::new();
    let sibling = Counter::default();
    let harness = rebuilding(rebuild_handler.clone(), 0)
        .module(
            Module::new("search").handle_named::<RebuildProjection, _>("reindex", sibling.clone()),
        )
        .module(Module::new("audit").handle_named::<ProjectionRebuilt, _>("log", announced.clone()))
        .fault("search", "reindex", Fault::fail_times(1))
        .build()
        .unwrap();
    let dead = harness
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    assert_eq!(
        dead.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    );
    harness.idle().await.unwrap();
    assert_eq!(announced.calls().len(), 1, "announced with the completion");
    harness
        .runtime()
        .dead_letters()
        .replay(dead.envelope_id)
        .await
        .unwrap();
    harness.idle().await.unwrap();
    assert_eq!(
        rebuild_handler.0.count(),
        1,
        "the replay skipped the completed handler"
    );
    assert_eq!(sibling.count(), 1, "the sibling ran on the replay");
    assert_eq!(announced.calls().len(), 1, "announced once");
}

#[tokio::test]
async fn a_key_function_that_panics_dead_letters_its_message_and_the_runtime_goes_on() {
    // The application's own code, run before any handler: its panic must not leave the
    // delivery unsettled for ever (idle never returning, a shutdown waiting out its drain).
    let effects = Counter::default();
    let runtime = Runtime::builder()
        .enable_deduplication()
        .module(
            Module::new("projections")
                .handle_named::<RebuildProjection, _>("h", effects.clone())
                .deduplicate(
                    "h",
                    Deduplication::by_key(|m: &RebuildProjection| {
                        assert_ne!(m.projection, "poison", "no key for a poison message");
                        Some(m.projection.clone())
                    }),
                ),
        )
        .build()
        .unwrap();
    let poison = runtime.publish(&rebuild("poison")).await.unwrap();
    runtime.publish(&rebuild("orders")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), runtime.idle())
        .await
        .expect("every delivery settled");
    assert_eq!(effects.count(), 1);
    let letters = runtime.dead_letters().list().await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].envelope.id, poison);
    assert!(
        matches!(&letters[0].reason, dacapo::DeadLetterReason::MalformedPayload(why)
            if why.contains("panicked") && why.contains("no key for a poison message")),
        "{}",
        letters[0].reason
    );
    assert!(runtime.shutdown().await.is_clean());
}

/// Claims whose store is down while `down` is set; counts the claims it refused.
struct DownAtFirst {
    down: std::sync::atomic::AtomicBool,
    refused: std::sync::atomic::AtomicUsize,
    inner: MemoryClaims,
}

#[async_trait]
impl Claims for DownAtFirst {
    async fn provision(&self) -> Result<(), dacapo::EngineError> {
        self.inner.provision().await
    }
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, dacapo::EngineError> {
        if self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(dacapo::EngineError::store("the claims' store is down"));
        }
        self.inner.claim(claim).await
    }
    async fn release(&self, claim: &Claim) -> Result<(), dacapo::EngineError> {
        self.inner.release(claim).await
    }
    async fn complete(
        &self,
        claim: &Claim,
        cascaded: &[dacapo::Envelope],
    ) -> Result<bool, dacapo::EngineError> {
        self.inner.complete(claim, cascaded).await
    }
}

/// A claim the store cannot take yet (unreachable, a failover) is tried again within the
/// attempt, as the delivery's own writes are: no handler ran, so no attempt is spent on it,
/// and an outage longer than the retry policy's budget does not dead-letter the intent.
#[tokio::test]
async fn a_claim_the_store_cannot_take_yet_is_tried_again_without_spending_an_attempt() {
    let claims = Arc::new(DownAtFirst {
        down: true.into(),
        refused: 0.into(),
        inner: MemoryClaims::default(),
    });
    let effects = Counter::default();
    let harness = TestHarness::builder()
        .retry_policy(RetryPolicy::no_retries())
        .configure(|runtime| {
            runtime
                .enable_deduplication()
                .claims(Arc::clone(&claims) as Arc<dyn Claims>)
        })
        .module(
            Module::new("orders")
                .handle_named::<RebuildProjection, _>("create", effects.clone())
                .deduplicate("create", Deduplication::from_envelope()),
        )
        .build()
        .unwrap();
    // The store comes back once it refused three claims.
    let back = async {
        tokio::time::timeout(Duration::from_secs(20), async {
            while claims.refused.load(Ordering::SeqCst) < 3 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the claim is asked again while the store is down");
        claims.down.store(false, Ordering::SeqCst);
    };
    let message = rebuild("keyed");
    let (report, ()) = tokio::join!(harness.publish_with(&message, keyed("k")), back);
    let report = report.unwrap();
    assert!(report.is_handled(), "{:?}", report.outcome);
    assert_eq!(report.attempts, 1);
    assert_eq!(effects.count(), 1);
}

/// A handler whose first call waits for `gate`; counts its calls.
#[derive(Clone)]
struct FirstWaits {
    calls: Arc<std::sync::atomic::AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Default for FirstWaits {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl Handler<RebuildProjection> for FirstWaits {
    async fn handle(&self, _: &RebuildProjection, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.gate.acquire().await?.forget();
        }
        Ok(())
    }
}

/// A claim that lands after an outage holds its whole window from then. Stamped at its first
/// try, it landed already old, and a duplicate arriving while its handler ran found it
/// expired and ran beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_lands_after_an_outage_holds_its_whole_window_from_then() {
    let clock = ManualClock(Arc::new(Mutex::new(Utc::now())));
    let claims = Arc::new(DownAtFirst {
        down: true.into(),
        refused: 0.into(),
        inner: MemoryClaims::default(),
    });
    let handler = FirstWaits::default();
    let runtime = Runtime::builder()
        .clock(Arc::new(clock.clone()))
        .enable_deduplication()
        .deduplication_window(Duration::from_secs(60))
        .claims(Arc::clone(&claims) as Arc<dyn Claims>)
        .module(
            Module::new("orders")
                .handle_named::<RebuildProjection, _>("create", handler.clone())
                .deduplicate("create", Deduplication::from_envelope()),
        )
        .build()
        .unwrap();
    let until = async |what: &str, done: &dyn Fn() -> bool| {
        tokio::time::timeout(Duration::from_secs(20), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what} within 20 s"));
    };
    runtime
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    until("the store refuses a claim", &|| {
        claims.refused.load(Ordering::SeqCst) > 0
    })
    .await;
    // The outage outlasts the window; the claim lands as it ends.
    *clock.0.lock().unwrap() += chrono::Duration::seconds(61);
    claims.down.store(false, Ordering::SeqCst);
    until("the handler runs", &|| {
        handler.calls.load(Ordering::SeqCst) == 1
    })
    .await;

    runtime
        .publish_with(&rebuild("orders"), keyed("k"))
        .await
        .unwrap();
    until("the second copy is told apart", &|| {
        runtime.stats().duplicate_intents == 1 || handler.calls.load(Ordering::SeqCst) == 2
    })
    .await;
    handler.gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .expect("both settle");
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1,
        "one effect of one intent"
    );
    assert_eq!(runtime.stats().duplicate_intents, 1);
    runtime.shutdown().await;
}
