//! The audit module: one entry per consumed fact, keyed on the message id.

use dacapo::prelude::*;
use sqlx::AssertSqlSafe;

use crate::db::Db;

use crate::events::MemberRemoved;

pub(crate) async fn migrate(db: &Db) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS audit_entries (
             id {},
             source_message_id TEXT NOT NULL,
             organization_id BIGINT NOT NULL,
             description TEXT NOT NULL)",
        db.generated_key()
    )))
    .execute(&db.pool)
    .await?;
    sqlx::query(
        "CREATE UNIQUE INDEX IF NOT EXISTS audit_entries_source
             ON audit_entries (source_message_id, organization_id)",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

pub(crate) struct RecordEntry {
    db: Db,
}

impl RecordEntry {
    pub(crate) fn new(db: Db) -> Self {
        Self { db }
    }
}

impl Handler<MemberRemoved> for RecordEntry {
    async fn handle(
        &self,
        event: &MemberRemoved,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        // An audit entry only ever comes from a consumed message: a missing id is a bug.
        let message_id = context.message_id().ok_or_else(|| {
            HandlerError::permanent("an audit entry is only recorded from a consumed message, and this one has no message id")
        })?;
        // The unique index, not a prior SELECT, decides: a second attempt inserts nothing.
        sqlx::query(
            "INSERT INTO audit_entries (source_message_id, organization_id, description)
             VALUES ($1, $2, $3) ON CONFLICT (source_message_id, organization_id) DO NOTHING",
        )
        .bind(message_id.simple().to_string())
        .bind(event.organization_id)
        .bind(format!("member {} removed", event.member_id))
        .execute(&self.db.pool)
        .await?;
        Ok(())
    }
}
