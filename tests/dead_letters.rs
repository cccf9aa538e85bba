//! Dead letters: list, inspect, replay with the same envelope id and a fresh count, purge.

#[path = "support/messages.rs"]
mod support;

use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, TestHarness};
use dacapo::{DeadLetterReason, DiscardReason, Error, Outcome};
use std::sync::Arc;
use std::time::Duration;
use support::{MemberRemoved, member_removed};
use uuid::Uuid;

fn harness(calls: &Recorder<MemberRemoved>) -> TestHarness {
    TestHarness::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 2,
            ..RetryPolicy::default()
        })
        .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", calls.clone()))
        // Three failures exhaust the policy; the fourth call, a replay, gets through.
        .fault("workspaces", "revoke", Fault::fail_times(3))
        .build()
        .unwrap()
}

#[tokio::test]
async fn dead_letters_can_be_listed_and_inspected() {
    let harness = harness(&Recorder::new());
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    );

    let list = harness.runtime().dead_letters().list().await.unwrap();
    assert_eq!(list.len(), 1);
    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(report.envelope_id)
        .await
        .unwrap();
    assert_eq!(dead, list[0]);
    assert_eq!(dead.envelope.id, report.envelope_id);
    assert_eq!(dead.attempts, 3);
    assert_eq!(
        dead.failures.iter().map(|f| f.attempt).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(dead.failures, report.failures);
}

#[tokio::test]
async fn a_replay_keeps_the_envelope_id_and_starts_a_fresh_attempt_count() {
    let calls = Recorder::new();
    let harness = harness(&calls);
    let report = harness.publish(&member_removed()).await.unwrap();
    let id = report.envelope_id;

    harness.runtime().dead_letters().replay(id).await.unwrap();
    harness.idle().await.unwrap();

    let calls = calls.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].message_id, Some(id), "same envelope id");
    assert_eq!(calls[0].attempt, 1, "fresh attempt count");
    assert!(
        harness
            .runtime()
            .dead_letters()
            .list()
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(harness.runtime().stats().handled, 1);
}

#[tokio::test]
async fn a_redelivery_of_a_dead_lettered_envelope_is_discarded_but_a_replay_is_not() {
    let calls = Recorder::new();
    let harness = harness(&calls);
    let report = harness.publish(&member_removed()).await.unwrap();
    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(report.envelope_id)
        .await
        .unwrap();

    redelivered_then_replayed(&harness, &dead.envelope, &calls).await;
}

/// Delivers a dead-lettered envelope again (the inbox discards it, nothing runs), then
/// replays its letter, which runs it once.
async fn redelivered_then_replayed(
    harness: &TestHarness,
    envelope: &Envelope,
    calls: &Recorder<MemberRemoved>,
) {
    let redelivered = harness.deliver(envelope.clone()).await.unwrap();
    assert_eq!(
        redelivered.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope)
    );
    assert_eq!(calls.count(), 0);
    harness
        .runtime()
        .dead_letters()
        .replay(envelope.id)
        .await
        .unwrap();
    harness.idle().await.unwrap();
    assert_eq!(calls.count(), 1, "the replay ran it, once");
}

#[tokio::test]
async fn replaying_or_inspecting_an_unknown_id_is_a_typed_error() {
    let harness = harness(&Recorder::new());
    let id = Uuid::new_v4();
    assert!(
        matches!(harness.runtime().dead_letters().replay(id).await, Err(Error::DeadLetterNotFound(x)) if x == id)
    );
    assert!(
        matches!(harness.runtime().dead_letters().inspect(id).await, Err(Error::DeadLetterNotFound(x)) if x == id)
    );
}

