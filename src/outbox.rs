//! The transactional outbox: write the outgoing message in the same transaction as the change
//! it announces. One commit: both land or neither does. The runtime's relay then publishes it.
//!
//! ```no_run
//! use dacapo::sqlx;
//! # use dacapo::prelude::*;
//! use dacapo::outbox::Outbox;
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize)] struct OrderPlaced { reference: String }
//! # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
//! # async fn place(pool: &sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
//! sqlx::query("INSERT INTO orders (reference) VALUES ($1)").bind("A-1").execute(&mut *tx).await?;
//! Outbox::enlist(&mut tx, &OrderPlaced { reference: "A-1".into() }).await?;
//! tx.commit().await?; // the order and its event, or neither
//! # Ok(())
//! # }
//! ```

use std::future::Future;

use dacapo_actors::{DeduplicationRules, Envelope, Message, SendOptions};
use uuid::Uuid;

use crate::{Error, Runtime};

use crate::store::sql::{ENLIST, EnvelopeColumns, Value, bind, millis};

mod sealed {
    pub trait Sealed {}
}

/// A transaction an envelope can be enlisted in: SQLite's or PostgreSQL's.
pub trait Enlist: sealed::Sealed + Send {
    #[doc(hidden)]
    fn insert(&mut self, envelope: &Envelope) -> impl Future<Output = Result<(), Error>> + Send;

    #[doc(hidden)]
    fn commit_now(self) -> impl Future<Output = Result<(), Error>> + Send
    where
        Self: Sized;
}

