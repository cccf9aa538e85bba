use crate::Envelope;

/// Errors of the engine and of the ports it calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A store (inbox, dead letters) failed; the operation did not take effect. It may pass
    /// later (a lost connection, a server restarting): [`is_retryable`](Self::is_retryable).
    #[error("store failed: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store refused the data itself (a value it cannot hold, a constraint it enforces):
    /// the operation did not take effect, and trying it again cannot help.
    #[error("store rejected the data: {0}")]
    Rejected(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The engine is shutting down or stopped; the envelope was not accepted.
    #[error("the runtime is shutting down; envelope {} was not accepted", .0.id)]
    ShuttingDown(Box<Envelope>),
    /// A context operation needs a delivery, and this context is detached from one.
    #[error("this message context is detached from any delivery")]
    Detached,
    /// The message could not be serialized.
    #[error("message could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The envelope is over the size limit and was not sent.
    #[error("envelope {} of type {} is {size} bytes, over the limit of {limit}", .envelope.id, .envelope.message_type)]
    TooLarge {
        /// The rejected envelope, handed back.
        envelope: Box<Envelope>,
        /// Its size in bytes.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// `send` needs a handler for the message type, and none is registered; the envelope is
    /// handed back.
    #[error("no handler is registered for {}; envelope {} was not sent", .0.message_type, .0.id)]
    NoRoute(Box<Envelope>),
    /// Another live process holds this node id on the database, and still did after `waited`:
    /// two processes under one id would each run the other's deliveries. Nothing was written.
    /// It passes once that process ends: it is retryable.
    #[error(
        "node {node} is held by another live process on {at} (waited {waited:?}): give each \
         process its own node id"
    )]
    NodeHeld {
        /// The node id.
        node: String,
        /// The database, without credentials.
        at: String,
        /// How long this process waited for it.
        waited: std::time::Duration,
    },
    /// The engine's threads could not be started.
    #[error("the engine could not start: {0}")]
    Startup(String),
    /// A broker failed (unreachable, a publication it did not confirm); nothing of the
    /// operation counts as done. It may pass later: it is retryable.
    #[error("{transport} failed: {source}")]
    Transport {
        /// Which transport (`rabbitmq`, `nats`, `postgres-queue`).
        transport: &'static str,
        /// The broker client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// Wraps a storage backend's error that may pass if tried again.
    pub fn store(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Store(error.into())
    }

    /// Wraps a storage backend's refusal of the data itself, which no retry can cure.
    pub fn rejected(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Rejected(error.into())
    }

    /// Whether the same operation may succeed if tried again later: a store failure may, and a
    /// node another process holds; a rejected value, a refusal or a closed runtime will not.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Store(_) | Self::Transport { .. } | Self::NodeHeld { .. }
        )
    }

    /// Wraps a broker client's error, which may pass if tried again.
    pub fn transport(
        transport: &'static str,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Transport {
            transport,
            source: error.into(),
        }
    }
}
