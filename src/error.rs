use dacapo_actors::{Envelope, HandlerId, RegistryError};
use uuid::Uuid;

/// What can go wrong in dacapo, in one enum to match on.
///
/// Where an operation refused an envelope (too large, no route, shutting down) the envelope
/// is handed back: [`envelope`](Self::envelope), [`into_envelope`](Self::into_envelope).
/// [`is_retryable`](Self::is_retryable) says whether the same call may pass later. `Debug`
/// shows an envelope's payload size, never its bytes, so `?` in `main` prints a short line.
///
/// Store ports ([`ports`](crate::ports)), which a store implementation writes, speak the
/// engine's own [`EngineError`](crate::EngineError); it converts into this one with `?`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A store failed; the operation did not take effect. It may pass later (a lost
    /// connection, a server restarting): it is retryable.
    #[error("store failed: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store refused the data itself (a value it cannot hold, a constraint it enforces):
    /// nothing took effect, and trying again cannot help.
    #[error("store rejected the data: {0}")]
    Rejected(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The database has no dacapo schema (or an older one) and was opened without creating
    /// or migrating it; nothing was written.
    #[error("no dacapo schema at {at}")]
    NoSchema {
        /// The SQLite path or the PostgreSQL URL, without its password.
        at: String,
    },
    /// The runtime is shutting down or stopped; the envelope, handed back, was not accepted.
    #[error("the runtime is shutting down; envelope {} was not accepted", .0.id)]
    ShuttingDown(Box<Envelope>),
    /// A context operation needs a delivery, and this context is detached from one.
    #[error("this message context is detached from any delivery")]
    Detached,
    /// The message could not be serialized.
    #[error("message could not be serialized: {0}")]
    Serialize(#[source] serde_json::Error),
    /// The envelope, handed back, is over the size limit and was not sent.
    #[error("envelope {} of type {} is {size} bytes, over the limit of {limit}", .envelope.id, .envelope.message_type)]
    TooLarge {
        /// The refused envelope.
        envelope: Box<Envelope>,
        /// Its size in bytes ([`Envelope::size`]).
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// `send` needs a handler for the message type and none is registered; the envelope is
    /// handed back.
    #[error("no handler is registered for {}; envelope {} was not sent", .0.message_type, .0.id)]
    NoRoute(Box<Envelope>),
    /// Another live process holds this node id on the database
    /// ([`SqlStore::node_id`](crate::store::SqlStore::node_id)), and still did after `waited`:
    /// two processes under one id would each run the other's deliveries. Nothing was written;
    /// it passes once that process ends, so it is retryable.
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
    /// operation counts as done. Retryable. A topology that is missing or different, which
    /// waiting does not create, is [`Error::Configuration`] instead.
    #[error("{transport} failed: {source}")]
    Transport {
        /// Which transport (`rabbitmq`, `nats`, `postgres-queue`).
        transport: &'static str,
        /// The broker client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The transport has stopped listening: the runtime shut down.
    #[error("the {0} transport has stopped: the runtime shut down")]
    TransportStopped(&'static str),
    /// The handler registrations are inconsistent.
    #[error("invalid registration: {0}")]
    Registry(#[from] RegistryError),
    /// A handler was named (to inject a fault, say) that no module registered.
    #[error("no handler {handler} is registered; the registered ones are: {}", registered_list(.registered))]
    UnknownHandler {
        /// The handler named.
        handler: HandlerId,
        /// Every registered handler, as `module/name`.
        registered: Vec<HandlerId>,
    },
    /// No dead letter has this id.
    #[error("no dead letter with id {0}")]
    DeadLetterNotFound(Uuid),
    /// A replay was refused: the envelope has no dead letter but is in the inbox, unsettled —
    /// being delivered (an earlier replay of the same dead letter runs) or scheduled for
    /// later. Nothing changed.
    #[error(
        "envelope {0} has no dead letter: it is being delivered (replayed already) or scheduled; \
         nothing was replayed"
    )]
    ReplayInProgress(Uuid),
    /// A replay was refused: the dead letter keeps a message from a broker that could not be
    /// read as an envelope ([`DeadLetterReason::Unreadable`](crate::DeadLetterReason::Unreadable)),
    /// which no handler can take as it is. The letter stays; have its sender send it again, or
    /// purge it.
    #[error(
        "dead letter {0} is a message that could not be read as an envelope; it stays, as it \
         arrived: have its sender send it again, or purge it"
    )]
    UnreadableReplay(Uuid),
    /// A tracked delivery did not settle within the wait allowed.
    #[error("delivery of envelope {envelope_id} did not settle within {waited:?}")]
    NotSettled {
        /// The envelope waited for.
        envelope_id: Uuid,
        /// How long the caller waited.
        waited: std::time::Duration,
    },
    /// A tracked delivery ended without settling: the runtime shut down first and handed the
    /// envelope back in its shutdown report.
    #[error("delivery of envelope {0} was abandoned by a shutdown before it settled")]
    Abandoned(Uuid),
    /// The test harness crashed the runtime at a failpoint while the call waited: what it
    /// waited for ends with the crashed process. [`TestHarness::restart`] starts the next one.
    ///
    /// [`TestHarness::restart`]: crate::testing::TestHarness::restart
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    #[error("the runtime crashed {at} (a failpoint of the test harness)")]
    Crashed {
        /// Where it crashed.
        at: dacapo_actors::Failpoint,
    },
    /// The builder's settings do not fit together; nothing was started.
    #[error("invalid configuration: {0}")]
    Configuration(String),
    /// An HTTP request's store transaction cannot be had: it is borrowed (a `RequestTx` is
    /// still held) or has ended (the Idempotency-Key layer committed or rolled it back).
    #[error("the request's transaction {0}")]
    RequestTransaction(&'static str),
    /// A table or column name given to a query helper is not a plain SQL identifier
    /// (letters, digits and `_`, optionally `schema.name`); nothing was run.
    #[error("{0:?} is not a plain SQL identifier")]
    InvalidIdentifier(String),
}

fn registered_list(handlers: &[HandlerId]) -> String {
    if handlers.is_empty() {
        return "none".to_owned();
    }
    handlers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Error {
    /// A broker client's failure, which may pass if tried again.
    pub(crate) fn transport(
        transport: &'static str,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Transport {
            transport,
            source: error.into(),
        }
    }

    /// Whether the same call may pass if made again later: a store failure may (the
    /// database was unreachable, a connection died); a refused value, a closed runtime, a
    /// registration or configuration mistake will not.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Store(_) | Self::Transport { .. } | Self::NodeHeld { .. }
        )
    }

    /// The envelope the operation refused, where one was handed back.
    pub fn envelope(&self) -> Option<&Envelope> {
        match self {
            Self::ShuttingDown(envelope)
            | Self::NoRoute(envelope)
            | Self::TooLarge { envelope, .. } => Some(envelope),
            _ => None,
        }
    }

    /// The envelope the operation refused, taken back out of the error.
    pub fn into_envelope(self) -> Option<Envelope> {
        match self {
            Self::ShuttingDown(envelope)
            | Self::NoRoute(envelope)
            | Self::TooLarge { envelope, .. } => Some(*envelope),
            _ => None,
        }
    }
}

