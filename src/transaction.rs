//! Handler transactions: a handler's own writes, its idempotency keys, its outbox rows, its
//! deduplication claim and the record that it completed, in one transaction on the runtime's
//! store. They commit together or not at all.
//!
//! Opening one records the handler's completion for the message first (a row under a primary
//! key of envelope id and handler): when an earlier attempt already committed, there is nothing
//! to open and [`transaction`](HandlerTransactions::transaction) answers `None`. A retry, a
//! restart or a redelivery within the inbox's retention then never repeats the handler's
//! database effects, whatever the [`RetryScope`](crate::RetryScope); with
//! `RetryScope::FailedHandlers` the handler is not even run again once it succeeded in an
//! attempt that failed (after a crash mid-attempt it is, and this answers `None`).
//!
//! Keep the transaction short and open one at a time per handler: on SQLite it holds the
//! database's write lock (`BEGIN IMMEDIATE`) until it ends, and the runtime's own writes wait
//! for it; on PostgreSQL a second transaction of the same handler and message would wait for
//! the first one's completion record.
//!
//! For writes that are idempotent by themselves, a [`HandlerConnection`]
//! ([`connection`](HandlerTransactions::connection)) is lighter: statements that commit one by
//! one, with no completion record, durable with the delivery's settle.
//!
//! ```no_run
//! use dacapo::sqlx;
//! use dacapo::prelude::*;
//! use dacapo::transaction::HandlerTransactions;
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize)] struct OrderPlaced { order: String }
//! # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
//! # #[derive(Serialize, Deserialize)] struct InvoiceIssued { order: String }
//! # impl Message for InvoiceIssued { const TYPE: &'static str = "billing.invoice_issued"; }
//!
//! struct Invoice;
//!
//! impl Handler<OrderPlaced> for Invoice {
//!     async fn handle(&self, event: &OrderPlaced, ctx: &MessageContext) -> Result<(), HandlerError> {
//!         let Some(mut tx) = ctx.transaction::<sqlx::Sqlite>().await? else {
//!             return Ok(()); // an earlier attempt committed this handler's work
//!         };
//!         sqlx::query("INSERT INTO invoices (order_ref) VALUES ($1)")
//!             .bind(&event.order)
//!             .execute(&mut **tx)
//!             .await?;
//!         tx.enlist(&InvoiceIssued { order: event.order.clone() }).await?;
//!         tx.commit().await?; // the invoice, its event and the completion record, together
//!         Ok(())
//!     }
//! }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use dacapo_actors::{Envelope, Message, MessageContext, SendOptions};
use uuid::Uuid;

use crate::Error;
use crate::store::sql::{
    COMPLETE_CLAIM, ENLIST_ONCE, EnvelopeColumns, Value, bind, claim_lost, id_text, millis,
};

pub(crate) const RECORD_COMPLETION: &str = "INSERT INTO dacapo_handler_completions \
    (envelope_id, handler, completed_at) VALUES ($1, $2, $3) \
    ON CONFLICT (envelope_id, handler) DO NOTHING";

/// Whether the attempt a handler transaction is opened for still runs here: its delivery not
/// settled, at this attempt, owned by this node (or by none, while this node's shutdown gave it
/// up for the moment). A node paused past its heartbeat finds another node took the delivery
/// over, or settled it and — past the retention — forgot its completion records; without this,
/// its handler's effect would commit a second time.
macro_rules! attempt_still_runs {
    () => {
        "SELECT 1 AS runs FROM dacapo_inbox WHERE id = $1 AND status <> 'handled' \
         AND attempts = $2 AND (owner = $3 OR owner IS NULL)"
    };
}

/// Completions older than the retention of envelopes neither unsettled in the inbox nor
/// dead-lettered: no attempt can run them again. A dead letter keeps its completions, so that
/// its replay does not redo the work its handlers committed.
pub(crate) const DELETE_COMPLETIONS: &str = "DELETE FROM dacapo_handler_completions \
    WHERE (envelope_id, handler) IN (SELECT envelope_id, handler \
    FROM dacapo_handler_completions c WHERE completed_at < $1 \
    AND NOT EXISTS (SELECT 1 FROM dacapo_inbox i \
        WHERE i.id = c.envelope_id AND i.status <> 'handled') \
    AND NOT EXISTS (SELECT 1 FROM dacapo_dead_letters d WHERE d.id = c.envelope_id) \
    LIMIT $2)";

