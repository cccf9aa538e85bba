//! Transports carry envelopes between publishers and the engine: in-process by default, and
//! to other nodes and services through a broker — RabbitMQ (feature `rabbitmq`), NATS
//! JetStream (feature `nats`), or a queue in PostgreSQL that nodes share (feature `postgres`).
//!
//! A transport is given to [`RuntimeBuilder::transport`](crate::RuntimeBuilder::transport)
//! with the message types it carries. Those leave through the outbox: published, a routed
//! message is written to the store's outbox, and the relay sends it to the broker and marks it
//! sent once the broker confirmed it. The node listens on the broker for the routed types it
//! handles, and acknowledges a message once its inbox recorded it; handling comes after, from
//! the inbox. Message types not routed stay node-local.

mod host;
mod in_process;
mod listener;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "postgres")]
mod postgres_queue;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
mod routes;
pub mod wire;

pub use dacapo_actors::Backoff;
pub(crate) use host::{Host, Pending};
pub use host::{Transport, TransportState};
pub(crate) use in_process::InProcess;
pub use listener::Listener;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use nats::Nats;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres_queue::PostgresQueue;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use rabbitmq::{QueueKind, RabbitMq};
pub(crate) use routes::Routes;
pub use wire::WireFormat;
