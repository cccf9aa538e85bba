//! A fresh database per test: a new SQLite file, or a new PostgreSQL database on the real
//! server (`DACAPO_TEST_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/postgres`).
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;

use dacapo::store::{PostgresStore, SqliteStore};
use sqlx::Connection;
use uuid::Uuid;

/// Which backend a test runs on.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Runs `$body` with `$pool`, the pool of `$db`'s store, whichever the backend.
macro_rules! with_pool {
    ($db:expr, |$pool:ident| $body:expr) => {
        match $db.backend {
            Backend::Sqlite => {
                let store = $db.sqlite().await;
                let $pool = store.pool();
                $body
            }
            Backend::Postgres => {
                let store = $db.postgres().await;
                let $pool = store.pool();
                $body
            }
        }
    };
}

/// A database that exists for one test; dropped with it.
#[derive(Debug)]
pub struct TestDatabase {
    pub backend: Backend,
    pub url: String,
    sqlite_file: Option<PathBuf>,
    postgres_name: Option<String>,
}

fn admin_url() -> String {
    std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

impl TestDatabase {
    pub async fn new(backend: Backend) -> Self {
        let name = format!("dacapo_test_{}", Uuid::new_v4().simple());
        match backend {
            Backend::Sqlite => {
                let file = std::env::temp_dir().join(format!("{name}.db"));
                Self {
                    backend,
                    url: file.display().to_string(),
                    sqlite_file: Some(file),
                    postgres_name: None,
                }
            }
            Backend::Postgres => {
                let admin = admin_url();
                let mut connection = sqlx::PgConnection::connect(&admin)
                    .await
                    .expect("PostgreSQL must be running for the tests (.ci/run starts it)");
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut connection)
                    .await
                    .expect("create the test database");
                let (base, _) = admin.rsplit_once('/').expect("a database url");
                Self {
                    backend,
                    url: format!("{base}/{name}"),
                    sqlite_file: None,
                    postgres_name: Some(name),
                }
            }
        }
    }

    pub async fn sqlite(&self) -> SqliteStore {
        SqliteStore::open(&self.url)
            .await
            .expect("open the SQLite store")
    }

    pub async fn postgres(&self) -> PostgresStore {
        PostgresStore::connect(&self.url)
            .await
            .expect("connect the PostgreSQL store")
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if let Some(file) = &self.sqlite_file {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
            }
            // The lock files of the nodes named on it.
            let prefix = format!("{}.node-", file.display());
            if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
                for entry in entries.flatten() {
                    if entry.path().display().to_string().starts_with(&prefix) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
        if let Some(name) = self.postgres_name.take() {
            // Drop runs outside any runtime guarantee: use a thread with its own.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                runtime.block_on(async {
                    let mut connection = sqlx::PgConnection::connect(&admin_url()).await.ok()?;
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut connection)
                    .await
                    .ok()
                })
            })
            .join();
        }
    }
}

