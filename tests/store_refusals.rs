//! Data the store refuses is refused at once, never retried forever: a listener dead-letters
//! the envelope (or, where the store refuses even that, hands the refusal back to its
//! transport) instead of stalling on one envelope, and a delivery whose next
//! state cannot be stored is dead-lettered with the store's reason instead of holding its
//! capacity slot. On a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::DeadLetterReason;
use dacapo::prelude::*;
use dacapo::testing::Recorder;
use serde::{Deserialize, Serialize};
use support::{MemberRemoved, member_removed};
use support_stores::{Backend, TestDatabase};

const WAIT: Duration = Duration::from_secs(20);

/// A message type the test's trigger makes the store refuse.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Poison;

impl Message for Poison {
    const TYPE: &'static str = "poison";
}

/// Makes `table` refuse rows whose message type is `poison`, as a constraint would.
async fn refuse_poison(db: &TestDatabase, table: &str) {
    match (db.backend, table) {
        (Backend::Sqlite, "dacapo_inbox") => {
            db.execute(
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON dacapo_inbox \
                 WHEN NEW.message_type = 'poison' BEGIN SELECT RAISE(ABORT, 'poison refused'); END",
            )
            .await;
        }
        (Backend::Sqlite, _) => {
            db.execute(
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON dacapo_outbox \
                 WHEN NEW.message_type = 'poison' BEGIN SELECT RAISE(ABORT, 'poison refused'); END",
            )
            .await;
        }
        (Backend::Postgres, table) => {
            db.execute(
                "CREATE FUNCTION refuse_poison() RETURNS trigger AS $$ BEGIN \
                 IF NEW.message_type = 'poison' THEN \
                 RAISE EXCEPTION 'poison refused' USING ERRCODE = '22023'; END IF; \
                 RETURN NEW; END $$ LANGUAGE plpgsql",
            )
            .await;
            db.execute(if table == "dacapo_inbox" {
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON dacapo_inbox \
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
            } else {
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON dacapo_outbox \
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
            })
            .await;
        }
    }
}

on_both_backends!(
    a_listener_dead_letters_an_envelope_the_store_rejects_at_once_and_goes_on_sqlite,
    a_listener_dead_letters_an_envelope_the_store_rejects_at_once_and_goes_on_postgres,
    |db| {
        let calls = Recorder::<MemberRemoved>::new();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        refuse_poison(&db, "dacapo_inbox").await;
        let listener = runtime.listener();

        // Alone, and in a batch with a good one: the transport may acknowledge both.
        let poison = Envelope::for_message(&Poison).unwrap();
        tokio::time::timeout(WAIT, listener.accept(poison.clone()))
            .await
            .expect("refused at once, not retried")
            .unwrap();
        let batched = Envelope::for_message(&Poison).unwrap();
        let beside = Envelope::for_message(&member_removed()).unwrap();
        tokio::time::timeout(WAIT, listener.accept_batch(vec![batched.clone(), beside]))
            .await
            .expect("refused at once, not retried")
            .unwrap();
        assert_eq!(
            listener.pauses(),
            0,
            "no backoff for what no retry can cure"
        );
        for refused in [&poison, &batched] {
            let letter = runtime.dead_letters().inspect(refused.id).await.unwrap();
            assert!(
                matches!(&letter.reason, DeadLetterReason::StoreRejected(why) if why.contains("poison refused")),
                "{:?}",
                letter.reason
            );
            assert_eq!(
                (&letter.envelope.message_type, &letter.envelope.payload),
                (&refused.message_type, &refused.payload)
            );
        }

        let good = Envelope::for_message(&member_removed()).unwrap();
        listener.accept(good).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(calls.count(), 2, "the envelopes beside it go through");
        runtime.shutdown().await;
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// A message type PostgreSQL cannot hold as text fits no dead letter either: the refusal goes
/// back to the transport.
async fn postgres_refuses_a_nul_byte_in_a_message_type_and_the_listener_says_so_at_once() {
    let db = TestDatabase::new(Backend::Postgres).await;
    let runtime = db
        .store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .build()
        .unwrap();
    let envelope = Envelope::new("organization.member\0removed", b"{}".to_vec());
    let listener = runtime.listener();
    let refused = tokio::time::timeout(WAIT, listener.accept(envelope))
        .await
        .expect("refused at once, not retried")
        .unwrap_err();
    assert!(matches!(&refused, dacapo::Error::Rejected(_)), "{refused}");
    assert_eq!(listener.pauses(), 0);
    assert_eq!(db.inbox_rows().await, 0, "nothing stored");

    // In a batch, the envelopes around it are recorded all the same, and the refusal comes
    // back at the end.
    let batch = vec![
        Envelope::new("organization.member_removed", b"{}".to_vec()),
        Envelope::new("organization.member\0removed", b"{}".to_vec()),
        Envelope::new("organization.member_removed", b"{}".to_vec()),
    ];
    let bad = batch[1].id;
    let refused = tokio::time::timeout(WAIT, listener.accept_batch(batch))
        .await
        .expect("refused at once, not retried")
        .unwrap_err();
    assert!(matches!(&refused, dacapo::Error::Rejected(_)), "{refused}");
    assert!(refused.to_string().contains(&bad.to_string()), "{refused}");
    assert_eq!(db.inbox_rows().await, 2, "the two around it");
    runtime.shutdown().await;
}

/// Cascades a message the store's outbox refuses.
struct CascadesPoison;

impl Handler<MemberRemoved> for CascadesPoison {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        ctx.publish(&Poison).await?;
        Ok(())
    }
}

on_both_backends!(
    a_delivery_whose_settle_the_store_rejects_is_dead_lettered_with_the_reason_sqlite,
    a_delivery_whose_settle_the_store_rejects_is_dead_lettered_with_the_reason_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", CascadesPoison),
            )
            .module(Module::new("sink").handle_named::<Poison, _>("drop", Recorder::new()))
            .build()
            .unwrap();
        refuse_poison(&db, "dacapo_outbox").await;
        let id = runtime.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, runtime.idle())
            .await
            .expect("settled, not retried forever");
        let letter = runtime.dead_letters().inspect(id).await.unwrap();
        assert!(
            matches!(&letter.reason, DeadLetterReason::StoreRejected(text) if text.contains("poison refused")),
            "{}",
            letter.reason
        );
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
        assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 0);
        runtime.shutdown().await;
    }
);

/// A database whose encoding lacks characters is refused when the store opens: a message type
/// or a header with one of them (`€` in LATIN1) would be refused with its dead letter.
#[tokio::test]
async fn a_postgres_database_that_cannot_hold_every_character_is_refused_at_open() {
    use sqlx::Connection;
    let admin = std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let name = format!("dacapo_test_latin1_{}", uuid::Uuid::new_v4().simple());
    let mut connection = sqlx::PgConnection::connect(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' \
         TEMPLATE template0"
    )))
    .execute(&mut connection)
    .await
    .unwrap();
    let (base, _) = admin.rsplit_once('/').unwrap();
    let opened = dacapo::store::PostgresStore::connect(&format!("{base}/{name}")).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&mut connection)
    .await
    .unwrap();
    match opened {
        Err(dacapo::Error::Configuration(why)) => {
            assert!(why.contains("LATIN1") && why.contains("UTF8"), "{why}");
        }
        other => panic!("opened a LATIN1 database: {:?}", other.err()),
    }
}
