use dacapo_actors::Error;
use futures::stream::BoxStream;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};

use crate::store::sql::{Migration, migrations, sql_store};

const MIGRATIONS: &[Migration] = migrations!("postgres");

sql_store!(
    /// The durable inbox and dead letters in PostgreSQL, for fleets: several nodes share one
    /// database, each owning the deliveries it runs, and take over from nodes that stop.
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    PostgresStore, sqlx::Postgres, PgPool,
    claim = CLAIM_POSTGRES,
    begin = "BEGIN",
    migrations = MIGRATIONS,
    // Nodes starting together apply the schema once: the first holds the lock.
    lock_migrations = ["SELECT pg_advisory_xact_lock(7215143920911461)"],
    claims_has_node = "SELECT count(*) FROM information_schema.columns \
        WHERE table_schema = current_schema() AND table_name = 'dacapo_deduplication' \
        AND column_name = 'node'"
);

/// The channel the outbox's insert trigger notifies at every commit that enlisted.
const OUTBOX_CHANNEL: &str = "dacapo_outbox";

async fn listen(pool: &PgPool) -> Result<PgListener, Error> {
    let mut listener = PgListener::connect_with(pool).await.map_err(Error::store)?;
    listener
        .listen(OUTBOX_CHANNEL)
        .await
        .map_err(Error::store)?;
    Ok(listener)
}

impl PostgresStore {
    /// A `NOTIFY` on the outbox channel per commit that enlisted, on one connection kept for
    /// it: a notification sent between two polls of the stream is queued, not lost.
    fn enlisted_signals(&self) -> Option<BoxStream<'static, Result<(), Error>>> {
        let pool = self.pool.clone();
        let signals = futures::stream::unfold(None, move |listener: Option<PgListener>| {
            let pool = pool.clone();
            async move {
                let mut listener = match listener {
                    Some(listener) => listener,
                    None => match listen(&pool).await {
                        Ok(listener) => listener,
                        Err(error) => return Some((Err(error), None)),
                    },
                };
                match listener.recv().await {
                    Ok(_) => Some((Ok(()), Some(listener))),
                    // Listen again on a fresh connection next time.
                    Err(error) => Some((Err(Error::store(error)), None)),
                }
            }
        });
        Some(Box::pin(signals))
    }

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
