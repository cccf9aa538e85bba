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
//! A writer sees it finish with a statement that also ends a transaction a handler began by
//! hand and left open there (`left_open`): a `ROLLBACK` when its last holder took it quiet or
//! fresh, so that all it ran is that holder's; a `COMMIT` when that holder took it from the
//! one before still counted open, since its writes may be inside such a transaction.
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

use dacapo_actors::Error;

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
    /// Its last holder took it still counted open, from the holder before: a transaction
    /// left open on it may hold later holders' writes (see `left_open`).
    shared: bool,
}

impl Parked {
    /// How a transaction left open on it ends: committed when a later holder may have
    /// written inside it, rolled back when it can only be its last holder's.
    fn ending(&self) -> Ending {
        if self.shared {
            Ending::Commit
        } else {
            Ending::Rollback
        }
    }

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
            let ending = self.ending();
            let ended = super::end_on_sqlite(&mut self.connection, ending).await;
            self.finished();
            if let Err(error) = ended {
                tracing::error!(
                    %error,
                    ?ending,
                    "a handler connection given up on failed; it is closed, with what it held"
                );
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
    /// connection it holds in `unsynced`, its `interrupt` (raised if what it runs was
    /// abandoned), and whether its holder took it `shared` (still counted open). Call it with
    /// the turn held, before giving the turn up.
    pub(crate) fn park(
        &self,
        connection: PoolConnection<sqlx::Sqlite>,
        unsynced: Option<Arc<Unsynced>>,
        interrupt: Interrupt,
        shared: bool,
    ) {
        let earlier = self.slot().replace(Parked {
            connection,
            quiet: false,
            unsynced,
            interrupt,
            shared,
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
    /// # Errors
    ///
    /// As [`quiesce`](Self::quiesce).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the connection stays parked.
    pub(crate) async fn take(&self) -> Result<Option<Taken>, Error> {
        let to_wait_for = self.slot().as_ref().is_some_and(|parked| {
            !parked.quiet
                && (sqlx::Connection::is_in_transaction(&*parked.connection)
                    || parked.interrupt.raised())
        });
        if to_wait_for {
            self.quiesce().await?;
        }
        Ok(self.slot().take().map(|parked| Taken {
            counted: !parked.quiet,
            connection: parked.connection,
            interrupt: parked.interrupt,
        }))
    }

    /// Waits until the parked connection finished everything it was asked: call it with the
    /// turn held, before writing on another connection. At most [`QUIESCE_WITHIN`]: a
    /// connection still busy then is given up (back to its pool once it finishes) and the
    /// write goes ahead.
    ///
    /// A transaction a handler left open there is ended first (`left_open`).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when a transaction left open, which later handlers may have written
    /// inside, failed to commit: the write waiting for it must not go, since it may settle
    /// deliveries over writes that never commit. SQLite refusing the commit (a deferred
    /// constraint, a full disk) leaves the connection parked, the transaction open, for the
    /// next writer to try again; a connection that failed is closed.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the connection stays parked, still to wait for.
    pub(crate) async fn quiesce(&self) -> Result<(), Error> {
        let busy = {
            let mut slot = self.slot();
            match slot.as_ref() {
                Some(parked) if !parked.quiet => slot.take(),
                _ => None,
            }
        };
        let Some(parked) = busy else {
            return Ok(());
        };
        let mut waiting = Waiting {
            parking: self,
            parked: Some(parked),
        };
        let Some(parked) = waiting.parked.as_mut() else {
            return Ok(());
        };
        let ending = parked.ending();
        let finished = tokio::time::timeout(
            QUIESCE_WITHIN,
            super::end_on_sqlite(&mut parked.connection, ending),
        )
        .await;
        match finished {
            Ok(Ok(_)) => {
                parked.finished();
                Ok(())
            }
            Ok(Err(sqlx::Error::Database(error))) if ending == Ending::Commit => {
                // Kept open and parked, still counted open: what later handlers wrote inside
                // it is not lost, and the next writer tries the commit again.
                tracing::error!(
                    %error,
                    "a transaction a handler left open on its connection, which later \
                     handlers may have written inside, failed to commit; the runtime's write \
                     waiting for it fails"
                );
                Err(Error::store(format!(
                    "a transaction a handler left open on its connection failed to commit: \
                     {error}"
                )))
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "a handler connection failed; it is closed");
                parked.finished();
                if let Some(parked) = waiting.parked.take() {
                    drop(parked.connection.detach());
                }
                match ending {
                    // What later handlers may have written inside a transaction left open
                    // went with the connection.
                    Ending::Commit => Err(Error::store(format!(
                        "a handler connection failed before what it held was seen to commit: \
                         {error}"
                    ))),
                    Ending::Rollback => Ok(()),
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
                Ok(())
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
        parking.park(db.left_running().await, None, Interrupt::default(), false);
        parking.quiesce().await.unwrap();
        assert_eq!(
            db.rows().await,
            1,
            "the insert ended before the writer's turn"
        );
        assert!(
            parking.take().await.unwrap().is_some(),
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
            false,
        );
        assert!(unsynced.take());
        assert!(
            unsynced.take(),
            "a sync now would miss what the insert still commits"
        );
        parking.quiesce().await.unwrap();
        assert!(unsynced.take(), "what it committed since the last sync");
        assert!(!unsynced.take(), "seen to finish, it no longer counts");
        let taken = parking.take().await.unwrap().expect("still parked");
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
        parking.park(connection, None, Interrupt::default(), false);
        let taken = parking.take().await.unwrap().expect("parked");
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
        parking.park(connection, None, interrupt, false);
        let started = std::time::Instant::now();
        let mut taken = parking.take().await.unwrap().expect("parked");
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
        parking.park(db.left_running().await, None, Interrupt::default(), false);
        // Paused, the clock jumps to the bound as soon as nothing else is left to run.
        tokio::time::pause();
        let started = tokio::time::Instant::now();
        parking.quiesce().await.unwrap();
        assert!(
            started.elapsed() >= super::QUIESCE_WITHIN,
            "waited to the bound"
        );
        assert!(
            parking.take().await.unwrap().is_none(),
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
                parking.park(
                    db.pool.acquire().await.unwrap(),
                    None,
                    Interrupt::default(),
                    false,
                );
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
        parking.park(db.left_running().await, None, Interrupt::default(), false);
        {
            let quiesce = parking.quiesce();
            futures::pin_mut!(quiesce);
            assert!(futures::poll!(quiesce).is_pending());
        }
        tokio::time::timeout(Duration::from_secs(30), parking.quiesce())
            .await
            .expect("the insert ends")
            .unwrap();
        assert_eq!(db.rows().await, 1, "the second wait waited for the insert");
        assert!(parking.take().await.unwrap().is_some());
    }

    /// A connection on which a transaction was begun by hand and a row written in it, left
    /// open.
    async fn left_open(db: &Database) -> PoolConnection<sqlx::Sqlite> {
        let mut connection = db.pool.acquire().await.unwrap();
        sqlx::raw_sql("BEGIN; INSERT INTO rows (n) VALUES (1)")
            .execute(&mut *connection)
            .await
            .unwrap();
        connection
    }

    /// Left open by its holder alone, the transaction is rolled back, like an sqlx
    /// transaction dropped; taken by a later holder still counted open (`shared`), it may
    /// hold that holder's writes, and commits.
    #[tokio::test]
    async fn a_transaction_left_open_is_rolled_back_unless_a_later_holder_shared_it() {
        for (shared, rows) in [(false, 0), (true, 1)] {
            let db = Database::new().await;
            let parking = Parking::default();
            parking.park(left_open(&db).await, None, Interrupt::default(), shared);
            parking.quiesce().await.unwrap();
            assert_eq!(db.rows().await, rows, "shared: {shared}");
            let taken = parking.take().await.unwrap().expect("still parked");
            assert!(!taken.counted, "seen to finish");
            let mut connection = taken.connection;
            assert!(
                !super::super::end_on_sqlite(&mut connection, super::Ending::Commit)
                    .await
                    .unwrap(),
                "out of any transaction"
            );
        }
    }

    /// A shared transaction left open that SQLite refuses to commit (a deferred constraint
    /// broken in it) fails the writer waiting for it, and stays open and parked, for the
    /// next writer to try again: what later holders wrote in it is not dropped.
    #[tokio::test]
    async fn a_shared_transaction_left_open_that_fails_to_commit_fails_the_writer_and_stays() {
        let db = Database::new().await;
        let mut connection = db.pool.acquire().await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE parents (id INTEGER PRIMARY KEY); \
             CREATE TABLE children (parent INTEGER REFERENCES parents (id) \
                 DEFERRABLE INITIALLY DEFERRED); \
             BEGIN; INSERT INTO rows (n) VALUES (1); INSERT INTO children VALUES (7)",
        )
        .execute(&mut *connection)
        .await
        .unwrap();
        let parking = Parking::default();
        parking.park(connection, None, Interrupt::default(), true);
        for _ in 0..2 {
            assert!(parking.quiesce().await.is_err());
        }
        assert_eq!(db.rows().await, 0, "not committed");
        let taken = parking.take().await.unwrap().expect("still parked");
        assert!(taken.counted, "never seen to finish");
        let mut connection = taken.connection;
        sqlx::raw_sql("INSERT INTO parents VALUES (7)")
            .execute(&mut *connection)
            .await
            .unwrap();
        parking.park(connection, None, Interrupt::default(), true);
        parking.quiesce().await.unwrap();
        assert_eq!(db.rows().await, 1, "committed once it could");
    }
}
