//! The request's store transaction, which an endpoint takes from the layer.

use std::sync::Arc;
use std::time::Duration;

use dacapo_actors::{DeduplicationRules, Envelope, Message, SendOptions};
use sha2::{Digest, Sha256};
use tokio::sync::{Mutex, MutexGuard};
use uuid::Uuid;

use super::backend::{Backend, IntentClaim, Slot};
use crate::Error;
use crate::outbox::Enlisting;
use crate::store::sql::{SqlStore, db_error, millis};

/// The store transaction of one request under the Idempotency-Key layer, found in the
/// request's extensions (with axum: `Extension<RequestTransaction<Sqlite>>`).
///
/// What the endpoint writes in it — its rows, its outbox messages, its intent claims — commits
/// together with the response the layer keeps for the key, after the endpoint answered. A
/// crash, a dropped connection or a 5xx answer before that rolls everything back and leaves
/// the key free, so the client's retry runs the endpoint again; after it, the retry gets the
/// kept response. The endpoint never commits it. A clone handed to a task that outlives the
/// request does not keep it open: once the request is dropped (the client went away), the
/// transaction is rolled back as soon as no [`RequestTx`] of it is held, and the task's later
/// borrows are refused.
///
/// On SQLite the transaction starts (`BEGIN IMMEDIATE`, the database's one write lock) when
/// the endpoint first asks for it: ask late, and keep slow calls out of it.
pub struct RequestTransaction<DB: Backend> {
    slot: Arc<Mutex<Slot<DB>>>,
    store: SqlStore<DB>,
    retention: Duration,
    enlisting: Option<Enlisting>,
}

impl<DB: Backend> Clone for RequestTransaction<DB> {
    fn clone(&self) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
            store: self.store.clone(),
            retention: self.retention,
            enlisting: self.enlisting.clone(),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for RequestTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTransaction").finish_non_exhaustive()
    }
}

/// The request's transaction, held by the endpoint: run queries on `&mut **tx`. Drop it
/// before answering (and before [`RequestTransaction::enlist`], which takes it too).
pub struct RequestTx<'a, DB: Backend> {
    /// Holds a begun transaction: [`RequestTransaction::get`] begins it before making this,
    /// and nothing takes it while this holds the lock.
    slot: MutexGuard<'a, Slot<DB>>,
}

impl<DB: Backend> std::fmt::Debug for RequestTx<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTx").finish_non_exhaustive()
    }
}

impl<DB: Backend> std::ops::Deref for RequestTx<'_, DB> {
    type Target = sqlx::Transaction<'static, DB>;

    fn deref(&self) -> &Self::Target {
        match &self.slot.tx {
            Some(tx) => tx,
            None => unreachable!("a RequestTx is made only over a begun transaction"),
        }
    }
}

impl<DB: Backend> std::ops::DerefMut for RequestTx<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match &mut self.slot.tx {
            Some(tx) => tx,
            None => unreachable!("a RequestTx is made only over a begun transaction"),
        }
    }
}

/// What [`RequestTransaction::enlist_once`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Intent {
    /// The intent is new: the message is enlisted under this envelope id.
    New(Uuid),
    /// An earlier request carried out this intent within its window: nothing was enlisted.
    /// Answer [`Problem::DuplicateIntent`](super::Problem::DuplicateIntent) (409).
    Duplicate,
}

impl<DB: Backend> RequestTransaction<DB> {
    pub(crate) fn new(
        slot: Slot<DB>,
        store: SqlStore<DB>,
        retention: Duration,
        enlisting: Option<Enlisting>,
    ) -> Self {
        Self {
            slot: Arc::new(Mutex::new(slot)),
            store,
            retention,
            enlisting,
        }
    }

    /// The envelope `message` travels in: under the layer's runtime's deduplication rules and
    /// size limit, or — without one — the message type's own deduplication id.
    fn envelope<M: Message>(&self, message: &M, options: SendOptions) -> Result<Envelope, Error> {
        if let Some(enlisting) = &self.enlisting {
            return enlisting.envelope(message, options);
        }
        let mut envelope = Envelope::for_message(message)?;
        options.apply(&mut envelope);
        DeduplicationRules::default().apply(message, &mut envelope);
        Ok(envelope)
    }

    pub(crate) fn slot(&self) -> &Arc<Mutex<Slot<DB>>> {
        &self.slot
    }

