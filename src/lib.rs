#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub mod idempotency;
pub mod ids;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub mod outbox;
pub mod prelude;
mod runtime;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub mod transaction;
pub mod transport;

pub use dacapo_actors::Error as EngineError;
pub use dacapo_actors::ports;
pub use dacapo_actors::{
    AggregateError, Conflicts, DeadLetter, DeadLetterFilter, DeadLetterReason, Deduplication,
    DeliveryReport, DiscardReason, Disposition, Envelope, FailureKind, Handler, HandlerError,
    HandlerFailure, HandlerId, MAX_MESSAGE_TYPE_LEN, Message, MessageContext, Module, Outcome,
    PendingRetry, RetryPolicy, RetryScope, SendOptions, ShutdownReport, StatsSnapshot,
    UnknownMessageTypes,
};
pub use error::Error;
pub use runtime::{DeadLetters, Runtime, RuntimeBuilder, Scheduled};
