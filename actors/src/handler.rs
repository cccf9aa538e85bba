use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Message, MessageContext};

/// What a module implements to react to one message type.
///
/// Every handler registered for a message runs on every attempt, and a retry reruns all of
/// them, so a handler must tolerate having already run: derive row ids from
/// [`MessageContext::message_id`], or record an idempotency key in its own transaction.
///
/// ```
/// use dacapo::{Handler, HandlerError, Message, MessageContext};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct MemberRemoved { member_id: u64 }
/// # impl Message for MemberRemoved { const TYPE: &'static str = "organization.member_removed"; }
///
/// struct RevokeAccess;
///
/// impl Handler<MemberRemoved> for RevokeAccess {
///     async fn handle(&self, event: &MemberRemoved, context: &MessageContext) -> Result<(), HandlerError> {
///         if event.member_id == 0 {
///             // Retrying will not fix a bad id: dead-letter now.
///             return Err(HandlerError::permanent("member id 0 is reserved"));
///         }
///         let _ = context.message_id();
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<M: Message>: Send + Sync + 'static {
    /// Handles one message.
    ///
    /// # Errors
    ///
    /// Any error fails this handler for this attempt; see [`HandlerError`] for how to ask for
    /// no retry or a later one.
    fn handle(
        &self,
        message: &M,
        context: &MessageContext,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// How a handler wants its failure treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Retry the delivery on the retry policy's schedule (the default).
    Retry,
    /// Retrying cannot help: dead-letter the message now.
    Permanent,
    /// Retry, but not before this much time has passed.
    RetryAfter(Duration),
}

/// The error a handler returns.
///
/// Any error converts into it with `?` (as a plain retryable failure); use
/// [`HandlerError::permanent`] or [`HandlerError::retry_after`] to say more.
pub struct HandlerError {
    disposition: Disposition,
    source: Box<dyn StdError + Send + Sync>,
}

impl HandlerError {
    /// A failure that the retry policy retries.
    pub fn retry(error: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            disposition: Disposition::Retry,
            source: error.into(),
        }
    }

    /// A failure that no retry can fix: the message is dead-lettered at once.
    pub fn permanent(error: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            disposition: Disposition::Permanent,
            source: error.into(),
        }
    }

    /// A failure to retry no sooner than `delay` (for example a rate limit's `Retry-After`).
    pub fn retry_after(delay: Duration, error: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            disposition: Disposition::RetryAfter(delay),
            source: error.into(),
        }
    }

    /// How the handler wants this failure treated.
    pub fn disposition(&self) -> Disposition {
        self.disposition
    }

    /// The underlying error.
    pub fn error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }
}

impl<E: Into<Box<dyn StdError + Send + Sync>>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        Self::retry(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("disposition", &self.disposition)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

/// Why one handler's attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FailureKind {
    /// The handler returned an error to be retried.
    Error,
    /// The handler returned a permanent error.
    Permanent,
    /// The handler returned an error asking for a retry after a delay.
    RetryAfter(Duration),
    /// The handler panicked. The panic is caught: it fails this handler's attempt (retried
    /// under the policy, like an error), with the panic's message as the failure's text, and
    /// nothing else. Rust's panic hook still prints it to standard error as it happens (with
    /// a backtrace under `RUST_BACKTRACE`); [`quiet_handler_panics`](crate::quiet_handler_panics)
    /// turns that into a `debug` event for handler panics only.
    Panicked,
    /// The handler did not finish within its timeout.
    TimedOut(Duration),
}

/// One handler's failure, as data: which handler, what went wrong and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerFailure {
    /// The module that registered the handler.
    pub module: String,
    /// The handler's name within its module.
    pub handler: String,
    /// The error text (or panic message).
    pub error: String,
    /// Whether it returned an error, panicked or timed out.
    pub kind: FailureKind,
}

impl HandlerFailure {
    /// Whether this failure forbids any retry.
    pub fn is_permanent(&self) -> bool {
        self.kind == FailureKind::Permanent
    }
}

impl fmt::Display for HandlerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            FailureKind::Error => "failed",
            FailureKind::Permanent => "failed permanently",
            FailureKind::RetryAfter(_) => "failed (retry later)",
            FailureKind::Panicked => "panicked",
            FailureKind::TimedOut(_) => "timed out",
        };
        write!(f, "{}/{} {what}: {}", self.module, self.handler, self.error)
    }
}
