//! The modules' own database: the same file or server as the runtime's store, reached through
//! sqlx's `Any` driver so that one set of queries serves SQLite and PostgreSQL.

use sqlx::{Any, Transaction};
use sqlx::{AnyPool, any::AnyPoolOptions};

/// The runtime store's own pool, typed, for transactions that enlist in its outbox.
#[derive(Clone)]
pub(crate) enum StorePool {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) pool: AnyPool,
    postgres: bool,
}

impl Db {
    /// `target` is a SQLite file path or a `postgres://` URL.
    pub(crate) async fn connect(target: &str, postgres: bool) -> Result<Self, sqlx::Error> {
        sqlx::any::install_default_drivers();
        let url = if postgres {
            target.to_owned()
        } else {
            format!("sqlite://{target}?mode=rwc")
        };
        let pool = AnyPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await?;
        Ok(Self { pool, postgres })
    }

    /// A write transaction: SQLite must take its write lock up front, or a transaction that
    /// reads then writes fails when another writer got in between.
    pub(crate) async fn begin(&self) -> Result<Transaction<'static, Any>, sqlx::Error> {
        if self.postgres {
            self.pool.begin().await
        } else {
            self.pool.begin_with("BEGIN IMMEDIATE").await
        }
    }

    /// The column type of a generated integer key.
    pub(crate) fn generated_key(&self) -> &'static str {
        if self.postgres {
            "BIGSERIAL PRIMARY KEY"
        } else {
            "INTEGER PRIMARY KEY AUTOINCREMENT"
        }
    }
}
