//! Storage adapters behind the engine's ports: in memory, SQLite (the embedded default) and
//! PostgreSQL (for fleets).

mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use memory::{MemoryClaims, MemoryDeadLetters, MemoryInbox};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::PostgresStore;
#[cfg(feature = "postgres")]
pub(crate) use postgres::holds_any_text;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use sql::{Dialect, SqlStore};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sqlite::SqliteStore;

/// `url` with its password, where it holds one (`user:password@`, `?password=`), shown as
/// `***`: what the store's errors and the command line show of a database URL.
///
/// ```
/// assert_eq!(
///     dacapo::store::redacted_url("postgres://app:s3cret@db/app"),
///     "postgres://app:***@db/app"
/// );
/// ```
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub fn redacted_url(url: &str) -> String {
    sql::redacted(url)
}
