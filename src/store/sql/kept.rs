//! Connections of the runtime's PostgreSQL pool kept between its statements.
//!
//! sqlx pings every connection it takes back into a pool, and no option turns that off: a
//! round trip to the server for each statement the runtime runs on its pool, as many as the
//! statements themselves on the path of a delivery (its accept and its settle). A few
//! connections are kept out of the pool instead, each taken back by the next statement once
//! the last one on it ended, whole. They still count against the pool's size; each goes back
//! through the pool (its ping, its `max_lifetime`) when a statement ends on it [`KEPT_FOR`]
//! after it left the pool, at once when a statement on it failed or was cancelled (so that no
//! connection in an unknown state is used again without sqlx's check); and all of them when
//! a statement ends while someone may be waiting for the pool. Nothing gives them back on a
//! timer: a quiet runtime holds its kept connections, which is why it keeps at most half of
//! the pool's. Between statements a kept connection runs none of the pool's
//! hooks (`before_acquire`, `after_release`), and the pool's `idle_timeout` does not reach it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

use super::own_thread::lasting_runtime;
use super::session_ended;

/// How many connections are kept at most: as many as the group commit's leaders, whose
/// statements are the ones on every delivery's path. Never more than half of what the pool has
/// besides the outbox's listener, which holds one for good: the pool's other users (handler
/// transactions where there is no handler pool, the flush before the relay sends, the
/// Idempotency-Key layer's lookups) take from it directly, and would wait for connections kept
/// idle.
const KEPT_AT_MOST: usize = 4;

/// How long a connection is kept before it goes back through its pool: the pool then closes
/// one past its `max_lifetime`, as it does its own, and shares it with its other users.
const KEPT_FOR: Duration = Duration::from_secs(60);

/// The kept connections of one pool, shared by every handle on it.
#[derive(Debug, Default)]
pub(crate) struct KeptConnections {
    idle: Mutex<Idle>,
    at_most: usize,
}

#[derive(Debug, Default)]
struct Idle {
    kept: Vec<Kept>,
    /// How many of this pool's statements wait for the pool itself, having found none kept:
    /// a connection a statement ends with then goes to the pool, which hands it to them.
    waiting: usize,
}

/// Counts a statement waiting for the pool while it waits, cancelled or not.
struct Waiting<'a>(&'a KeptConnections);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.idle().waiting -= 1;
    }
}

/// A connection taken from [`KeptConnections`] or the pool. Dropped, it goes back to the pool
/// (sqlx's ping, on the runtime it is dropped on); [`KeptConnections::keep`] keeps it instead.
#[derive(Debug)]
pub(crate) struct Kept {
    connection: PoolConnection<Postgres>,
    since: Instant,
}

impl std::ops::Deref for Kept {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for Kept {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection
    }
}

