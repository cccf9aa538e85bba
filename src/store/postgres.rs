use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use dacapo_actors::Error;
use futures::stream::BoxStream;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};

use crate::store::sql::{
    Database, FLUSH_WAL, Flush, HandlerPool, Migration, OwnThread, SqlStore, migrations, redacted,
};

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

/// How long opening a store waits for the server's first connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl SqlStore<sqlx::Postgres> {
    /// A store over `pool`, whose schema is created (or brought up to date) first.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`](crate::Error::Configuration) for a database whose encoding
    /// cannot hold every character (anything but `UTF8` and `SQL_ASCII`); the database's error
    /// when the schema cannot be applied.
    pub async fn with_pool(pool: PgPool) -> Result<Self, crate::Error> {
        // The connections of the runtime's pools opened now are used by the runtime's threads
        // for as long as the store lives, and need a runtime that drives them as long: not
        // the caller's, which may stay idle once the store is open.
        let opener = OwnThread::start("dacapo-postgres")
            .map(Arc::new)
            .map_err(|error| {
                crate::Error::Store(format!("cannot start the store's thread: {error}").into())
            })?;
        let engine = {
            // Where the pool's upkeep task goes, which opens connections to keep a minimum.
            let _on_opener = opener.runtime().enter();
            engine_pool(&pool)
        };
        holds_any_text(&pool).await?;
        let handlers = handler_pool(&pool, &engine, &opener).await?;
        let store = Self::open_on(pool, engine.clone(), Database::postgres).await?;
        opener.run(async move { opened_ahead(&engine).await }).await;
        let store = store.opened_on(opener);
        Ok(match handlers {
            Some(handlers) => store.with_handler_pool(handlers),
            None => store,
        })
    }

    /// Connects to the PostgreSQL database at `url` (`postgres://` or `postgresql://`) and
    /// brings its schema up to date.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`](crate::Error::Configuration) for a URL of another kind or one
    /// that does not parse, or a database in an encoding that cannot hold every character (see
    /// [`with_pool`](Self::with_pool)); [`Error::Store`](crate::Error::Store) naming the server (the URL
    /// without its password) and the cause when it cannot be reached within 5 seconds, or
    /// when the schema cannot be applied.
    pub async fn connect(url: &str) -> Result<Self, crate::Error> {
        let pool = pool(url).await?;
        Self::with_pool(pool).await
    }

    /// Connects to the PostgreSQL database at `url` without creating or migrating anything:
    /// for tools that only read or act on what a runtime wrote (the `dacapo` command line).
    ///
    /// # Errors
    ///
    /// [`Error::NoSchema`](crate::Error::NoSchema) when the database holds no dacapo schema
    /// of this version, and the errors of [`connect`](Self::connect).
    pub async fn connect_existing(url: &str) -> Result<Self, crate::Error> {
        let pool = pool(url).await?;
        let engine = engine_pool(&pool);
        Self::existing_on(pool, engine, Database::postgres, redacted(url)).await
    }
}

/// Refuses a database whose encoding cannot hold every character: message types, headers and
/// deduplication keys are text from anywhere, and one with a character the encoding lacks
/// (`€` in LATIN1) would be refused, with its dead letter, on its way in, and lost.
/// `SQL_ASCII` keeps whatever bytes it is given.
pub(crate) async fn holds_any_text(pool: &PgPool) -> Result<(), crate::Error> {
    let encoding: String = match sqlx::query_scalar("SHOW server_encoding")
        .fetch_one(pool)
        .await
    {
        Ok(encoding) => encoding,
        // A server that keeps no such setting (one only speaking PostgreSQL's protocol) is
        // not refused for it; a lost connection is met again by the next statement.
        Err(sqlx::Error::Database(error)) => {
            tracing::warn!(%error, "the database's encoding could not be read; dacapo needs one that holds every character (UTF8)");
            return Ok(());
        }
        Err(error) => return Err(crate::store::sql::db_error(error).into()),
    };
    if ["UTF8", "SQL_ASCII"].contains(&encoding.to_ascii_uppercase().as_str()) {
        return Ok(());
    }
    Err(crate::Error::Configuration(format!(
        "the database's encoding is {encoding}, which cannot hold every character of the text \
         dacapo keeps (message types, headers, keys from other services): create it with \
         ENCODING 'UTF8'"
    )))
}

