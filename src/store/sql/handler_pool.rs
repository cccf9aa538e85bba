//! Handler connections that leave their fsync to the delivery's settle, on a SQLite file in WAL
//! mode: their pool, the log a settle (or the outbox relay) syncs, and whether anything they
//! committed may still wait for that sync.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use dacapo_actors::Error;

/// Where a store's handler connections come from when their commits are not synced by
/// themselves, and what makes them durable.
#[derive(Debug)]
pub(crate) struct HandlerPool<D: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<D>,
    /// The write-ahead log of the database file, as SQLite names it (absolute, links
    /// resolved).
    log: PathBuf,
    pub(crate) unsynced: Arc<Unsynced>,
}

impl<D: sqlx::Database> HandlerPool<D> {
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn new(pool: sqlx::Pool<D>, log: PathBuf) -> Self {
        Self {
            pool,
            log,
            unsynced: Arc::default(),
        }
    }

    /// The log this pool's commits wait in.
    #[cfg(test)]
    pub(crate) fn log(&self) -> &std::path::Path {
        &self.log
    }

    /// Makes every commit of a handler connection so far durable: an fsync of the log — what
    /// a `synchronous = FULL` commit does after writing its own frames, and what covers every
    /// frame written before it, whichever connection wrote them. Nothing to do while no
    /// handler connection was opened since the last sync.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the log cannot be synced.
    pub(crate) async fn sync(&self) -> Result<(), Error> {
        if !self.unsynced.take() {
            return Ok(());
        }
        let log = self.log.clone();
        let synced = tokio::task::spawn_blocking(move || sync_file(&log))
            .await
            .map_err(|error| Error::store(format!("syncing the SQLite log: {error}")))
            .and_then(|synced| {
                synced.map_err(|error| Error::store(format!("syncing the SQLite log: {error}")))
            });
        if synced.is_err() {
            // Still to sync next time.
            self.unsynced.dirty.store(true, Ordering::SeqCst);
        }
        synced
    }
}

/// An fsync of the file at `path`. A log that is not there was checkpointed into the
/// database and removed, the checkpoint having synced both first.
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
        let dirty = self.dirty.swap(false, Ordering::SeqCst);
        dirty || self.open.load(Ordering::SeqCst) > 0
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
