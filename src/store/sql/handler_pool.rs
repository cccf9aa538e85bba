//! Handler connections that leave their flush to the delivery's settle: their pool, what makes
//! their commits durable when something read from them must be (the outbox relay, before it
//! sends), and whether anything they committed may still wait for that.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use dacapo_actors::Error;

/// Where a store's handler connections come from when their commits are not made durable by
/// themselves, and what makes them durable.
#[derive(Debug)]
pub(crate) struct HandlerPool<D: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<D>,
    flush: Flush,
    pub(crate) unsynced: Arc<Unsynced>,
}

/// What makes every commit of a handler connection so far durable.
#[derive(Debug)]
pub(crate) enum Flush {
    /// An fsync of SQLite's write-ahead log, named as SQLite names it (absolute, links
    /// resolved): what a `synchronous = FULL` commit does after writing its own frames, and
    /// what covers every frame written before it, whichever connection wrote them.
    #[cfg(feature = "sqlite")]
    SqliteLog(std::path::PathBuf),
    /// A commit at the store's own `synchronous_commit`, on the runtime's pool, that writes
    /// a record to PostgreSQL's write-ahead log ([`FLUSH_WAL`]): the server then flushes the
    /// log up to that commit, and with it every commit before it, those made with
    /// `synchronous_commit = off` included.
    #[cfg(feature = "postgres")]
    PostgresWal(sqlx::PgPool),
}

/// A transactional logical message, the smallest write that gives a transaction a commit
/// record (a read, or an id taken without a write, commits without a flush). PostgreSQL lets
/// any user emit one, though a server may revoke it: the store then keeps handler connections
/// on its own pool. Logical decoding (change data capture) sees one such message per flush.
#[cfg(feature = "postgres")]
pub(crate) const FLUSH_WAL: &str =
    "SELECT pg_logical_emit_message(true, 'dacapo', 'handler connections')";

impl<D: sqlx::Database> HandlerPool<D> {
    pub(crate) fn new(pool: sqlx::Pool<D>, flush: Flush) -> Self {
        Self {
            pool,
            flush,
            unsynced: Arc::default(),
        }
    }

    /// How this pool's commits are made durable.
    #[cfg(test)]
    pub(crate) fn flush(&self) -> &Flush {
        &self.flush
    }

    /// This pool anew, with the same settings, flushing through `engine`: for a runtime
    /// started after another was killed, whose PostgreSQL connections went with it.
    #[cfg(feature = "testing")]
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) fn on_new_pools(&self, engine: &sqlx::Pool<D>) -> Self {
        let pool = self
            .pool
            .options()
            .clone()
            .connect_lazy_with((*self.pool.connect_options()).clone());
        let flush = match &self.flush {
            #[cfg(feature = "sqlite")]
            Flush::SqliteLog(log) => Flush::SqliteLog(log.clone()),
            #[cfg(feature = "postgres")]
            Flush::PostgresWal(_) => {
                let engine: &dyn std::any::Any = engine;
                Flush::PostgresWal(
                    engine
                        .downcast_ref::<sqlx::PgPool>()
                        .expect("a PostgreSQL store flushes through its own pool")
                        .clone(),
                )
            }
        };
        Self::new(pool, flush)
    }

    /// Makes every commit of a handler connection so far durable. On SQLite, nothing to do
    /// while no handler connection of this store was opened since the last sync. On
    /// PostgreSQL the flush is made every time: the rows the relay read may come from
    /// another node's handlers, whose commits this process knows nothing of.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the log cannot be synced or flushed.
    pub(crate) async fn sync(&self) -> Result<(), Error> {
        let owed = self.unsynced.take();
        #[cfg(feature = "postgres")]
        let owed = owed || matches!(self.flush, Flush::PostgresWal(_));
        if !owed {
            return Ok(());
        }
        let synced = self.flush.run().await;
        if synced.is_err() {
            // Still to sync next time.
            self.unsynced.dirty.store(true, Ordering::SeqCst);
        }
        synced
    }
}

impl Flush {
    async fn run(&self) -> Result<(), Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::SqliteLog(log) => {
                let log = log.clone();
                tokio::task::spawn_blocking(move || sync_file(&log))
                    .await
                    .map_err(|error| Error::store(format!("syncing the SQLite log: {error}")))?
                    .map_err(|error| Error::store(format!("syncing the SQLite log: {error}")))
            }
            #[cfg(feature = "postgres")]
            Self::PostgresWal(engine) => sqlx::query(FLUSH_WAL)
                .execute(engine)
                .await
                .map(drop)
                .map_err(|error| {
                    Error::store(format!("flushing PostgreSQL's write-ahead log: {error}"))
                }),
        }
    }
}

/// An fsync of the file at `path`. A log that is not there was checkpointed into the
/// database and removed, the checkpoint having synced both first.
#[cfg(feature = "sqlite")]
fn sync_file(path: &std::path::Path) -> std::io::Result<()> {
    // Opened for writing: some systems refuse to flush a file opened only to read it.
    match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(file) => file.sync_data(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

/// Whether handler connections may have committed since the log was last synced: set when a
/// connection opens and again when it closes (what it wrote in between comes before), and
/// true while any is open.
#[derive(Debug, Default)]
pub(crate) struct Unsynced {
    open: AtomicUsize,
    dirty: AtomicBool,
}

impl Unsynced {
    pub(crate) fn opened(&self) {
        self.open.fetch_add(1, Ordering::SeqCst);
        self.dirty.store(true, Ordering::SeqCst);
    }

    pub(crate) fn closed(&self) {
        self.dirty.store(true, Ordering::SeqCst);
        self.open.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether the log needs a sync now; clears the mark a sync is about to honour.
    pub(super) fn take(&self) -> bool {
        // `open` first: a connection that closes in between marked `dirty` before it left
        // `open`, so one or the other tells of it.
        let open = self.open.load(Ordering::SeqCst) > 0;
        let dirty = self.dirty.swap(false, Ordering::SeqCst);
        dirty || open
    }
}

#[cfg(test)]
mod tests {
    use super::Unsynced;

    #[test]
    fn a_sync_is_owed_from_the_first_open_until_a_sync_after_the_last_close() {
        let unsynced = Unsynced::default();
        assert!(!unsynced.take(), "nothing was opened");
        unsynced.opened();
        assert!(unsynced.take());
        assert!(unsynced.take(), "still open: it may write after this sync");
        unsynced.closed();
        assert!(unsynced.take(), "what it wrote after the last sync");
        assert!(!unsynced.take());
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn a_missing_log_is_synced_and_another_failure_is_told() {
        let directory = std::env::temp_dir().join(format!("dacapo-sync-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let log = directory.join("present.db-wal");
        std::fs::write(&log, b"frames").unwrap();
        assert!(super::sync_file(&log).is_ok());
        assert!(super::sync_file(&directory.join("absent.db-wal")).is_ok());
        // A directory cannot be opened for writing.
        assert!(super::sync_file(&directory).is_err());
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