mod sealed {
    pub trait Sealed {}
}

/// A database the runtime's store can open handler transactions on: SQLite or PostgreSQL.
pub trait Backend: sealed::Sealed + sqlx::Database {
    #[doc(hidden)]
    fn begin(
        context: &MessageContext,
    ) -> impl Future<Output = Result<Option<HandlerTransaction<Self>>, Error>> + Send;

    #[doc(hidden)]
    fn finish(
        transaction: &mut HandlerTransaction<Self>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    #[doc(hidden)]
    fn insert(
        transaction: &mut HandlerTransaction<Self>,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    #[doc(hidden)]
    fn connect(
        context: &MessageContext,
    ) -> impl Future<Output = Result<HandlerConnection<'_, Self>, Error>> + Send;

    /// Waits until `connection` finished what it was asked, then rolls back a transaction a
    /// handler began by hand and left open on it; whether there was one.
    #[doc(hidden)]
    fn end_left_open(
        connection: &mut Self::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
}

/// Opens handler transactions from a [`MessageContext`].
pub trait HandlerTransactions {
    /// Opens a transaction on the runtime's store for this handler and message, after
    /// recording in it that the handler completed; `None` when an earlier attempt's
    /// transaction already committed that record, so the handler's work is done.
    ///
    /// `DB` is the store's database: `sqlx::Sqlite` for a [`SqliteStore`](crate::store::SqliteStore),
    /// `sqlx::Postgres` for a [`PostgresStore`](crate::store::PostgresStore).
    ///
    /// # Errors
    ///
    /// [`Error::Detached`](crate::Error::Detached) outside a consumer,
    /// [`Error::Store`](crate::Error::Store) when the runtime's store is not a `DB` store or the
    /// database fails.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, no transaction is left open: whatever it wrote is rolled back.
    fn transaction<DB: Backend>(
        &self,
    ) -> impl Future<Output = Result<Option<HandlerTransaction<DB>>, Error>> + Send;

    /// A connection on the runtime's store for this handler's own statements, each committed
    /// on its own (or in a transaction the handler begins on it): for writes that are
    /// idempotent by themselves — an insert under a deterministic id, an upsert — and need no
    /// completion record. See [`HandlerConnection`] for when they are durable.
    ///
    /// # Errors
    ///
    /// [`Error::Detached`](crate::Error::Detached) outside a consumer, and for a copy of the
    /// context kept past its attempt; [`Error::Store`](crate::Error::Store)
    /// when the runtime's store is not a `DB` store, when no connection comes within the
    /// pool's acquire timeout, and, on SQLite, when the turn to write does not come within
    /// 30 s. A handler that already holds a connection or a handler transaction may wait for
    /// itself (on SQLite, the turn is one; on PostgreSQL, each holds a connection of a
    /// bounded pool): drop one before opening the next.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, nothing is held: the turn and the connection go back.
    fn connection<DB: Backend>(
        &self,
    ) -> impl Future<Output = Result<HandlerConnection<'_, DB>, Error>> + Send;
}

impl HandlerTransactions for MessageContext {
    fn transaction<DB: Backend>(
        &self,
    ) -> impl Future<Output = Result<Option<HandlerTransaction<DB>>, Error>> + Send {
        DB::begin(self)
    }

    fn connection<DB: Backend>(
        &self,
    ) -> impl Future<Output = Result<HandlerConnection<'_, DB>, Error>> + Send {
        DB::connect(self)
    }
}

/// A connection a handler opened with [`HandlerTransactions::connection`]. It dereferences to
/// the database's connection (`.execute(&mut *connection)`); each statement commits on its
/// own, unless the handler begins a transaction on it (on SQLite, `BEGIN IMMEDIATE` for one
/// that reads, then writes).
///
/// **Durable with the delivery.** On a SQLite file in WAL mode whose store fsyncs its commits
/// (what [`SqliteStore::open`](crate::store::SqliteStore::open) makes) its statements commit without
/// an fsync of their own (`synchronous = NORMAL`, on a pool of at most two connections); the
/// delivery's settle — handled, retry scheduled or dead-lettered — commits after them with
/// `FULL`, which fsyncs the write-ahead log and with it every commit before it. So once the
/// delivery is settled, the handler's writes are as durable as its settle. A process crash
/// loses none of them; a power cut or an operating-system crash before the settle can take
/// back the last ones, and the settle with them, so the delivery runs again and the handler
/// writes them again — keep them idempotent (deterministic ids, `ON CONFLICT`), as a retry
/// needs anyway. Until then other readers can see them: the outbox relay syncs the log before
/// it sends what it read to a broker. A database the connection attaches (`ATTACH`) has a log
/// of its own, which the settle does not sync. On PostgreSQL it comes from a pool of its own
/// (as large as the application's) with `synchronous_commit = off`: its commits return before
/// the server flushed them to its write-ahead log, and the settle, committed after them at the
/// store's own level, has the server flush the log up to it, every commit before it included.
/// A crash of the server before the settle can take back the last of them with the settle;
/// the relay has the log flushed before it sends what it read. Everywhere else — an in-memory
/// SQLite database, another journal mode, a store opened at `synchronous = NORMAL`, a
/// PostgreSQL store whose own commits do not wait for the flush, a store whose deliveries
/// settle in another inbox — it is a connection of the runtime's own pool, at the store's own
/// level.
///
/// **On SQLite it holds the turn to write** until it is dropped: the runtime's own writes wait
/// for it, so keep it short — no calls to other services while it is open. What it leaves
/// running when dropped (a statement whose future was dropped, the rollback of an sqlx
/// transaction dropped unfinished) ends before the next handler connection's first
/// statement — that one is the same connection, its statements queued behind — and before
/// the runtime's next write, which waits up to 5 s for it and then writes anyway (SQLite's
/// busy timeout then decides); a rollback is waited for, as long, before the next handler
/// gets the connection. A `BEGIN` run by hand is the handler's to end; left open when the
/// connection is dropped, the runtime ends it (with a warning) before its own next write and
/// before the connection goes back to its pool: rolled back where nobody used the connection
/// since, committed when the next handler took SQLite's parked connection first and may have
/// written inside it (a `BEGIN` of its own fails meanwhile). Commit what you begin, or begin
/// with sqlx's `begin`, which rolls back when dropped. Session settings a handler changes on
/// it (`SET`, a `PRAGMA`) outlive the handler, for the next user of the connection — on
/// PostgreSQL the next handler's: change them with `SET LOCAL` inside a transaction, which
/// ends them with it. It borrows the handler's [`MessageContext`], and a
/// copy of the context kept past its attempt opens none: a write after the attempt would
/// come after the settle that makes it durable. On PostgreSQL, which has no turn to hold, the
/// attempt's end (and so its settle) waits instead until every connection opened in it is
/// dropped and done with what it ran — a statement a handler left running when it gave up, a
/// connection handed to a task of its own — for up to 5 s, then settles anyway with a
/// warning: what such a connection commits later comes after the settle, without a flush of
/// its own. Keep the connection, and what runs on it, within the handler.
pub struct HandlerConnection<'a, DB: Backend> {
    /// `None` only once dropped.
    connection: Option<sqlx::pool::PoolConnection<DB>>,
    /// SQLite's turn to write; released once the connection is parked, or elsewhere done with
    /// what it was asked.
    turn: Option<tokio::sync::OwnedSemaphorePermit>,
    /// On PostgreSQL, a connection of the runtime's pool held by a handler
    /// (`Database::handler_slot`); released once the connection is back.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Told when the connection opens and closes, where its commits wait for a later sync.
    unsynced: Option<Arc<crate::store::sql::Unsynced>>,
    /// Where the connection waits with the turn for the next handler, on SQLite's handler
    /// pool (see `store::sql::parking`); `None` where it goes back to its pool.
    park: Option<Park<DB>>,
    /// Asked, once the connection is dropped, whether the runtime gave up on the handler.
    context: &'a MessageContext,
    /// Given to the handler: what runs on it may be the handler's.
    handed: bool,
    /// Where no turn keeps the connection inside its attempt (PostgreSQL): a hold on the
    /// attempt, whose end waits until the connection is back in its pool, whatever ran on it
    /// over.
    hold: Option<dacapo_actors::AttemptHold>,
}

/// Leaves a handler connection with the turn to write, told whether the runtime gave up on
/// its handler (what runs on it was abandoned).
pub(crate) type Park<DB> = Box<dyn FnOnce(sqlx::pool::PoolConnection<DB>, bool) + Send + Sync>;

/// The turn to write for a handler connection, the connection parked with it, and where to
/// park the connection after use.
pub(crate) struct ParkedTurn<DB: sqlx::Database> {
    pub(crate) turn: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The parked connection, and whether it still counts as an open handler connection.
    pub(crate) connection: Option<(sqlx::pool::PoolConnection<DB>, bool)>,
    pub(crate) park: Park<DB>,
}

/// How long a closing handler connection may take to finish what it was asked (a rollback
/// left pending) before its turn goes anyway; the connection goes back to its pool only once
/// it finished.
const CLOSING: std::time::Duration = std::time::Duration::from_secs(5);

impl<DB: Backend> Drop for HandlerConnection<'_, DB> {
    /// Gives the turn, and the connection with it to the next handler, on SQLite's handler
    /// pool: what this handler left running on it (a statement a cancelled handler dropped,
    /// the rollback of a transaction dropped unfinished) ends before anything the next one
    /// asks, and a writer of the runtime's waits for it (`store::sql::parking`). A statement
    /// left outside a transaction by a handler the runtime gave up on is interrupted.
    ///
    /// Elsewhere, finishes what the connection was asked, then gives the turn: a statement,
    /// queued behind that work (bounded by `CLOSING`), tells when it ended, so the next
    /// writer never finds SQLite's lock taken, and rolls back a transaction the handler began
    /// by hand and left open (`store::sql::left_open`) before the connection goes back to its
    /// pool.
    fn drop(&mut self) {
        let connection = self.connection.take();
        // Released with the turn: once the connection is back, or gone.
        let turn = (self.turn.take(), self.slot.take());
        let unsynced = self.unsynced.take();
        let hold = self.hold.take();
        if let Some(park) = self.park.take()
            && let Some(connection) = connection
        {
            // It counts as an open handler connection until a writer sees it finish: what it
            // may still commit comes before the next sync, the settle's or the relay's.
            park(connection, self.handed && self.context.given_up());
            drop((unsynced, turn));
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (one of the engine's workers stopped under the handler, a shutdown
            // past its drain): gone as it is, closed, on a runtime that lasts, since sqlx
            // cannot take a connection back where none runs (it panics there).
            if let Some(unsynced) = unsynced {
                unsynced.closed();
            }
            let gone = move || drop((connection.map(|c| c.detach()), turn, hold));
            match crate::store::sql::lasting_runtime() {
                Some(lasting) => {
                    let _on_it = lasting.enter();
                    gone();
                }
                None => std::mem::forget(gone),
            }
            return;
        };
        runtime.spawn(async move {
            let ((mut turn, slot), mut hold) = (turn, hold);
            if let Some(connection) = connection {
                let mut closing = Closing(Some(connection));
                let ended = end_left_open::<DB>(closing.connection(), &mut turn).await;
                // Nothing on it can write any more: the attempt may end.
                drop(hold.take());
                if ended.is_ok() {
                    closing.give_back();
                }
            }
            // What it committed comes before: the next sync covers it.
            if let Some(unsynced) = unsynced {
                unsynced.closed();
            }
            drop((turn, slot, hold));
        });
    }
}

/// A handler connection on its way back to its pool, closed instead if it never gets there
/// (it failed, or its task was dropped with the runtime) — with whatever it may still hold,
/// which ends with it.
struct Closing<DB: sqlx::Database>(Option<sqlx::pool::PoolConnection<DB>>);

/// Ends what a handler left open on `connection` ([`Backend::end_left_open`]); still busy
/// after [`CLOSING`], gives the `turn` up (the next writer's busy timeout decides) and waits
/// on: the connection goes back to its pool only once it ended.
async fn end_left_open<DB: Backend>(
    connection: &mut DB::Connection,
    turn: &mut Option<tokio::sync::OwnedSemaphorePermit>,
) -> Result<bool, sqlx::Error> {
    let ending = DB::end_left_open(connection);
    tokio::pin!(ending);
    match tokio::time::timeout(CLOSING, &mut ending).await {
        Ok(ended) => ended,
        Err(_) => {
            drop(turn.take());
            ending.await
        }
    }
}

impl<DB: sqlx::Database> Closing<DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self.0
            .as_deref_mut()
            .expect("a closing connection is there until given back or dropped")
    }

    fn give_back(mut self) {
        drop(self.0.take());
    }
}

