//! The idempotency toolkit for handlers: record that a piece of work was done, in the same
//! transaction as the work, under a unique constraint. The constraint, not an `if`, decides:
//! two transactions recording one key at the same moment get one `true` between them.
//!
//! ```no_run
//! use dacapo::{sqlx, uuid};
//! # async fn charge(pool: &sqlx::SqlitePool, message_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
//! use dacapo::idempotency;
//!
//! let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
//! if !idempotency::record_key(&mut tx, &format!("charge:{}", message_id.simple())).await? {
//!     return Ok(()); // already done: a redelivery or a retry
//! }
//! // … charge the card, in `tx` …
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

use std::future::Future;

use crate::Error;
use crate::store::sql::millis;

const RECORD_KEY: &str = "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ($1, $2) \
    ON CONFLICT (key) DO NOTHING";

mod sealed {
    pub trait Sealed {}
}

/// A transaction a key can be recorded in: SQLite's or PostgreSQL's.
pub trait KeyTransaction: sealed::Sealed + Send {
    #[doc(hidden)]
    fn insert_key(&mut self, key: &str) -> impl Future<Output = Result<bool, Error>> + Send;

    #[doc(hidden)]
    fn insert_key_at(
        &mut self,
        key: &str,
        recorded_at: i64,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    #[doc(hidden)]
    fn select_existing(
        &mut self,
        table: &str,
        column: &str,
        ids: &[String],
    ) -> impl Future<Output = Result<Vec<String>, Error>> + Send;
}

macro_rules! key_transaction {
    ($db:ty, lookup = $lookup:literal, ids = $ids:expr) => {
        impl sealed::Sealed for sqlx::Transaction<'_, $db> {}

        impl KeyTransaction for sqlx::Transaction<'_, $db> {
            async fn insert_key(&mut self, key: &str) -> Result<bool, Error> {
                self.insert_key_at(key, millis(chrono::Utc::now())).await
            }

            async fn insert_key_at(&mut self, key: &str, recorded_at: i64) -> Result<bool, Error> {
                let inserted = sqlx::query(RECORD_KEY)
                    .bind(key)
                    .bind(recorded_at)
                    .execute(&mut **self)
                    .await
                    .map_err(crate::store::sql::db_error)?
                    .rows_affected();
                Ok(inserted == 1)
            }

            async fn select_existing(
                &mut self,
                table: &str,
                column: &str,
                ids: &[String],
            ) -> Result<Vec<String>, Error> {
                let sql = format!($lookup, column = column, table = table);
                let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind($ids(ids)?)
                    .fetch_all(&mut **self)
                    .await
                    .map_err(crate::store::sql::db_error)?;
                Ok(rows)
            }
        }
    };
}

// One round trip whatever the number of ids: SQLite reads them from a JSON array, PostgreSQL
// from an array parameter.
#[cfg(feature = "sqlite")]
key_transaction!(
    sqlx::Sqlite,
    lookup = "SELECT {column} FROM {table} WHERE {column} IN (SELECT value FROM json_each($1))",
    ids = |ids: &[String]| serde_json::to_string(ids)
        .map_err(|e| Error::from(dacapo_actors::Error::store(e)))
);
#[cfg(feature = "postgres")]
key_transaction!(
    sqlx::Postgres,
    lookup = "SELECT {column} FROM {table} WHERE {column} = ANY($1)",
    ids = |ids: &[String]| Ok::<_, Error>(ids.to_vec())
);

// A handler's transaction stamps its keys on the store's clock, as the store stamps its rows,
// and the runtime's cleanup reads that clock unless the runtime was given another (virtual
// under the test harness); a bare transaction has only the system's.
impl<DB: crate::transaction::Backend> sealed::Sealed
    for crate::transaction::HandlerTransaction<DB>
{
}

