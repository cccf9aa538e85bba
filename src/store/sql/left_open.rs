//! A transaction a handler began by hand (`BEGIN` run as a statement) on its connection and
//! left open when it gave the connection up.
//!
//! sqlx ends the transactions it began itself (a dropped `sqlx::Transaction` queues its
//! rollback), but it does not know of one begun by a statement. Left open, on SQLite it keeps
//! the database's write lock, so every writer of the runtime's would fail as busy; on a
//! connection that goes back to the runtime's pool, the runtime's next statements there would
//! run inside it and commit with it, if ever. So the runtime ends it before anyone else
//! writes on that connection, or through SQLite's lock: rolled back, like a dropped sqlx
//! transaction, where nobody else used the connection since; committed on SQLite's parked
//! handler connection (see `parking`) when the next handler took it first — its statements,
//! each meant to commit on its own, are then inside that transaction, and a rollback would
//! take back work whose delivery settles as handled.

/// How a transaction left open is ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Nobody used the connection after the handler that left it open.
    Rollback,
    /// Later handlers may have written in it (only on SQLite, whose connections are parked).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Commit,
}

impl Ending {
    fn statement(self) -> &'static str {
        match self {
            Self::Rollback => "ROLLBACK",
            Self::Commit => "COMMIT",
        }
    }

    fn told(self) {
        tracing::warn!(
            ending = self.statement(),
            "a handler left a transaction it began by hand open on its connection; the runtime \
             ended it (commit what you begin, or begin with sqlx's `begin`, which rolls back \
             when dropped)"
        );
    }
}

/// Waits until `connection` finished everything it was asked (what a ping tells), then ends
/// a transaction left open on it by `ending`. Answers whether there was one.
///
/// One statement, `ending`'s own: outside a transaction SQLite refuses it and changes
/// nothing.
///
/// # Errors
///
/// The database's error when the connection fails, or the transaction left open cannot end
/// as asked (a commit refused: a deferred constraint, a full disk).
///
/// # Cancel safety
///
/// Cancelled, the statement may still run, after what was asked before it: the connection
/// is then out of any transaction, as asked; it is never left in one of the runtime's own.
#[cfg(feature = "sqlite")]
pub(crate) async fn end_on_sqlite(
    connection: &mut sqlx::SqliteConnection,
    ending: Ending,
) -> Result<bool, sqlx::Error> {
    match sqlx::raw_sql(ending.statement())
        .execute(&mut *connection)
        .await
    {
        Ok(_) => {
            ending.told();
            Ok(true)
        }
        Err(sqlx::Error::Database(error))
            if error.message().contains("no transaction is active") =>
        {
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// PostgreSQL's `in_failed_sql_transaction`: a statement in a transaction that failed.
#[cfg(feature = "postgres")]
const IN_FAILED_TRANSACTION: &str = "25P02";

/// [`end_on_sqlite`] on PostgreSQL, which ends it by rolling it back: a connection there goes
/// back to its pool, used by nobody in between.
///
/// Outside a transaction block a statement is a transaction of its own, which starts with
/// it: its start and the transaction's are one timestamp. Inside one begun earlier, the
/// transaction started before. In a failed transaction the statement fails.
///
/// # Errors
///
/// The database's error when the connection fails.
///
/// # Cancel safety
///
/// Cancelled, the connection may be left between the two statements, in the transaction:
/// close it.
#[cfg(feature = "postgres")]
pub(crate) async fn end_on_postgres(
    connection: &mut sqlx::PgConnection,
) -> Result<bool, sqlx::Error> {
    use sqlx::Row;

    let left_open = match sqlx::raw_sql("SELECT statement_timestamp() <> transaction_timestamp()")
        .fetch_one(&mut *connection)
        .await
    {
        Ok(row) => row.try_get::<bool, _>(0)?,
        Err(sqlx::Error::Database(error))
            if error.code().as_deref() == Some(IN_FAILED_TRANSACTION) =>
        {
            true
        }
        Err(error) => return Err(error),
    };
    if left_open {
        sqlx::raw_sql(Ending::Rollback.statement())
            .execute(&mut *connection)
            .await?;
        Ending::Rollback.told();
    }
    Ok(left_open)
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn on_sqlite_a_transaction_left_open_is_ended_as_asked_and_none_is_left_alone() {
        use sqlx::Connection;

        use super::{Ending, end_on_sqlite};

        let mut connection = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::raw_sql("CREATE TABLE rows (id INTEGER PRIMARY KEY)")
            .execute(&mut connection)
            .await
            .unwrap();
        assert!(
            !end_on_sqlite(&mut connection, Ending::Commit)
                .await
                .unwrap()
        );
        for (id, ending, kept) in [(1, Ending::Commit, 1), (2, Ending::Rollback, 1)] {
            sqlx::raw_sql("BEGIN")
                .execute(&mut connection)
                .await
                .unwrap();
            sqlx::query("INSERT INTO rows (id) VALUES (?)")
                .bind(id)
                .execute(&mut connection)
                .await
                .unwrap();
            assert!(end_on_sqlite(&mut connection, ending).await.unwrap());
            // Out of any transaction again: a second look finds none.
            assert!(!end_on_sqlite(&mut connection, ending).await.unwrap());
            let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rows")
                .fetch_one(&mut connection)
                .await
                .unwrap();
            assert_eq!(rows, kept, "after {ending:?}");
        }
    }

    /// A transaction left open, a failed one, and none, on a real PostgreSQL server
    /// (`DACAPO_TEST_POSTGRES`, by default the local one).
    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn on_postgres_a_transaction_left_open_or_failed_is_rolled_back_and_none_is_left_alone() {
        use sqlx::Connection;

        use super::end_on_postgres;

        let url = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let mut connection = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql("CREATE TEMPORARY TABLE left_open (id INT PRIMARY KEY)")
            .execute(&mut connection)
            .await
            .unwrap();
        assert!(!end_on_postgres(&mut connection).await.unwrap());
        sqlx::raw_sql("BEGIN; INSERT INTO left_open VALUES (1)")
            .execute(&mut connection)
            .await
            .unwrap();
        assert!(end_on_postgres(&mut connection).await.unwrap());
        sqlx::raw_sql("BEGIN; INSERT INTO left_open VALUES (2)")
            .execute(&mut connection)
            .await
            .unwrap();
        assert!(
            sqlx::raw_sql("SELECT 1 / 0")
                .execute(&mut connection)
                .await
                .is_err()
        );
        assert!(end_on_postgres(&mut connection).await.unwrap());
        assert!(!end_on_postgres(&mut connection).await.unwrap());
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM left_open")
            .fetch_one(&mut connection)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    }
}
