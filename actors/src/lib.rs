//! The engine of [dacapo](https://docs.rs/dacapo): an implementation crate.
//!
//! **Depend on `dacapo`, not on this crate.** `dacapo` re-exports every type a module author,
//! a tester or a store implementer uses, and its documentation is the one to read; the
//! examples here are written against it. What this crate makes public beyond that (the
//! actors, the registry, the engine's parts) exists for `dacapo` alone and may change in any
//! release.
//!
//! It holds every actix actor (the delivery supervisor, handler, context, timer, recovery,
//! relay and cleanup actors), the delivery's pure state machine they drive, the types they
//! exchange, and the [ports] through which they reach storage and the clock. It knows no
//! database, broker or socket.

mod aggregate;
mod backoff;
mod batches;
mod capacity;
mod cleanup;
mod clock;
mod context;
mod dead_letter;
mod deduplication;
mod delivery;
mod dispatcher;
mod engine;
mod envelope;
mod error;
mod failpoint;
mod handler;
mod handler_actor;
mod message;
mod module;
mod panics;
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
mod told;
mod tracker;

pub use aggregate::AggregateError;
pub use backoff::Backoff;
#[doc(hidden)]
pub use cleanup::{CleanupActor, nodes_silent_since};
#[doc(hidden)]
pub use clock::{Busy, Timers, VirtualClock};
#[doc(hidden)]
pub use context::ContextActor;
pub use context::{AttemptHold, MessageContext, SendOptions, TestContext};
pub use dead_letter::{DeadLetter, DeadLetterFilter, DeadLetterReason};
#[doc(hidden)]
pub use deduplication::DeduplicationRules;
pub use deduplication::{Conflicts, Deduplication};
pub use dispatcher::UnknownMessageTypes;
#[doc(hidden)]
pub use dispatcher::{Dispatcher, Persisted, Receiving};
pub use engine::ShutdownReport;
#[doc(hidden)]
pub use engine::{Durability, Engine, EngineConfig, EngineParts, ReportSink};
pub use envelope::Envelope;
pub use error::Error;
pub use failpoint::Failpoint;
#[doc(hidden)]
pub use failpoint::Failpoints;
pub use handler::{Disposition, FailureKind, Handler, HandlerError, HandlerFailure};
#[doc(hidden)]
pub use handler_actor::HandlerActor;
pub use message::Message;
#[doc(hidden)]
pub use module::{Decoded, HandlerEntry, Invoke};
pub use module::{HandlerId, Module};
pub use panics::quiet_handler_panics;
#[doc(hidden)]
pub use reaper::ReaperActor;
#[doc(hidden)]
pub use recovery::RecoveryActor;
pub use registry::{MAX_MESSAGE_TYPE_LEN, RegistryError};
#[doc(hidden)]
pub use registry::{Registry, Route};
#[doc(hidden)]
pub use relay::RelayActor;
pub use report::{DeliveryReport, DiscardReason, Outcome};
pub use retry::{RetryDecision, RetryPolicy, RetryScope};
#[doc(hidden)]
pub use stats::Stats;
pub use stats::StatsSnapshot;
#[doc(hidden)]
pub use supervisor::DeliverySupervisor;
#[doc(hidden)]
pub use timer::TimerActor;
pub use tracker::PendingRetry;
