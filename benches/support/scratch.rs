//! Scratch databases for one benchmark run: a SQLite file, or a PostgreSQL database on the server
//! at `DACAPO_BENCH_POSTGRES` (default `postgres://postgres@127.0.0.1:5432/postgres`), removed
//! afterwards.
#![allow(dead_code, unreachable_pub)]

use sqlx::Connection;

/// Writes the system still holds for the disk, out before a contender starts timing: the
/// last one's (or its own seed's) would otherwise be flushed during its fsyncs, and slow them.
pub fn flush_writes() {
    let _ = std::process::Command::new("sync").status();
}

/// A SQLite file path in the temporary directory; its files are removed on drop.
pub struct ScratchSqlite(String);

impl ScratchSqlite {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "dacapo-{label}-{}.db",
            uuid::Uuid::new_v4().simple()
        ));
        Self(path.display().to_string())
    }

    pub fn path(&self) -> &str {
        &self.0
    }
}

impl Drop for ScratchSqlite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0));
        }
    }
}

/// A PostgreSQL database created for the run; [`remove`](Self::remove) drops it.
pub struct ScratchPostgres {
    admin: sqlx::PgConnection,
    name: String,
    pub url: String,
}

impl ScratchPostgres {
    pub async fn create(label: &str) -> Self {
        let admin_url = std::env::var("DACAPO_BENCH_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let (base, _) = admin_url.rsplit_once('/').expect("a database URL");
        let name = format!("dacapo_{label}_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let url = format!("{base}/{name}");
        Self { admin, name, url }
    }

    pub async fn remove(mut self) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut self.admin)
        .await
        .unwrap();
    }
}