impl From<dacapo_actors::Error> for Error {
    fn from(error: dacapo_actors::Error) -> Self {
        use dacapo_actors::Error as Engine;
        match error {
            Engine::Store(error) => Self::Store(error),
            Engine::Rejected(error) => Self::Rejected(error),
            Engine::ShuttingDown(envelope) => Self::ShuttingDown(envelope),
            Engine::Detached => Self::Detached,
            Engine::Serialize(error) => Self::Serialize(error),
            Engine::TooLarge {
                envelope,
                size,
                limit,
            } => Self::TooLarge {
                envelope,
                size,
                limit,
            },
            Engine::NoRoute(envelope) => Self::NoRoute(envelope),
            Engine::Startup(reason) => Self::Startup(reason),
            Engine::NodeHeld { node, at, waited } => Self::NodeHeld { node, at, waited },
            Engine::Transport { transport, source } => Self::Transport { transport, source },
            // The engine's error grows with the engine; what it adds is a store's failure to
            // the caller until it has a variant here.
            other => Self::Store(Box::new(other)),
        }
    }
}

impl From<serde_json::Error> for Error {
    fn from(error: serde_json::Error) -> Self {
        Self::Serialize(error)
    }
}

/// A database error from the application's own queries on the store's pool: a refusal of the
/// data (a constraint, a value the column cannot hold) is [`Error::Rejected`], anything else
/// (a lost connection, a timeout) [`Error::Store`], as for the runtime's own writes.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        crate::store::sql::db_error(error).into()
    }
}
