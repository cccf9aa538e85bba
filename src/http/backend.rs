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

/// The key's lock: its digest (`$1`) mixed with the schema the store's tables are in, so that
/// stores in two schemas of one database keep their keys apart as their tables do.
#[cfg(feature = "postgres")]
const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock(\
    $1 # hashtextextended(coalesce(current_schema(), ''), 0))";

/// Takes the key's lock (as [`TRY_LOCK`]), and tells whether the statement that took it also fixed the
/// transaction's snapshot (REPEATABLE READ or SERIALIZABLE, as a database or role may set
/// by default): that snapshot is older than the lock.
#[cfg(feature = "postgres")]
const OPEN: &str = "SELECT pg_try_advisory_xact_lock(\
    $1 # hashtextextended(coalesce(current_schema(), ''), 0)), \
    current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted')";

/// How often the lock of a request whose COMMIT was refused is looked at, 2 ms apart, before
/// the layer answers all the same (another request may have taken it meanwhile).
#[cfg(feature = "postgres")]
const LOCK_LET_GO_TRIES: usize = 50;

/// The database state of one request: its transaction once there is one.
pub struct Slot<DB: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) tx: Option<sqlx::Transaction<'static, DB>>,
    /// Set once the layer committed or rolled back: the endpoint can no longer write.
    pub(crate) ended: bool,
    /// Where kept answers are looked up when the transaction sees the database as it was
    /// before it held the key's lock (REPEATABLE READ, SERIALIZABLE), without the answer the
    /// request that held the lock just before kept: the runtime's own pool, so that a request
    /// never waits for a second connection of the pool its transaction holds one of.
    pub(crate) fresh_reads: Option<sqlx::Pool<DB>>,
    /// Whether the endpoint enlisted a message: its commit then wakes the runtime's relay.
    pub(crate) enlisted: bool,
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

pub(crate) mod sealed {
    use super::*;

    /// What the layer does in the database; sealed, so that no one outside can implement it
    /// or call it.
    #[allow(private_interfaces)]
    pub trait Ops: Dialect {
        /// The request's database state: on PostgreSQL a transaction holding the key's lock
        /// (`None` when another node holds it).
        fn open(
            store: &SqlStore<Self>,
            lock: i64,
        ) -> impl Future<Output = Result<Option<Slot<Self>>, sqlx::Error>> + Send;