impl KeptConnections {
    /// Keeps connections of a pool of `size` connections: none for a pool of two or fewer.
    pub(crate) fn of_a_pool_of(size: u32) -> Self {
        let shared = usize::try_from(size.saturating_sub(1) / 2).unwrap_or(usize::MAX);
        Self {
            idle: Mutex::default(),
            at_most: KEPT_AT_MOST.min(shared),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection kept last, or one of `pool`'s.
    ///
    /// # Errors
    ///
    /// The pool's, when it has no connection to give within its timeout.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, it took nothing.
    pub(crate) async fn take(&self, pool: &PgPool) -> Result<Kept, sqlx::Error> {
        {
            let mut idle = self.idle();
            if let Some(kept) = idle.kept.pop() {
                return Ok(kept);
            }
            idle.waiting += 1;
        }
        let waiting = Waiting(self);
        let connection = pool.acquire().await?;
        drop(waiting);
        Ok(Kept {
            connection,
            since: Instant::now(),
        })
    }

    /// Keeps `kept`, whose last statement ended whole outside a transaction, for the next
    /// statement; or gives it back to `pool`, its pool: when enough are kept, or when it left
    /// the pool [`KEPT_FOR`] ago. When someone may wait for the pool (a statement of ours that
    /// found none kept, or, with every connection of the pool taken, one of its other users),
    /// gives back every kept connection with it.
    pub(crate) fn keep(&self, kept: Kept, pool: &PgPool) {
        let exhausted = pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections();
        let given_back = {
            let mut idle = self.idle();
            if exhausted || idle.waiting > 0 {
                // Those kept too: a user of the pool's own waits for one.
                let mut given_back = std::mem::take(&mut idle.kept);
                given_back.push(kept);
                given_back
            } else if kept.since.elapsed() < KEPT_FOR && idle.kept.len() < self.at_most {
                idle.kept.push(kept);
                Vec::new()
            } else {
                vec![kept]
            }
        };
        // Outside the lock: sqlx spawns their way back to the pool.
        drop(given_back);
    }
}

/// What `$statement` (an expression that uses `$connection`, a `&mut PgConnection`) answers on
/// a connection of `$kept` (a [`KeptConnections`]) or of `$pool`, run again on another where
/// the server had ended the session of the one it took, at most `$tries` times in all (see
/// [`on_live_session`](super::on_live_session): each connection is found so once). The
/// connection is kept once the statement ended whole; cancelled or failed, it goes back to its
/// pool, which checks it first. A macro, not a function taking an async closure: the future
/// of such a closure over a borrowed connection is not known to be `Send` for every borrow.
macro_rules! on_a_kept_connection {
    ($kept:expr, $pool:expr, $tries:expr, |$connection:ident| $statement:expr) => {{
        let (kept, pool, tries): (&$crate::store::sql::kept::KeptConnections, _, u32) =
            (&$kept, $pool, $tries);
        let mut tried = 1;
        loop {
            let mut taken = match kept.take(pool).await {
                Ok(taken) => taken,
                Err(error) => break Err(error),
            };
            let $connection: &mut sqlx::PgConnection = &mut taken;
            match $statement.await {
                Ok(done) => {
                    kept.keep(taken, pool);
                    break Ok(done);
                }
                Err(error) if $crate::store::sql::session_ended(&error) && tried < tries => {
                    tracing::debug!(%error, "the server ended an idle connection's session; running on another");
                    tried += 1;
                }
                Err(error) => break Err(error),
            }
        }
    }};
}
pub(crate) use on_a_kept_connection;

impl Drop for KeptConnections {
    /// Gives what is kept back to the pool, on a runtime that runs the task sqlx spawns for
    /// that: the last handle may go where no runtime runs (sqlx then panics), or on one that
    /// may stall.
    fn drop(&mut self) {
        let idle = std::mem::take(
            &mut self
                .idle
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .kept,
        );
        on_a_lasting_runtime(move || drop(idle));
    }
}

/// Runs `drop_connections`, which drops pooled connections, where the tasks sqlx spawns for
/// them run. Without any runtime (no thread could start for one) the connections are
/// forgotten, not dropped: a pool that keeps a minimum spawns a task even for a connection
/// taken out of it, and sqlx panics without a runtime.
fn on_a_lasting_runtime(drop_connections: impl FnOnce() + Send + 'static) {
    match lasting_runtime() {
        Some(runtime) => {
            let _entered = runtime.enter();
            drop_connections();
        }
        None => std::mem::forget(drop_connections),
    }
}

/// A transaction on a kept connection, begun and ended by the statements themselves.
#[derive(Debug)]
pub(crate) struct KeptTransaction {
    /// `None` once committed or rolled back.
    open: Option<Kept>,
    home: Arc<KeptConnections>,
    pool: PgPool,
}

impl KeptTransaction {
    /// Begins a transaction on a connection of `home`, on another where the server had ended
    /// the session of the one it took (at most `tries` times).
    ///
    /// # Errors
    ///
    /// The `BEGIN`'s, or the pool's.
    pub(crate) async fn begin(
        home: &Arc<KeptConnections>,
        pool: &PgPool,
        tries: u32,
    ) -> Result<Self, sqlx::Error> {
        let mut tried = 1;
        loop {
            // Held by the transaction before the `BEGIN` is sent: cancelled on its way, the
            // transaction's `Drop` rolls it back before the connection is used again.
            let mut tx = Self {
                open: Some(home.take(pool).await?),
                home: Arc::clone(home),
                pool: pool.clone(),
            };
            match sqlx::raw_sql("BEGIN").execute(tx.connection()).await {
                Ok(_) => return Ok(tx),
                Err(error) => {
                    // Rolled back by its `Drop` in case the server did begin it (an answer
                    // that could not be read): a dead connection then goes to the pool, which
                    // closes it.
                    drop(tx);
                    if !(session_ended(&error) && tried < tries) {
                        return Err(error);
                    }
                    tracing::debug!(%error, "the server ended an idle connection's session; beginning on another");
                    tried += 1;
                }
            }
        }
    }

    /// The transaction's connection.
    ///
    /// # Panics
    ///
    /// Never while the transaction is open: it ends by `commit` or `rollback`, which take it.
    pub(crate) fn connection(&mut self) -> &mut PgConnection {
        self.open
            .as_mut()
            .expect("a kept transaction is open until it is committed or rolled back")
    }

    /// Commits the transaction.
    ///
    /// # Errors
    ///
    /// The `COMMIT`'s: the transaction may or may not have committed.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the transaction rolls back if it did not commit yet (see `Drop`).
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.end("COMMIT").await
    }

    /// Rolls the transaction back.
    ///
    /// # Errors
    ///
    /// The `ROLLBACK`'s.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    async fn end(mut self, statement: &'static str) -> Result<(), sqlx::Error> {
        // Still held by `self` while it runs: cancelled, or failed, `Drop` rolls back before
        // the connection is used again.
        sqlx::raw_sql(statement).execute(self.connection()).await?;
        if let Some(kept) = self.open.take() {
            self.home.keep(kept, &self.pool);
        }
        Ok(())
    }
}