impl<DB: sqlx::Database> Drop for Closing<DB> {
    fn drop(&mut self) {
        if let Some(connection) = self.0.take() {
            drop(connection.detach());
        }
    }
}

impl<DB: Backend> std::fmt::Debug for HandlerConnection<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerConnection")
            .field("database", &DB::NAME)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Deref for HandlerConnection<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        self.connection
            .as_deref()
            .expect("a handler connection is there until it is dropped")
    }
}

impl<DB: Backend> DerefMut for HandlerConnection<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.connection
            .as_deref_mut()
            .expect("a handler connection is there until it is dropped")
    }
}

/// A transaction a handler opened with [`HandlerTransactions::transaction`]. It dereferences
/// to the `sqlx::Transaction` for the handler's own queries (`.execute(&mut **tx)`), and
/// idempotency keys and [`Outbox`](crate::outbox::Outbox) rows can be written in it.
///
/// Dropped without [`commit`](Self::commit), it rolls back, completion record included: the
/// handler's next attempt opens it anew. On SQLite it holds the turn to write until it ended
/// on its connection — a statement it left running, then its rollback — so the runtime's next
/// write never finds SQLite's lock taken.
pub struct HandlerTransaction<DB: Backend> {
    /// `None` only once committed, rolled back or dropped.
    tx: Option<sqlx::Transaction<'static, DB>>,
    context: MessageContext,
    message_id: Uuid,
    handler: String,
    /// The store's node, which the handler's claim must still be held by at commit.
    node: String,
    enlisted: HashMap<(String, Vec<u8>), u32>,
    /// SQLite's turn to write, which the runtime's own writers wait for (on PostgreSQL, one of
    /// the connections handler transactions may hold); released once the transaction ended on
    /// its connection, its commit or rollback included.
    turn: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The store's clock, which it stamps its rows on.
    clock: Arc<dyn dacapo_actors::ports::Clock>,
}

