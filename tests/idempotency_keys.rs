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
    tokio::time::sleep(Duration::from_millis(100)).await;
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
