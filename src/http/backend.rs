//! What the layer does in the database, written once per backend.

use std::future::Future;

use dacapo_actors::Envelope;

use super::record::Record;
use crate::store::sql::{Dialect, SqlStore};

pub(crate) const LOOKUP: &str = "SELECT fingerprint, status, headers, body FROM dacapo_http_keys \
    WHERE id = $1 AND expires_at > $2";

/// Keeps a response; replaces one only once it expired, so of two racing requests (two
/// processes on one SQLite file) the second finds the first's row and keeps nothing.
pub(crate) const RECORD: &str = "INSERT INTO dacapo_http_keys \
    (id, scope, key, fingerprint, status, headers, body, recorded_at, expires_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
    ON CONFLICT (id) DO UPDATE SET scope = excluded.scope, key = excluded.key, \
    fingerprint = excluded.fingerprint, status = excluded.status, headers = excluded.headers, \
    body = excluded.body, recorded_at = excluded.recorded_at, expires_at = excluded.expires_at \
    WHERE dacapo_http_keys.expires_at <= $8";

/// Claims an endpoint's intent, completed at once: it commits with the request's work. A
/// claim still within its window is left alone (a duplicate intent).
pub(crate) const CLAIM_INTENT: &str = "INSERT INTO dacapo_deduplication \
    (handler, key_hash, key, fingerprint, envelope_id, node, completed, claimed_at, expires_at) \
    VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8) \
    ON CONFLICT (handler, key_hash) DO UPDATE SET key = excluded.key, \
    fingerprint = excluded.fingerprint, envelope_id = excluded.envelope_id, \
    node = excluded.node, completed = 1, claimed_at = excluded.claimed_at, \
    expires_at = excluded.expires_at \
    WHERE dacapo_deduplication.expires_at <= $7";

#[cfg(feature = "postgres")]
const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";

/// The database state of one request: its transaction once there is one.
pub struct Slot<DB: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) tx: Option<sqlx::Transaction<'static, DB>>,
    /// Set once the layer committed or rolled back: the endpoint can no longer write.
    pub(crate) ended: bool,
}

/// A row of the key table to write.
pub(crate) struct Row<'a> {
    pub(crate) id: &'a str,
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) record: &'a Record,
    pub(crate) now: i64,
    pub(crate) expires_at: i64,
}

/// An intent claim to write.
pub(crate) struct IntentClaim<'a> {
    pub(crate) handler: &'a str,
    pub(crate) key_hash: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: &'a str,
    pub(crate) envelope: &'a Envelope,
    pub(crate) node: &'a str,
    pub(crate) now: i64,
    pub(crate) expires_at: i64,
}

mod sealed {
    pub trait Sealed {}
}