#[tokio::test]
async fn purge_removes_every_dead_letter_and_counts_them() {
    let harness = harness(&Recorder::new());
    harness.publish(&member_removed()).await.unwrap();
    harness.publish(&member_removed()).await.unwrap();
    assert_eq!(harness.runtime().dead_letters().purge().await.unwrap(), 2);
    assert!(
        harness
            .runtime()
            .dead_letters()
            .list()
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(harness.runtime().dead_letters().purge().await.unwrap(), 0);
}

#[tokio::test]
async fn a_failed_replay_puts_the_dead_letter_back() {
    let harness = harness(&Recorder::new());
    let report = harness.publish(&member_removed()).await.unwrap();
    harness.shutdown().await;

    let error = harness
        .runtime()
        .dead_letters()
        .replay(report.envelope_id)
        .await
        .unwrap_err();

    assert!(matches!(error, Error::ShuttingDown(_)), "{error}");
    assert!(
        harness
            .runtime()
            .dead_letters()
            .inspect(report.envelope_id)
            .await
            .is_ok()
    );
}

/// Past the inbox's retention, a dead-lettered envelope's id is still known while its letter
/// is kept: a redelivery is discarded, and the replay is the one run (the redelivery was
/// handled before, and the replay ran it a second time).
async fn a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept(
    builder: dacapo::testing::TestHarnessBuilder,
) {
    let calls = Recorder::new();
    let hooks = Recorder::<support::WebhookQueued>::new();
    let harness = builder
        .retry_policy(RetryPolicy {
            retry_limit: 2,
            ..RetryPolicy::default()
        })
        .module(Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", calls.clone()))
        .module(
            Module::new("webhooks")
                .handle_named::<support::WebhookQueued, _>("queue", hooks.clone()),
        )
        .fault("workspaces", "revoke", Fault::fail_times(3))
        .configure(|runtime| {
            runtime
                .keep_after_handling(Duration::from_secs(60))
                .cleanup_interval(Duration::from_secs(10))
        })
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert!(matches!(report.outcome, Outcome::DeadLettered(_)));
    let dead = harness
        .runtime()
        .dead_letters()
        .inspect(report.envelope_id)
        .await
        .unwrap();
    // The control: a message handled beside it, whose row the cleanup does remove.
    let control = Envelope::for_message(&support::WebhookQueued {
        delivery_id: "hook-1".into(),
    })
    .unwrap();
    assert!(harness.deliver(control.clone()).await.unwrap().is_handled());
    harness.advance(Duration::from_secs(120)).await.unwrap();
    assert!(
        harness.deliver(control).await.unwrap().is_handled(),
        "the sweep removed the handled row"
    );
    assert_eq!(hooks.count(), 2);

    redelivered_then_replayed(&harness, &dead.envelope, &calls).await;
    harness.shutdown().await;
}

#[tokio::test]
async fn a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept_in_memory() {
    a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept(TestHarness::builder())
        .await;
}

/// A harness builder on a scratch database of its own, SQLite or PostgreSQL; the database
/// lives as long as the guard returned with it.
#[cfg(all(feature = "sqlite", feature = "postgres"))]
async fn on_a_scratch_database(
    postgres: bool,
) -> (
    dacapo::testing::TestHarnessBuilder,
    dacapo::testing::ScratchDatabase,
) {
    use dacapo::testing::ScratchDatabase;
    if postgres {
        let admin = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let db = ScratchDatabase::postgres(&admin).await.unwrap();
        let store = db.postgres_store().await.unwrap();
        (TestHarness::builder().store(store), db)
    } else {
        let db = ScratchDatabase::sqlite();
        let store = db.sqlite_store().await.unwrap();
        (TestHarness::builder().store(store), db)
    }
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept_sqlite() {
    let (builder, _db) = on_a_scratch_database(false).await;
    a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept(builder).await;
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept_postgres() {
    let (builder, _db) = on_a_scratch_database(true).await;
    a_redelivery_past_the_retention_is_discarded_while_the_letter_is_kept(builder).await;
}

/// A letter this build cannot read (a reason a newer build wrote) is left out of the listing
/// with a warning, instead of failing every listing, and so every bulk replay and purge.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_letter_that_cannot_be_read_is_left_out_of_the_listing() {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let (harness, readable) = one_dead_letter(TestHarness::builder().store(store.clone())).await;
    let unreadable = harness
        .publish(&member_removed())
        .await
        .unwrap()
        .envelope_id;
    dacapo::sqlx::query(
        "UPDATE dacapo_dead_letters SET reason = '\"FromANewerBuild\"' WHERE id = ?",
    )
    .bind(unreadable.simple().to_string())
    .execute(store.pool())
    .await
    .unwrap();
    assert!(
        harness
            .runtime()
            .dead_letters()
            .inspect(unreadable)
            .await
            .is_err()
    );

    let listed = harness.runtime().dead_letters().list().await.unwrap();

    let ids: Vec<Uuid> = listed.iter().map(|letter| letter.envelope.id).collect();
    assert_eq!(ids, [readable]);
    harness.shutdown().await;
}

#[tokio::test]
async fn an_unreadable_dead_letter_stays_in_an_inbox_in_memory() {
    use dacapo::ports::{DeadLetterStore, Inbox, Replay, ReplayTo, SystemClock};
    let inbox = dacapo::store::MemoryInbox::new(Duration::from_secs(60), Arc::new(SystemClock));
    let envelope = dacapo::Envelope::new("unknown", b"not an envelope".to_vec());
    let letter = dacapo::DeadLetter::rejected(
        envelope.clone(),
        DeadLetterReason::Unreadable("no message-id header".into()),
        chrono::Utc::now(),
    );
    inbox.dead_letters().put(letter).await.unwrap();
    assert!(matches!(
        inbox.replay(envelope.id, ReplayTo::ThisNode).await.unwrap(),
        Replay::Unreadable
    ));
    assert!(
        inbox
            .dead_letters()
            .get(envelope.id)
            .await
            .unwrap()
            .is_some()
    );
}

/// A harness from `builder` whose handler always fails, with no retries, and the id of the
/// message it dead-lettered first.
async fn one_dead_letter(builder: dacapo::testing::TestHarnessBuilder) -> (TestHarness, Uuid) {
    let harness = builder
        .retry_policy(RetryPolicy::no_retries())
        .module(
            Module::new("workspaces")
                .handle_named::<MemberRemoved, _>("revoke", Recorder::<MemberRemoved>::new()),
        )
        .fault("workspaces", "revoke", Fault::always_fail())
        .build()
        .unwrap();
    let id = harness
        .publish(&member_removed())
        .await
        .unwrap()
        .envelope_id;
    (harness, id)
}

/// A purge removes the letter the operator looked at, not one written since under the same id
/// (the envelope replayed and failed again while the question waited): `letters` is the
/// harness's dead-letter store.
async fn only_the_letter_looked_at_is_removed(
    builder: dacapo::testing::TestHarnessBuilder,
    letters: &dyn dacapo::ports::DeadLetterStore,
) {
    let (_harness, id) = one_dead_letter(builder).await;
    let seen = letters.get(id).await.unwrap().expect("dead-lettered");
    let mut again = seen.clone();
    again.last_failure_at += chrono::Duration::seconds(1);
    letters.put(again.clone()).await.unwrap();

    let removed = letters.remove_if_unchanged(id, seen.last_failure_at).await;
    assert!(!removed.unwrap(), "the letter changed since it was seen");
    assert_eq!(letters.get(id).await.unwrap(), Some(again.clone()));
    let removed = letters.remove_if_unchanged(id, again.last_failure_at).await;
    assert!(removed.unwrap(), "the letter seen is removed");
    assert_eq!(letters.get(id).await.unwrap(), None);
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_letter_looked_at_is_removed_sqlite() {
    let db = dacapo::testing::ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let builder = TestHarness::builder().store(store.clone());
    only_the_letter_looked_at_is_removed(builder, &store).await;
}

#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_letter_looked_at_is_removed_postgres() {
    let admin = std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let db = dacapo::testing::ScratchDatabase::postgres(&admin)
        .await
        .unwrap();
    let store = db.postgres_store().await.unwrap();
    let builder = TestHarness::builder().store(store.clone());
    only_the_letter_looked_at_is_removed(builder, &store).await;
}

/// An inbox in memory, and a harness builder on it.
fn on_an_inbox_in_memory() -> (
    Arc<dacapo::store::MemoryInbox>,
    dacapo::testing::TestHarnessBuilder,
) {
    let inbox = Arc::new(dacapo::store::MemoryInbox::new(
        Duration::from_secs(300),
        Arc::new(dacapo::ports::SystemClock),
    ));
    let builder = TestHarness::builder().configure({
        let inbox = Arc::clone(&inbox);
        move |runtime| runtime.inbox(inbox)
    });
    (inbox, builder)
}

#[tokio::test]
async fn only_the_letter_looked_at_is_removed_in_memory() {
    let (inbox, builder) = on_an_inbox_in_memory();
    only_the_letter_looked_at_is_removed(builder, &*inbox).await;
}

/// The trait's own way, for a store that does not override it: look, remove, and put back a
/// letter that changed in between. This store's removal lands a newer letter first, as a
/// replay that failed again between the look and the removal would.
#[tokio::test]
async fn only_the_letter_looked_at_is_removed_by_a_store_that_leaves_it_to_the_trait() {
    use dacapo::ports::DeadLetterStore;
    use dacapo::{DeadLetter, DeadLetterFilter};

    struct Plain(Arc<dacapo::store::MemoryInbox>);

    #[async_trait::async_trait]
    impl DeadLetterStore for Plain {
        async fn put(&self, letter: DeadLetter) -> Result<(), dacapo::EngineError> {
            self.0.put(letter).await
        }
        async fn list(
            &self,
            filter: &DeadLetterFilter,
        ) -> Result<Vec<DeadLetter>, dacapo::EngineError> {
            self.0.list(filter).await
        }
        async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, dacapo::EngineError> {
            self.0.get(id).await
        }
        async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, dacapo::EngineError> {
            if let Some(mut newer) = self.0.get(id).await? {
                newer.last_failure_at += chrono::Duration::minutes(1);
                self.0.put(newer).await?;
            }
            self.0.remove(id).await
        }
        async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, dacapo::EngineError> {
            self.0.purge(filter).await
        }
    }

    let (inbox, builder) = on_an_inbox_in_memory();
    let (_harness, id) = one_dead_letter(builder).await;
    let letters = Plain(inbox);
    let seen = letters.get(id).await.unwrap().expect("dead-lettered");

    let removed = letters.remove_if_unchanged(id, seen.last_failure_at).await;
    assert!(!removed.unwrap(), "the letter changed before its removal");
    let kept = letters.get(id).await.unwrap().expect("put back");
    assert_eq!(
        kept.last_failure_at,
        seen.last_failure_at + chrono::Duration::minutes(1),
        "the newer letter is the one put back"
    );
}
