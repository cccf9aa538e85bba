use dacapo_actors::{HandlerId, RegistryError};
use uuid::Uuid;

/// Errors of the dacapo runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The engine refused or failed an operation (shutting down, store failure, too large…).
    #[error(transparent)]
    Engine(#[from] dacapo_actors::Error),
    /// The handler registrations are inconsistent.
    #[error("invalid registration: {0}")]
    Registry(#[from] RegistryError),
    /// A handler was named (to inject a fault, say) that no module registered.
    #[error("no handler {0} is registered")]
    UnknownHandler(HandlerId),
    /// No dead letter has this id.
    #[error("no dead letter with id {0}")]
    DeadLetterNotFound(Uuid),
    /// A replay was refused: the envelope is being delivered right now (an earlier replay of
    /// the same dead letter runs). Nothing changed.
    #[error("envelope {0} is being delivered right now (replayed already); nothing was replayed")]
    ReplayInProgress(Uuid),
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
    /// The builder's settings do not fit together; nothing was started.
    #[error("invalid configuration: {0}")]
    Configuration(String),
    /// A table or column name given to a query helper is not a plain SQL identifier
    /// (letters, digits and `_`, optionally `schema.name`); nothing was run.
    #[error("{0:?} is not a plain SQL identifier")]
    InvalidIdentifier(String),
}