impl Drop for KeptTransaction {
    /// Rolls an unfinished transaction back on a task of the current runtime (or of dacapo's
    /// lasting thread, where that one may stall or there is none), and only then gives its
    /// connection back: a pool's ping would pass on a connection still inside a transaction,
    /// and its next user would write in it.
    fn drop(&mut self) {
        let Some(mut kept) = self.open.take() else {
            return;
        };
        let (home, pool) = (Arc::clone(&self.home), self.pool.clone());
        on_a_lasting_runtime(move || {
            drop(tokio::spawn(async move {
                // A `ROLLBACK` outside a transaction (after a `COMMIT` that did run, a `BEGIN`
                // that did not) is a warning, not an error.
                if sqlx::raw_sql("ROLLBACK").execute(&mut *kept).await.is_ok() {
                    home.keep(kept, &pool);
                }
            }));
        });
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Duration;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use sqlx::{PgConnection, PgPool};

    use super::{KEPT_FOR, KeptConnections, KeptTransaction};

    fn pool_of(size: u32) -> PgPool {
        let url = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        PgPoolOptions::new()
            .max_connections(size)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect_lazy_with(PgConnectOptions::from_str(&url).unwrap())
    }

    async fn session(connection: &mut PgConnection) -> Result<(i32, String), sqlx::Error> {
        sqlx::query_as("SELECT pg_backend_pid(), current_setting('application_name')")
            .fetch_one(connection)
            .await
    }

    /// A pool of `size`, its kept connections, and `count` connections taken from them.
    async fn taken_of_a_pool_of(
        size: u32,
        count: usize,
    ) -> (PgPool, KeptConnections, Vec<super::Kept>) {
        let pool = pool_of(size);
        let kept = KeptConnections::of_a_pool_of(size);
        let mut taken = Vec::new();
        for _ in 0..count {
            taken.push(kept.take(&pool).await.unwrap());
        }
        (pool, kept, taken)
    }

    /// A user of `pool` that takes from it directly, as the pool's other users do.
    fn acquiring(
        pool: &PgPool,
    ) -> tokio::task::JoinHandle<Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error>>
    {
        let pool = pool.clone();
        tokio::spawn(async move { pool.acquire().await })
    }

    async fn kept_within(kept: &KeptConnections, count: usize) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while kept.idle().kept.len() < count {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the connection is kept");
    }

    /// The next statement runs on the connection the last one ended on, which never went back
    /// through the pool (whose ping is a round trip each time).
    #[tokio::test]
    async fn a_statement_runs_on_the_connection_the_last_one_ended_on() {
        let pool = pool_of(4);
        let kept = KeptConnections::of_a_pool_of(4);
        let first = on_a_kept_connection!(kept, &pool, 2, |connection| session(connection));
        let second = on_a_kept_connection!(kept, &pool, 2, |connection| session(connection));
        assert_eq!(first.unwrap().0, second.unwrap().0);
        assert_eq!(kept.idle().kept.len(), 1);
        assert_eq!(pool.num_idle(), 0, "the connection stays out of the pool");
    }

    /// A transaction dropped unfinished (its caller cancelled, an error on the way) is rolled
    /// back before its connection is kept: its next user does not write inside it.
    #[tokio::test]
    async fn a_transaction_dropped_unfinished_is_rolled_back_before_its_connection_is_used_again() {
        let pool = pool_of(3);
        let kept = Arc::new(KeptConnections::of_a_pool_of(3));
        let mut tx = KeptTransaction::begin(&kept, &pool, 2).await.unwrap();
        sqlx::query("SET LOCAL application_name = 'left_open'")
            .execute(tx.connection())
            .await
            .unwrap();
        let (pid, name) = session(tx.connection()).await.unwrap();
        assert_eq!(name, "left_open");
        drop(tx);
        kept_within(&kept, 1).await;
        let (next_pid, next_name) =
            on_a_kept_connection!(kept, &pool, 2, |connection| session(connection)).unwrap();
        assert_eq!(
            next_pid, pid,
            "the same connection, kept after the rollback"
        );
        assert_ne!(next_name, "left_open", "the transaction was rolled back");
    }

    /// A committed transaction's connection is kept; a rolled back one's too, both outside a
    /// transaction.
    #[tokio::test]
    async fn a_transaction_ended_keeps_its_connection_outside_a_transaction() {
        let pool = pool_of(3);
        let kept = Arc::new(KeptConnections::of_a_pool_of(3));
        for commits in [true, false] {
            let mut tx = KeptTransaction::begin(&kept, &pool, 2).await.unwrap();
            sqlx::query("SET LOCAL application_name = 'inside'")
                .execute(tx.connection())
                .await
                .unwrap();
            if commits {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            assert_eq!(kept.idle().kept.len(), 1);
            let (_, name) =
                on_a_kept_connection!(kept, &pool, 2, |connection| session(connection)).unwrap();
            assert_ne!(name, "inside");
        }
    }

    /// A pool of two keeps nothing (the outbox's listener may hold the other connection):
    /// whoever takes from the pool itself would otherwise wait for a connection kept idle.
    #[tokio::test]
    async fn a_pool_of_two_keeps_nothing_and_its_other_users_find_its_connection() {
        let pool = pool_of(2);
        let _listener = pool.acquire().await.unwrap();
        let kept = KeptConnections::of_a_pool_of(2);
        on_a_kept_connection!(kept, &pool, 2, |connection| session(connection)).unwrap();
        assert_eq!(kept.idle().kept.len(), 0);
        let direct = tokio::time::timeout(Duration::from_secs(5), pool.acquire()).await;
        assert!(
            matches!(direct, Ok(Ok(_))),
            "the pool's other connection is back"
        );
        for (size, at_most) in [(1, 0), (3, 1), (8, 3), (10, 4), (100, 4)] {
            assert_eq!(KeptConnections::of_a_pool_of(size).at_most, at_most);
        }
    }

    /// A connection kept long goes back through its pool, which checks it and applies its
    /// lifetime.
    #[tokio::test]
    async fn a_connection_kept_long_goes_back_to_its_pool() {
        let pool = pool_of(3);
        let kept = KeptConnections::of_a_pool_of(3);
        let taken = kept.take(&pool).await.unwrap();
        kept.keep(taken, &pool);
        let taken = kept.take(&pool).await.unwrap();
        tokio::time::pause();
        tokio::time::advance(KEPT_FOR).await;
        kept.keep(taken, &pool);
        tokio::time::resume();
        assert_eq!(kept.idle().kept.len(), 0);
        assert_eq!(pool.num_idle(), 0);
        tokio::time::timeout(Duration::from_secs(5), async {
            while pool.num_idle() < 1 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the connection is back in its pool");
    }

    /// The last handle on kept connections may drop where no runtime runs: their way back to
    /// the pool is spawned on dacapo's lasting thread, instead of panicking in sqlx, which
    /// spawns it on the current runtime (even for a connection taken out of a pool that keeps
    /// a minimum).
    #[test]
    fn kept_connections_dropped_without_a_runtime_do_not_panic() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let pool = runtime.block_on(async { pool_of(3) });
        let kept = KeptConnections::of_a_pool_of(3);
        runtime
            .block_on(async {
                on_a_kept_connection!(kept, &pool, 2, |connection| session(connection))
            })
            .unwrap();
        assert_eq!(kept.idle().kept.len(), 1);
        drop(kept);
    }

    /// A `BEGIN` given up on its way (its caller cancelled) is rolled back before its
    /// connection is used again: a pool's ping passes inside a transaction, and the next
    /// statements on that connection would run in it, uncommitted.
    #[tokio::test]
    async fn a_begin_given_up_on_its_way_is_rolled_back_before_its_connection_is_used_again() {
        let pool = pool_of(3);
        let kept = Arc::new(KeptConnections::of_a_pool_of(3));
        let (pid, _) =
            on_a_kept_connection!(kept, &pool, 2, |connection| session(connection)).unwrap();
        assert_eq!(kept.idle().kept.len(), 1);
        {
            let begin = KeptTransaction::begin(&kept, &pool, 2);
            futures::pin_mut!(begin);
            let mut context = std::task::Context::from_waker(futures::task::noop_waker_ref());
            // Takes the kept connection and sends the `BEGIN`; its answer is not read yet, or,
            // rarely, at once (the transaction is then dropped begun).
            drop(begin.as_mut().poll(&mut context));
        }
        tokio::time::timeout(Duration::from_secs(5), async {
            while kept.idle().kept.is_empty() && pool.num_idle() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the connection is back");
        // Two statements in one transaction share its id; two that commit on their own do not.
        let mut transactions = Vec::new();
        for _ in 0..2 {
            let (next_pid, transaction): (i32, String) =
                on_a_kept_connection!(kept, &pool, 2, |connection| {
                    sqlx::query_as("SELECT pg_backend_pid(), pg_current_xact_id()::text")
                        .fetch_one(connection)
                })
                .unwrap();
            assert_eq!(next_pid, pid, "the same connection");
            transactions.push(transaction);
        }
        assert_ne!(
            transactions[0], transactions[1],
            "each statement committed on its own"
        );
    }

    /// With every connection of the pool taken, one that a statement ends with goes to the
    /// pool, not to the kept ones: the pool's other users, and statements of ours that found
    /// none kept, wait for the pool itself.
    #[tokio::test]
    async fn a_connection_goes_back_to_a_pool_others_wait_for() {
        let (pool, kept, mut taken) = taken_of_a_pool_of(3, 3).await;
        // Each holds what it gets: two connections ended with must reach two waiters.
        let direct = acquiring(&pool);
        let ours = kept.take(&pool);
        let giving_back = async {
            // Both wait before any connection ends: ours counted as waiting, the other user's
            // task run (this test's runtime runs one task at a time) after it was spawned.
            while kept.idle().waiting == 0 {
                tokio::task::yield_now().await;
            }
            tokio::task::yield_now().await;
            for one in taken.drain(..2) {
                kept.keep(one, &pool);
            }
        };
        let (ours, ()) = tokio::time::timeout(
            Duration::from_secs(3),
            futures::future::join(ours, giving_back),
        )
        .await
        .expect("our statement found a connection");
        let _ours = ours.unwrap();
        let _direct = tokio::time::timeout(Duration::from_secs(3), direct)
            .await
            .expect("the pool's other user found a connection")
            .unwrap()
            .unwrap();
        assert!(kept.idle().kept.is_empty());
    }

    /// With every connection of the pool taken, one that a statement ends with goes to the
    /// pool, and so does every kept one: the pool's other users wait for the pool itself.
    #[tokio::test]
    async fn a_pool_with_none_left_to_give_gets_the_connections_a_statement_ends_with() {
        let (pool, kept, mut taken) = taken_of_a_pool_of(5, 4).await;
        // The pool could still open one: kept.
        kept.keep(taken.pop().unwrap(), &pool);
        assert_eq!(kept.idle().kept.len(), 1);
        let _last = pool.acquire().await.unwrap();
        let other = acquiring(&pool);
        // The other user waits for the pool: this test's runtime runs one task at a time.
        tokio::task::yield_now().await;
        kept.keep(taken.pop().unwrap(), &pool);
        assert!(kept.idle().kept.is_empty(), "the kept one went back too");
        let _other = tokio::time::timeout(Duration::from_secs(3), other)
            .await
            .expect("the other user found a connection")
            .unwrap()
            .unwrap();
    }
}
