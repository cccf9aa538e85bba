//! The durable inbox on a real SQLite file and a real PostgreSQL server: envelopes persisted
//! before they count as received, duplicates discarded across restarts, dead letters kept.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use dacapo::{DeadLetterReason, DiscardReason, Outcome};
use support::{MemberRemoved, member_removed};

/// Every unsettled row of the inbox's node that nothing runs, up to ten, whatever its age.
async fn every_orphan(
    inbox: &dyn dacapo::ports::DurableInbox,
) -> Result<Vec<dacapo::ports::Resumable>, dacapo::EngineError> {
    inbox
        .orphaned(
            chrono::DateTime::<chrono::Utc>::MAX_UTC,
            &std::collections::HashSet::new(),
            10,
        )
        .await
}

const WAIT: Duration = Duration::from_secs(20);

async fn settled(
    report: tokio::sync::oneshot::Receiver<dacapo::DeliveryReport>,
) -> dacapo::DeliveryReport {
    tokio::time::timeout(WAIT, report)
        .await
        .expect("settles in time")
        .expect("a report")
}

on_both_backends!(
    a_redelivery_is_discarded_even_after_a_restart_sqlite,
    a_redelivery_is_discarded_even_after_a_restart_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let envelope = Envelope::for_message(&member_removed()).unwrap();

        let first = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        let report = settled(first.receive_tracked(envelope.clone()).await.unwrap()).await;
        assert!(report.is_handled());
        let again = settled(first.receive_tracked(envelope.clone()).await.unwrap()).await;
        assert_eq!(
            again.outcome,
            Outcome::Discarded(DiscardReason::DuplicateEnvelope)
        );
        assert!(first.shutdown().await.is_clean());

        // A new runtime on the same database still knows the envelope.
        let second = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
            .build()
            .unwrap();
        let after_restart = settled(second.receive_tracked(envelope).await.unwrap()).await;
        assert_eq!(
            after_restart.outcome,
            Outcome::Discarded(DiscardReason::DuplicateEnvelope)
        );
        assert_eq!(calls.count(), 1);
        second.shutdown().await;
    }
);

struct AlwaysFails;

impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

on_both_backends!(
    dead_letters_survive_a_restart_and_can_be_replayed_sqlite,
    dead_letters_survive_a_restart_and_can_be_replayed_postgres,
    |db| {
        let quick = RetryPolicy {
            retry_limit: 1,
            min_retry_interval: Duration::from_millis(10),
            ..RetryPolicy::default()
        };
        let first = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .retry_policy(quick)
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", AlwaysFails))
            .build()
            .unwrap();
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        let report = settled(first.receive_tracked(envelope.clone()).await.unwrap()).await;
        assert_eq!(
            report.outcome,
            Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
        );
        first.shutdown().await;

        let calls = Recorder::<MemberRemoved>::new();
        let second = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        let letters = second.dead_letters().list().await.unwrap();
        assert_eq!(letters.len(), 1);
        let letter = &letters[0];
        assert_eq!(letter.envelope.id, envelope.id);
        assert_eq!(letter.envelope.payload, envelope.payload);
        assert_eq!(letter.reason, DeadLetterReason::RetriesExhausted);
        assert_eq!(letter.attempts, 2);
        assert_eq!(letter.failures.len(), 2);
        assert_eq!(
            letter.failures[0].failures[0].error,
            "the downstream service is down"
        );
        assert!(letter.first_failure_at <= letter.last_failure_at);

        second.dead_letters().replay(envelope.id).await.unwrap();
        tokio::time::timeout(WAIT, second.idle()).await.unwrap();
        let calls = calls.calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (calls[0].message_id, calls[0].attempt),
            (Some(envelope.id), 1)
        );
        assert!(second.dead_letters().list().await.unwrap().is_empty());
        assert_eq!(second.dead_letters().purge().await.unwrap(), 0);
        second.shutdown().await;
    }
);

