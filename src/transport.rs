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

/// `url` without the password of its user info, for logs and `Debug`.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The authority ends at the first `/`; its user info at the last `@` (a password may
    // hold `@`).
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((user_info, host)) if user_info.contains(':') => {
            let user = user_info.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}{path}")
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(
            super::redacted("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            super::redacted("nats://127.0.0.1:4222"),
            "nats://127.0.0.1:4222"
        );
    }
}
