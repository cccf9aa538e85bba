//! The SQLite and PostgreSQL stores: one [`SqlStore`] written once against a [`Database`]
//! handle (statements bound with values, rows read by column name), the SQL both run
//! (`statements`), and the portable column types (`columns`). What differs between the two
//! databases — how a write transaction starts, how a claim of unsettled rows locks, how nodes
//! starting together apply migrations — is in `database`, chosen by the pool's kind.

mod columns;
mod database;
mod dialect;
mod group_commit;
mod handler_pool;
#[cfg(feature = "sqlite")]
mod interrupt;
#[cfg(feature = "postgres")]
mod kept;
mod left_open;
mod node_hold;
mod own_thread;
#[cfg(feature = "sqlite")]
mod parking;
mod statements;
mod store;

pub(crate) use columns::{EnvelopeColumns, id_text, millis, stored_attempts};
pub(crate) use database::{Database, Value, bind, to_the_end};
pub use dialect::Dialect;
#[cfg(feature = "postgres")]
pub(crate) use handler_pool::FLUSH_WAL;
pub(crate) use handler_pool::{Flush, HandlerPool, Unsynced};
#[cfg(feature = "sqlite")]
pub(crate) use interrupt::Interrupt;
#[cfg(feature = "postgres")]
pub(crate) use left_open::end_on_postgres;
#[cfg(feature = "sqlite")]
pub(crate) use left_open::{Ending, end_on_sqlite};
#[cfg(feature = "postgres")]
pub(crate) use own_thread::OwnThread;
pub(crate) use own_thread::driven_for_its_life;
pub(crate) use own_thread::lasting_runtime;
#[cfg(feature = "sqlite")]
pub(crate) use parking::{Parking, Taken};
pub(crate) use statements::{COMPLETE_CLAIM, ENLIST, ENLIST_ONCE};
pub use store::SqlStore;

use dacapo_actors::Error;

/// One embedded schema change.
#[derive(Debug)]
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) sql: &'static str,
}

/// The schema changes of one backend, read from `migrations/<backend>/`: both backends have
/// the same versions under the same file names, so one list names them.
macro_rules! migrations {
    ($backend:literal) => {
        &[
            $crate::store::sql::Migration {
                version: 1,
                description: "inbox, dead letters, nodes",
                sql: include_str!(concat!("../../migrations/", $backend, "/0001_inbox.sql")),
            },
            $crate::store::sql::Migration {
                version: 2,
                description: "handlers that succeeded",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0002_handler_successes.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 3,
                description: "outbox",
                sql: include_str!(concat!("../../migrations/", $backend, "/0003_outbox.sql")),
            },
            $crate::store::sql::Migration {
                version: 4,
                description: "idempotency keys",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0004_idempotency_keys.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 5,
                description: "handler completions",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0005_handler_completions.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 6,
                description: "delivery state: cascades, pending and retention indexes",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0006_delivery_state.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 7,
                description: "responses kept for HTTP idempotency keys",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0007_http_keys.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 8,
                description: "each node's own expiry",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0008_node_expiry.sql"
                )),
            },
            $crate::store::sql::Migration {
                version: 9,
                description: "claim indexes: ready rows by age, due rows by time",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $backend,
                    "/0009_claim_indexes.sql"
                )),
            },
        ]
    };
}
pub(crate) use migrations;

/// A database error as the engine sees it: [`Error::Rejected`] when the database refused the
/// data itself — a constraint, a value it cannot hold, a limit — which no retry can cure;
/// [`Error::Store`] otherwise (a lost connection, a timeout, a serialization conflict), which
/// may pass when tried again.
pub(crate) fn db_error(error: sqlx::Error) -> Error {
    let rejected = match &error {
        sqlx::Error::Database(database) => {
            !matches!(database.kind(), sqlx::error::ErrorKind::Other)
                || database.code().is_some_and(|code| rejects_data(&code))
        }
        sqlx::Error::Encode(_) => true,
        _ => false,
    };
    if rejected {
        Error::rejected(error)
    } else {
        Error::store(error)
    }
}

/// Whether a database error code says the data was refused. PostgreSQL's SQLSTATE has five
/// characters: classes 22 (data exception, such as a NUL byte in text), 23 (integrity
/// constraint) and 54 (program limit exceeded). SQLite's code is a number whose low byte is the
/// primary result: 18 (too big), 19 (constraint) or 20 (type mismatch).
pub(crate) fn rejects_data(code: &str) -> bool {
    if code.len() == 5 {
        return ["22", "23", "54"]
            .iter()
            .any(|class| code.starts_with(class));
    }
    code.parse::<i32>()
        .is_ok_and(|code| matches!(code & 0xff, 18..=20))
}

/// Whether the server ended the connection's session before it ran anything of ours:
/// PostgreSQL's SQLSTATE 57P01 to 57P05 (terminated by an administrator, a crash, a shutdown,
/// an idle timeout). The server sends that notice on the idle connection as it closes it, so
/// the first statement sent there reads it back instead of running; a commit under way when
/// the notice came finishes and answers first. Such a failure is safe to run again on another
/// connection.
pub(crate) fn session_ended(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database)
        if database.code().is_some_and(|code| code.starts_with("57P0")))
}

/// Runs `attempt` until it does not fail with [`session_ended`], at most `tries` times.
///
/// The runtime's pools take a connection without a ping (a round trip each time), so a
/// connection the server closed while it sat idle is found by the statement that uses it;
/// each idle connection is found that way at most once, so `tries` of one more than the
/// pool's size reaches a live one.
pub(crate) async fn on_live_session<T, F, Fut>(tries: u32, mut attempt: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut tried = 1;
    loop {
        match attempt().await {
            Err(error) if session_ended(&error) && tried < tries => {
                tracing::debug!(%error, "the server ended an idle connection's session; running on another");
                tried += 1;
            }
            done => return done,
        }
    }
}

/// `url` without its password, to name a database in an error or a log.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((credentials, host)) => match credentials.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    // A password may come as an option too: `?password=…`.
    let tail = match tail.split_once('?') {
        Some((path, options)) => {
            let options: Vec<String> = options
                .split('&')
                .map(|option| match option.split_once('=') {
                    Some((name, _)) if name.eq_ignore_ascii_case("password") => {
                        format!("{name}=***")
                    }
                    _ => option.to_owned(),
                })
                .collect();
            format!("{path}?{}", options.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

/// A claim this node no longer holds: another node took it over (this one was taken for dead).
/// No retry can bring it back.
pub(crate) fn claim_lost(claim: &dacapo_actors::ports::Claim) -> Error {
    Error::rejected(format!(
        "the deduplication claim of handler {} on {:?} was taken over by another node",
        claim.handler, claim.key
    ))
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn a_url_is_named_without_its_password() {
        assert_eq!(
            redacted("postgres://app:s3cr@t@db.internal:5432/app?sslmode=require"),
            "postgres://app:***@db.internal:5432/app?sslmode=require"
        );
        assert_eq!(
            redacted("postgres://app@db.internal/app"),
            "postgres://app@db.internal/app"
        );
        assert_eq!(redacted("postgres://db.internal"), "postgres://db.internal");
        assert_eq!(
            redacted("postgres://app@db/app?sslmode=require&password=s3cret&x=1"),
            "postgres://app@db/app?sslmode=require&password=***&x=1"
        );
        assert_eq!(
            redacted("postgres://app:pw@db?password=s3cret"),
            "postgres://app:***@db?password=***"
        );
    }
}