impl<DB: Backend> Drop for HandlerTransaction<DB> {
    /// Dropped unfinished (an error on the way, a cancelled handler), the transaction rolls
    /// back on its connection's thread a moment later, still holding SQLite's lock — after
    /// whatever statement the handler left running there: the turn goes once that ended, so
    /// that the next writer never finds the lock taken.
    ///
    /// The rollback runs on a runtime that lasts: a handler's runtime is one of the engine's
    /// workers, and one that stops under it (a shutdown past its drain) runs no task any more
    /// and drops the transaction where sqlx cannot take its connection back (it panics there).
    fn drop(&mut self) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        let turn = self.turn.take();
        let end = async move {
            let _ = tx.rollback().await;
            drop(turn);
        };
        match crate::store::sql::lasting_runtime() {
            Some(runtime) => {
                runtime.spawn(end);
            }
            // No runtime, and no thread could start: the connection stays out of its pool,
            // its transaction open until the process ends, rather than a panic here.
            None => std::mem::forget(end),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for HandlerTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction")
            .field("message_id", &self.message_id)
            .field("handler", &self.handler)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Deref for HandlerTransaction<DB> {
    type Target = sqlx::Transaction<'static, DB>;

    fn deref(&self) -> &Self::Target {
        self.tx
            .as_ref()
            .expect("a handler transaction is open until it is consumed or dropped")
    }
}

impl<DB: Backend> DerefMut for HandlerTransaction<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx
            .as_mut()
            .expect("a handler transaction is open until it is consumed or dropped")
    }
}