macro_rules! enlist_in {
    ($db:ty, $alive_at_commit:expr) => {
        impl sealed::Sealed for sqlx::Transaction<'_, $db> {}

        impl Enlist for sqlx::Transaction<'_, $db> {
            async fn insert(&mut self, envelope: &Envelope) -> Result<(), Error> {
                let columns = EnvelopeColumns::of(envelope)?;
                let values = columns.values_and(&[Value::Int64(millis(chrono::Utc::now()))]);
                bind(sqlx::query(ENLIST), &values)
                    .execute(&mut **self)
                    .await
                    .map_err(crate::store::sql::db_error)?;
                Ok(())
            }

            async fn commit_now(mut self) -> Result<(), Error> {
                if let Some(alive) = $alive_at_commit {
                    sqlx::query(alive)
                        .execute(&mut *self)
                        .await
                        .map_err(crate::store::sql::db_error)?;
                }
                self.commit().await.map_err(crate::store::sql::db_error)?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "sqlite")]
enlist_in!(sqlx::Sqlite, None::<&'static str>);
// A statement that failed aborts a PostgreSQL transaction, whose COMMIT then answers ROLLBACK
// with no error: told committed, the caller would take its messages for sent. Any statement
// in an aborted transaction fails, so one goes before the COMMIT.
#[cfg(feature = "postgres")]
enlist_in!(sqlx::Postgres, Some("SELECT 1"));

/// Enlists outgoing messages in the caller's transaction.
#[derive(Debug)]
pub struct Outbox;

impl Outbox {
    /// Writes `message` to the outbox within `tx`; returns its envelope id. It is published
    /// after `tx` commits, and never if it rolls back.
    ///
    /// # Errors
    ///
    /// The serializer's or the database's error; `tx` should then be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the row may or may not be written in `tx`: roll it back.
    pub async fn enlist<M: Message, T: Enlist>(tx: &mut T, message: &M) -> Result<Uuid, Error> {
        Self::enlist_with(tx, message, SendOptions::default()).await
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
    pub async fn enlist_with<M: Message, T: Enlist>(
        tx: &mut T,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let mut envelope = Envelope::for_message(message).map_err(dacapo_actors::Error::from)?;
        options.apply(&mut envelope);
        // No runtime here: the message type's own declaration gives the logical id.
        DeduplicationRules::default().apply(message, &mut envelope);
        tx.insert(&envelope).await?;
        Ok(envelope.id)
    }
}

/// The outbox of one runtime, from [`Runtime::outbox`]: enlisting applies the runtime's
/// deduplication rules and size limit, and [`commit`](Self::commit) wakes its relay.
///
/// ```no_run
/// use dacapo::sqlx;
/// # use dacapo::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct OrderPlaced { reference: String }
/// # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
/// # async fn place(runtime: &Runtime, pool: &sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
/// sqlx::query("INSERT INTO orders (reference) VALUES ($1)").bind("A-1").execute(&mut *tx).await?;
/// runtime.outbox().enlist(&mut tx, &OrderPlaced { reference: "A-1".into() }).await?;
/// runtime.outbox().commit(tx).await?; // published now, not at the relay's next poll
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RuntimeOutbox<'a> {
    runtime: &'a Runtime,
}

impl<'a> RuntimeOutbox<'a> {
    pub(crate) fn new(runtime: &'a Runtime) -> Self {
        Self { runtime }
    }

    /// Writes `message` to the outbox within `tx`, with the runtime's deduplication rules
    /// applied; returns its envelope id.
    ///
    /// # Errors
    ///
    /// The serializer's or the database's error, or an envelope over the runtime's size limit;
    /// `tx` should then be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the row may or may not be written in `tx`: roll it back.
    pub async fn enlist<M: Message, T: Enlist>(
        &self,
        tx: &mut T,
        message: &M,
    ) -> Result<Uuid, Error> {
        self.enlist_with(tx, message, SendOptions::default()).await
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
    pub async fn enlist_with<M: Message, T: Enlist>(
        &self,
        tx: &mut T,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let envelope = self.runtime.envelope(message, options)?;
        tx.insert(&envelope).await?;
        Ok(envelope.id)
    }

    /// Writes an envelope prepared with [`Runtime::envelope`] to the outbox within `tx`,
    /// as it is: an application that keeps the envelopes it sent (to show them, or to resend
    /// them) enlists the very one it kept.
    ///
    /// # Errors
    ///
    /// The database's error; `tx` should then be rolled back.
    ///
    /// # Cancel safety
    ///
    /// As [`enlist`](Self::enlist).
    pub async fn enlist_envelope<T: Enlist>(
        &self,
        tx: &mut T,
        envelope: &Envelope,
    ) -> Result<(), Error> {
        tx.insert(envelope).await
    }

    /// Commits `tx` and wakes the relay, which publishes what it enlisted right away. A
    /// transaction committed otherwise is published at the relay's next poll (or, on
    /// PostgreSQL, when the commit's notification reaches it).
    ///
    /// # Errors
    ///
    /// The database's error; nothing of `tx` took effect. On PostgreSQL that includes a
    /// transaction a failed statement aborted, whose `COMMIT` the server answers with a
    /// rollback (sqlx's own `commit` reports it as done).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the commit may or may not have happened; the relay's poll publishes what did.
    pub async fn commit<T: Enlist>(&self, tx: T) -> Result<(), Error> {
        tx.commit_now().await?;
        self.runtime.wake_outbox();
        Ok(())
    }
}

/// How a runtime makes the envelopes its outbox takes — its deduplication rules and its size
/// limit — and a wake for its relay; from [`Runtime::enlisting`], for code that enlists
/// outside the runtime (the HTTP layer's request transactions). Cheap to clone.
#[derive(Clone)]
pub struct Enlisting {
    pub(crate) dispatcher: dacapo_actors::Dispatcher,
    pub(crate) max_envelope_size: usize,
}

impl std::fmt::Debug for Enlisting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enlisting")
            .field("max_envelope_size", &self.max_envelope_size)
            .finish_non_exhaustive()
    }
}

impl Enlisting {
    /// The envelope `message` travels in, as [`Runtime::envelope`] makes it.
    ///
    /// # Errors
    ///
    /// A serialization failure, or an envelope over the runtime's size limit (handed back).
    pub fn envelope<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Envelope, Error> {
        crate::runtime::envelope_under(
            self.dispatcher.deduplication_rules(),
            self.max_envelope_size,
            message,
            options,
        )
    }

    /// Tells the runtime's relay that envelopes were just committed to its outbox, so that
    /// it publishes them now rather than at its next poll.
    pub fn wake_relay(&self) {
        self.dispatcher.wake_outbox();
    }
}
