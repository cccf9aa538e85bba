//! The transactional outbox: write the outgoing message in the same transaction as the change
//! it announces. One commit: both land or neither does. The runtime's relay then publishes it.
//!
//! ```no_run
//! # use reprise::prelude::*;
//! use reprise::outbox::Outbox;
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

use reprise_actors::{DeduplicationRules, Envelope, Message, SendOptions};
use uuid::Uuid;

use crate::Error;
use crate::store::sql::{ENLIST, EnvelopeColumns, millis};

mod sealed {
    pub trait Sealed {}
}

/// A transaction an envelope can be enlisted in: SQLite's or PostgreSQL's.
pub trait Enlist: sealed::Sealed + Send {
    #[doc(hidden)]
    fn insert(&mut self, envelope: &Envelope) -> impl Future<Output = Result<(), Error>> + Send;
}

macro_rules! enlist_in {
    ($db:ty) => {
        impl sealed::Sealed for sqlx::Transaction<'_, $db> {}

        impl Enlist for sqlx::Transaction<'_, $db> {
            async fn insert(&mut self, envelope: &Envelope) -> Result<(), Error> {
                let c = EnvelopeColumns::of(envelope)?;
                crate::store::sql::bind_envelope!(sqlx::query(ENLIST), c)
                    .bind(millis(chrono::Utc::now()))
                    .execute(&mut **self)
                    .await
                    .map_err(reprise_actors::Error::store)?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "sqlite")]
enlist_in!(sqlx::Sqlite);
#[cfg(feature = "postgres")]
enlist_in!(sqlx::Postgres);

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
        let mut envelope = Envelope::for_message(message).map_err(reprise_actors::Error::from)?;
        options.apply(&mut envelope);
        // No runtime here: the message type's own declaration gives the logical id.
        DeduplicationRules::default().apply(message, &mut envelope);
        tx.insert(&envelope).await?;
        Ok(envelope.id)
    }
}
