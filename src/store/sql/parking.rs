//! The handler connection that last had SQLite's turn to write, kept with the turn instead
//! of going back to its pool.
//!
//! A handler may leave work running on its connection when it gives the connection up: a
//! statement whose future it dropped (a cancelled attempt), the rollback of a transaction it
//! dropped unfinished. sqlx's worker runs a connection's commands in order, so a later command
//! on the *same* connection starts only after that work ended. Parking the connection with
//! the turn uses this: the next handler to hold the turn writes on it, queued behind what the
//! last one left, and the turn passes from handler to handler at once. A writer of the
//! runtime's own (the settle of a delivery, a claim, a handler transaction) writes on another
//! connection: taking the turn, it first waits for the parked connection to finish
//! ([`Parking::quiesce`]), one round trip for as many handler connections as came before it.
//! So no writer of the runtime finds SQLite's lock taken by a handler, and a settle still
//! commits (and syncs the log) after every handler write before it — unless the parked
//! connection is still busy after [`QUIESCE_WITHIN`], when the writer goes ahead anyway.
//!
//! A writer sees it finish with two statements, a deferred `BEGIN` and its `ROLLBACK`, which
//! also tell whether a transaction a handler began by hand was left open there: committed
//! then, since the handlers after it may have written inside it (`left_open`).
//!
//! Until a writer has seen it finish, a parked connection still counts as an open handler
//! connection for the log's sync ([`Unsynced`]): what it may still commit is synced by the
//! next sync, the outbox relay's included.
//!
//! A connection parked by a handler the runtime gave up on (its timeout) comes with its
//! [`Interrupt`] raised when it was not in a transaction, and was quiet (or fresh) when that
//! handler took it, so that all it runs is that handler's: the statement it left running stops
//! at once instead of holding the turn for as long as it would run, and whoever takes the turn
//! next waits for it to stop (it lowers the interrupt once the connection finished).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sqlx::pool::PoolConnection;

use super::{Ending, Interrupt, Unsynced};

/// How long a writer waits for the parked connection to finish what it was asked before it
/// writes anyway (then SQLite's busy timeout decides), and gives that connection up.
const QUIESCE_WITHIN: Duration = Duration::from_secs(5);

/// Where a handler connection waits with the turn; shared by everyone who takes the turn.
#[derive(Clone, Debug, Default)]
pub(crate) struct Parking(Arc<Slot>);

#[derive(Debug, Default)]
struct Slot(Mutex<Option<Parked>>);

impl Drop for Slot {
    fn drop(&mut self) {
        let parked = self
            .0
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(parked) = parked {
            parked.let_go();
        }
    }
}

#[derive(Debug)]
struct Parked {
    connection: PoolConnection<sqlx::Sqlite>,
    /// Nothing asked of it since it was last seen to finish.
    quiet: bool,
    /// Where it counts as an open handler connection, for as long as it is not quiet.
    unsynced: Option<Arc<Unsynced>>,
    /// Raised, what it runs stops; lowered once it is seen to finish.
    interrupt: Interrupt,
}

impl Parked {
    /// No longer counted as open: it was seen to finish, or failed.
    fn finished(&mut self) {
        self.interrupt.lower();
        if !self.quiet {
            self.quiet = true;
            if let Some(unsynced) = &self.unsynced {
                unsynced.closed();
            }
        }
    }

    /// Gives the connection up: back to its pool once it finished (it stays counted as open
    /// until then), or closed when there is no runtime to give it back on — a store can be
    /// dropped after the runtime that used it ended, and sqlx gives a connection back on a
    /// task.
    fn let_go(mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.finished();
            drop(self.connection.detach());
            return;
        };
        if self.quiet {
            return;
        }
        runtime.spawn(async move {
            let ended = super::end_on_sqlite(&mut self.connection, Ending::Commit).await;
            self.finished();
            if ended.is_err() {
                drop(self.connection.detach());
            }
        });
    }
}

/// A parked connection, taken by the handler that now holds the turn.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) connection: PoolConnection<sqlx::Sqlite>,
    /// It still counts as an open handler connection: the handler takes that count over.
    pub(crate) counted: bool,
    /// Its interrupt, lowered, to park it with again.
    pub(crate) interrupt: Interrupt,
}

impl Parking {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Parked>> {
        self.0.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves `connection` for the next holder of the turn, with the count of an open handler
    /// connection it holds in `unsynced`, and its `interrupt` (raised if what it runs was
    /// abandoned). Call it with the turn held, before giving the turn up.
    pub(crate) fn park(
        &self,
        connection: PoolConnection<sqlx::Sqlite>,
        unsynced: Option<Arc<Unsynced>>,
        interrupt: Interrupt,
    ) {
        let earlier = self.slot().replace(Parked {
            connection,
            quiet: false,
            unsynced,
            interrupt,
        });
        // Only one connection holds the turn at a time, and it takes the parked one first:
        // there is never a second.
        if let Some(earlier) = earlier {
            earlier.let_go();
        }
    }