impl<DB: crate::transaction::Backend> KeyTransaction for crate::transaction::HandlerTransaction<DB>
where
    sqlx::Transaction<'static, DB>: KeyTransaction,
{
    async fn insert_key(&mut self, key: &str) -> Result<bool, Error> {
        let recorded_at = self.stamp();
        self.insert_key_at(key, recorded_at).await
    }

    async fn insert_key_at(&mut self, key: &str, recorded_at: i64) -> Result<bool, Error> {
        (**self).insert_key_at(key, recorded_at).await
    }

    async fn select_existing(
        &mut self,
        table: &str,
        column: &str,
        ids: &[String],
    ) -> Result<Vec<String>, Error> {
        (**self).select_existing(table, column, ids).await
    }
}

/// Records `key` in `tx` (in the store's `dacapo_idempotency_keys`); `true` if it is new, so
/// the work should be done in the same transaction, `false` if it was recorded before.
///
/// In a handler's [`HandlerTransaction`](crate::transaction::HandlerTransaction) (pass
/// `&mut tx`, not `&mut *tx`) the key is stamped on the store's clock, which the runtime's
/// cleanup goes by; in a transaction of your own, on the system's clock.
///
/// On PostgreSQL a concurrent transaction recording the same key waits for the first to
/// finish: it then sees `false` if that one committed, `true` if it rolled back — under
/// `READ COMMITTED`. Under `REPEATABLE READ` or `SERIALIZABLE` it fails instead with a
/// serialization failure (SQLSTATE 40001) when the first committed: roll back and run it
/// again, to see `false`.
///
/// # Errors
///
/// The database's error; roll `tx` back.
///
/// # Cancel safety
///
/// Cancelled, the key may or may not be written in `tx`: roll it back.
pub async fn record_key<T: KeyTransaction>(tx: &mut T, key: &str) -> Result<bool, Error> {
    tx.insert_key(key).await
}

/// Of `ids` (row ids derived from the message, say with [`ids::derive`](crate::ids::derive)),
/// the ones not yet in `table.column`, in the order given, found in one round trip within
/// `tx`. A handler inserts those and returns early when there are none — a retry of work
/// already done then writes nothing, commits nothing and publishes nothing.
///
/// ```no_run
/// use dacapo::{sqlx, uuid};
/// # async fn queue(pool: &sqlx::SqlitePool, message_id: uuid::Uuid, webhooks: &[i64]) -> Result<(), Box<dyn std::error::Error>> {
/// use dacapo::{idempotency, ids};
///
/// let wanted: Vec<String> = webhooks
///     .iter()
///     .map(|webhook| ids::derive(message_id, &webhook.to_string()))
///     .collect();
/// let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
/// let missing = idempotency::missing_ids(&mut tx, "webhook_deliveries", "id", &wanted).await?;
/// if missing.is_empty() {
///     return Ok(()); // all done before: no commit, no publish
/// }
/// // … insert the missing rows in `tx`, commit, then announce them …
/// # Ok(())
/// # }
/// ```
///
/// `column` must hold text (the ids [`ids::derive`](crate::ids::derive) gives are); `table`
/// and `column` are used as written, unquoted (`schema.table` is accepted).
///
/// # Errors
///
/// [`Error::InvalidIdentifier`] when `table` or `column` is not a plain identifier (nothing
/// is run), or the database's error.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn missing_ids<T: KeyTransaction>(
    tx: &mut T,
    table: &str,
    column: &str,
    ids: &[String],
) -> Result<Vec<String>, Error> {
    let (table, column) = (identifier(table)?, identifier(column)?);
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let existing: std::collections::HashSet<String> = tx
        .select_existing(table, column, ids)
        .await?
        .into_iter()
        .collect();
    let mut seen = std::collections::HashSet::new();
    Ok(ids
        .iter()
        .filter(|id| !existing.contains(*id) && seen.insert(*id))
        .cloned()
        .collect())
}

/// `name` if it is a plain identifier, optionally qualified (`schema.table`): it is spliced
/// into SQL, so nothing else may pass.
fn identifier(name: &str) -> Result<&str, Error> {
    let plain = |part: &str| {
        let mut chars = part.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() <= 2 && parts.iter().all(|part| plain(part)) {
        Ok(name)
    } else {
        Err(Error::InvalidIdentifier(name.to_owned()))
    }
}
