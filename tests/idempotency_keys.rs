//! `idempotency::record_key`: the unique constraint decides, also for two concurrent
//! transactions, on a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::idempotency;
use support_stores::{Backend, TestDatabase};

async fn record_twice_sequentially(db: &TestDatabase) -> (bool, bool, bool) {
    match db.backend {
        Backend::Sqlite => {
            let pool = db.sqlite().await.pool().clone();
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
            let first = idempotency::record_key(&mut tx, "charge:7").await.unwrap();
            tx.commit().await.unwrap();
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
            let again = idempotency::record_key(&mut tx, "charge:7").await.unwrap();
            let other = idempotency::record_key(&mut tx, "charge:8").await.unwrap();
            tx.commit().await.unwrap();
            (first, again, other)
        }
        Backend::Postgres => {
            let pool = db.postgres().await.pool().clone();
            let mut tx = pool.begin().await.unwrap();
            let first = idempotency::record_key(&mut tx, "charge:7").await.unwrap();
            tx.commit().await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            let again = idempotency::record_key(&mut tx, "charge:7").await.unwrap();
            let other = idempotency::record_key(&mut tx, "charge:8").await.unwrap();
            tx.commit().await.unwrap();
            (first, again, other)
        }
    }
}

on_both_backends!(a_key_is_new_once_sqlite, a_key_is_new_once_postgres, |db| {
    assert_eq!(record_twice_sequentially(&db).await, (true, false, true));
});

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_concurrent_transactions_with_one_key_exactly_one_proceeds() {
    let db = TestDatabase::new(Backend::Postgres).await;
    let pool = db.postgres().await.pool().clone();
    let mut first = pool.begin().await.unwrap();
    let mut second = pool.begin().await.unwrap();
    assert!(
        idempotency::record_key(&mut first, "ship:42")
            .await
            .unwrap()
    );
    // The second blocks on the first's uncommitted key…
    let waiting = tokio::spawn(async move {
        let proceeded = idempotency::record_key(&mut second, "ship:42")
            .await
            .unwrap();
        second.commit().await.unwrap();
        proceeded
    });
    db.until_a_session_waits_for_a_lock(
        Duration::from_secs(10),
        "the second transaction waits for the first's lock",
    )
    .await;
    assert!(
        !waiting.is_finished(),
        "the unique index holds the second transaction"
    );
    first.commit().await.unwrap();
    // …and sees it as already handled once the first commits.
    let proceeded = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap();
    assert!(!proceeded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_key_lets_the_next_transaction_proceed() {
    let db = TestDatabase::new(Backend::Sqlite).await;
    let pool = db.sqlite().await.pool().clone();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert!(idempotency::record_key(&mut tx, "k").await.unwrap());
    tx.rollback().await.unwrap();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert!(
        idempotency::record_key(&mut tx, "k").await.unwrap(),
        "the work never happened"
    );
    tx.commit().await.unwrap();
}

on_both_backends!(
    keys_past_their_retention_are_removed_and_younger_ones_stay_sqlite,
    keys_past_their_retention_are_removed_and_younger_ones_stay_postgres,
    |db| {
        let runtime = db
            .store(dacapo::Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .idempotency_key_retention(Duration::from_secs(3600))
            .cleanup_interval(Duration::from_millis(50))
            .build()
            .unwrap();
        // Two days old, and one recorded just now.
        db.execute(
            "INSERT INTO dacapo_idempotency_keys (key, recorded_at) \
             VALUES ('charge:old-1', 0), ('charge:old-2', 1000)",
        )
        .await;
        let recent = match db.backend {
            Backend::Sqlite => {
                let pool = db.sqlite().await.pool().clone();
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                let new = idempotency::record_key(&mut tx, "charge:recent")
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                new
            }
            Backend::Postgres => {
                let pool = db.postgres().await.pool().clone();
                let mut tx = pool.begin().await.unwrap();
                let new = idempotency::record_key(&mut tx, "charge:recent")
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                new
            }
        };
        assert!(recent);
        tokio::time::timeout(Duration::from_secs(20), async {
            while db
                .scalar(
                    "SELECT count(*) FROM dacapo_idempotency_keys WHERE key LIKE 'charge:old-%'",
                )
                .await
                > 0
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the cleanup removed the expired keys");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_idempotency_keys")
                .await,
            1,
            "the recent key stays"
        );
        runtime.shutdown().await;
    }
);

/// The plan the database chooses for `query` (PostgreSQL with sequential scans discouraged, so
/// a usable index shows even on an empty table).
async fn plan(db: &TestDatabase, query: &str) -> String {
    use sqlx::Row;
    match db.backend {
        Backend::Sqlite => {
            let pool = db.sqlite().await.pool().clone();
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {query}")))
                .fetch_all(&pool)
                .await
                .unwrap();
            rows.iter()
                .map(|r| r.get::<String, _>(3))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Backend::Postgres => {
            let pool = db.postgres().await.pool().clone();
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SET LOCAL enable_seqscan = off")
                .execute(&mut *tx)
                .await
                .unwrap();
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
                .fetch_all(&mut *tx)
                .await
                .unwrap();
            rows.iter()
                .map(|r| r.get::<String, _>(0))
                .collect::<Vec<_>>()
                .join("\n")
        }
    }
}

on_both_backends!(
    every_retention_sweep_and_the_recovery_claim_read_an_index_sqlite,
    every_retention_sweep_and_the_recovery_claim_read_an_index_postgres,
    |db| {
        // Opening the store applies the schema.
        let _store = db.sqlite_or_postgres_inbox().await;
        for (query, index) in [
            (
                "SELECT key FROM dacapo_idempotency_keys WHERE recorded_at < 1 LIMIT 10",
                "dacapo_idempotency_keys_at",
            ),
            (
                "SELECT seq FROM dacapo_outbox WHERE published_at < 1 LIMIT 10",
                "dacapo_outbox_published",
            ),
            (
                "SELECT id FROM dacapo_http_keys WHERE expires_at <= 1 LIMIT 10",
                "dacapo_http_keys_expires",
            ),
            (
                "SELECT id FROM dacapo_inbox WHERE status = 'handled' AND handled_at < 1 LIMIT 10",
                "dacapo_inbox_handled",
            ),
            (
                "SELECT id FROM dacapo_inbox WHERE status IN ('incoming', 'scheduled') \
                 AND execute_at IS NULL ORDER BY received_at LIMIT 10",
                "dacapo_inbox_ready",
            ),
            (
                "SELECT id FROM dacapo_inbox WHERE status IN ('incoming', 'scheduled') \
                 AND execute_at IS NOT NULL AND execute_at < 1 ORDER BY execute_at LIMIT 10",
                "dacapo_inbox_due",
            ),
        ] {
            let plan = plan(&db, query).await;
            assert!(
                index.split('|').any(|index| plan.contains(index)),
                "{query}\n{plan}"
            );
            assert!(
                !plan.contains("Seq Scan")
                    && !plan.lines().any(|l| l.trim() == "SCAN dacapo_inbox"),
                "{query}\n{plan}"
            );
        }
    }
);