/// The application's pool for `url`, after one connection proved the server is there: a
/// pool's own error for an unreachable server is a timeout that hides the cause.
async fn pool(url: &str) -> Result<PgPool, crate::Error> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        let kind = url.split_once("://").map_or(url, |(scheme, _)| scheme);
        return Err(crate::Error::Configuration(format!(
            "{kind:?} is not a PostgreSQL URL: PostgresStore connects to postgres:// or \
             postgresql:// URLs only"
        )));
    }
    let options = PgConnectOptions::from_str(url)
        .map_err(|error| crate::Error::Configuration(format!("{}: {error}", redacted(url))))?;
    let unreachable = |cause: String| {
        crate::Error::Store(
            format!("cannot connect to PostgreSQL at {}: {cause}", redacted(url)).into(),
        )
    };
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|error| unreachable(error.to_string()))?;
    let _ = probe.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|connection, _| {
            Box::pin(async move {
                // One at a time: a server (or a proxy) that refuses one keeps the others.
                for setting in KEEPALIVES {
                    match sqlx::query(setting).execute(&mut *connection).await {
                        Ok(_) => {}
                        Err(sqlx::Error::Database(error)) => {
                            tracing::debug!(%error, setting, "a keepalive setting of a session");
                        }
                        // The connection itself failed: the pool does not take it.
                        Err(error) => return Err(error),
                    }
                }
                Ok(())
            })
        })
        .connect_lazy_with(options))
}

/// A session whose host vanished (its power lost, a partition) ends within about half a minute,
/// rather than after the system's keepalive of two hours, and the locks it held go with it:
/// an Idempotency-Key's, the rows of a handler transaction, a claimed batch. The server probes
/// an idle connection after 10 s, every 5 s, three times; data left unacknowledged 30 s ends
/// it too. Set on every connection of the pools a store opens from a URL (the runtime's and the
/// handlers' take the application pool's settings); not on a pool given to `with_pool`, which
/// suits a pooler in front of the server (a `SET` pins an RDS Proxy session, and behind
/// PgBouncer's transaction pooling it lands on a shared server connection).
const KEEPALIVES: [&str; 4] = [
    "SET tcp_keepalives_idle = 10",
    "SET tcp_keepalives_interval = 5",
    "SET tcp_keepalives_count = 3",
    "SET tcp_user_timeout = 30000",
];

