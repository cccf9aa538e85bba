//! The databases a [`SqlStore`](super::SqlStore) runs on.

mod sealed {
    pub trait Sealed {}
}

/// A database the durable store runs on: `sqlx::Sqlite` or `sqlx::Postgres`. Sealed: the
/// store's SQL is written for these two.
pub trait Dialect: sealed::Sealed + sqlx::Database {
    /// How many group commits may run at once: one on SQLite (one writer), several on
    /// PostgreSQL (which flushes concurrent commits together).
    #[doc(hidden)]
    const CONCURRENT_COMMITS: usize;
}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for sqlx::Sqlite {}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::Sqlite {
    const CONCURRENT_COMMITS: usize = 1;
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for sqlx::Postgres {}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::Postgres {
    const CONCURRENT_COMMITS: usize = 4;
}
