//! The organizations module: it owns memberships and announces their changes through the
//! transactional outbox — the change and its announcement commit together, or neither does.
//! Its change log keeps the envelopes it announced, which the main job replays after a
//! restart, as a broker does when a consumer's acknowledgements were lost.

use dacapo::prelude::*;
use sqlx::Row;

use crate::db::{Db, StorePool};

use crate::events::MemberRemoved;

pub(crate) async fn migrate(db: &Db) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS organization_events (
             id TEXT PRIMARY KEY NOT NULL,
             envelope TEXT NOT NULL,
             published_at BIGINT NOT NULL)",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// Creates the example organization with three subscribed webhooks; returns its id.
pub(crate) async fn seed(db: &Db) -> Result<i64, sqlx::Error> {
    let organization_id = 1;
    for url in [
        "https://hooks.example/a",
        "https://hooks.example/b",
        "https://hooks.example/c",
    ] {
        sqlx::query(
            "INSERT INTO webhooks (organization_id, url) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(organization_id)
        .bind(url)
        .execute(&db.pool)
        .await?;
    }
    Ok(organization_id)
}

/// The envelopes published in the last `minutes` minutes (by earlier runs, when called first).
pub(crate) async fn recently_published(
    db: &Db,
    minutes: i64,
) -> Result<Vec<Envelope>, Box<dyn std::error::Error>> {
    let since = chrono::Utc::now().timestamp_millis() - minutes * 60_000;
    let rows = sqlx::query(
        "SELECT envelope FROM organization_events WHERE published_at > $1 ORDER BY published_at",
    )
    .bind(since)
    .fetch_all(&db.pool)
    .await?;
    let mut envelopes = Vec::with_capacity(rows.len());
    for row in rows {
        let envelope: String = row.try_get(0)?;
        envelopes.push(serde_json::from_str(&envelope)?);
    }
    Ok(envelopes)
}

pub(crate) struct Organizations<'a> {
    runtime: &'a Runtime,
    store: StorePool,
}

/// Records the change in the log and enlists its envelope, in one transaction on `$pool`.
macro_rules! change_and_announce {
    ($runtime:expr, $pool:expr, $begin:literal, $envelope:expr) => {{
        let mut tx = $pool.begin_with($begin).await?;
        sqlx::query(
            "INSERT INTO organization_events (id, envelope, published_at) VALUES ($1, $2, $3)",
        )
        .bind($envelope.id.simple().to_string())
        .bind(serde_json::to_string(&$envelope)?)
        .bind(chrono::Utc::now().timestamp_millis())
        .execute(&mut *tx)
        .await?;
        $runtime
            .outbox()
            .enlist_envelope(&mut tx, &$envelope)
            .await?;
        // Committing through the runtime wakes its relay, which publishes at once.
        $runtime.outbox().commit(tx).await?;
    }};
}

impl<'a> Organizations<'a> {
    pub(crate) fn new(runtime: &'a Runtime, store: StorePool) -> Self {
        Self { runtime, store }
    }

    /// Removes a member and announces it; returns the envelope, as a broker would carry it.
    pub(crate) async fn remove_member(
        &self,
        organization_id: i64,
        member_id: i64,
    ) -> Result<Envelope, Box<dyn std::error::Error>> {
        let event = MemberRemoved {
            organization_id,
            member_id,
        };
        let envelope = self.runtime.envelope(&event, SendOptions::new())?;
        match &self.store {
            StorePool::Sqlite(pool) => {
                change_and_announce!(self.runtime, pool, "BEGIN IMMEDIATE", envelope)
            }
            #[cfg(feature = "postgres")]
            StorePool::Postgres(pool) => {
                change_and_announce!(self.runtime, pool, "BEGIN", envelope)
            }
        }
        Ok(envelope)
    }
}