    /// The request's state for the endpoint: refused while another borrow holds it (waiting
    /// would never end: the holder is the same endpoint) and once the request ended.
    fn borrow(&self) -> Result<MutexGuard<'_, Slot<DB>>, Error> {
        let slot = self.slot.try_lock().map_err(|_| {
            Error::RequestTransaction(
                "is in use: a RequestTx of this request is still held; drop it first",
            )
        })?;
        if slot.ended {
            return Err(ended());
        }
        Ok(slot)
    }

    /// The transaction, begun if it was not yet.
    ///
    /// # Errors
    ///
    /// The database's error when it cannot begin; [`Error::RequestTransaction`] while another
    /// [`RequestTx`] of the request is held (drop it first: the transaction is one) or once
    /// the layer has committed or rolled it back (the handle outlived its request).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a transaction begun meanwhile stays with the request.
    pub async fn get(&self) -> Result<RequestTx<'_, DB>, Error> {
        let mut slot = self.borrow()?;
        DB::begin(&mut slot).await.map_err(db_error)?;
        if slot.tx.is_none() {
            return Err(ended());
        }
        Ok(RequestTx { slot })
    }

    /// Enlists `message` in the outbox, in the request's transaction: it is published once
    /// the request commits, and never if it rolls back. It carries the message type's own
    /// deduplication id ([`Message::deduplication_id`]), as from the application's outbox.
    /// Returns its envelope id.
    ///
    /// # Errors
    ///
    /// The serializer's or the database's error: answer with an error status (5xx rolls the
    /// request back).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the row may be written in the transaction or not; the request then ends
    /// without committing.
    pub async fn enlist<M: Message>(&self, message: &M) -> Result<Uuid, Error> {
        self.enlist_with(message, SendOptions::new()).await
    }

    /// [`enlist`](Self::enlist) with headers, a correlation id or a deduplication id.
    ///
    /// # Errors
    ///
    /// As [`enlist`](Self::enlist).
    ///
    /// # Cancel safety
    ///
    /// As [`enlist`](Self::enlist).
    pub async fn enlist_with<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let envelope = self.envelope(message, options)?;
        let mut slot = self.borrow()?;
        DB::begin(&mut slot).await.map_err(db_error)?;
        let tx = slot.tx.as_mut().ok_or_else(ended)?;
        DB::enlist(tx, &envelope).await?;
        slot.enlisted = true;
        Ok(envelope.id)
    }

    /// Enlists `message` in the outbox under `deduplication_id`, unless an earlier request
    /// carried out the same intent: a claim on the id is written in the request's
    /// transaction, in the deduplication claims table that message handlers use (under the
    /// handler name `http:<message type>`), completed at once and kept for the layer's
    /// retention. The claim is the message type's, whatever the layer's scope: an id that
    /// comes from a client names the tenant or principal too, or one tenant's request claims
    /// another's intent.
    ///
    /// # Errors
    ///
    /// The serializer's or the database's error: answer with an error status (5xx rolls the
    /// request back).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the claim and the row may be written in the transaction or not; the request
    /// then ends without committing.
    pub async fn enlist_once<M: Message>(
        &self,
        message: &M,
        deduplication_id: impl Into<String>,
    ) -> Result<Intent, Error> {
        let deduplication_id = deduplication_id.into();
        let envelope = self.envelope(
            message,
            SendOptions::new().deduplication_id(deduplication_id.clone()),
        )?;
        let now = self.store.now();
        let expires = super::layer::expiry(now, self.retention);
        let handler = format!("http:{}", M::TYPE);
        let key_hash = hex(&Sha256::digest(deduplication_id.as_bytes()));
        let fingerprint = hex(&Sha256::digest(&envelope.payload));
        let mut slot = self.borrow()?;
        let claimed = DB::claim_intent(
            &mut slot,
            IntentClaim {
                handler: &handler,
                key_hash: &key_hash,
                key: &deduplication_id,
                fingerprint: &fingerprint,
                envelope: &envelope,
                node: self.store.node(),
                now: millis(now),
                expires_at: millis(expires),
            },
        )
        .await
        .map_err(db_error)?;
        if !claimed {
            return Ok(Intent::Duplicate);
        }
        let tx = slot.tx.as_mut().ok_or_else(ended)?;
        DB::enlist(tx, &envelope).await?;
        slot.enlisted = true;
        Ok(Intent::New(envelope.id))
    }
}

fn ended() -> Error {
    Error::RequestTransaction(
        "has ended: the Idempotency-Key layer committed or rolled it back after the endpoint \
         answered",
    )
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