/// Runs `$body` once per backend, with `$db` the fresh database.
#[macro_export]
macro_rules! on_both_backends {
    ($sqlite:ident, $postgres:ident, |$db:ident| $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sqlite() {
            let $db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
            $body
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $postgres() {
            let $db = support_stores::TestDatabase::new(support_stores::Backend::Postgres).await;
            $body
        }
    };
}

impl TestDatabase {
    /// `builder` with this database's store, under the node name `node`.
    pub async fn store(
        &self,
        builder: dacapo::RuntimeBuilder,
        node: &str,
        node_timeout: std::time::Duration,
    ) -> dacapo::RuntimeBuilder {
        match self.backend {
            Backend::Sqlite => {
                builder.store(self.sqlite().await.node_id(node).node_timeout(node_timeout))
            }
            Backend::Postgres => builder.store(
                self.postgres()
                    .await
                    .node_id(node)
                    .node_timeout(node_timeout),
            ),
        }
    }
}

impl TestDatabase {
    /// Rows in the inbox table, read with a connection of its own.
    pub async fn inbox_rows(&self) -> i64 {
        let sql = "SELECT count(*) FROM dacapo_inbox";
        with_pool!(self, |pool| sqlx::query_scalar(sql)
            .fetch_one(pool)
            .await
            .unwrap())
    }
}

impl TestDatabase {
    /// The inbox status of envelope `id` (`incoming`, `scheduled`, `handled`), if it is there.
    pub async fn inbox_status(&self, id: Uuid) -> Option<String> {
        let sql = "SELECT status FROM dacapo_inbox WHERE id = $1";
        let id = id.simple().to_string();
        with_pool!(self, |pool| sqlx::query_scalar(sql)
            .bind(id)
            .fetch_optional(pool)
            .await
            .unwrap())
    }
}

impl TestDatabase {
    /// The single integer `sql` answers, read with a connection of its own.
    pub async fn scalar(&self, sql: &'static str) -> i64 {
        with_pool!(self, |pool| sqlx::query_scalar(sql)
            .fetch_one(pool)
            .await
            .unwrap())
    }

    /// Whether the table `name` exists.
    pub async fn has_table(&self, name: &str) -> bool {
        let sql = match self.backend {
            Backend::Sqlite => {
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = $1"
            }
            Backend::Postgres => {
                "SELECT count(*) FROM information_schema.tables WHERE table_name = $1"
            }
        };
        let count: i64 = with_pool!(self, |pool| sqlx::query_scalar(sql)
            .bind(name)
            .fetch_one(pool)
            .await
            .unwrap());
        count > 0
    }
}

impl TestDatabase {
    /// Runs `f` with a transaction on this database's store (SQLite `BEGIN IMMEDIATE`), then
    /// commits it if `commit`, or rolls it back.
    pub async fn outbox_transaction<M: dacapo::Message>(&self, messages: &[M], commit: bool) {
        use dacapo::outbox::Outbox;
        match self.backend {
            Backend::Sqlite => {
                let store = self.sqlite().await;
                let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                for message in messages {
                    Outbox::enlist(&mut tx, message).await.unwrap();
                }
                if commit {
                    tx.commit().await.unwrap()
                } else {
                    tx.rollback().await.unwrap()
                }
            }
            Backend::Postgres => {
                let store = self.postgres().await;
                let mut tx = store.pool().begin().await.unwrap();
                for message in messages {
                    Outbox::enlist(&mut tx, message).await.unwrap();
                }
                if commit {
                    tx.commit().await.unwrap()
                } else {
                    tx.rollback().await.unwrap()
                }
            }
        }
    }
}

impl TestDatabase {
    /// This database's store, as the engine's inbox sees it.
    pub async fn sqlite_or_postgres_inbox(&self) -> Box<dyn dacapo::ports::DurableInbox> {
        match self.backend {
            Backend::Sqlite => Box::new(self.sqlite().await),
            Backend::Postgres => Box::new(self.postgres().await),
        }
    }

    /// This database's store, as the relay sees it.
    pub async fn sqlite_or_postgres_outbox(&self) -> Box<dyn dacapo::ports::OutboxStore> {
        match self.backend {
            Backend::Sqlite => Box::new(self.sqlite().await),
            Backend::Postgres => Box::new(self.postgres().await),
        }
    }
}

impl TestDatabase {
    /// Runs one statement with a connection of its own.
    pub async fn execute(&self, sql: &'static str) {
        with_pool!(self, |pool| {
            sqlx::query(sql).execute(pool).await.unwrap();
        })
    }
}

impl TestDatabase {
    /// Returns once a session of this PostgreSQL database waits for a lock (a statement queued
    /// behind another transaction's row or key); panics with `what` after `wait`.
    pub async fn until_a_session_waits_for_a_lock(&self, wait: std::time::Duration, what: &str) {
        let waiting = tokio::time::timeout(wait, async {
            while self
                .scalar(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .await
                == 0
            {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(waiting.is_ok(), "{what}: no session waited within {wait:?}");
    }

    /// The one value `sql` answers with `bind` as its `$1`, read with a connection of its own.
    pub async fn value_for<T>(&self, sql: &'static str, bind: String) -> T
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Sqlite>
            + sqlx::Type<sqlx::Sqlite>
            + for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + Send
            + Unpin,
    {
        with_pool!(self, |pool| sqlx::query_scalar(sql)
            .bind(bind)
            .fetch_one(pool)
            .await
            .unwrap())
    }
}

/// A pool on the SQLite file `path` that never waits for SQLite's lock (WAL, four connections,
/// a busy timeout of zero: a writer that finds the lock taken fails at once), with `table`
/// created, and a store on it.
pub async fn never_waiting_sqlite(
    path: &str,
    table: &'static str,
) -> (sqlx::SqlitePool, SqliteStore) {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::ZERO);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    sqlx::query(table).execute(&pool).await.unwrap();
    let store = SqliteStore::with_pool(pool.clone()).await.unwrap();
    (pool, store)
}