/// The pool of handler connections: as many connections as the application's pool allows, with
/// `synchronous_commit = off`, whose commits return before the server flushed them to its
/// write-ahead log. A delivery's settle commits after its handlers' writes, at the store's own
/// level, and the server flushes the log in order: up to the settle's commit, every commit
/// before it included. So the handlers' writes are durable once the settle is, and a crash of
/// the server that takes them back takes the settle too. `None` (handler connections then come
/// from the runtime's pool) when the store's own commits do not wait for the flush either,
/// and, with a warning, when the server (or a pooler in front of it) refuses what this needs:
/// the flush the relay makes before it sends to a broker, or the connection option.
async fn handler_pool(
    pool: &PgPool,
    engine: &PgPool,
    opener: &OwnThread,
) -> Result<Option<HandlerPool<sqlx::Postgres>>, crate::Error> {
    let level: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(pool)
        .await
        .map_err(crate::store::sql::db_error)?;
    if level.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    if let Err(error) = sqlx::query(FLUSH_WAL).execute(pool).await {
        tracing::warn!(%error, "handler connections commit at the store's own level: the server refuses the write that flushes what they leave unflushed");
        return Ok(None);
    }
    let options = (*pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    let handlers = {
        let _on_opener = opener.runtime().enter();
        pool.options()
            .clone()
            .min_connections(0)
            .test_before_acquire(false)
            .connect_lazy_with(options)
    };
    // One connection now: a pooler that refuses the option refuses it here, not in every
    // handler; and the first handlers do not wait for a connection to open.
    let opening = handlers.clone();
    let refused = opener
        .run(async move {
            match tokio::time::timeout(CONNECT_TIMEOUT, opening.acquire()).await {
                Ok(Ok(connection)) => {
                    drop(connection);
                    back_in(&opening, 1).await;
                    None
                }
                Ok(Err(error)) => Some(error.to_string()),
                Err(_) => Some(format!("none within {CONNECT_TIMEOUT:?}")),
            }
        })
        .await;
    if let Some(error) = refused {
        tracing::warn!(%error, "handler connections commit at the store's own level: a connection with synchronous_commit = off could not be opened");
        return Ok(None);
    }
    Ok(Some(HandlerPool::new(
        handlers,
        Flush::PostgresWal(engine.clone()),
    )))
}

/// How many of the runtime's connections a store opens before the runtime starts: as many as
/// its group commits run at once.
const OPENED_AHEAD: u32 = 4;

/// Opens a few of the runtime's connections now, all at once, so that its first deliveries do
/// not each wait for one to open (a TLS handshake each, where the server offers it: 90 ms was
/// seen on a loaded machine, with a node's first deliveries 200–320 ms after its start). A
/// connection that does not open is left to the runtime, which opens its own when it needs
/// them.
async fn opened_ahead(engine: &PgPool) {
    let count = OPENED_AHEAD.min(engine.options().get_max_connections());
    let opening = futures::future::join_all((0..count).map(|_| engine.acquire()));
    match tokio::time::timeout(CONNECT_TIMEOUT, opening).await {
        Ok(opened) => {
            if let Some(Err(error)) = opened.iter().find(|opened| opened.is_err()) {
                tracing::debug!(%error, "a connection of the runtime's did not open ahead");
            }
            let open = opened.iter().filter(|opened| opened.is_ok()).count();
            drop(opened);
            back_in(engine, open).await;
        }
        Err(_) => tracing::debug!("the runtime's connections did not open ahead in time"),
    }
}

/// Waits, a bounded while, until `pool` has `count` connections idle: a connection dropped
/// goes back to its pool on a task of the runtime it is dropped on, after a ping. Waited for
/// on the store's own thread, so that the store's first statements, on whatever runtime,
/// find them in the pool instead of opening others there.
async fn back_in(pool: &PgPool, count: usize) {
    let back = tokio::time::timeout(CONNECT_TIMEOUT, async {
        while pool.num_idle() < count {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    if back.is_err() {
        tracing::debug!("the connections opened ahead were not all back in the pool in time");
    }
}

/// The runtime's own pool, with every option of the application's (timeouts, hooks) but the
/// ping before each use: a round trip per statement. A connection the server closed meanwhile
/// is found by the statement, which runs again on another (`on_live_session`, and the kept
/// connections' own loop). The runtime keeps a few of its connections out of the pool between
/// statements (`sql::kept`), against the ping sqlx makes on each connection it takes back.
fn engine_pool(pool: &PgPool) -> PgPool {
    pool.options()
        .clone()
        .test_before_acquire(false)
        .connect_lazy_with((*pool.connect_options()).clone())
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    fn admin_options() -> PgConnectOptions {
        let url = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        PgConnectOptions::from_str(&url).unwrap()
    }

    /// A store opened from a URL has the server give up on a session whose host vanished
    /// within about half a minute, on each of its pools.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sessions_of_a_store_opened_from_a_url_are_kept_alive_by_the_server() {
        let url = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let pool = super::pool(&url).await.unwrap();
        let engine = super::engine_pool(&pool);
        for pool in [&pool, &engine] {
            let settings: (String, String, String, String) = sqlx::query_as(
                "SELECT current_setting('tcp_keepalives_idle'), \
                 current_setting('tcp_keepalives_interval'), \
                 current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            assert_eq!(
                settings,
                ("10".into(), "5".into(), "3".into(), "30000".into()),
                "the test server is reached over TCP"
            );
        }
    }

    /// A store's runtime finds connections open: as many as its group commits run at once,
    /// or as its pool allows.
    #[tokio::test]
    async fn the_runtimes_first_connections_are_opened_with_the_store() {
        for (max, opened) in [(8, 4), (2, 2)] {
            let engine = PgPoolOptions::new()
                .max_connections(max)
                .connect_lazy_with(admin_options());
            assert_eq!(engine.size(), 0);
            super::opened_ahead(&engine).await;
            assert_eq!(engine.size(), opened);
            // Each goes back to the pool as its handle drops, on a task of its own.
            tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while engine.num_idle() < opened as usize {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("every connection opened ahead is idle in the pool");
            engine.close().await;
        }
    }

    /// Handler connections leave their flush to the settle where the settle waits for it, and
    /// run on the runtime's own pool where it does not either.
    #[tokio::test]
    async fn handler_connections_leave_their_flush_only_to_a_store_that_waits_for_its_own() {
        let waits = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(admin_options());
        let opener = crate::store::sql::OwnThread::start("test").unwrap();
        let handlers = super::handler_pool(&waits, &waits, &opener)
            .await
            .unwrap()
            .expect("a pool of their own");
        let level: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&handlers.pool)
            .await
            .unwrap();
        assert_eq!(level, "off");
        let does_not_wait = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(admin_options().options([("synchronous_commit", "off")]));
        assert!(
            super::handler_pool(&does_not_wait, &does_not_wait, &opener)
                .await
                .unwrap()
                .is_none()
        );
    }
}
