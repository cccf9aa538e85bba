//! Stopping a statement that a handler the runtime gave up on left running on its SQLite
//! handler connection.
//!
//! A handler cancelled by its timeout mid-statement leaves the statement running on the
//! connection's worker: nobody waits for its result, yet it holds SQLite's write lock (and the
//! connection) until it ends, which for a runaway statement is no time soon. Each handler
//! connection carries a progress handler that stops its statement with `SQLITE_INTERRUPT`
//! while the connection's [`Interrupt`] is raised. An interrupted statement outside a
//! transaction is rolled back (unless it was already committing when SQLite looked): the
//! attempt failed anyway, and its retry writes again.
//!
//! Only what the given-up handler runs is stopped: a connection is interrupted for its holder
//! only if it was quiet (or fresh) when taken, so that a statement an earlier handler left
//! running for its own reasons still runs to its end. A handler that installs a progress
//! handler of its own on the connection replaces this one, until the connection goes back to
//! its pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// How many of SQLite's virtual machine instructions run between two looks at the flag: a
/// look is one atomic load, next to a thousand instructions.
const INSTRUCTIONS_BETWEEN_LOOKS: i32 = 1000;

/// Raised, the statement running on its connection stops at the next look.
#[derive(Clone, Debug, Default)]
pub(crate) struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// Gives `connection` a progress handler that stops its statement while the returned
    /// interrupt is raised, in place of any it had (a connection back from its pool had one).
    ///
    /// # Errors
    ///
    /// The connection's worker is gone.
    pub(crate) async fn install(
        connection: &mut sqlx::SqliteConnection,
    ) -> Result<Self, sqlx::Error> {
        let interrupt = Self::default();
        let raised = Arc::clone(&interrupt.0);
        connection
            .lock_handle()
            .await?
            .set_progress_handler(INSTRUCTIONS_BETWEEN_LOOKS, move || {
                !raised.load(Ordering::Acquire)
            });
        Ok(interrupt)
    }

    /// Stops what runs on the connection now, and whatever it is asked next until
    /// [`lowered`](Self::lower): raise it only on a connection nobody will use before it was
    /// seen to finish.
    pub(crate) fn raise(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub(crate) fn raised(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// Lets the connection run statements again: call it once the connection was seen to
    /// finish what it was asked.
    pub(crate) fn lower(&self) {
        self.0.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

    use super::Interrupt;

    /// Minutes of SQLite's time, were it not stopped.
    const RUNAWAY: &str = "SELECT max(x) FROM (WITH RECURSIVE c(x) AS \
        (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT x FROM c)";

    #[tokio::test]
    async fn a_raised_interrupt_stops_the_running_statement_and_a_lowered_one_lets_the_next_run() {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteConnectOptions::new().in_memory(true))
            .await
            .unwrap();
        let mut connection = pool.acquire().await.unwrap();
        let interrupt = Interrupt::install(&mut connection).await.unwrap();
        {
            let runaway = sqlx::query(RUNAWAY).execute(&mut *connection);
            futures::pin_mut!(runaway);
            assert!(
                futures::poll!(runaway.as_mut()).is_pending(),
                "the statement runs"
            );
            interrupt.raise();
            let stopped = tokio::time::timeout(std::time::Duration::from_secs(30), runaway)
                .await
                .expect("stopped long before its end");
            let error = stopped.expect_err("interrupted");
            assert!(error.to_string().contains("interrupt"), "{error}");
        }
        interrupt.lower();
        let one: i64 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
        assert_eq!(one, 1);
    }
}
