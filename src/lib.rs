#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
#[cfg(all(feature = "http", any(feature = "sqlite", feature = "postgres")))]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
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
    PendingRetry, RetryDecision, RetryPolicy, RetryScope, SendOptions, ShutdownReport,
    StatsSnapshot, TestContext, UnknownMessageTypes, quiet_handler_panics,
};

// The crates whose types appear in dacapo's signatures, so an application uses the very
// versions dacapo was built with (another sqlx minor is another `Pool` type).
pub use async_trait;
pub use chrono;
pub use error::Error;
pub use futures;
pub use runtime::{DeadLetters, Runtime, RuntimeBuilder, Scheduled};
pub use serde;
pub use serde_json;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use sqlx;
pub use uuid;
