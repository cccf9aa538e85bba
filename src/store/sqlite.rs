use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::store::sql::{Database, Flush, HandlerPool, Migration, SqlStore, migrations};

pub(crate) const MIGRATIONS: &[Migration] = migrations!("sqlite");

/// The durable inbox, dead letters, claims and outbox in a SQLite file: the embedded default.
///
/// WAL journal, `synchronous = FULL` by default (every commit is fsynced: an accepted or
/// settled envelope survives a power cut as well as a crash; see
/// [`open_with`](SqlStore::open_with) for `NORMAL`), and `BEGIN IMMEDIATE` for write
/// transactions.
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

impl SqlStore<sqlx::Sqlite> {
    /// A store over `pool`, whose schema is created (or brought up to date) first.
    ///
    /// # Errors
    ///
    /// The database's error when the schema cannot be applied.
    pub async fn with_pool(pool: SqlitePool) -> Result<Self, crate::Error> {
        let engine = engine_pool(&pool);
        let handlers = handler_pool(&pool).await?;
        let store = Self::open_on(pool, engine, Database::sqlite).await?;
        Ok(match handlers {
            Some(handlers) => store.with_handler_pool(handlers),
            None => store,
        })
    }

    /// Opens (creating if needed) the SQLite database at `path` — a file path, or a
    /// `sqlite:` URL such as `sqlite::memory:` — and brings its schema up to date.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`](crate::Error::Configuration) for an empty path (SQLite would
    /// open a temporary database, deleted on close); [`Error::Store`](crate::Error::Store),
    /// naming the path, when the file cannot be opened or the schema applied.
    pub async fn open(path: &str) -> Result<Self, crate::Error> {
        Self::open_with(path, SqliteSynchronous::Full).await
    }

    /// [`open`](Self::open) with the `synchronous` level of your choice. `Full` (the
    /// default) fsyncs the WAL at every commit: what the store acknowledged survives a
    /// process crash and a power cut. `Normal` fsyncs only at checkpoints: a process crash
    /// (kill -9, a panic) still loses nothing, but a power cut or an operating-system crash
    /// can take back the last commits — envelopes a broker saw acknowledged, deliveries
    /// marked handled (which then run again) — in exchange for far fewer fsyncs.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub async fn open_with(
        path: &str,
        synchronous: SqliteSynchronous,
    ) -> Result<Self, crate::Error> {
        let (options, memory) = options(path)?;
        let options = options.synchronous(synchronous);
        let pool = pool_options(memory)
            .connect_with(options.create_if_missing(true))
            .await
            .map_err(|error| open_error(path, error))?;
        Self::with_pool(pool).await
    }

    /// Opens the SQLite database at `path` without creating or migrating anything: for tools
    /// that only read or act on what a runtime wrote (the `dacapo` command line).
    ///
    /// # Errors
    ///
    /// [`Error::NoSchema`](crate::Error::NoSchema) when the file does not exist or holds no
    /// dacapo schema of this version, and the errors of [`open`](Self::open).
    pub async fn open_existing(path: &str) -> Result<Self, crate::Error> {
        let (options, memory) = options(path)?;
        if memory || !options.get_filename().exists() {
            return Err(crate::Error::NoSchema {
                at: path.to_owned(),
            });
        }
        let pool = pool_options(memory)
            .connect_with(options.create_if_missing(false))
            .await
            .map_err(|error| open_error(path, error))?;
        let engine = engine_pool(&pool);
        Self::existing_on(pool, engine, Database::sqlite, path.to_owned()).await
    }
}

/// The runtime's own pool, with every option of the application's (timeouts, hooks) but the
/// ping before each use, which a file the process holds open has no need of; a
/// one-connection pool (an in-memory database is one) is shared instead.
fn engine_pool(pool: &SqlitePool) -> SqlitePool {
    if pool.options().get_max_connections() <= 1 {
        pool.clone()
    } else {
        pool.options()
            .clone()
            .test_before_acquire(false)
            .connect_lazy_with((*pool.connect_options()).clone())
    }
}

/// The pool of handler connections on a file in WAL mode whose commits the store fsyncs
/// (`FULL` or above): at most two connections (they take turns anyway) with
/// `synchronous = NORMAL`, whose commits append to the write-ahead log without an fsync. A
/// delivery's settle commits after its handlers' writes with `FULL`, and a `FULL` commit
/// fsyncs the log, every commit before it included: the handlers' writes are durable once the
/// settle is. `None` (handler connections then come from the runtime's pool) for an in-memory
/// or temporary database, which has nothing to fsync, for another journal mode, whose commits
/// do not all go through the one log, and for a store that does not fsync its own commits.
async fn handler_pool(
    pool: &SqlitePool,
) -> Result<Option<HandlerPool<sqlx::Sqlite>>, crate::Error> {
    if pool.options().get_max_connections() <= 1 {
        return Ok(None);
    }
    let db_error = crate::store::sql::db_error;
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(pool)
        .await
        .map_err(db_error)?;
    let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(pool)
        .await
        .map_err(db_error)?;
    // The file as SQLite opened it: absolute, links resolved, whatever form its name took.
    let file: String =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(pool)
            .await
            .map_err(db_error)?;
    if !mode.eq_ignore_ascii_case("wal") || level < 2 || file.is_empty() {
        return Ok(None);
    }
    let options = (*pool.connect_options())
        .clone()
        .synchronous(SqliteSynchronous::Normal);
    let handlers = pool
        .options()
        .clone()
        .max_connections(2)
        .min_connections(0)
        .test_before_acquire(false)
        .connect_lazy_with(options);
    Ok(Some(HandlerPool::new(
        handlers,
        Flush::SqliteLog(PathBuf::from(format!("{file}-wal"))),
    )))
}

