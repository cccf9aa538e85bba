//! Round trips to PostgreSQL per delivery, counted by a proxy that reads the server's
//! `ReadyForQuery` messages: the runtime's statements take no ping, before or after, and a
//! connection the server closed while idle is still found and replaced.
#![cfg(all(feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/proxy.rs"]
mod support_proxy;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::store::PostgresStore;
use dacapo::testing::Recorder;
use support::{MemberRemoved, member_removed};
use support_proxy::Proxy;

const WAIT: Duration = Duration::from_secs(30);

/// Round trips per delivery that the store's own work may take: the accept and the settle, a
/// statement each: 2. The connections they run on are kept between statements, out of the
/// pool, whose ping as each connection goes back (no option turns it off) made 4; with a ping
/// before each use as well, a delivery took 6. (Measured with each write committed alone:
/// group commit trades round trips — a `BEGIN` and a `COMMIT` around the writes it groups —
/// for fewer WAL flushes.)
const MOST_PER_DELIVERY: f64 = 2.5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_takes_no_ping_before_or_after_its_statements() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let (proxy, url) = Proxy::to(&db.url).await;
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = Runtime::builder()
        .store(
            PostgresStore::connect(&url)
                .await
                .unwrap()
                .group_commit(1, Duration::ZERO),
        )
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap();
    // Statements are prepared once per connection: warm every connection up first.
    for _ in 0..50 {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();

    let deliveries = 200;
    let before = proxy.round_trips();
    for _ in 0..deliveries {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let per_delivery = (proxy.round_trips() - before) as f64 / f64::from(deliveries);
    println!("round trips per delivery on PostgreSQL: {per_delivery:.2}");
    assert_eq!(calls.count(), 250);
    assert!(
        per_delivery <= MOST_PER_DELIVERY,
        "{per_delivery:.2} round trips per delivery, at most {MOST_PER_DELIVERY} expected"
    );
    runtime.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_idle_connection_closed_by_the_server_is_replaced_without_an_error() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
    let calls = Recorder::<MemberRemoved>::new();
    let runtime = Runtime::builder()
        .store(db.postgres().await)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", calls.clone()))
        .build()
        .unwrap();
    // Open several connections at once, so several sit idle in the pool.
    let messages: Vec<_> = (0..16).map(|_| member_removed()).collect();
    let published = futures::future::join_all(messages.iter().map(|m| runtime.publish(m)));
    for id in published.await {
        id.unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();

    let admin = db.postgres().await;
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let killed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    )))
    .fetch_one(admin.pool())
    .await
    .unwrap();
    assert!(
        killed > 1,
        "several idle connections were killed ({killed})"
    );

    // Every publish finds a dead connection first, until none is left: none fails.
    for _ in 0..20 {
        tokio::time::timeout(WAIT, runtime.publish(&member_removed()))
            .await
            .unwrap()
            .unwrap();
    }
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    assert_eq!(calls.count(), 36);
    runtime.shutdown().await;
}