on_both_backends!(
    only_a_first_attempt_never_started_is_taken_back_sqlite,
    only_a_first_attempt_never_started_is_taken_back_postgres,
    |db| {
        use dacapo::ports::{Fenced, Handled, Receipt};
        let inbox = db.sqlite_or_postgres_inbox().await;
        let [waiting, handled, running, not_its] =
            std::array::from_fn(|_| Envelope::for_message(&member_removed()).unwrap());
        for envelope in [&waiting, &handled, &running, &not_its] {
            assert_eq!(inbox.receive(envelope).await.unwrap(), Receipt::New);
        }
        assert_eq!(
            inbox.settle_handled(handled.id, 1, &[]).await.unwrap(),
            Handled::Written { in_outbox: true }
        );
        assert_eq!(
            inbox.begin_attempt(running.id, 2).await.unwrap(),
            Fenced::Written
        );
        inbox
            .never_started(&[waiting.id, handled.id, running.id])
            .await
            .unwrap();
        // Another node (a store of its own, under another node name) owns none of them.
        let other = db.sqlite_or_postgres_inbox().await;
        other.never_started(&[not_its.id]).await.unwrap();
        let unsettled = every_orphan(&*inbox).await.unwrap();
        let attempts = |id: uuid::Uuid| {
            unsettled
                .iter()
                .find(|resumable| resumable.envelope.id == id)
                .map(|resumable| resumable.envelope.attempts)
        };
        assert_eq!(
            attempts(waiting.id),
            Some(0),
            "its first attempt taken back"
        );
        assert_eq!(
            attempts(running.id),
            Some(2),
            "an attempt that began is kept"
        );
        assert_eq!(attempts(handled.id), None, "settled: nothing to take back");
        assert_eq!(
            attempts(not_its.id),
            Some(1),
            "another node's to take back, not this one's"
        );
        assert_eq!(
            db.inbox_status(handled.id).await.as_deref(),
            Some("handled")
        );
    }
);

on_both_backends!(
    a_row_with_an_unreadable_id_does_not_stop_the_sweep_for_the_others_sqlite,
    a_row_with_an_unreadable_id_does_not_stop_the_sweep_for_the_others_postgres,
    |db| {
        use dacapo::ports::Receipt;
        let inbox = db.sqlite_or_postgres_inbox().await;
        let damaged = Envelope::new("tests.damaged", b"{}".to_vec());
        let readable = Envelope::for_message(&member_removed()).unwrap();
        for envelope in [&damaged, &readable] {
            assert_eq!(inbox.receive(envelope).await.unwrap(), Receipt::New);
        }
        db.execute(
            "UPDATE dacapo_inbox SET id = 'not-a-uuid' WHERE message_type = 'tests.damaged'",
        )
        .await;
        let unsettled = every_orphan(&*inbox)
            .await
            .expect("the sweep goes on past the row it cannot read");
        let ids: Vec<_> = unsettled.iter().map(|r| r.envelope.id).collect();
        assert_eq!(ids, [readable.id]);
    }
);

on_both_backends!(
    a_late_attempt_never_takes_a_handled_envelope_back_sqlite,
    a_late_attempt_never_takes_a_handled_envelope_back_postgres,
    |db| {
        use dacapo::ports::{Fenced, Handled, Receipt, RetryRecord};
        let inbox = db.sqlite_or_postgres_inbox().await;
        let envelope = Envelope::for_message(&member_removed()).unwrap();
        assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::New);
        assert_eq!(
            inbox.settle_handled(envelope.id, 1, &[]).await.unwrap(),
            Handled::Written { in_outbox: true }
        );
        // The writes of a node that lost this delivery to recovery and ran its attempt late.
        assert_eq!(
            inbox.begin_attempt(envelope.id, 2).await.unwrap(),
            Fenced::OwnedElsewhere,
            "a handled delivery is nobody's to attempt again"
        );
        let record = RetryRecord::new(&envelope, chrono::Utc::now(), &[], &[], &[]);
        assert_eq!(
            inbox.schedule_retry(record).await.unwrap(),
            Fenced::OwnedElsewhere
        );
        assert_eq!(
            inbox.settle_handled(envelope.id, 1, &[]).await.unwrap(),
            Handled::OwnedElsewhere,
            "settled once"
        );
        assert_eq!(
            db.inbox_status(envelope.id).await.as_deref(),
            Some("handled")
        );
        assert!(
            inbox
                .recover(10, chrono::DateTime::<chrono::Utc>::MAX_UTC, true)
                .await
                .unwrap()
                .is_empty(),
            "nothing to run again"
        );
        assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::Duplicate);
    }
);

