//! The databases a [`SqlStore`](super::SqlStore) runs on.

mod sealed {
    pub trait Sealed {}
}

/// A database the durable store runs on: `sqlx::Sqlite` or `sqlx::Postgres`. Sealed: the
/// store's SQL is written for these two.
pub trait Dialect: sealed::Sealed + sqlx::Database {}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for sqlx::Sqlite {}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::Sqlite {}

#[cfg(feature = "postgres")]
impl sealed::Sealed for sqlx::Postgres {}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::Postgres {}
