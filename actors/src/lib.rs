//! The actors of [dacapo](https://docs.rs/dacapo) and the vocabulary they speak.
//!
//! Applications depend on `dacapo`, which re-exports what they need; this crate holds every
//! actix actor ([`DeliverySupervisor`], [`HandlerActor`], [`ContextActor`], [`TimerActor`]),
//! the types they exchange, and the [ports] through which they reach storage and the
//! clock. It knows no database, broker or socket.

mod aggregate;
mod backoff;
mod batches;
mod capacity;
mod cleanup;
mod context;
mod dead_letter;
mod deduplication;
mod delivery;
mod dispatcher;
mod engine;
mod envelope;
mod error;
mod handler;
mod handler_actor;
mod message;
mod module;
pub mod ports;
mod reaper;
mod recovery;
mod registry;
mod relay;
mod report;
mod retry;
mod stats;
mod supervisor;
mod timer;
mod tracker;

pub use aggregate::AggregateError;
pub use backoff::Backoff;
pub use cleanup::CleanupActor;
pub use context::{ContextActor, MessageContext, SendOptions};
pub use dead_letter::{DeadLetter, DeadLetterFilter, DeadLetterReason};
pub use deduplication::{Conflicts, Deduplication, DeduplicationRules};
pub use dispatcher::{Dispatcher, UnknownMessageTypes};
pub use engine::{Durability, Engine, EngineConfig, EngineParts, ShutdownReport};
pub use envelope::Envelope;
pub use error::Error;
pub use handler::{Disposition, FailureKind, Handler, HandlerError, HandlerFailure};
pub use handler_actor::HandlerActor;
pub use message::Message;
pub use module::{Decoded, HandlerEntry, HandlerId, Invoke, Module};
pub use reaper::ReaperActor;
pub use recovery::RecoveryActor;
pub use registry::{MAX_MESSAGE_TYPE_LEN, Registry, RegistryError, Route};
pub use relay::RelayActor;
pub use report::{DeliveryReport, DiscardReason, Outcome};
pub use retry::{RetryDecision, RetryPolicy, RetryScope};
pub use stats::{Stats, StatsSnapshot};
pub use supervisor::DeliverySupervisor;
pub use timer::TimerActor;
pub use tracker::PendingRetry;
