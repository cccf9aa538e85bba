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

    /// How long a group commit waits for more writes, when three or more wait: on SQLite,
    /// where the next group waits for this one, long enough for the writes of deliveries that
    /// are finishing to join; on PostgreSQL none, the next group starting at once beside it.
    #[doc(hidden)]
    const LINGER: std::time::Duration;
}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for sqlx::Sqlite {}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::Sqlite {
    const CONCURRENT_COMMITS: usize = 1;
    const LINGER: std::time::Duration = std::time::Duration::from_micros(150);
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for sqlx::Postgres {}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::Postgres {
    const CONCURRENT_COMMITS: usize = 4;
    const LINGER: std::time::Duration = std::time::Duration::ZERO;
}
