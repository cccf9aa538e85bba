use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{AggregateError, Envelope};

/// Why a message was dead-lettered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// Every attempt the retry policy allows failed.
    RetriesExhausted,
    /// A handler reported a failure that no retry can fix.
    Permanent,
    /// The payload does not deserialize into the registered message type.
    MalformedPayload(String),
    /// No handler is registered for the message type.
    NoHandler(String),
    /// A handler requires a deduplication id, and the message has none.
    MissingDeduplicationId(String),
    /// The store refused to record the delivery's next state (a cascaded message it cannot
    /// hold, say); the delivery could not settle otherwise.
    StoreRejected(String),
    /// A message from a broker could not be read as an envelope (no id or type header, a
    /// header that does not parse): it is kept as it arrived, headers and body.
    Unreadable(String),
    /// A message routed to a broker that the broker can never take (a header it cannot
    /// carry, a body over its limit): kept here instead of published.
    Undeliverable(String),
    /// The envelope is larger than the runtime accepts.
    TooLarge {
        /// The envelope's size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RetriesExhausted => f.write_str("retries exhausted"),
            Self::Permanent => f.write_str("permanent failure"),
            Self::MalformedPayload(error) => write!(f, "malformed payload: {error}"),
            Self::NoHandler(message_type) => write!(f, "no handler for {message_type}"),
            Self::MissingDeduplicationId(handler) => {
                write!(f, "missing deduplication id (required by {handler})")
            }
            Self::StoreRejected(error) => write!(f, "store rejected the delivery: {error}"),
            Self::Unreadable(why) => write!(f, "unreadable message: {why}"),
            Self::Undeliverable(why) => write!(f, "undeliverable to the broker: {why}"),
            Self::TooLarge { size, limit } => {
                write!(
                    f,
                    "envelope too large: {size} bytes over a limit of {limit}"
                )
            }
        }
    }
}

/// A message the runtime gave up on, with everything needed to understand and replay it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The envelope (its id is the dead letter's id), its attempt count as it last ran.
    pub envelope: Envelope,
    /// Why it was dead-lettered.
    pub reason: DeadLetterReason,
    /// The aggregate error of each failed attempt (the first and the latest 99), oldest first
    /// (empty for bad input).
    pub failures: Vec<AggregateError>,
    /// How many attempts ran.
    pub attempts: u32,
    /// When the first attempt failed (or the input was rejected).
    pub first_failure_at: DateTime<Utc>,
    /// When the last attempt failed.
    pub last_failure_at: DateTime<Utc>,
}

/// Which dead letters a listing or a purge takes: all by default, narrowed by message type,
/// by when they were dead-lettered, and by a count (oldest failure first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only this message type.
    pub message_type: Option<String>,
    /// Only letters whose last failure was at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// At most this many, oldest failure first.
    pub limit: Option<usize>,
}

impl DeadLetterFilter {
    /// Every dead letter.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only dead letters of `message_type`.
    #[must_use]
    pub fn message_type(mut self, message_type: impl Into<String>) -> Self {
        self.message_type = Some(message_type.into());
        self
    }

    /// Only dead letters whose last failure was at or after `at`.
    #[must_use]
    pub fn since(mut self, at: DateTime<Utc>) -> Self {
        self.since = Some(at);
        self
    }

    /// At most `count` dead letters, oldest failure first.
    #[must_use]
    pub fn limit(mut self, count: usize) -> Self {
        self.limit = Some(count);
        self
    }

    /// Whether `letter` passes the type and time conditions (the limit aside).
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        self.message_type
            .as_deref()
            .is_none_or(|t| letter.envelope.message_type == t)
            && self.since.is_none_or(|at| letter.last_failure_at >= at)
    }
}

impl DeadLetter {
    /// A dead letter for input rejected before any handler ran.
    #[doc(hidden)]
    pub fn rejected(envelope: Envelope, reason: DeadLetterReason, at: DateTime<Utc>) -> Self {
        Self {
            envelope,
            reason,
            failures: Vec::new(),
            attempts: 0,
            first_failure_at: at,
            last_failure_at: at,
        }
    }

    /// A dead letter for a message whose handlers failed.
    #[doc(hidden)]
    pub fn failed(
        envelope: Envelope,
        reason: DeadLetterReason,
        failures: Vec<AggregateError>,
        first_failure_at: DateTime<Utc>,
        last_failure_at: DateTime<Utc>,
    ) -> Self {
        let attempts = failures.last().map_or(0, |f| f.attempt);
        Self {
            envelope,
            reason,
            failures,
            attempts,
            first_failure_at,
            last_failure_at,
        }
    }
}
