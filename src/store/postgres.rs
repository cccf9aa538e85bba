use dacapo_actors::Error;
use futures::stream::BoxStream;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};

use crate::store::sql::{Database, Migration, SqlStore, migrations};

pub(crate) const MIGRATIONS: &[Migration] = migrations!("postgres");

/// The durable inbox, dead letters, claims and outbox in PostgreSQL, for fleets: several nodes
/// share one database, each owning the deliveries it runs, and take over from nodes that stop.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub type PostgresStore = SqlStore<sqlx::Postgres>;

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

/// A `NOTIFY` on the outbox channel per commit that enlisted, on one connection kept for it: a
/// notification sent between two polls of the stream is queued, not lost.
pub(crate) fn enlisted_signals(pool: PgPool) -> BoxStream<'static, Result<(), Error>> {
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
    Box::pin(signals)
}

impl SqlStore<sqlx::Postgres> {
    /// A store over `pool`, whose schema is created (or brought up to date) first.
    ///
    /// # Errors
    ///
    /// The database's error when the schema cannot be applied.
    pub async fn with_pool(pool: PgPool) -> Result<Self, Error> {
        // The runtime's own pool, with every option of the application's (timeouts, hooks) but
        // the ping before each use: a round trip per statement. A connection the server closed
        // meanwhile is found by the statement, which runs again on another (`on_live_session`).
        let engine = pool
            .options()
            .clone()
            .test_before_acquire(false)
            .connect_lazy_with((*pool.connect_options()).clone());
        Self::open_on(pool, engine, Database::Postgres).await
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
