use std::time::Duration;

use uuid::Uuid;

use crate::{AggregateError, DeadLetterReason, Envelope, HandlerFailure, Message};

/// How a delivery ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every handler succeeded.
    Handled,
    /// The runtime gave up; the message is in the dead letters.
    DeadLettered(DeadLetterReason),
    /// The envelope was not handled: a duplicate, or a type configured to be discarded.
    Discarded(DiscardReason),
    /// The envelope was recorded for the time it is scheduled for; a node runs it then.
    Scheduled(chrono::DateTime<chrono::Utc>),
}

/// Why an envelope was discarded without being handled.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiscardReason {
    /// The inbox already knew the envelope id.
    DuplicateEnvelope,
    /// No handler handles the type, and the runtime is set to discard such messages.
    NoHandler,
    /// The store refused to record even the delivery's dead letter (the error is logged with
    /// the envelope's id and type); the delivery was settled without one rather than hold its
    /// capacity slot forever.
    StoreRejected,
    /// Another node took the delivery over (this node's heartbeat had expired), or handled
    /// it, before this node's next attempt: this node stopped, and the owner carries on.
    OwnedElsewhere,
}

/// The account of one settled delivery.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DeliveryReport {
    /// The envelope's id.
    pub envelope_id: Uuid,
    /// Its message type.
    pub message_type: String,
    /// How it ended.
    pub outcome: Outcome,
    /// How many attempts ran.
    pub attempts: u32,
    /// The aggregate error of each failed attempt (the first and the latest 99), oldest first.
    pub failures: Vec<AggregateError>,
    /// When each attempt started, measured from the first attempt's start on the engine's
    /// clock (virtual under the test harness, so cooldowns can be checked exactly); the first
    /// entry is therefore zero. Of a delivery of more than 100 attempts, the first and the
    /// latest 99 are kept, as with [`failures`](Self::failures). A delivery resumed after a
    /// restart counts from the resuming runtime's start instead (zero), and lists only the
    /// attempts that runtime made: the earlier ones ran in the runtime that stopped, whose
    /// clock this one does not share, while [`attempts`](Self::attempts) and
    /// [`failures`](Self::failures) cover the whole delivery.
    pub attempt_offsets: Vec<Duration>,
    /// The messages its handlers cascaded that settled with it (sent only when it was
    /// handled). Those a handler's work recorded on its own — a handler transaction's commit,
    /// or the completion of a deduplication claim — were sent then (through the outbox, on a
    /// durable runtime), and are not listed here.
    pub cascaded: Vec<Envelope>,
    /// Each pause between an attempt's end and the next one's start.
    pub(crate) pauses: Vec<Duration>,
}

impl DeliveryReport {
    pub(crate) fn discarded(envelope: &Envelope, reason: DiscardReason) -> Self {
        Self::accepted(envelope, Outcome::Discarded(reason))
    }

    /// The report of an envelope that ended at its acceptance (discarded, or scheduled).
    pub(crate) fn accepted(envelope: &Envelope, outcome: Outcome) -> Self {
        Self {
            envelope_id: envelope.id,
            message_type: envelope.message_type.to_string(),
            outcome,
            attempts: 0,
            failures: Vec::new(),
            attempt_offsets: Vec::new(),
            cascaded: Vec::new(),
            pauses: Vec::new(),
        }
    }

    /// Whether every handler succeeded.
    pub fn is_handled(&self) -> bool {
        self.outcome == Outcome::Handled
    }

    /// The pauses between consecutive attempts: from one attempt's end (its failure decided)
    /// to the next one's start, on the engine's clock. An attempt that timed out lasted its
    /// timeout before its cooldown; [`attempt_offsets`](Self::attempt_offsets) count both. After
    /// a restart, the first is what was left of the cooldown the stopped runtime began. Of a
    /// delivery of more than 100 attempts, the latest 99 are kept.
    pub fn cooldowns(&self) -> Vec<Duration> {
        self.pauses.clone()
    }

    /// Every handler failure of each attempt kept, oldest attempt first, with its attempt number
    /// (the field [`failures`](Self::failures) groups them by attempt).
    pub fn failures(&self) -> impl Iterator<Item = (u32, &HandlerFailure)> {
        self.failures
            .iter()
            .flat_map(|attempt| attempt.failures().iter().map(|f| (attempt.attempt, f)))
    }

    /// The messages of type `M` the delivery's handlers cascaded, decoded, in the order they
    /// were published.
    ///
    /// # Errors
    ///
    /// The deserializer's error for an envelope of `M`'s type whose payload is not an `M`.
    pub fn cascaded<M: Message>(&self) -> Result<Vec<M>, serde_json::Error> {
        self.cascaded
            .iter()
            .filter(|envelope| envelope.message_type == M::TYPE)
            .map(|envelope| serde_json::from_slice(&envelope.payload))
            .collect()
    }
}
