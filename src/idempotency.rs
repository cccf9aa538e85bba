//! The idempotency toolkit for handlers: record that a piece of work was done, in the same
//! transaction as the work, under a unique constraint. The constraint, not an `if`, decides:
//! two transactions recording one key at the same moment get one `true` between them.
//!
//! ```no_run
//! # async fn charge(pool: &sqlx::SqlitePool, message_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
//! use reprise::idempotency;
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

const RECORD_KEY: &str = "INSERT INTO reprise_idempotency_keys (key, recorded_at) VALUES ($1, $2) \
    ON CONFLICT (key) DO NOTHING";

mod sealed {
    pub trait Sealed {}
}

/// A transaction a key can be recorded in: SQLite's or PostgreSQL's.
pub trait KeyTransaction: sealed::Sealed + Send {
    #[doc(hidden)]
    fn insert_key(&mut self, key: &str) -> impl Future<Output = Result<bool, Error>> + Send;
}

macro_rules! key_transaction {
    ($db:ty) => {
        impl sealed::Sealed for sqlx::Transaction<'_, $db> {}

        impl KeyTransaction for sqlx::Transaction<'_, $db> {
            async fn insert_key(&mut self, key: &str) -> Result<bool, Error> {
                let inserted = sqlx::query(RECORD_KEY)
                    .bind(key)
                    .bind(millis(chrono::Utc::now()))
                    .execute(&mut **self)
                    .await
                    .map_err(reprise_actors::Error::store)?
                    .rows_affected();
                Ok(inserted == 1)
            }
        }
    };
}

#[cfg(feature = "sqlite")]
key_transaction!(sqlx::Sqlite);
#[cfg(feature = "postgres")]
key_transaction!(sqlx::Postgres);

/// Records `key` in `tx` (in the store's `reprise_idempotency_keys`); `true` if it is new, so
/// the work should be done in the same transaction, `false` if it was recorded before.
///
/// On PostgreSQL a concurrent transaction recording the same key waits for the first to
/// finish: it then sees `false` if that one committed, `true` if it rolled back.
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