on_both_backends!(
    a_claim_of_released_rows_only_leaves_a_lapsed_nodes_rows_sqlite,
    a_claim_of_released_rows_only_leaves_a_lapsed_nodes_rows_postgres,
    |db| {
        let dead = db.sqlite_or_postgres_inbox().await;
        let claimer = db.sqlite_or_postgres_inbox().await;
        let (lapsed, released) = (
            Envelope::for_message(&member_removed()).unwrap(),
            Envelope::for_message(&member_removed()).unwrap(),
        );
        dead.receive(&lapsed).await.unwrap();
        dead.receive(&released).await.unwrap();
        // Both old, and the dead node never heartbeat.
        db.execute("UPDATE dacapo_inbox SET received_at = 0").await;
        // The row with the lesser id (ids are stored as 32 hex digits) is released.
        db.execute(
            "UPDATE dacapo_inbox SET owner = NULL WHERE id = (SELECT min(id) FROM dacapo_inbox)",
        )
        .await;
        let released_id =
            std::cmp::min_by_key(lapsed.id, released.id, |id| id.simple().to_string());
        let never = chrono::DateTime::<chrono::Utc>::MAX_UTC;
        let only_released = claimer.recover(10, never, false).await.unwrap();
        assert_eq!(only_released.len(), 1);
        assert_eq!(only_released[0].envelope.id, released_id);
        let the_rest = claimer.recover(10, never, true).await.unwrap();
        assert_eq!(the_rest.len(), 1, "the lapsed node's row, once asked for");
        assert_ne!(the_rest[0].envelope.id, released_id);
    }
);

on_both_backends!(
    attempts_begun_together_answer_each_write_sqlite,
    attempts_begun_together_answer_each_write_postgres,
    |db| {
        use dacapo::ports::Fenced;
        let inbox = db.sqlite_or_postgres_inbox().await;
        let other_node = db.sqlite_or_postgres_inbox().await;
        let envelopes: Vec<Envelope> = (0..70)
            .map(|_| Envelope::for_message(&member_removed()).unwrap())
            .collect();
        // Received with their first attempt begun.
        inbox.receive_batch(&envelopes).await.unwrap();
        let foreign = Envelope::for_message(&member_removed()).unwrap();
        other_node.receive(&foreign).await.unwrap();

        // Second attempts begun at once: those that queue behind the first commit go in
        // statements of many rows (64, then powers of two). One begins the third envelope's
        // again, one the other node's delivery.
        let ids = envelopes
            .iter()
            .map(|envelope| envelope.id)
            .chain([envelopes[2].id, foreign.id]);
        let begun = futures::future::join_all(ids.map(|id| inbox.begin_attempt(id, 2))).await;
        let count = |fenced: Fenced| {
            begun
                .iter()
                .filter(|answer| matches!(answer, Ok(f) if *f == fenced))
                .count()
        };
        assert_eq!(
            (count(Fenced::Written), count(Fenced::OwnedElsewhere)),
            (70, 2),
            "{begun:?}"
        );
        assert_eq!(
            begun.last().unwrap().as_ref().unwrap(),
            &Fenced::OwnedElsewhere
        );
        let second_attempts = db
            .scalar("SELECT count(*) FROM dacapo_inbox WHERE attempts = 2")
            .await;
        assert_eq!(second_attempts, 70);
        // A begin that does not follow the recorded attempt is fenced, alone or together.
        let stale = futures::future::join_all(
            envelopes[..3]
                .iter()
                .map(|envelope| inbox.begin_attempt(envelope.id, 2)),
        )
        .await;
        assert!(
            stale
                .iter()
                .all(|answer| matches!(answer, Ok(Fenced::OwnedElsewhere))),
            "{stale:?}"
        );
    }
);

on_both_backends!(
    receives_and_settles_written_together_answer_each_write_sqlite,
    receives_and_settles_written_together_answer_each_write_postgres,
    |db| {
        use dacapo::ports::{Handled, Receipt};
        let inbox = db.sqlite_or_postgres_inbox().await;
        // Another store on the database: another node.
        let other_node = db.sqlite_or_postgres_inbox().await;
        let envelopes: Vec<Envelope> = (0..70)
            .map(|_| Envelope::for_message(&member_removed()).unwrap())
            .collect();
        // The first envelope twice in the batch's first statement, the second again in its
        // last (a batch of 72 takes a statement of 64 rows, then one of 8).
        let mut batch = envelopes.clone();
        batch.insert(1, envelopes[0].clone());
        batch.push(envelopes[1].clone());
        let receipts = inbox.receive_batch(&batch).await.unwrap();
        let mut expected = vec![Receipt::New; batch.len()];
        expected[1] = Receipt::Duplicate;
        expected[71] = Receipt::Duplicate;
        assert_eq!(receipts, expected);
        assert_eq!(db.inbox_rows().await, 70);

        let foreign = Envelope::for_message(&member_removed()).unwrap();
        assert_eq!(other_node.receive(&foreign).await.unwrap(), Receipt::New);

        // Settled at once: they queue behind the first commit and commit together; one of
        // them settles the third envelope again, one settles the other node's delivery.
        let ids = envelopes
            .iter()
            .map(|envelope| envelope.id)
            .chain([envelopes[2].id, foreign.id]);
        let settled =
            futures::future::join_all(ids.map(|id| inbox.settle_handled(id, 1, &[]))).await;
        let written = settled
            .iter()
            .filter(|answer| matches!(answer, Ok(Handled::Written { in_outbox: true })))
            .count();
        let elsewhere = settled
            .iter()
            .filter(|answer| matches!(answer, Ok(Handled::OwnedElsewhere)))
            .count();
        assert_eq!((written, elsewhere), (70, 2), "{settled:?}");
        assert_eq!(
            settled.last().unwrap().as_ref().unwrap(),
            &Handled::OwnedElsewhere,
            "the other node's delivery is not this node's to settle"
        );
        for envelope in &envelopes {
            assert_eq!(
                db.inbox_status(envelope.id).await.as_deref(),
                Some("handled")
            );
        }
        assert_eq!(
            db.inbox_status(foreign.id).await.as_deref(),
            Some("incoming")
        );
    }
);

