//! Databases that exist for one test.

use uuid::Uuid;

use crate::Error;

/// A database that exists for one test — a temporary SQLite file, or a scratch PostgreSQL
/// database created from an admin URL — removed when dropped, so each test starts empty and
/// leaves nothing behind.
///
/// ```no_run
/// # async fn test() -> Result<(), dacapo::Error> {
/// use dacapo::testing::{ScratchDatabase, TestHarness};
///
/// let db = ScratchDatabase::sqlite();
/// let store = db.sqlite_store().await?;
/// let harness = TestHarness::builder().store(store).build()?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ScratchDatabase {
    url: String,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    #[cfg(feature = "sqlite")]
    Sqlite(std::path::PathBuf),
    #[cfg(feature = "postgres")]
    Postgres { admin: String, name: String },
}

impl ScratchDatabase {
    /// A SQLite file of its own in the temporary directory (created when a store opens it).
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn sqlite() -> Self {
        let path =
            std::env::temp_dir().join(format!("dacapo-scratch-{}.db", Uuid::new_v4().simple()));
        Self {
            url: path.display().to_string(),
            kind: Kind::Sqlite(path),
        }
    }

    /// A new, empty PostgreSQL database on the server of `admin_url` (a URL whose user may
    /// create databases, such as `postgres://postgres@127.0.0.1:5432/postgres`).
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] when `admin_url` is not a `postgres://` URL; [`Error::Store`]
    /// when the server cannot be reached or refuses to create it.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres(admin_url: &str) -> Result<Self, Error> {
        use sqlx::Connection;
        let name = format!("dacapo_scratch_{}", Uuid::new_v4().simple());
        let url = on_the_same_server(admin_url, &name)?;
        let mut admin = sqlx::PgConnection::connect(admin_url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await?;
        let _ = admin.close().await;
        Ok(Self {
            url,
            kind: Kind::Postgres {
                admin: admin_url.to_owned(),
                name,
            },
        })
    }

    /// Where it is: the SQLite file's path, or the PostgreSQL URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A store on it.
    ///
    /// # Errors
    ///
    /// As [`SqliteStore::open`](crate::store::SqliteStore::open).
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite_store(&self) -> Result<crate::store::SqliteStore, Error> {
        crate::store::SqliteStore::open(&self.url).await
    }

    /// A store on it.
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::connect`](crate::store::PostgresStore::connect).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres_store(&self) -> Result<crate::store::PostgresStore, Error> {
        crate::store::PostgresStore::connect(&self.url).await
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        match &self.kind {
            #[cfg(feature = "sqlite")]
            Kind::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm", "-journal"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
                remove_node_locks(path);
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres { admin, name } => {
                let (admin, name) = (admin.clone(), name.clone());
                // Drop may run on a runtime's thread, or on none: a thread of its own, with a
                // runtime of its own, drops the database.
                let _ = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .ok()?;
                    let dropped = runtime.block_on(async {
                        use sqlx::Connection;
                        let mut admin = sqlx::PgConnection::connect(&admin).await?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .execute(&mut admin)
                        .await
                    });
                    if let Err(error) = &dropped {
                        tracing::warn!(%error, database = %name, "could not drop a scratch database; it is left on the server");
                    }
                    dropped.ok()
                })
                .join();
            }
        }
    }
}

/// Removes the lock files of the nodes named on the SQLite file at `path`
/// ([`SqlStore::node_id`](crate::store::SqlStore::node_id)).
#[cfg(feature = "sqlite")]
fn remove_node_locks(path: &std::path::Path) {
    let (Some(directory), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let prefix = format!("{}.node-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(directory) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let file = file.to_string_lossy();
        if file.starts_with(&prefix) && file.ends_with(".lock") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The URL of database `name` on the server of `admin_url`, with the admin URL's options (its
/// query: `sslmode`, a socket's `host`) kept.
#[cfg(feature = "postgres")]
fn on_the_same_server(admin_url: &str, name: &str) -> Result<String, Error> {
    let (address, options) = match admin_url.split_once('?') {
        Some((address, options)) => (address, Some(options)),
        None => (admin_url, None),
    };
    let authority = ["postgres://", "postgresql://"]
        .iter()
        .find(|scheme| address.starts_with(*scheme))
        .map(|scheme| scheme.len())
        .ok_or_else(|| Error::Configuration(format!("{admin_url:?} is not a postgres:// URL")))?;
    // The admin URL's database, named as an option, would stand in for the scratch one.
    let options = options.map(|options| {
        options
            .split('&')
            .filter(|option| !option.starts_with("dbname="))
            .collect::<Vec<_>>()
            .join("&")
    });
    let options = options.filter(|options| !options.is_empty());
    let server = match address[authority..].find('/') {
        Some(path) => &address[..authority + path],
        None => address,
    };
    Ok(match options {
        Some(options) => format!("{server}/{name}?{options}"),
        None => format!("{server}/{name}"),
    })
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::on_the_same_server;

    #[test]
    fn a_scratch_database_keeps_the_admin_urls_server_and_options() {
        let url = |admin| on_the_same_server(admin, "scratch").unwrap();
        assert_eq!(
            url("postgres://postgres@127.0.0.1:5432/postgres"),
            "postgres://postgres@127.0.0.1:5432/scratch"
        );
        assert_eq!(
            url("postgres://u@db/postgres?sslmode=require&host=/run/postgresql"),
            "postgres://u@db/scratch?sslmode=require&host=/run/postgresql"
        );
        assert_eq!(url("postgres://u@db:5433"), "postgres://u@db:5433/scratch");
        assert_eq!(
            url("postgres://u@db/?sslmode=disable"),
            "postgres://u@db/scratch?sslmode=disable"
        );
        assert!(on_the_same_server("127.0.0.1:5432", "scratch").is_err());
        assert!(on_the_same_server("mysql://u@db/x", "scratch").is_err());
        assert_eq!(
            url("postgresql://u@db?dbname=postgres&sslmode=disable"),
            "postgresql://u@db/scratch?sslmode=disable"
        );
        assert_eq!(url("postgres://u@db/x?dbname=x"), "postgres://u@db/scratch");
    }
}