impl<DB: Backend> HandlerTransaction<DB> {
    /// The id of the message being handled.
    pub fn message_id(&self) -> Uuid {
        self.message_id
    }

    /// Now, on the store's clock, in the store's unit.
    pub(crate) fn stamp(&self) -> i64 {
        millis(self.clock.now())
    }

    /// Writes `message` to the outbox in this transaction: it is published after the commit,
    /// as [`MessageContext::envelope`] prepares it (this message as its causation, the
    /// runtime's deduplication rules and size limit). Its envelope id is derived from the message id,
    /// the handler and what it enlisted before, so the same work enlists the same envelope.
    ///
    /// # Errors
    ///
    /// The serializer's error, an envelope over the size limit, or the database's error; drop
    /// the transaction.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the row may or may not be written: drop the transaction.
    pub async fn enlist<M: Message>(&mut self, message: &M) -> Result<Uuid, Error> {
        self.enlist_with(message, SendOptions::default()).await
    }

    /// [`enlist`](Self::enlist) with a deduplication id, headers or correlation id.
    ///
    /// # Errors
    ///
    /// As [`enlist`](Self::enlist).
    ///
    /// # Cancel safety
    ///
    /// As [`enlist`](Self::enlist).
    pub async fn enlist_with<M: Message>(
        &mut self,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let mut envelope = self.context.envelope(message, options)?;
        let occurrence = self
            .enlisted
            .entry((envelope.message_type.to_string(), envelope.payload.clone()))
            .or_default();
        let mut name = format!(
            "dacapo.handler-outbox:{}:{}:{occurrence}:",
            self.handler, envelope.message_type
        )
        .into_bytes();
        name.extend_from_slice(&envelope.payload);
        *occurrence += 1;
        envelope.id = Uuid::new_v5(&self.message_id, &name);
        DB::insert(self, &envelope).await?;
        Ok(envelope.id)
    }

