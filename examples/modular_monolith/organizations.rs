//! The organizations module: it owns memberships and announces their changes. It keeps a log of
//! the envelopes it published, which the main job replays after a restart, as a broker does
//! when a consumer's acknowledgements were lost.

use std::sync::atomic::{AtomicUsize, Ordering};

use reprise::prelude::*;
use sqlx::{Row, SqlitePool};

use crate::events::MemberRemoved;

pub(crate) async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS organization_events (
             id TEXT PRIMARY KEY NOT NULL,
             envelope TEXT NOT NULL,
             published_at INTEGER NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates the example organization with three subscribed webhooks; returns its id.
pub(crate) async fn seed(pool: &SqlitePool) -> Result<i64, sqlx::Error> {
    let organization_id = 1;
    for url in [
        "https://hooks.example/a",
        "https://hooks.example/b",
        "https://hooks.example/c",
    ] {
        sqlx::query("INSERT OR IGNORE INTO webhooks (organization_id, url) VALUES (?, ?)")
            .bind(organization_id)
            .bind(url)
            .execute(pool)
            .await?;
    }
    Ok(organization_id)
}

/// The envelopes published in the last `minutes` minutes (by earlier runs, when called first).
pub(crate) async fn recently_published(
    pool: &SqlitePool,
    minutes: i64,
) -> Result<Vec<Envelope>, Box<dyn std::error::Error>> {
    let since = chrono::Utc::now().timestamp_millis() - minutes * 60_000;
    let rows = sqlx::query(
        "SELECT envelope FROM organization_events WHERE published_at > ? ORDER BY published_at",
    )
    .bind(since)
    .fetch_all(pool)
    .await?;
    let mut envelopes = Vec::with_capacity(rows.len());
    for row in rows {
        envelopes.push(serde_json::from_str(row.try_get(0)?)?);
    }
    Ok(envelopes)
}

pub(crate) struct Organizations<'a> {
    runtime: &'a Runtime,
    pool: SqlitePool,
    published: AtomicUsize,
}

impl<'a> Organizations<'a> {
    pub(crate) fn new(runtime: &'a Runtime, pool: SqlitePool) -> Self {
        Self {
            runtime,
            pool,
            published: AtomicUsize::new(0),
        }
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
        sqlx::query(
            "INSERT INTO organization_events (id, envelope, published_at) VALUES (?, ?, ?)",
        )
        .bind(envelope.id.simple().to_string())
        .bind(serde_json::to_string(&envelope)?)
        .bind(chrono::Utc::now().timestamp_millis())
        .execute(&self.pool)
        .await?;
        self.runtime.receive(envelope.clone()).await?;
        self.published.fetch_add(1, Ordering::Relaxed);
        Ok(envelope)
    }

    pub(crate) fn published(&self) -> i64 {
        self.published.load(Ordering::Relaxed) as i64
    }
}
