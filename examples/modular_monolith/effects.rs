//! What the database shows of the events the organizations module announced: for each, a
//! delivery row per subscribed webhook, each sent, and one audit entry. Counted in the modules'
//! own tables, so it holds across the processes of a fleet and across runs a `kill -9` cut
//! short, where the handlers' counters in memory do not.

use std::collections::{HashMap, HashSet};

use sqlx::Row;
use uuid::Uuid;

use crate::db::Db;
use crate::webhooks;

/// The effects of a set of events.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    pub(crate) events: usize,
    /// Delivery rows found, one expected per event and subscribed webhook.
    pub(crate) rows: usize,
    /// Rows sent at least once.
    pub(crate) sent: usize,
    /// Sends beyond the first of each row: what a crash between a send and its settle repeats.
    pub(crate) repeated_sends: i64,
    pub(crate) audited: usize,
    /// Events missing a row, a send or their audit entry.
    pub(crate) incomplete: Vec<Uuid>,
}

impl Effects {
    /// Every event has all its effects.
    pub(crate) fn complete(&self) -> bool {
        self.incomplete.is_empty()
    }

    /// The summary's line for every run in the database.
    pub(crate) fn of_all_runs(&self) -> String {
        format!(
            "  all runs in this database   {} events, {} with every effect; {} sends repeated \
             after a crash (the receiver's idempotency key absorbs them)",
            self.events,
            self.events - self.incomplete.len(),
            self.repeated_sends
        )
    }
}

/// Every event the organizations module recorded, in any run.
pub(crate) async fn announced(db: &Db) -> Result<Vec<Uuid>, Box<dyn std::error::Error>> {
    let mut events = Vec::new();
    for row in sqlx::query("SELECT id FROM organization_events")
        .fetch_all(&db.pool)
        .await?
    {
        events.push(Uuid::parse_str(&row.try_get::<String, _>(0)?)?);
    }
    Ok(events)
}

/// The effects of `events`, all of `organization_id`.
pub(crate) async fn of(
    db: &Db,
    organization_id: i64,
    events: &[Uuid],
) -> Result<Effects, Box<dyn std::error::Error>> {
    let webhooks = webhooks::webhook_ids(db, organization_id).await?;
    let rows: HashSet<String> = strings(db, "SELECT id FROM webhook_deliveries").await?;
    let audited: HashSet<String> =
        strings(db, "SELECT source_message_id FROM audit_entries").await?;
    let mut sends = HashMap::new();
    for row in sqlx::query("SELECT delivery_id, runs FROM webhook_sends")
        .fetch_all(&db.pool)
        .await?
    {
        sends.insert(row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?);
    }

    let mut effects = Effects {
        events: events.len(),
        ..Effects::default()
    };
    for &event in events {
        let mut complete = audited.contains(&event.simple().to_string());
        effects.audited += usize::from(complete);
        for &webhook in &webhooks {
            let id = webhooks::delivery_id(Some(event), webhook);
            let written = rows.contains(&id);
            let runs = sends.get(&id).copied().unwrap_or(0);
            effects.rows += usize::from(written);
            effects.sent += usize::from(runs > 0);
            effects.repeated_sends += (runs - 1).max(0);
            complete &= written && runs > 0;
        }
        if !complete {
            effects.incomplete.push(event);
        }
    }
    Ok(effects)
}

async fn strings(
    db: &Db,
    query: &'static str,
) -> Result<HashSet<String>, Box<dyn std::error::Error>> {
    let mut strings = HashSet::new();
    for row in sqlx::query(query).fetch_all(&db.pool).await? {
        strings.insert(row.try_get(0)?);
    }
    Ok(strings)
}
