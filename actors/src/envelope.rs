use std::borrow::Cow;
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Message;

/// A message on the wire: its payload and everything a delivery needs to know about it.
///
/// The `id` is the identity of the delivery: it stays the same across broker redeliveries and
/// retries, which is what inboxes deduplicate on and what handlers derive row ids from.
///
/// Its `Debug` shows the payload's size, never its bytes: an error that hands an envelope back
/// can be printed with `{:?}` whatever the payload holds.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Envelope {
    /// Identity of this envelope, the same on every redelivery and retry.
    pub id: Uuid,
    /// The message's stable type name ([`Message::TYPE`]); borrowed when it is a Rust
    /// type's own, so publishing allocates nothing for it.
    pub message_type: Cow<'static, str>,
    /// The serialized message (JSON).
    pub payload: Vec<u8>,
    /// Free-form headers.
    pub headers: BTreeMap<String, String>,
    /// Identity of the *intent*, distinct from the envelope id (logical deduplication).
    pub deduplication_id: Option<String>,
    /// Id shared by every message of one conversation.
    pub correlation_id: Option<Uuid>,
    /// Id of the message whose handling produced this one.
    pub causation_id: Option<Uuid>,
    /// How many times this envelope has been attempted so far.
    pub attempts: u32,
    /// When the envelope was first sent.
    pub sent_at: DateTime<Utc>,
    /// When the envelope should be handled, if not now.
    pub scheduled_for: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for Envelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envelope")
            .field("id", &self.id)
            .field("message_type", &self.message_type)
            .field("payload", &format_args!("<{} bytes>", self.payload.len()))
            .field("headers", &self.headers.len())
            .field("deduplication_id", &self.deduplication_id)
            .field("correlation_id", &self.correlation_id)
            .field("causation_id", &self.causation_id)
            .field("attempts", &self.attempts)
            .field("sent_at", &self.sent_at)
            .field("scheduled_for", &self.scheduled_for)
            .finish()
    }
}

impl Envelope {
    /// An envelope with a fresh id around an already serialized payload. The id is a UUID v7:
    /// unique (74 random bits) and ordered by creation time, so the inbox and the outbox index
    /// new envelopes at the end of their keys, as CombGuids do for NServiceBus and Wolverine,
    /// instead of at random places that cost the database a page each.
    pub fn new(message_type: impl Into<Cow<'static, str>>, payload: Vec<u8>) -> Self {
        let id = Uuid::now_v7();
        Self {
            id,
            message_type: message_type.into(),
            payload,
            headers: BTreeMap::new(),
            deduplication_id: None,
            correlation_id: Some(id),
            causation_id: None,
            attempts: 0,
            sent_at: Utc::now(),
            scheduled_for: None,
        }
    }

    /// Serializes `message` into a new envelope.
    ///
    /// # Errors
    ///
    /// Returns the serializer's error when the message cannot be turned into JSON.
    pub fn for_message<M: Message>(message: &M) -> Result<Self, serde_json::Error> {
        Ok(Self::new(M::TYPE, serde_json::to_vec(message)?))
    }

    /// Bytes the envelope occupies for the size limit: type name, payload, headers and
    /// deduplication id — everything of variable length that a store writes.
    pub fn size(&self) -> usize {
        let headers: usize = self.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
        self.message_type.len()
            + self.payload.len()
            + headers
            + self.deduplication_id.as_ref().map_or(0, String::len)
    }
}