/// A database the Idempotency-Key layer can keep responses in: SQLite or PostgreSQL.
// Sealed: its methods are the layer's, written with the layer's own types, which no one
// outside can name, call or implement.
#[allow(private_interfaces)]
pub trait Backend: Dialect + sealed::Sealed {
    #[doc(hidden)]
    fn open(
        store: &SqlStore<Self>,
        lock: i64,
    ) -> impl Future<Output = Result<Option<Slot<Self>>, sqlx::Error>> + Send;

    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn lookup(
        slot: &mut Slot<Self>,
        id: &str,
        now: i64,
    ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn begin(slot: &mut Slot<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn record(
        slot: &mut Slot<Self>,
        row: Row<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn claim_intent(
        slot: &mut Slot<Self>,
        claim: IntentClaim<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn enlist(
        tx: &mut sqlx::Transaction<'static, Self>,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send;
}

macro_rules! backend {
    ($db:ty, $begin:expr, $row:ty, |$store:ident, $lock:ident| $open:expr) => {
        impl sealed::Sealed for $db {}

        #[allow(private_interfaces)]
        impl Backend for $db {
            async fn open(
                $store: &SqlStore<Self>,
                $lock: i64,
            ) -> Result<Option<Slot<Self>>, sqlx::Error> {
                $open
            }

            async fn lookup(
                slot: &mut Slot<Self>,
                id: &str,
                now: i64,
            ) -> Result<Option<Record>, sqlx::Error> {
                use sqlx::Row as _;
                let query = sqlx::query(LOOKUP).bind(id).bind(now);
                let row: Option<$row> = match slot.tx.as_mut() {
                    Some(tx) => query.fetch_optional(&mut **tx).await?,
                    None => query.fetch_optional(&slot.pool).await?,
                };
                row.map(|row| {
                    Ok(Record {
                        fingerprint: row.try_get("fingerprint")?,
                        status: u16::try_from(row.try_get::<i32, _>("status")?).unwrap_or(500),
                        headers: Record::headers_from_json(&row.try_get::<String, _>("headers")?),
                        body: row.try_get("body")?,
                    })
                })
                .transpose()
            }

            async fn begin(slot: &mut Slot<Self>) -> Result<(), sqlx::Error> {
                if slot.tx.is_none() {
                    slot.tx = Some(slot.pool.begin_with($begin).await?);
                }
                Ok(())
            }

            async fn record(slot: &mut Slot<Self>, row: Row<'_>) -> Result<bool, sqlx::Error> {
                Self::begin(slot).await?;
                let Some(tx) = slot.tx.as_mut() else {
                    return Ok(false);
                };
                let headers = row.record.headers_json();
                let done = sqlx::query(RECORD)
                    .bind(row.id)
                    .bind(row.scope)
                    .bind(row.key)
                    .bind(&row.record.fingerprint)
                    .bind(i32::from(row.record.status))
                    .bind(headers)
                    .bind(row.record.body.as_deref())
                    .bind(row.now)
                    .bind(row.expires_at)
                    .execute(&mut **tx)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn claim_intent(
                slot: &mut Slot<Self>,
                claim: IntentClaim<'_>,
            ) -> Result<bool, sqlx::Error> {
                Self::begin(slot).await?;
                let Some(tx) = slot.tx.as_mut() else {
                    return Ok(false);
                };
                let done = sqlx::query(CLAIM_INTENT)
                    .bind(claim.handler)
                    .bind(claim.key_hash)
                    .bind(claim.key)
                    .bind(claim.fingerprint)
                    .bind(claim.envelope.id.simple().to_string())
                    .bind(claim.node)
                    .bind(claim.now)
                    .bind(claim.expires_at)
                    .execute(&mut **tx)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn enlist(
                tx: &mut sqlx::Transaction<'static, Self>,
                envelope: &Envelope,
            ) -> Result<(), crate::Error> {
                crate::outbox::Enlist::insert(tx, envelope).await
            }
        }
    };
}

// SQLite has one writer and one process: requests are kept apart in the process, and the
// transaction starts (`BEGIN IMMEDIATE`) only when there is something to write.
#[cfg(feature = "sqlite")]
backend!(
    sqlx::Sqlite,
    "BEGIN IMMEDIATE",
    sqlx::sqlite::SqliteRow,
    |store, _lock| Ok(Some(Slot {
        pool: store.pool().clone(),
        tx: None,
        ended: false,
    }))
);

// PostgreSQL serves several nodes: the request's transaction takes a lock on its key first,
// held until it commits or rolls back, so a request on another node with the same key is
// answered 409 at once; a crash releases it with the connection.
#[cfg(feature = "postgres")]
backend!(
    sqlx::Postgres,
    "BEGIN",
    sqlx::postgres::PgRow,
    |store, lock| {
        let mut tx = store.pool().begin().await?;
        let locked: bool = sqlx::query_scalar(TRY_LOCK)
            .bind(lock)
            .fetch_one(&mut *tx)
            .await?;
        Ok(locked.then(|| Slot {
            pool: store.pool().clone(),
            tx: Some(tx),
            ended: false,
        }))
    }
);
