//! The organizations module: it owns memberships and announces their changes.

use std::sync::atomic::{AtomicUsize, Ordering};

use reprise::prelude::*;
use sqlx::SqlitePool;

use crate::events::MemberRemoved;

pub(crate) struct Organizations<'a> {
    runtime: &'a Runtime,
    published: AtomicUsize,
}

impl<'a> Organizations<'a> {
    pub(crate) fn new(runtime: &'a Runtime) -> Self {
        Self {
            runtime,
            published: AtomicUsize::new(0),
        }
    }

    /// Removes a member and announces it; returns the envelope, as a broker would carry it.
    pub(crate) async fn remove_member(
        &self,
        organization_id: i64,
        member_id: i64,
    ) -> Result<Envelope, reprise::Error> {
        let event = MemberRemoved {
            organization_id,
            member_id,
        };
        let envelope = self.runtime.envelope(&event, SendOptions::new())?;
        self.runtime.receive(envelope.clone()).await?;
        self.published.fetch_add(1, Ordering::Relaxed);
        Ok(envelope)
    }

    pub(crate) fn published(&self) -> i64 {
        self.published.load(Ordering::Relaxed) as i64
    }
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
