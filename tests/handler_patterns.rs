//! The seed's idempotent-handler patterns, each run twice for the same message (a sibling
//! handler fails the first attempt, so every handler reruns) on a real SQLite file and a real
//! PostgreSQL server: one row, no second publish, no second commit.
//!
//! - fan-out: derive row ids from the message id, find the existing ones in one round trip
//!   ([`idempotency::missing_ids`]), insert the missing, commit before publishing, return early
//!   when nothing is new;
//! - audit: record under the message id with a unique index, and fail loudly without one;
//! - mirror: newest-wins upsert, so an older event never overwrites a newer one.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dacapo::idempotency;
use dacapo::prelude::*;
use dacapo::store::{PostgresStore, SqliteStore};
use dacapo::testing::Recorder;
use serde::{Deserialize, Serialize};
use support::WebhookQueued;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct MemberRenamed {
    member_id: i64,
    name: String,
    /// The member's version after the rename: newer events carry higher versions.
    version: i64,
}

impl Message for MemberRenamed {
    const TYPE: &'static str = "organization.member_renamed";
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pattern {
    FanOut,
    Audit,
    Mirror,
}

/// One of the patterns, counting its runs and its commits.
#[derive(Clone)]
struct Idempotent {
    pattern: Pattern,
    runs: Arc<AtomicUsize>,
    commits: Arc<AtomicUsize>,
}

impl Idempotent {
    fn new(pattern: Pattern) -> Self {
        Self {
            pattern,
            runs: Arc::default(),
            commits: Arc::default(),
        }
    }
}

const WEBHOOKS: [i64; 3] = [11, 12, 13];

/// The pattern's body, for one database type.
macro_rules! pattern {
    ($self:ident, $event:ident, $ctx:ident, $pool:expr, $begin:literal) => {{
        let mut tx = $pool.begin_with($begin).await?;
        match $self.pattern {
            Pattern::FanOut => {
                let message_id = $ctx.message_id().ok_or("no message id")?;
                let wanted: Vec<String> = WEBHOOKS
                    .iter()
                    .map(|webhook| ids::derive(message_id, &webhook.to_string()))
                    .collect();
                let missing =
                    idempotency::missing_ids(&mut tx, "deliveries", "id", &wanted).await?;
                if missing.is_empty() {
                    return Ok(());
                }
                for id in &missing {
                    sqlx::query("INSERT INTO deliveries (id) VALUES ($1)")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                $self.commits.fetch_add(1, Ordering::SeqCst);
                for id in missing {
                    $ctx.publish(&WebhookQueued { delivery_id: id }).await?;
                }
            }
            Pattern::Audit => {
                let message_id = $ctx.message_id().ok_or("no message id")?;
                let inserted = sqlx::query(
                    "INSERT INTO audit (message_id, member_id) VALUES ($1, $2) \
                     ON CONFLICT (message_id) DO NOTHING",
                )
                .bind(message_id.simple().to_string())
                .bind($event.member_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if inserted == 0 {
                    return Ok(());
                }
                tx.commit().await?;
                $self.commits.fetch_add(1, Ordering::SeqCst);
            }
            Pattern::Mirror => {
                let changed = sqlx::query(
                    "INSERT INTO members (member_id, name, version) VALUES ($1, $2, $3) \
                     ON CONFLICT (member_id) DO UPDATE SET name = excluded.name, \
                     version = excluded.version WHERE members.version < excluded.version",
                )
                .bind($event.member_id)
                .bind(&$event.name)
                .bind($event.version)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if changed == 0 {
                    return Ok(()); // as new as this event, or newer: nothing to commit
                }
                tx.commit().await?;
                $self.commits.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }};
}

impl Handler<MemberRenamed> for Idempotent {
    async fn handle(
        &self,
        event: &MemberRenamed,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        // Row ids come from the message id: without one the pattern fails loudly, rather than
        // invent an id a retry could not find again.
        if self.pattern != Pattern::Mirror && ctx.message_id().is_none() {
            return Err(HandlerError::permanent("this pattern needs a message id"));
        }
        let store = ctx.store().ok_or("no store")?;
        if let Some(store) = store.downcast_ref::<SqliteStore>() {
            pattern!(self, event, ctx, store.pool(), "BEGIN IMMEDIATE")
        } else if let Some(store) = store.downcast_ref::<PostgresStore>() {
            pattern!(self, event, ctx, store.pool(), "BEGIN")
        } else {
            Err("not a SQL store".into())
        }
    }
}

/// Fails the first attempt of every message, so the whole delivery is retried.
#[derive(Clone, Default)]
struct FailsFirstAttempt;

impl Handler<MemberRenamed> for FailsFirstAttempt {
    async fn handle(&self, _: &MemberRenamed, ctx: &MessageContext) -> Result<(), HandlerError> {
        if ctx.attempt() == 1 {
            return Err("first attempt fails".into());
        }
        Ok(())
    }
}

async fn schema(db: &support_stores::TestDatabase) {
    db.execute("CREATE TABLE deliveries (id TEXT PRIMARY KEY NOT NULL)")
        .await;
    db.execute("CREATE TABLE audit (message_id TEXT NOT NULL UNIQUE, member_id BIGINT NOT NULL)")
        .await;
    db.execute(
        "CREATE TABLE members (member_id BIGINT PRIMARY KEY NOT NULL, name TEXT NOT NULL, \
         version BIGINT NOT NULL)",
    )
    .await;
}

/// A runtime whose `pattern` handler reruns once per message, with the webhook sends recorded.
async fn runtime(
    db: &support_stores::TestDatabase,
    handler: &Idempotent,
    sent: &Recorder<WebhookQueued>,
) -> Runtime {
    db.store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .retry_policy(RetryPolicy {
            retry_limit: 2,
            min_retry_interval: Duration::from_millis(10),
            retry_interval_delta: Duration::from_millis(10),
            max_retry_interval: Duration::from_millis(50),
        })
        .module(Module::new("app").handle_named::<MemberRenamed, _>("pattern", handler.clone()))
        .module(Module::new("flaky").handle_named::<MemberRenamed, _>("fails", FailsFirstAttempt))
        .module(Module::new("webhooks").handle_named::<WebhookQueued, _>("send", sent.clone()))
        .build()
        .unwrap()
}

async fn settle(runtime: &Runtime, event: &MemberRenamed) -> dacapo::DeliveryReport {
    let envelope = runtime.envelope(event, SendOptions::default()).unwrap();
    let report = runtime.receive_tracked(envelope).await.unwrap();
    let report = tokio::time::timeout(WAIT, report).await.unwrap().unwrap();
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    report
}

fn renamed(version: i64) -> MemberRenamed {
    MemberRenamed {
        member_id: 7,
        name: format!("name v{version}"),
        version,
    }
}

on_both_backends!(
    fan_out_inserts_only_the_missing_rows_and_publishes_once_sqlite,
    fan_out_inserts_only_the_missing_rows_and_publishes_once_postgres,
    |db| {
        schema(&db).await;
        let (handler, sent) = (Idempotent::new(Pattern::FanOut), Recorder::new());
        let runtime = runtime(&db, &handler, &sent).await;
        let report = settle(&runtime, &renamed(1)).await;
        assert_eq!(report.attempts, 2);
        assert_eq!(handler.runs.load(Ordering::SeqCst), 2, "run twice");
        assert_eq!(handler.commits.load(Ordering::SeqCst), 1, "committed once");
        assert_eq!(db.scalar("SELECT count(*) FROM deliveries").await, 3);
        assert_eq!(sent.count(), 3, "one send per webhook, none twice");
        runtime.shutdown().await;
    }
);

on_both_backends!(
    audit_records_once_under_the_message_id_sqlite,
    audit_records_once_under_the_message_id_postgres,
    |db| {
        schema(&db).await;
        let (handler, sent) = (Idempotent::new(Pattern::Audit), Recorder::new());
        let runtime = runtime(&db, &handler, &sent).await;
        settle(&runtime, &renamed(1)).await;
        assert_eq!(handler.runs.load(Ordering::SeqCst), 2);
        assert_eq!(handler.commits.load(Ordering::SeqCst), 1);
        assert_eq!(db.scalar("SELECT count(*) FROM audit").await, 1);
        assert_eq!(sent.count(), 0);
        runtime.shutdown().await;
    }
);

on_both_backends!(
    mirror_keeps_the_newest_and_an_older_event_never_overwrites_it_sqlite,
    mirror_keeps_the_newest_and_an_older_event_never_overwrites_it_postgres,
    |db| {
        schema(&db).await;
        let (handler, sent) = (Idempotent::new(Pattern::Mirror), Recorder::new());
        let runtime = runtime(&db, &handler, &sent).await;
        settle(&runtime, &renamed(2)).await;
        assert_eq!(handler.runs.load(Ordering::SeqCst), 2);
        assert_eq!(
            handler.commits.load(Ordering::SeqCst),
            1,
            "the rerun commits nothing"
        );
        // An older event arriving late changes nothing.
        settle(&runtime, &renamed(1)).await;
        assert_eq!(handler.commits.load(Ordering::SeqCst), 1);
        assert_eq!(db.scalar("SELECT count(*) FROM members").await, 1);
        assert_eq!(db.scalar("SELECT version FROM members").await, 2);
        // A newer one does.
        settle(&runtime, &renamed(3)).await;
        assert_eq!(handler.commits.load(Ordering::SeqCst), 2);
        assert_eq!(db.scalar("SELECT version FROM members").await, 3);
        runtime.shutdown().await;
    }
);

#[tokio::test]
async fn the_patterns_refuse_a_message_without_an_id() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    schema(&db).await;
    // Outside a consumer there is no message id; the pattern must not invent one.
    for pattern in [Pattern::Audit, Pattern::FanOut] {
        let error = Idempotent::new(pattern)
            .handle(&renamed(1), &MessageContext::detached())
            .await
            .unwrap_err();
        assert_eq!(
            error.disposition(),
            dacapo::Disposition::Permanent,
            "{pattern:?}"
        );
        assert!(error.to_string().contains("needs a message id"), "{error}");
    }
    assert_eq!(db.scalar("SELECT count(*) FROM audit").await, 0);
}

#[tokio::test]
async fn missing_ids_refuses_names_that_are_not_identifiers() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    schema(&db).await;
    let store = db.sqlite().await;
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let ids = vec!["a".to_owned()];
    for bad in ["deliveries; DROP TABLE audit", "", "a.b.c", "1st", "id\""] {
        let error = idempotency::missing_ids(&mut tx, bad, "id", &ids)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, dacapo::Error::InvalidIdentifier(name) if name == bad),
            "{error}"
        );
    }
    let error = idempotency::missing_ids(&mut tx, "deliveries", "id)", &ids)
        .await
        .unwrap_err();
    assert!(matches!(error, dacapo::Error::InvalidIdentifier(_)));
    tx.rollback().await.unwrap();
    assert!(db.has_table("audit").await);
}

on_both_backends!(
    missing_ids_answers_in_order_without_repeats_sqlite,
    missing_ids_answers_in_order_without_repeats_postgres,
    |db| {
        schema(&db).await;
        db.execute("INSERT INTO deliveries (id) VALUES ('b'), ('d')")
            .await;
        let wanted: Vec<String> = ["a", "b", "c", "a", "d"].map(String::from).to_vec();
        let missing = match db.backend {
            support_stores::Backend::Sqlite => {
                let store = db.sqlite().await;
                let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                idempotency::missing_ids(&mut tx, "deliveries", "id", &wanted)
                    .await
                    .unwrap()
            }
            support_stores::Backend::Postgres => {
                let store = db.postgres().await;
                let mut tx = store.pool().begin().await.unwrap();
                idempotency::missing_ids(&mut tx, "public.deliveries", "id", &wanted)
                    .await
                    .unwrap()
            }
        };
        assert_eq!(missing, ["a", "c"]);
    }
);