    /// Completes the handler's deduplication claim, if it holds one, and commits: the
    /// handler's writes, keys, outbox rows, claim and completion record land together, with
    /// what the handler published with its context so far. The outbox relay is woken at once.
    ///
    /// What the handler publishes with its context after the commit is enlisted in the
    /// outbox at once, in a write of its own: a rerun after a crash finds the work done, opens
    /// no transaction and publishes nothing, so it cannot wait for the delivery to settle.
    ///
    /// # Errors
    ///
    /// The database's error; nothing of the transaction took effect. A store error saying the
    /// write stopped before its end (the runtime running it is stopping): the commit may or may
    /// not have happened, as when cancelled.
    ///
    /// # Panics
    ///
    /// If the task running the commit panicked.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the commit may or may not have happened; the completion record tells the
    /// next attempt which.
    pub async fn commit(mut self) -> Result<(), Error> {
        // What the handler published with its context so far commits with its work: a rerun
        // that finds the work done (and opens no transaction) publishes nothing, so these
        // messages must not wait in memory for the delivery to settle.
        let published = self.context.take_published().await;
        if let Err(error) = self.prepare_commit(&published).await {
            // Nothing committed: they stay the attempt's, as if no transaction had been opened.
            self.context.restore_published(published).await;
            return Err(error);
        }
        let context = self.context.clone();
        let committed = match self.tx.take() {
            Some(tx) => crate::store::sql::to_the_end(self.turn.take(), tx.commit())
                .await
                .and_then(|committed| committed.map_err(crate::store::sql::db_error)),
            None => Err(dacapo_actors::Error::store("the transaction already ended")),
        };
        match committed {
            Ok(()) => {
                context.recorded_on_its_own();
                context.wake_outbox();
                Ok(())
            }
            Err(error) => {
                // Had it committed after all, the outbox keeps one row per envelope id.
                context.restore_published(published).await;
                Err(error.into())
            }
        }
    }

    async fn prepare_commit(&mut self, published: &[Envelope]) -> Result<(), Error> {
        for envelope in published {
            DB::insert(self, envelope).await?;
        }
        DB::finish(self).await
    }

    /// Rolls back: nothing of the transaction takes effect.
    ///
    /// # Errors
    ///
    /// The database's error; the transaction is rolled back when its connection closes.
    pub async fn rollback(mut self) -> Result<(), Error> {
        let Some(tx) = self.tx.take() else {
            return Ok(());
        };
        crate::store::sql::to_the_end(self.turn.take(), tx.rollback())
            .await?
            .map_err(crate::store::sql::db_error)?;
        Ok(())
    }
}

/// The message, the handler and the runtime's store of a handler's context, the store as
/// the `S` named `store`.
fn handling<'c, S: 'static>(
    context: &'c MessageContext,
    store: &str,
) -> Result<(Uuid, &'c dacapo_actors::HandlerId, &'c S), Error> {
    let (Some(message_id), Some(handler)) = (context.message_id(), context.handler()) else {
        return Err(dacapo_actors::Error::Detached.into());
    };
    let store = context
        .store()
        .and_then(|runtime_store| runtime_store.downcast_ref::<S>())
        .ok_or_else(|| {
            dacapo_actors::Error::store(format!(
                "handler transactions and connections on this database need the runtime's \
                 store to be a {store}"
            ))
        })?;
    Ok((message_id, handler, store))
}