/// The connection options of `path`, and whether it is an in-memory database.
fn options(path: &str) -> Result<(SqliteConnectOptions, bool), crate::Error> {
    let file = path
        .strip_prefix("sqlite://")
        .or_else(|| path.strip_prefix("sqlite:"))
        .unwrap_or(path);
    if file.split('?').next().unwrap_or("").trim().is_empty() {
        return Err(crate::Error::Configuration(format!(
            "an empty SQLite path ({path:?}) would open a temporary database, deleted when it \
             closes: give a file path, or sqlite::memory: for an in-memory database"
        )));
    }
    let url = if path.starts_with("sqlite:") {
        path.to_owned()
    } else {
        format!("sqlite://{path}")
    };
    let memory = url.contains(":memory:");
    let options = SqliteConnectOptions::from_str(&url)
        .map_err(|error| open_error(path, error))?
        .journal_mode(if memory {
            SqliteJournalMode::Memory
        } else {
            SqliteJournalMode::Wal
        })
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10));
    Ok((options, memory))
}

fn pool_options(memory: bool) -> SqlitePoolOptions {
    // An in-memory database exists once per connection: keep exactly one.
    let pool = SqlitePoolOptions::new().max_connections(if memory { 1 } else { 4 });
    if memory {
        // The database lives and dies with its one connection: never recycle it.
        pool.min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
    } else {
        pool
    }
}

fn open_error(path: &str, error: sqlx::Error) -> crate::Error {
    crate::Error::Store(format!("cannot open the SQLite database {path}: {error}").into())
}

#[cfg(test)]
mod tests {
    use super::{handler_pool, options, pool_options};

    /// A directory of its own for one test, removed after.
    struct Directory(std::path::PathBuf);

    impl Directory {
        fn new(name: &str) -> Self {
            let path = std::env::temp_dir()
                .join(format!("dacapo-{name}-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for Directory {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The log the handler pool of the database opened as `name` syncs.
    async fn synced_log(name: &str) -> std::path::PathBuf {
        let (options, memory) = options(name).unwrap();
        let pool = pool_options(memory)
            .connect_with(options.create_if_missing(true))
            .await
            .unwrap();
        let handlers = handler_pool(&pool)
            .await
            .unwrap()
            .expect("a file in WAL mode");
        match handlers.flush() {
            super::Flush::SqliteLog(log) => log.clone(),
            #[cfg(feature = "postgres")]
            super::Flush::PostgresWal(_) => unreachable!("a SQLite store flushes its log"),
        }
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn the_log_synced_is_the_one_sqlite_writes_whatever_the_name_given() {
        let directory = Directory::new("log");
        let real = directory.0.join("real.db");
        let path = real.display().to_string();
        let by_path = synced_log(&path).await;
        let expected =
            std::path::PathBuf::from(format!("{}-wal", real.canonicalize().unwrap().display()));
        assert_eq!(by_path, expected);
        assert!(expected.exists(), "the log SQLite writes");
        let link = directory.0.join("link.db");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let by_link = synced_log(&link.display().to_string()).await;
        assert_eq!(by_link, expected, "through a link, its target's log");
        let by_uri = synced_log(&format!("file:{path}")).await;
        assert_eq!(by_uri, expected, "named by a file: URI");
    }

    /// A store at `synchronous = NORMAL` does not sync its own commits: its handlers' writes
    /// have no settle's sync to wait for, and go on the runtime's pool, as durable as it.
    #[tokio::test]
    async fn a_store_that_does_not_sync_its_commits_gives_handlers_its_own_pool() {
        let directory = Directory::new("normal");
        let (options, memory) =
            options(&directory.0.join("normal.db").display().to_string()).unwrap();
        let pool = pool_options(memory)
            .connect_with(
                options
                    .create_if_missing(true)
                    .synchronous(sqlx::sqlite::SqliteSynchronous::Normal),
            )
            .await
            .unwrap();
        assert!(handler_pool(&pool).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn an_in_memory_database_has_no_log_to_sync() {
        let (options, memory) = options("sqlite::memory:").unwrap();
        let pool = pool_options(memory).connect_with(options).await.unwrap();
        assert!(handler_pool(&pool).await.unwrap().is_none());
    }
}
