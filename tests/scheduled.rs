//! Scheduled envelopes: published for a later time, kept by the store until then (across a
//! crash, for any node), run once when due and not before, listed and cancelled. On a real
//! SQLite file and a real PostgreSQL server, and in memory.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use dacapo::Outcome;
use dacapo::prelude::*;
use serde::{Deserialize, Serialize};
use support::{MemberRemoved, member_removed};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

/// Records when each call ran.
#[derive(Clone, Default)]
struct Timed(Arc<Mutex<Vec<DateTime<Utc>>>>);

impl Timed {
    fn calls(&self) -> Vec<DateTime<Utc>> {
        self.0.lock().unwrap().clone()
    }
}

impl<M: Message> Handler<M> for Timed {
    async fn handle(&self, _: &M, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(Utc::now());
        Ok(())
    }
}

async fn until_called(timed: &Timed) {
    tokio::time::timeout(WAIT, async {
        while timed.calls().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("run when due");
}

/// Whether `ran` is not before `due`, at the millisecond the store keeps times in.
fn not_before(ran: DateTime<Utc>, due: DateTime<Utc>) -> bool {
    ran.timestamp_millis() >= due.timestamp_millis()
}

fn after(delay: Duration) -> DateTime<Utc> {
    Utc::now() + chrono::Duration::from_std(delay).unwrap()
}

on_both_backends!(
    a_scheduled_envelope_waits_in_the_store_and_runs_once_when_due_sqlite,
    a_scheduled_envelope_waits_in_the_store_and_runs_once_when_due_postgres,
    |db| {
        let timed = Timed::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("reports").handle_named::<MemberRemoved, _>("rebuild", timed.clone()),
            )
            .build()
            .unwrap();
        let due_at = after(Duration::from_millis(1200));
        let mut envelope = Envelope::for_message(&member_removed()).unwrap();
        envelope.scheduled_for = Some(due_at);
        let id = envelope.id;
        let report = runtime
            .receive_tracked(envelope)
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(
            report.outcome,
            Outcome::Scheduled(due_at),
            "accepted for later"
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("scheduled"));

        until_called(&timed).await;
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        let calls = timed.calls();
        assert_eq!(calls.len(), 1);
        assert!(
            not_before(calls[0], due_at),
            "not before it was due: {} < {due_at}",
            calls[0]
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_scheduled_envelope_survives_a_crash_and_any_node_runs_it_when_due_sqlite,
    a_scheduled_envelope_survives_a_crash_and_any_node_runs_it_when_due_postgres,
    |db| {
        let crashed = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(
                Module::new("reports")
                    .handle_named::<MemberRemoved, _>("rebuild", Timed::default()),
            )
            .build()
            .unwrap();
        // Its first round over, the next is an interval (10 s) away: it never claims the
        // envelope below, which another node runs when due. (A round after the publish would
        // claim it, due before the next round, and the crash would leave it to the node's
        // timeout.)
        crashed.first_recovery().await;
        let due_at = after(Duration::from_millis(800));
        crashed.publish_at(&member_removed(), due_at).await.unwrap();
        drop(crashed);

        let timed = Timed::default();
        let other = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("reports").handle_named::<MemberRemoved, _>("rebuild", timed.clone()),
            )
            .build()
            .unwrap();
        until_called(&timed).await;
        tokio::time::timeout(WAIT, other.idle()).await.unwrap();
        let calls = timed.calls();
        assert_eq!(calls.len(), 1);
        assert!(not_before(calls[0], due_at));
        other.shutdown().await;
    }
);

on_both_backends!(
    a_scheduled_envelope_is_listed_and_cancelled_and_never_runs_sqlite,
    a_scheduled_envelope_is_listed_and_cancelled_and_never_runs_postgres,
    |db| {
        let timed = Timed::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(50))
            .module(
                Module::new("reports").handle_named::<MemberRemoved, _>("rebuild", timed.clone()),
            )
            .build()
            .unwrap();
        let next_year = Utc::now() + chrono::Duration::days(365);
        let id = runtime
            .publish_at(&member_removed(), next_year)
            .await
            .unwrap();
        let listed = runtime.scheduled().list(10).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].envelope.id, id);
        assert_eq!(
            listed[0].due_at.timestamp_millis(),
            next_year.timestamp_millis()
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("scheduled"));
        // No dead letter to replay: refused, and it stays scheduled.
        let refused = runtime.dead_letters().replay(id).await.unwrap_err();
        assert!(
            matches!(refused, dacapo::Error::ReplayInProgress(e) if e == id),
            "{refused}"
        );
        assert!(refused.to_string().contains("scheduled"), "{refused}");
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("scheduled"));

        assert!(runtime.scheduled().cancel(id).await.unwrap());
        assert!(runtime.scheduled().list(10).await.unwrap().is_empty());
        assert!(
            !runtime.scheduled().cancel(id).await.unwrap(),
            "cancelled once"
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        // A redelivery of the cancelled envelope within the retention is discarded.
        let mut again = Envelope::for_message(&member_removed()).unwrap();
        again.id = id;
        let report = runtime.receive_tracked(again).await.unwrap().await.unwrap();
        assert_eq!(
            report.outcome,
            Outcome::Discarded(dacapo::DiscardReason::DuplicateEnvelope)
        );
        assert!(timed.calls().is_empty(), "never run");
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_scheduled_envelope_that_cannot_be_read_is_left_out_of_the_listing_sqlite,
    a_scheduled_envelope_that_cannot_be_read_is_left_out_of_the_listing_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(
                Module::new("reports")
                    .handle_named::<MemberRemoved, _>("rebuild", Timed::default()),
            )
            .build()
            .unwrap();
        let next_year = Utc::now() + chrono::Duration::days(365);
        let readable = runtime
            .publish_at(&member_removed(), next_year)
            .await
            .unwrap();
        let unreadable = runtime
            .publish_at(&member_removed(), next_year)
            .await
            .unwrap();
        db.value_for::<i64>(
            "UPDATE dacapo_inbox SET headers = 'not json' WHERE id = $1 \
             RETURNING CAST(1 AS BIGINT)",
            unreadable.simple().to_string(),
        )
        .await;
        let listed = runtime.scheduled().list(10).await.unwrap();
        let ids: Vec<Uuid> = listed.iter().map(|s| s.envelope.id).collect();
        assert_eq!(
            ids,
            [readable],
            "the unreadable one is left out, not the listing"
        );
        runtime.shutdown().await;
    }
);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Reminder {
    member_id: u64,
}