        /// The kept answer for `id`, if one is kept and not expired; in the transaction when
        /// there is one. A column of another type than kept there is a decoding error.
        #[allow(private_interfaces)]
        fn lookup(
            slot: &mut Slot<Self>,
            id: &str,
            now: i64,
        ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

        /// Marks where the endpoint's work starts, to undo just that work later.
        fn mark(slot: &mut Slot<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

        /// Undoes the endpoint's work, keeping the request's lock.
        fn undo(slot: &mut Slot<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

        /// Begins the transaction if there is none.
        fn begin(slot: &mut Slot<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

        /// Keeps an answer; whether it was written (not when another request kept one).
        fn record(
            slot: &mut Slot<Self>,
            row: Row<'_>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Claims an intent; whether it was new.
        fn claim_intent(
            slot: &mut Slot<Self>,
            claim: IntentClaim<'_>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

        /// Returns once no transaction holds the key's lock `lock`, or after a short while:
        /// after a COMMIT the server refused, PostgreSQL sends the refusal before it ends the
        /// transaction and lets the lock go, and a retry arriving in between would be
        /// answered 409 for a request that is over.
        fn lock_let_go(pool: &sqlx::Pool<Self>, lock: i64) -> impl Future<Output = ()> + Send;

        /// Writes an outbox row in the transaction.
        fn enlist(
            tx: &mut sqlx::Transaction<'static, Self>,
            envelope: &Envelope,
        ) -> impl Future<Output = Result<(), crate::Error>> + Send;
    }
}

/// A database the Idempotency-Key layer can keep answers in: SQLite or PostgreSQL.
pub trait Backend: sealed::Ops {}

macro_rules! backend {
    ($db:ty, $begin:expr, $row:ty, |$store:ident, $lock:ident| $open:expr,
     mark = |$marked:ident| $mark:expr, undo = |$undone:ident| $undo:expr,
     lock_let_go = |$pool:ident, $locked:ident| $let_go:expr) => {
        impl Backend for $db {}

        #[allow(private_interfaces)]
        impl sealed::Ops for $db {
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
                let row: Option<$row> = match (&slot.fresh_reads, slot.tx.as_mut()) {
                    // The runtime's pool takes its connections without a ping: one the server
                    // closed while idle fails the lookup, which runs again on another. Not on
                    // a runtime that may stall, which a connection opened there would wait on.
                    (Some(pool), _) => {
                        let tries = pool.options().get_max_connections().saturating_add(1);
                        let (pool, id) = (pool.clone(), id.to_owned());
                        let lookup = async move {
                            crate::store::sql::on_live_session(tries, || {
                                sqlx::query(LOOKUP)
                                    .bind(id.as_str())
                                    .bind(now)
                                    .fetch_optional(&pool)
                            })
                            .await
                        };
                        match crate::store::sql::lasting_runtime() {
                            Some(runtime) => match runtime.spawn(lookup).await {
                                Ok(found) => found?,
                                Err(error) if error.is_panic() => {
                                    std::panic::resume_unwind(error.into_panic())
                                }
                                Err(error) => {
                                    return Err(sqlx::Error::Io(std::io::Error::other(error)));
                                }
                            },
                            None => lookup.await?,
                        }
                    }
                    (None, Some(tx)) => query.fetch_optional(&mut **tx).await?,
                    (None, None) => query.fetch_optional(&slot.pool).await?,
                };
                row.map(|row| {
                    Ok(Record::stored(
                        row.try_get("fingerprint")?,
                        row.try_get("status")?,
                        &row.try_get::<String, _>("headers")?,
                        row.try_get("body")?,
                    ))
                })
                .transpose()
            }

            async fn mark($marked: &mut Slot<Self>) -> Result<(), sqlx::Error> {
                $mark
            }

            async fn undo($undone: &mut Slot<Self>) -> Result<(), sqlx::Error> {
                $undo
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

            async fn lock_let_go($pool: &sqlx::Pool<Self>, $locked: i64) {
                $let_go
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

#[cfg(feature = "postgres")]
const MARK: &str = "SAVEPOINT dacapo_endpoint";
#[cfg(feature = "postgres")]
const UNDO: &str = "ROLLBACK TO SAVEPOINT dacapo_endpoint";

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
        fresh_reads: None,
        enlisted: false,
    })),
    // The endpoint's transaction is the request's only one: undoing its work is rolling it
    // back, and the answer is kept in a new one.
    mark = |_slot| Ok(()),
    undo = |slot| match slot.tx.take() {
        Some(tx) => tx.rollback().await,
        None => Ok(()),
    },
    // Requests are kept apart in the process, whose entry goes before the answer.
    lock_let_go = |_pool, _lock| ()
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
        let (locked, snapshot_before_lock): (bool, bool) =
            sqlx::query_as(OPEN).bind(lock).fetch_one(&mut *tx).await?;
        Ok(locked.then(|| Slot {
            pool: store.pool().clone(),
            tx: Some(tx),
            ended: false,
            fresh_reads: snapshot_before_lock.then(|| store.engine_pool().clone()),
            enlisted: false,
        }))
    },
    // A savepoint keeps the key's lock while the endpoint's work (even a failed statement,
    // which aborts a PostgreSQL transaction) is undone.
    mark = |slot| match slot.tx.as_mut() {
        Some(tx) => sqlx::query(MARK).execute(&mut **tx).await.map(drop),
        None => Ok(()),
    },
    undo = |slot| match slot.tx.as_mut() {
        Some(tx) => sqlx::query(UNDO).execute(&mut **tx).await.map(drop),
        None => Ok(()),
    },
    // A COMMIT the server refused: its error comes before the lock goes.
    lock_let_go = |pool, lock| {
        for _ in 0..LOCK_LET_GO_TRIES {
            let Ok(mut tx) = pool.begin().await else {
                return;
            };
            let free: Result<bool, _> = sqlx::query_scalar(TRY_LOCK)
                .bind(lock)
                .fetch_one(&mut *tx)
                .await;
            let _ = tx.rollback().await;
            if !matches!(free, Ok(false)) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
);