    /// The parked connection, for a handler that now holds the turn. One left with a
    /// transaction's rollback still to run is waited for first, as a writer of the runtime's
    /// does ([`quiesce`](Self::quiesce)): the handler would otherwise hold the turn behind it
    /// without a bound. So is one whose interrupt is raised, which must see its statement
    /// stop before it runs the next.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the connection stays parked.
    pub(crate) async fn take(&self) -> Option<Taken> {
        let to_wait_for = self.slot().as_ref().is_some_and(|parked| {
            !parked.quiet
                && (sqlx::Connection::is_in_transaction(&*parked.connection)
                    || parked.interrupt.raised())
        });
        if to_wait_for {
            self.quiesce().await;
        }
        self.slot().take().map(|parked| Taken {
            counted: !parked.quiet,
            connection: parked.connection,
            interrupt: parked.interrupt,
        })
    }

    /// Waits until the parked connection finished everything it was asked: call it with the
    /// turn held, before writing on another connection. At most [`QUIESCE_WITHIN`]: a
    /// connection still busy then is given up (back to its pool once it finishes) and the
    /// write goes ahead.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the connection stays parked, still to wait for.
    pub(crate) async fn quiesce(&self) {
        let busy = {
            let mut slot = self.slot();
            match slot.as_ref() {
                Some(parked) if !parked.quiet => slot.take(),
                _ => None,
            }
        };
        let Some(parked) = busy else {
            return;
        };
        let mut waiting = Waiting {
            parking: self,
            parked: Some(parked),
        };
        let Some(parked) = waiting.parked.as_mut() else {
            return;
        };
        let finished = tokio::time::timeout(
            QUIESCE_WITHIN,
            super::end_on_sqlite(&mut parked.connection, Ending::Commit),
        )
        .await;
        match finished {
            Ok(Ok(_)) => parked.finished(),
            Ok(Err(error)) => {
                tracing::warn!(%error, "a handler connection failed; it is closed");
                parked.finished();
                if let Some(parked) = waiting.parked.take() {
                    drop(parked.connection.detach());
                }
            }
            Err(_) => {
                tracing::warn!(
                    "a handler connection was still busy after {QUIESCE_WITHIN:?}; the runtime \
                     writes without waiting further"
                );
                if let Some(parked) = waiting.parked.take() {
                    parked.let_go();
                }
            }
        }
    }
}

/// A parked connection taken out to wait for it: back in its place when the wait ends, or
/// is cancelled.
struct Waiting<'a> {
    parking: &'a Parking,
    parked: Option<Parked>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(parked) = self.parked.take() {
            *self.parking.slot() = Some(parked);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::pool::PoolConnection;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    use std::sync::Arc;

    use super::{Interrupt, Parking, Unsynced};

    /// A quarter of a second of SQLite's time (unoptimized), far within the writer's bound,
    /// before the row is written.
    const SLOW_INSERT: &str = "INSERT INTO rows (n) SELECT max(x) FROM \
        (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) \
         SELECT x FROM c)";

    /// As long, writing nothing.
    const SLOW_QUERY: &str = "SELECT max(x) FROM (WITH RECURSIVE c(x) AS \
        (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000) SELECT x FROM c)";

    /// Minutes of SQLite's time before its row is written, were it not stopped.
    const RUNAWAY_INSERT: &str = "INSERT INTO rows (n) SELECT max(x) FROM \
        (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) \
         SELECT x FROM c)";

    /// A database file of its own, removed after, with a table to write to.
    struct Database {
        directory: std::path::PathBuf,
        pool: sqlx::SqlitePool,
    }

    impl Database {
        async fn new() -> Self {
            let directory = std::env::temp_dir()
                .join(format!("dacapo-parking-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&directory).unwrap();
            let options = SqliteConnectOptions::new()
                .filename(directory.join("db.sqlite"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            let pool = SqlitePoolOptions::new()
                .max_connections(2)
                .connect_with(options)
                .await
                .unwrap();
            sqlx::query("CREATE TABLE rows (n INTEGER)")
                .execute(&pool)
                .await
                .unwrap();
            Self { directory, pool }
        }

        /// A connection on which a slow insert runs, its future dropped after it was sent:
        /// what a cancelled handler leaves behind.
        async fn left_running(&self) -> PoolConnection<sqlx::Sqlite> {
            let mut connection = self.pool.acquire().await.unwrap();
            {
                let insert = sqlx::query(SLOW_INSERT).execute(&mut *connection);
                futures::pin_mut!(insert);
                assert!(futures::poll!(insert).is_pending(), "the insert is slow");
            }
            connection
        }

        async fn rows(&self) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM rows")
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }
    }

    impl Drop for Database {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.directory);
        }
    }

    #[tokio::test]
    async fn a_writer_waits_for_what_the_parked_connection_left_running() {
        let db = Database::new().await;
        let parking = Parking::default();
        parking.park(db.left_running().await, None, Interrupt::default());
        parking.quiesce().await;
        assert_eq!(
            db.rows().await,
            1,
            "the insert ended before the writer's turn"
        );
        assert!(
            parking.take().await.is_some(),
            "still parked for the next handler"
        );
    }

    #[tokio::test]
    async fn a_parked_connection_counts_as_open_until_a_writer_sees_it_finish() {
        let db = Database::new().await;
        let parking = Parking::default();
        let unsynced = Arc::new(Unsynced::default());
        unsynced.opened();
        parking.park(
            db.left_running().await,
            Some(Arc::clone(&unsynced)),
            Interrupt::default(),
        );
        assert!(unsynced.take());
        assert!(
            unsynced.take(),
            "a sync now would miss what the insert still commits"
        );
        parking.quiesce().await;
        assert!(unsynced.take(), "what it committed since the last sync");
        assert!(!unsynced.take(), "seen to finish, it no longer counts");
        let taken = parking.take().await.expect("still parked");
        assert!(!taken.counted, "the next handler counts itself open");
    }

    #[tokio::test]
    async fn a_connection_left_rolling_back_is_waited_for_before_a_handler_takes_it() {
        let db = Database::new().await;
        let mut connection = db.pool.acquire().await.unwrap();
        {
            let mut tx = sqlx::Connection::begin_with(&mut *connection, "BEGIN IMMEDIATE")
                .await
                .unwrap();
            sqlx::query("INSERT INTO rows (n) VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            let slow = sqlx::query(SLOW_QUERY).execute(&mut *tx);
            futures::pin_mut!(slow);
            assert!(futures::poll!(slow).is_pending(), "the query is slow");
        }
        let parking = Parking::default();
        parking.park(connection, None, Interrupt::default());
        let taken = parking.take().await.expect("parked");
        assert!(
            !sqlx::Connection::is_in_transaction(&*taken.connection),
            "the rollback ran before the handler got the connection"
        );
        assert!(!taken.counted);
        drop(taken);
        assert_eq!(db.rows().await, 0, "rolled back");
    }

    #[tokio::test]
    async fn a_statement_abandoned_by_a_handler_given_up_on_stops_before_the_next_handler_gets_the_connection()
     {
        let db = Database::new().await;
        let mut connection = db.pool.acquire().await.unwrap();
        let interrupt = Interrupt::install(&mut connection).await.unwrap();
        {
            let runaway = sqlx::query(RUNAWAY_INSERT).execute(&mut *connection);
            futures::pin_mut!(runaway);
            assert!(futures::poll!(runaway).is_pending(), "the insert is slow");
        }
        interrupt.raise();
        let parking = Parking::default();
        parking.park(connection, None, interrupt);
        let started = std::time::Instant::now();
        let mut taken = parking.take().await.expect("parked");
        assert!(
            started.elapsed() < super::QUIESCE_WITHIN,
            "stopped, not waited for to the bound"
        );
        assert!(!taken.interrupt.raised(), "lowered for the next handler");
        sqlx::query("INSERT INTO rows (n) VALUES (2)")
            .execute(&mut *taken.connection)
            .await
            .expect("the next handler's statement runs");
        let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM rows")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert_eq!(rows, [2], "the abandoned insert wrote nothing");
    }

    #[tokio::test]
    async fn a_parked_connection_still_busy_after_the_bound_is_given_up() {
        let db = Database::new().await;
        let parking = Parking::default();
        parking.park(db.left_running().await, None, Interrupt::default());
        // Paused, the clock jumps to the bound as soon as nothing else is left to run.
        tokio::time::pause();
        let started = tokio::time::Instant::now();
        parking.quiesce().await;
        assert!(
            started.elapsed() >= super::QUIESCE_WITHIN,
            "waited to the bound"
        );
        assert!(
            parking.take().await.is_none(),
            "given up, not left with the turn"
        );
    }

    #[test]
    fn a_connection_parked_when_its_runtime_ends_is_closed_without_one() {
        let (parking, pool) = {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async {
                let db = Database::new().await;
                let parking = Parking::default();
                parking.park(db.pool.acquire().await.unwrap(), None, Interrupt::default());
                (parking, db.pool.clone())
            })
        };
        let open = pool.size();
        // Dropped with no runtime to give the connection back to its pool on.
        drop(parking);
        assert_eq!(pool.size(), open - 1, "the connection was closed");
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_the_connection_parked_and_still_to_wait_for() {
        let db = Database::new().await;
        let parking = Parking::default();
        parking.park(db.left_running().await, None, Interrupt::default());
        {
            let quiesce = parking.quiesce();
            futures::pin_mut!(quiesce);
            assert!(futures::poll!(quiesce).is_pending());
        }
        tokio::time::timeout(Duration::from_secs(30), parking.quiesce())
            .await
            .expect("the insert ends");
        assert_eq!(db.rows().await, 1, "the second wait waited for the insert");
        assert!(parking.take().await.is_some());
    }
}
