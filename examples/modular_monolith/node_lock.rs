//! Two jobs started at once take turns. The store holds a node id for one live process (a
//! second process's writes under it fail after the store's `node_timeout`), which is what
//! keeps their deliveries apart; the job, whose second run should wait for the first rather
//! than fail, first waits for a lock of its own named after the node — a file lock next to the
//! SQLite file, an advisory lock on PostgreSQL — which the system releases when the process
//! dies, kill -9 included.

use std::time::Duration;

/// How long a job waits for another one under the same node id to finish.
const WAIT: Duration = Duration::from_secs(300);

/// Held until dropped.
pub(crate) enum NodeLock {
    File(#[allow(dead_code)] std::fs::File),
    #[cfg(feature = "postgres")]
    Session(#[allow(dead_code)] sqlx::PgConnection),
}

impl NodeLock {
    /// Takes the lock of `node` on the database at `target`, waiting while another process
    /// holds it.
    pub(crate) async fn take(
        target: &str,
        postgres: bool,
        node: &str,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let waited = tokio::time::timeout(WAIT, Self::wait_for(target, postgres, node)).await;
        waited.map_err(|_| {
            format!("another process ran as node {node} on {target} for over {WAIT:?}")
        })?
    }

    async fn wait_for(
        target: &str,
        postgres: bool,
        node: &str,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        if postgres {
            #[cfg(feature = "postgres")]
            {
                use sqlx::Connection;
                let mut session = sqlx::PgConnection::connect(target).await?;
                let key = format!("dacapo.example.node:{node}");
                let taken: bool =
                    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
                        .bind(&key)
                        .fetch_one(&mut session)
                        .await?;
                if !taken {
                    eprintln!(
                        "modular_monolith: waiting for the other process running as node {node}"
                    );
                    // Blocks while another session holds it; released when that one ends.
                    sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 0))")
                        .bind(&key)
                        .execute(&mut session)
                        .await?;
                }
                return Ok(Self::Session(session));
            }
            #[cfg(not(feature = "postgres"))]
            return Err("a PostgreSQL URL needs the `postgres` feature".into());
        }
        let path = format!("{target}.{node}.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)?;
        let mut announced = false;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Self::File(file)),
                Err(std::fs::TryLockError::WouldBlock) => {
                    if !announced {
                        eprintln!(
                            "modular_monolith: waiting for the other process running as node {node}"
                        );
                        announced = true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(std::fs::TryLockError::Error(error)) => return Err(error.into()),
            }
        }
    }
}