impl Message for Reminder {
    const TYPE: &'static str = "scheduled.reminder";
}

/// Schedules a reminder a little later, as a handler would.
struct ScheduleReminder(DateTime<Utc>);

impl Handler<MemberRemoved> for ScheduleReminder {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let reminder = Reminder {
            member_id: event.member_id,
        };
        ctx.publish_with(&reminder, SendOptions::new().deliver_at(self.0))
            .await?;
        Ok(())
    }
}

on_both_backends!(
    a_handler_schedules_a_message_through_the_outbox_sqlite,
    a_handler_schedules_a_message_through_the_outbox_postgres,
    |db| {
        let due_at = after(Duration::from_millis(900));
        let timed = Timed::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(100))
            .relay_interval(Duration::from_millis(50))
            .module(
                Module::new("members")
                    .handle_named::<MemberRemoved, _>("remind", ScheduleReminder(due_at)),
            )
            .module(Module::new("mail").handle_named::<Reminder, _>("send", timed.clone()))
            .build()
            .unwrap();
        runtime.publish(&member_removed()).await.unwrap();
        until_called(&timed).await;
        let calls = timed.calls();
        assert_eq!(calls.len(), 1);
        assert!(
            not_before(calls[0], due_at),
            "the reminder waited for its time"
        );
        runtime.shutdown().await;
    }
);

#[tokio::test]
async fn in_memory_a_scheduled_envelope_waits_on_its_timer_and_is_not_listable() {
    let timed = Timed::default();
    let runtime = Runtime::builder()
        .module(Module::new("reports").handle_named::<MemberRemoved, _>("rebuild", timed.clone()))
        .build()
        .unwrap();
    let due_at = after(Duration::from_millis(300));
    runtime.publish_at(&member_removed(), due_at).await.unwrap();
    until_called(&timed).await;
    assert!(not_before(timed.calls()[0], due_at));
    let error = runtime.scheduled().list(10).await.unwrap_err();
    assert!(error.to_string().contains("keeps no schedule"), "{error}");
    assert!(!error.is_retryable(), "no retry makes it keep one: {error}");
    let error = runtime
        .scheduled()
        .cancel(Uuid::new_v4())
        .await
        .unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    runtime.shutdown().await;
}

on_both_backends!(
    a_durable_store_given_as_a_plain_inbox_is_refused_at_build_sqlite,
    a_durable_store_given_as_a_plain_inbox_is_refused_at_build_postgres,
    |db| {
        // Its recovery, relay and claims would not run: what it schedules or cascades would wait
        // forever.
        let builder = match db.backend {
            support_stores::Backend::Sqlite => {
                Runtime::builder().inbox(Arc::new(db.sqlite().await))
            }
            support_stores::Backend::Postgres => {
                Runtime::builder().inbox(Arc::new(db.postgres().await))
            }
        };
        let error = builder.build().unwrap_err();
        assert!(
            matches!(&error, dacapo::Error::Configuration(text) if text.contains("RuntimeBuilder::store")),
            "{error}"
        );
    }
);
