use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::HandlerFailure;

/// Every handler failure of one attempt at one message.
///
/// Displayed as `N handler(s) failed for event TYPE with MessageId ID.`, the line operators
/// search logs for; [`AggregateError::failures`] has the details.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AggregateError {
    /// The message's type name.
    pub message_type: String,
    /// The envelope id.
    pub message_id: Uuid,
    /// The attempt (1-based) these failures belong to.
    pub attempt: u32,
    /// One entry per failed handler, in registration order.
    pub failures: Vec<HandlerFailure>,
    /// When the attempt ended.
    pub failed_at: DateTime<Utc>,
}

impl AggregateError {
    /// The failed handlers of this attempt.
    pub fn failures(&self) -> &[HandlerFailure] {
        &self.failures
    }
}

impl fmt::Display for AggregateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} handler(s) failed for event {} with MessageId {}.",
            self.failures.len(),
            self.message_type,
            self.message_id
        )
    }
}

impl std::error::Error for AggregateError {}
