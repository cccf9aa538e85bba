use std::str::FromStr;
use std::time::Duration;

use dacapo_actors::Error;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::store::sql::{Database, Migration, SqlStore, migrations};

pub(crate) const MIGRATIONS: &[Migration] = migrations!("sqlite");

/// The durable inbox, dead letters, claims and outbox in a SQLite file: the embedded default.
///
/// WAL journal, `synchronous = FULL` (a handled envelope survives a power cut), and
/// `BEGIN IMMEDIATE` for write transactions.
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

impl SqlStore<sqlx::Sqlite> {
    /// A store over `pool`, whose schema is created (or brought up to date) first.
    ///
    /// # Errors
    ///
    /// The database's error when the schema cannot be applied.
    pub async fn with_pool(pool: SqlitePool) -> Result<Self, Error> {
        // The runtime's own pool, with every option of the application's (timeouts, hooks) but
        // the ping before each use, which a file the process holds open has no need of; a
        // one-connection pool (an in-memory database is one) is shared instead.
        let engine = if pool.options().get_max_connections() <= 1 {
            pool.clone()
        } else {
            pool.options()
                .clone()
                .test_before_acquire(false)
                .connect_lazy_with((*pool.connect_options()).clone())
        };
        Self::open_on(pool, engine, Database::Sqlite).await
    }

    /// Opens (creating if needed) the SQLite database at `path` — a file path, or a
    /// `sqlite:` URL — and brings its schema up to date.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the file cannot be opened or the schema applied.
    pub async fn open(path: &str) -> Result<Self, Error> {
        let url = if path.starts_with("sqlite:") {
            path.to_owned()
        } else {
            format!("sqlite://{path}")
        };
        let memory = url.contains(":memory:");
        let options = SqliteConnectOptions::from_str(&url)
            .map_err(Error::store)?
            .create_if_missing(true)
            .journal_mode(if memory {
                SqliteJournalMode::Memory
            } else {
                SqliteJournalMode::Wal
            })
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10));
        // An in-memory database exists once per connection: keep exactly one.
        let mut pool = SqlitePoolOptions::new().max_connections(if memory { 1 } else { 4 });
        if memory {
            // The database lives and dies with its one connection: never recycle it.
            pool = pool
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None);
        }
        let pool = pool.connect_with(options).await.map_err(Error::store)?;
        Self::with_pool(pool).await
    }
}
