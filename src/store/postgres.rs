use reprise_actors::Error;
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::store::sql::{Migration, sql_store};

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "inbox, dead letters, nodes",
        sql: include_str!("../../migrations/postgres/0001_inbox.sql"),
    },
    Migration {
        version: 2,
        description: "handlers that succeeded",
        sql: include_str!("../../migrations/postgres/0002_handler_successes.sql"),
    },
    Migration {
        version: 3,
        description: "outbox",
        sql: include_str!("../../migrations/postgres/0003_outbox.sql"),
    },
    Migration {
        version: 4,
        description: "idempotency keys",
        sql: include_str!("../../migrations/postgres/0004_idempotency_keys.sql"),
    },
];

sql_store!(
    /// The durable inbox and dead letters in PostgreSQL, for fleets: several nodes share one
    /// database, each owning the deliveries it runs, and take over from nodes that stop.
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    PostgresStore, sqlx::Postgres, PgPool,
    claim = CLAIM_POSTGRES,
    begin = "BEGIN",
    migrations = MIGRATIONS,
    // Nodes starting together apply the schema once: the first holds the lock.
    lock_migrations = ["SELECT pg_advisory_xact_lock(7215143920911461)"]
);

impl PostgresStore {
    /// Connects to the PostgreSQL database at `url` and brings its schema up to date.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the server cannot be reached or the schema applied.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await
            .map_err(Error::store)?;
        Self::with_pool(pool).await
    }
}