/// PostgreSQL flushes concurrent commits together, so its group commits do not queue behind
/// one another: while one group waits (here on a row lock another session holds), the next
/// write commits in a group of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_on_postgresql_commits_while_an_earlier_group_is_still_committing() {
    use dacapo::ports::{Handled, Receipt};
    use sqlx::Connection;
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let inbox = std::sync::Arc::new(db.sqlite_or_postgres_inbox().await);
    let held = Envelope::for_message(&member_removed()).unwrap();
    assert_eq!(inbox.receive(&held).await.unwrap(), Receipt::New);

    let mut other = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("SELECT id FROM dacapo_inbox WHERE id = $1 FOR UPDATE")
        .bind(held.id.simple().to_string())
        .execute(&mut other)
        .await
        .unwrap();
    let settling = tokio::spawn({
        let inbox = std::sync::Arc::clone(&inbox);
        async move { inbox.settle_handled(held.id, 1, &[]).await }
    });
    // The settle's group is under way once its statement waits for the lock.
    db.until_a_session_waits_for_a_lock(WAIT, "the settle waits for the row lock")
        .await;

    let next = Envelope::for_message(&member_removed()).unwrap();
    let received = tokio::time::timeout(Duration::from_secs(5), inbox.receive(&next))
        .await
        .expect("not queued behind the waiting group");
    assert_eq!(received.unwrap(), Receipt::New);
    assert!(!settling.is_finished(), "the first group still waits");

    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    let settled = tokio::time::timeout(WAIT, settling).await.unwrap().unwrap();
    assert_eq!(settled.unwrap(), Handled::Written { in_outbox: true });
}

/// A replay that makes a handled row `incoming` again while the retention sweep waits for that
/// row's lock: the sweep, on PostgreSQL, checks the row again and leaves it. (It chose the row
/// while it was handled; checked against its choice alone, it deleted the replayed delivery,
/// whose dead letter the replay had already removed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_sweep_leaves_a_row_a_replay_made_incoming_while_it_waited() {
    use dacapo::ports::Receipt;
    use sqlx::Connection;
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let inbox = std::sync::Arc::new(db.sqlite_or_postgres_inbox().await);
    let envelope = Envelope::for_message(&member_removed()).unwrap();
    assert_eq!(inbox.receive(&envelope).await.unwrap(), Receipt::New);
    inbox.settle_handled(envelope.id, 1, &[]).await.unwrap();

    let mut replay = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut replay).await.unwrap();
    sqlx::query(
        "UPDATE dacapo_inbox SET status = 'incoming', attempts = 0, handled_at = NULL \
         WHERE id = $1",
    )
    .bind(envelope.id.simple().to_string())
    .execute(&mut replay)
    .await
    .unwrap();
    let sweeping = tokio::spawn({
        let inbox = std::sync::Arc::clone(&inbox);
        async move {
            inbox
                .delete_handled_before(chrono::Utc::now() + chrono::Duration::hours(1), 100)
                .await
        }
    });
    db.until_a_session_waits_for_a_lock(WAIT, "the sweep waits for the replayed row's lock")
        .await;
    sqlx::query("COMMIT").execute(&mut replay).await.unwrap();
    tokio::time::timeout(WAIT, sweeping)
        .await
        .expect("the sweep ends once the replay committed")
        .unwrap()
        .unwrap();
    assert_eq!(
        db.inbox_status(envelope.id).await.as_deref(),
        Some("incoming"),
        "the replayed delivery is still there"
    );
}
