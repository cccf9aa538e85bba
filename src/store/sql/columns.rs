//! The portable column types — ids as 32 hex digits, times as milliseconds, JSON as text — and
//! the conversions between rows and the engine's types.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use dacapo_actors::{AggregateError, DeadLetter, DeadLetterReason, Envelope, Error};
use uuid::Uuid;

use super::database::{Row, Value};

pub(crate) fn millis(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

pub(crate) fn time(millis: i64) -> Result<DateTime<Utc>, Error> {
    DateTime::from_timestamp_millis(millis)
        .ok_or_else(|| Error::store(format!("stored time {millis} ms is out of range")))
}

pub(crate) fn id_text(id: Uuid) -> String {
    id.simple().to_string()
}

pub(crate) fn parse_id(text: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(text)
        .map_err(|e| Error::store(format!("stored id {text:?} is not a uuid: {e}")))
}

fn parse_optional_id(text: Option<String>) -> Result<Option<Uuid>, Error> {
    text.as_deref().map(parse_id).transpose()
}

pub(crate) fn json<T: serde::Serialize>(value: &T) -> Result<String, Error> {
    serde_json::to_string(value).map_err(Error::store)
}

pub(crate) fn from_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, Error> {
    serde_json::from_str(text).map_err(Error::store)
}

/// An envelope's columns, as stored.
pub(crate) struct EnvelopeColumns {
    pub(crate) id: String,
    pub(crate) message_type: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) deduplication_id: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
    pub(crate) sent_at: i64,
    pub(crate) scheduled_for: Option<i64>,
}

impl EnvelopeColumns {
    /// The nine columns as statement parameters, in the order every envelope table declares
    /// them (`id` … `scheduled_for`).
    pub(crate) fn values(&self) -> [Value<'_>; 9] {
        [
            Value::Text(&self.id),
            Value::Text(&self.message_type),
            Value::Bytes(&self.payload),
            Value::Text(&self.headers),
            Value::OptionalText(self.deduplication_id.as_deref()),
            Value::OptionalText(self.correlation_id.as_deref()),
            Value::OptionalText(self.causation_id.as_deref()),
            Value::Int64(self.sent_at),
            Value::OptionalInt64(self.scheduled_for),
        ]
    }

    /// The nine columns, then `more`, as the parameters of one statement.
    pub(crate) fn values_and<'a>(&'a self, more: &[Value<'a>]) -> Vec<Value<'a>> {
        let mut values = self.values().to_vec();
        values.extend_from_slice(more);
        values
    }

    /// The envelope columns of `row`, by name.
    pub(crate) fn read(row: &Row) -> Result<Self, Error> {
        Ok(Self {
            id: row.get("id")?,
            message_type: row.get("message_type")?,
            payload: row.get("payload")?,
            headers: row.get("headers")?,
            deduplication_id: row.get("deduplication_id")?,
            correlation_id: row.get("correlation_id")?,
            causation_id: row.get("causation_id")?,
            sent_at: row.get("sent_at")?,
            scheduled_for: row.get("scheduled_for")?,
        })
    }

    pub(crate) fn of(envelope: &Envelope) -> Result<Self, Error> {
        Ok(Self {
            id: id_text(envelope.id),
            message_type: envelope.message_type.to_string(),
            payload: envelope.payload.clone(),
            headers: json(&envelope.headers)?,
            deduplication_id: envelope.deduplication_id.clone(),
            correlation_id: envelope.correlation_id.map(id_text),
            causation_id: envelope.causation_id.map(id_text),
            sent_at: millis(envelope.sent_at),
            scheduled_for: envelope.scheduled_for.map(millis),
        })
    }

    pub(crate) fn into_envelope(self, attempts: u32) -> Result<Envelope, Error> {
        let mut envelope = Envelope::new(self.message_type, self.payload);
        envelope.id = parse_id(&self.id)?;
        envelope.headers = from_json::<BTreeMap<String, String>>(&self.headers)?;
        envelope.deduplication_id = self.deduplication_id;
        envelope.correlation_id = parse_optional_id(self.correlation_id)?;
        envelope.causation_id = parse_optional_id(self.causation_id)?;
        envelope.attempts = attempts;
        envelope.sent_at = time(self.sent_at)?;
        envelope.scheduled_for = self.scheduled_for.map(time).transpose()?;
        Ok(envelope)
    }
}

/// A dead letter's columns, as stored: its envelope's, then why and when it failed.
pub(crate) struct DeadLetterColumns {
    envelope: EnvelopeColumns,
    reason: String,
    failures: String,
    attempts: i32,
    first_failure_at: i64,
    last_failure_at: i64,
}

impl DeadLetterColumns {
    pub(crate) fn of(letter: &DeadLetter) -> Result<Self, Error> {
        Ok(Self {
            envelope: EnvelopeColumns::of(&letter.envelope)?,
            reason: reason_json(&letter.reason)?,
            failures: json(&letter.failures)?,
            attempts: stored_attempts(letter.attempts),
            first_failure_at: millis(letter.first_failure_at),
            last_failure_at: millis(letter.last_failure_at),
        })
    }

    /// The fourteen columns in the order the dead-letter table declares them.
    pub(crate) fn values(&self) -> Vec<Value<'_>> {
        self.envelope.values_and(&[
            Value::Text(&self.reason),
            Value::Text(&self.failures),
            Value::Int32(self.attempts),
            Value::Int64(self.first_failure_at),
            Value::Int64(self.last_failure_at),
        ])
    }
}

pub(crate) fn failures_from(text: Option<&str>) -> Result<Vec<AggregateError>, Error> {
    text.map(from_json)
        .transpose()
        .map(Option::unwrap_or_default)
}

pub(crate) fn reason_json(reason: &DeadLetterReason) -> Result<String, Error> {
    json(reason)
}

pub(crate) fn attempts(stored: i32) -> u32 {
    u32::try_from(stored).unwrap_or(0)
}

pub(crate) fn stored_attempts(attempts: u32) -> i32 {
    i32::try_from(attempts).unwrap_or(i32::MAX)
}