macro_rules! backend {
    (
        $db:ty,
        $store:ty,
        $begin:expr,
        still_runs = $still_runs:expr,
        alive_at_commit = $alive_at_commit:expr,
        parked = |$parked_store:ident| $parked:expr,
        end_left_open = |$connection:ident| $end_left_open:expr
    ) => {
        impl sealed::Sealed for $db {}

        impl Backend for $db {
            async fn begin(
                context: &MessageContext,
            ) -> Result<Option<HandlerTransaction<Self>>, Error> {
                let (message_id, handler, store) =
                    handling::<$store>(context, stringify!($store))?;
                // On the runtime's own pool: a connection opened here, on the runtime's threads,
                // never ends up in the application's pool.
                let pool = store.engine_pool();
                let tries = pool.options().get_max_connections().saturating_add(1);
                let turn = store.handler_transaction_turn().await?;
                // A copy of the context kept past its attempt opens nothing: its work would
                // land after the delivery settled.
                if !context.attempt_running() {
                    return Err(dacapo_actors::Error::Detached.into());
                }
                let tx = crate::store::sql::on_live_session(tries, || pool.begin_with($begin))
                    .await
                    .map_err(crate::store::sql::db_error)?;
                // Held by the handler's transaction from here, so that an error (or a
                // cancellation) on the way ends the transaction before the turn goes.
                let mut transaction = HandlerTransaction {
                    tx: Some(tx),
                    context: context.clone(),
                    message_id,
                    handler: handler.to_string(),
                    node: store.node().to_owned(),
                    enlisted: HashMap::new(),
                    turn,
                    clock: dacapo_actors::ports::DurableInbox::stamping_clock(store),
                };
                if store.deliveries_here() {
                    let runs = sqlx::query($still_runs)
                        .bind(id_text(message_id))
                        .bind(crate::store::sql::stored_attempts(context.attempt()))
                        .bind(store.node())
                        .fetch_optional(&mut **transaction)
                        .await
                        .map_err(crate::store::sql::db_error)?;
                    if runs.is_none() {
                        tracing::warn!(
                            messaging.message.id = %message_id,
                            dacapo.handler = %transaction.handler,
                            attempt = context.attempt(),
                            "the delivery was taken over or settled elsewhere while this attempt ran (was this node paused?); its handler transaction is not opened"
                        );
                        transaction.rollback().await?;
                        return Err(dacapo_actors::Error::Detached.into());
                    }
                }
                let recorded = sqlx::query(RECORD_COMPLETION)
                    .bind(id_text(message_id))
                    .bind(&transaction.handler)
                    .bind(millis(store.now()))
                    .execute(&mut **transaction)
                    .await
                    .map_err(crate::store::sql::db_error)?
                    .rows_affected();
                if recorded == 0 {
                    tracing::debug!(
                        messaging.message.id = %message_id,
                        dacapo.handler = %transaction.handler,
                        "handler transaction committed by an earlier attempt; not opened again"
                    );
                    transaction.rollback().await?;
                    return Ok(None);
                }
                Ok(Some(transaction))
            }

            async fn connect(
                context: &MessageContext,
            ) -> Result<HandlerConnection<'_, Self>, Error> {
                let (_, _, store) = handling::<$store>(context, stringify!($store))?;
                let slot = store.handler_connection_slot().await?;
                let $parked_store = store;
                let (turn, parked, park) = match $parked {
                    Some(parked) => (parked.turn, parked.connection, Some(parked.park)),
                    None => (store.write_turn().await?, None, None),
                };
                // Without a turn, nothing else keeps what runs on the connection before the
                // settle: the attempt's end waits for it.
                let hold = match (&turn, &park) {
                    (None, None) => Some(
                        context
                            .hold_attempt()
                            .ok_or(dacapo_actors::Error::Detached)?,
                    ),
                    _ => None,
                };
                let (pool, unsynced) = store.handler_pool();
                let unsynced = unsynced.map(Arc::clone);
                let (connection, counted) = match parked {
                    Some(parked) => parked,
                    None => (
                        pool.acquire().await.map_err(crate::store::sql::db_error)?,
                        false,
                    ),
                };
                // A parked connection not yet seen to finish is counted open already.
                if let Some(unsynced) = unsynced.as_ref().filter(|_| !counted) {
                    unsynced.opened();
                }
                let mut connection = HandlerConnection {
                    connection: Some(connection),
                    turn,
                    slot,
                    unsynced,
                    park,
                    context,
                    handed: false,
                    hold,
                };
                // Checked with the turn held: the settle takes the turn after the attempt
                // closed, so a copy of the context kept past its attempt can never write
                // after the settle that makes it durable. Dropped, the connection is parked
                // again (or goes back to its pool).
                if !context.attempt_running() {
                    return Err(dacapo_actors::Error::Detached.into());
                }
                connection.handed = true;
                Ok(connection)
            }

            async fn end_left_open(
                $connection: &mut <Self as sqlx::Database>::Connection,
            ) -> Result<bool, sqlx::Error> {
                $end_left_open.await
            }

            async fn finish(transaction: &mut HandlerTransaction<Self>) -> Result<(), Error> {
                if let Some(claim) = transaction.context.deduplication_claim() {
                    let tx = transaction.tx.as_mut().ok_or_else(|| {
                        dacapo_actors::Error::store("the transaction already ended")
                    })?;
                    let rows = sqlx::query(COMPLETE_CLAIM)
                        .bind(&claim.handler)
                        .bind(&claim.key_hash)
                        .bind(&claim.envelope_id)
                        .bind(&transaction.node)
                        .execute(&mut **tx)
                        .await
                        .map_err(crate::store::sql::db_error)?
                        .rows_affected();
                    if rows == 0 {
                        return Err(claim_lost(claim).into());
                    }
                }
                if let Some(alive) = $alive_at_commit {
                    let tx = transaction.tx.as_mut().ok_or_else(|| {
                        dacapo_actors::Error::store("the transaction already ended")
                    })?;
                    // Its own completion record, written as it opened: gone, the transaction
                    // was ended under it (a `ROLLBACK` the handler sent itself), and the
                    // `COMMIT` would commit nothing.
                    let recorded = sqlx::query(alive)
                        .bind(id_text(transaction.message_id))
                        .bind(&transaction.handler)
                        .fetch_optional(&mut **tx)
                        .await
                        .map_err(crate::store::sql::db_error)?;
                    if recorded.is_none() {
                        return Err(dacapo_actors::Error::store(
                            "the handler transaction was ended before its commit (a ROLLBACK \
                             or COMMIT sent on it): its work is not committed",
                        )
                        .into());
                    }
                }
                Ok(())
            }

            async fn insert(
                transaction: &mut HandlerTransaction<Self>,
                envelope: &Envelope,
            ) -> Result<(), Error> {
                let columns = EnvelopeColumns::of(envelope)?;
                let values = columns.values_and(&[Value::Int64(transaction.stamp())]);
                bind(sqlx::query(ENLIST_ONCE), &values)
                    .execute(&mut ***transaction)
                    .await
                    .map_err(crate::store::sql::db_error)?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "sqlite")]
backend!(
    sqlx::Sqlite,
    crate::store::SqliteStore,
    "BEGIN IMMEDIATE",
    // `BEGIN IMMEDIATE` keeps every other writer out until the commit.
    still_runs = attempt_still_runs!(),
    // A statement that fails on its data leaves SQLite's transaction as it was, but for that
    // statement; one that ends it (a full disk, an I/O error) makes the COMMIT fail.
    alive_at_commit = None::<&'static str>,
    parked = |store| store.parked_handler_turn().await?,
    end_left_open = |connection| crate::store::sql::end_on_sqlite(
        connection,
        crate::store::sql::Ending::Rollback
    )
);
// No turn to write on PostgreSQL: a handler connection goes back to the pool.
#[cfg(feature = "postgres")]
backend!(
    sqlx::Postgres,
    crate::store::PostgresStore,
    "BEGIN",
    // Held until the commit: a node taking the delivery over skips it meanwhile (its claim
    // locks `FOR UPDATE SKIP LOCKED`) instead of running it beside this attempt; this node's
    // own settle, which changes no key, is not held back.
    still_runs = concat!(attempt_still_runs!(), " FOR KEY SHARE"),
    // A statement that failed aborts a PostgreSQL transaction, whose COMMIT then answers
    // ROLLBACK with no error (sqlx reports it as committed): the handler that went on past the
    // failure would see its work, and its completion record, gone, and its delivery settled.
    // Any statement in an aborted transaction fails, so one goes before the COMMIT.
    alive_at_commit =
        Some("SELECT 1 FROM dacapo_handler_completions WHERE envelope_id = $1 AND handler = $2"),
    parked = |_store| None::<ParkedTurn<Self>>,
    end_left_open = |connection| crate::store::sql::end_on_postgres(connection)
);
