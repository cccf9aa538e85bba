//! What the SQLite and PostgreSQL stores share: the SQL (one dialect, `$N` parameters, which
//! both accept), the portable column types (ids as text, times as milliseconds, JSON as text),
//! and the conversions between rows and the engine's types.
//!
//! The two stores are stamped from one definition by [`sql_store!`](crate::store::sql_store):
//! their code differs only in the sqlx types, the claim statement and how a write transaction
//! starts.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use dacapo_actors::{AggregateError, DeadLetterReason, Envelope, Error};
use uuid::Uuid;

pub(crate) const RECEIVE: &str = "INSERT INTO dacapo_inbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, status, attempts, owner, received_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'incoming', $10, $11, $12) \
    ON CONFLICT (id) DO NOTHING";

/// An envelope scheduled for later: unowned, no attempt started, due at `$10`.
pub(crate) const RECEIVE_SCHEDULED: &str = "INSERT INTO dacapo_inbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, status, attempts, execute_at, owner, received_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'scheduled', 0, $10, NULL, $11) \
    ON CONFLICT (id) DO NOTHING";

/// Envelopes scheduled for later and not started, soonest first.
pub(crate) const LIST_SCHEDULED: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, execute_at \
    FROM dacapo_inbox WHERE status = 'scheduled' AND attempts = 0 \
    ORDER BY execute_at, id LIMIT $1";

/// Settles a scheduled envelope that has not started; its row stays for the retention, so a
/// redelivery is discarded, and a node waiting to run it finds it settled.
pub(crate) const CANCEL_SCHEDULED: &str = "UPDATE dacapo_inbox \
    SET status = 'handled', handled_at = $2, owner = NULL \
    WHERE id = $1 AND status = 'scheduled' AND attempts = 0";

// An attempt's start and its retry record never take an envelope back from handled, and only
// the owner writes them: a node that lost a delivery to recovery while it was cooling down or
// running late must neither start it again next to the new owner nor overwrite the new owner's
// state. Its late settlement (handled, or dead-lettered) is still recorded: the attempt ran,
// and the new owner's next attempt then finds the envelope settled and stops.
//
// It is also a compare-and-set on the attempt count: attempt N starts only over a row that
// counts N - 1 started, so two runners of one delivery (even on one node) never both start it.
pub(crate) const BEGIN_ATTEMPT: &str = "UPDATE dacapo_inbox \
    SET status = 'incoming', attempts = $2, execute_at = NULL \
    WHERE id = $1 AND status <> 'handled' AND owner = $3 AND attempts = $4";

pub(crate) const SCHEDULE_RETRY: &str = "UPDATE dacapo_inbox \
    SET status = 'scheduled', attempts = $2, execute_at = $3, failures = $4, succeeded = $5, \
    cascaded = $7 \
    WHERE id = $1 AND status <> 'handled' AND owner = $6";

/// Settles a delivery, handled or dead-lettered; only its owner does, and only once.
pub(crate) const MARK_HANDLED: &str = "UPDATE dacapo_inbox \
    SET status = 'handled', handled_at = $2, owner = NULL \
    WHERE id = $1 AND status <> 'handled' AND owner = $3";

/// A replayed dead letter back in the inbox, fresh attempt count: a new row if the settled one
/// was cleaned up, the settled one rewritten otherwise — never a row still being delivered.
pub(crate) const REPLAY: &str = "INSERT INTO dacapo_inbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, status, attempts, owner, received_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'incoming', 0, $10, $11) \
    ON CONFLICT (id) DO UPDATE SET status = 'incoming', attempts = 0, execute_at = NULL, \
    failures = NULL, succeeded = NULL, cascaded = NULL, owner = excluded.owner, \
    received_at = excluded.received_at, handled_at = NULL \
    WHERE dacapo_inbox.status = 'handled'";

/// Releases the uncompleted claims of a dead-lettered envelope, whichever node made them: the
/// work never happened, so the logical id must be free for a message that will do it.
pub(crate) const RELEASE_ENVELOPE_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE envelope_id = $1 AND completed = 0";

pub(crate) const HEARTBEAT: &str = "INSERT INTO dacapo_nodes (id, heartbeat_at) VALUES ($1, $2) \
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at";

pub(crate) const RELEASE: &str = "UPDATE dacapo_inbox SET owner = NULL \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled')";

pub(crate) const RELEASE_BEFORE: &str = "UPDATE dacapo_inbox SET owner = NULL \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled') AND received_at < $2";

pub(crate) const FORGET_NODE: &str = "DELETE FROM dacapo_nodes WHERE id = $1";

pub(crate) const DELETE_HANDLED: &str = "DELETE FROM dacapo_inbox WHERE id IN \
    (SELECT id FROM dacapo_inbox WHERE status = 'handled' AND handled_at < $1 LIMIT $2)";

pub(crate) const PUT_DEAD_LETTER: &str = "INSERT INTO dacapo_dead_letters \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, reason, failures, attempts, first_failure_at, last_failure_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
    ON CONFLICT (id) DO UPDATE SET reason = excluded.reason, failures = excluded.failures, \
    attempts = excluded.attempts, first_failure_at = excluded.first_failure_at, \
    last_failure_at = excluded.last_failure_at";

pub(crate) const LIST_DEAD_LETTERS: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, reason, failures, \
    attempts, first_failure_at, last_failure_at \
    FROM dacapo_dead_letters ORDER BY first_failure_at, id";

pub(crate) const GET_DEAD_LETTER: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, reason, failures, \
    attempts, first_failure_at, last_failure_at \
    FROM dacapo_dead_letters WHERE id = $1";

pub(crate) const REMOVE_DEAD_LETTER: &str = "DELETE FROM dacapo_dead_letters WHERE id = $1 \
    RETURNING id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, \
    sent_at, scheduled_for, reason, failures, attempts, first_failure_at, last_failure_at";

pub(crate) const PURGE_DEAD_LETTERS: &str = "DELETE FROM dacapo_dead_letters";

/// This node's own unsettled rows received before `$2`, oldest first.
pub(crate) const OWN_UNSETTLED: &str = "SELECT id FROM dacapo_inbox \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled') AND received_at < $2 \
    ORDER BY received_at LIMIT $3";

/// One of this node's own unsettled rows, as recovery reads them.
pub(crate) const OWN_UNSETTLED_ROW: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, attempts, execute_at, \
    failures, succeeded, cascaded FROM dacapo_inbox \
    WHERE id = $1 AND owner = $2 AND status IN ('incoming', 'scheduled')";

pub(crate) const DELETE_IDEMPOTENCY_KEYS: &str = "DELETE FROM dacapo_idempotency_keys \
    WHERE key IN (SELECT key FROM dacapo_idempotency_keys WHERE recorded_at < $1 LIMIT $2)";

pub(crate) const INBOX_STATUS: &str = "SELECT status FROM dacapo_inbox WHERE id = $1";

/// The claims table, created only when a runtime enables deduplication: with the feature off
/// the schema does not change at all.
pub(crate) const PROVISION_CLAIMS: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS dacapo_deduplication (\
        handler TEXT NOT NULL, key_hash TEXT NOT NULL, key TEXT NOT NULL, \
        fingerprint TEXT NOT NULL, envelope_id TEXT NOT NULL, node TEXT NOT NULL, \
        completed INTEGER NOT NULL, \
        claimed_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, \
        PRIMARY KEY (handler, key_hash))",
    "CREATE INDEX IF NOT EXISTS dacapo_deduplication_expires ON dacapo_deduplication (expires_at)",
    "CREATE INDEX IF NOT EXISTS dacapo_deduplication_envelope ON dacapo_deduplication (envelope_id)",
];

/// A claim is this one insert: the primary key rejects a held id. The same statement takes
/// over, atomically, a claim whose window ended, or one the same envelope made and never
/// completed in an attempt that certainly ended: this node's own earlier attempt (a node runs a
/// delivery once at a time), or one of a node whose heartbeat expired — the rule by which the
/// delivery itself was taken over. A live node's running attempt keeps its claim.
pub(crate) const CLAIM: &str = "INSERT INTO dacapo_deduplication \
    (handler, key_hash, key, fingerprint, envelope_id, node, completed, claimed_at, expires_at) \
    VALUES ($1, $2, $3, $4, $5, $8, 0, $6, $7) \
    ON CONFLICT (handler, key_hash) DO UPDATE SET key = excluded.key, \
    fingerprint = excluded.fingerprint, envelope_id = excluded.envelope_id, \
    node = excluded.node, completed = 0, \
    claimed_at = excluded.claimed_at, expires_at = excluded.expires_at \
    WHERE dacapo_deduplication.expires_at <= excluded.claimed_at \
    OR (dacapo_deduplication.envelope_id = excluded.envelope_id \
        AND dacapo_deduplication.completed = 0 \
        AND (dacapo_deduplication.node = excluded.node \
            OR dacapo_deduplication.node NOT IN \
                (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $9)))";

pub(crate) const CLAIM_HOLDER: &str = "SELECT fingerprint, envelope_id, completed, node \
    FROM dacapo_deduplication WHERE handler = $1 AND key_hash = $2";

/// Claims a previous run under this node's name made and never completed: that run is over
/// (one process per node name), so they are released when this run provisions the claims,
/// before it claims anything — another node resuming those deliveries then gets them.
pub(crate) const RELEASE_OWN_UNCOMPLETED_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE node = $1 AND completed = 0";

/// The claims table as an earlier version created it, without the claiming node.
pub(crate) const ADD_CLAIMS_NODE: &str =
    "ALTER TABLE dacapo_deduplication ADD COLUMN node TEXT NOT NULL DEFAULT ''";

// A completed claim stays: the handler's transaction committed its work with it, even if
// the handler failed afterwards.
pub(crate) const RELEASE_CLAIM: &str = "DELETE FROM dacapo_deduplication \
    WHERE handler = $1 AND key_hash = $2 AND envelope_id = $3 AND completed = 0 AND node = $4";

/// Fenced on the node: a node whose claim was taken over (it was taken for dead) completes
/// nothing, and its handler transaction fails instead of committing a second effect.
pub(crate) const COMPLETE_CLAIM: &str = "UPDATE dacapo_deduplication SET completed = 1 \
    WHERE handler = $1 AND key_hash = $2 AND envelope_id = $3 AND node = $4";

pub(crate) const REAP_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE (handler, key_hash) IN (SELECT handler, key_hash FROM dacapo_deduplication \
    WHERE expires_at <= $1 LIMIT $2)";

pub(crate) const ENLIST: &str = "INSERT INTO dacapo_outbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, enlisted_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

pub(crate) const ENLIST_ONCE: &str = "INSERT INTO dacapo_outbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, enlisted_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
    ON CONFLICT (id) DO NOTHING";

pub(crate) const BACKLOG: &str = "SELECT count(*), min(enlisted_at) FROM dacapo_outbox \
    WHERE published_at IS NULL";

pub(crate) const DELETE_PUBLISHED: &str = "DELETE FROM dacapo_outbox WHERE seq IN \
    (SELECT seq FROM dacapo_outbox WHERE published_at < $1 LIMIT $2)";

pub(crate) const LEASE: &str = "INSERT INTO dacapo_outbox_lease (id, owner, expires_at) \
    VALUES (1, $1, $3) ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, \
    expires_at = excluded.expires_at \
    WHERE dacapo_outbox_lease.owner = excluded.owner OR dacapo_outbox_lease.expires_at <= $2";

pub(crate) const UNPUBLISHED: &str = "SELECT seq, id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for \
    FROM dacapo_outbox WHERE published_at IS NULL AND seq > $2 ORDER BY seq LIMIT $1";

/// `UPDATE … WHERE seq IN ($2, $3, …)` for `count` positions.
pub(crate) fn mark_published(count: usize) -> String {
    let positions: Vec<String> = (2..count + 2).map(|n| format!("${n}")).collect();
    format!(
        "UPDATE dacapo_outbox SET published_at = $1 WHERE seq IN ({})",
        positions.join(", ")
    )
}

pub(crate) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS dacapo_migrations (\
    version BIGINT PRIMARY KEY NOT NULL, description TEXT NOT NULL, applied_at BIGINT NOT NULL)";

pub(crate) const APPLIED_MIGRATION: &str =
    "SELECT count(*) FROM dacapo_migrations WHERE version = $1";

pub(crate) const RECORD_MIGRATION: &str =
    "INSERT INTO dacapo_migrations (version, description, applied_at) VALUES ($1, $2, $3)";

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
fn rejects_data(code: &str) -> bool {
    if code.len() == 5 {
        return ["22", "23", "54"]
            .iter()
            .any(|class| code.starts_with(class));
    }
    code.parse::<i32>()
        .is_ok_and(|code| matches!(code & 0xff, 18..=20))
}

/// A claim this node no longer holds: another node took it over (this one was taken for dead).
/// No retry can bring it back.
pub(crate) fn claim_lost(claim: &dacapo_actors::ports::Claim) -> Error {
    Error::rejected(format!(
        "the deduplication claim of handler {} on {:?} was taken over by another node",
        claim.handler, claim.key
    ))
}

pub(crate) fn millis(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

pub(crate) fn time(millis: i64) -> Result<DateTime<Utc>, Error> {
    DateTime::from_timestamp_millis(millis)
        .ok_or_else(|| Error::store(format!("stored time {millis} ms is out of range")))
}

pub(crate) fn id_text(id: Uuid) -> String {
    id.simple().to_string()
}

pub(crate) fn parse_id(text: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(text)
        .map_err(|e| Error::store(format!("stored id {text:?} is not a uuid: {e}")))
}

fn parse_optional_id(text: Option<String>) -> Result<Option<Uuid>, Error> {
    text.as_deref().map(parse_id).transpose()
}

pub(crate) fn json<T: serde::Serialize>(value: &T) -> Result<String, Error> {
    serde_json::to_string(value).map_err(Error::store)
}

pub(crate) fn from_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, Error> {
    serde_json::from_str(text).map_err(Error::store)
}

/// An envelope's columns, as stored.
pub(crate) struct EnvelopeColumns {
    pub(crate) id: String,
    pub(crate) message_type: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) deduplication_id: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
    pub(crate) sent_at: i64,
    pub(crate) scheduled_for: Option<i64>,
}

impl EnvelopeColumns {
    pub(crate) fn of(envelope: &Envelope) -> Result<Self, Error> {
        Ok(Self {
            id: id_text(envelope.id),
            message_type: envelope.message_type.to_string(),
            payload: envelope.payload.clone(),
            headers: json(&envelope.headers)?,
            deduplication_id: envelope.deduplication_id.clone(),
            correlation_id: envelope.correlation_id.map(id_text),
            causation_id: envelope.causation_id.map(id_text),
            sent_at: millis(envelope.sent_at),
            scheduled_for: envelope.scheduled_for.map(millis),
        })
    }

    pub(crate) fn into_envelope(self, attempts: u32) -> Result<Envelope, Error> {
        let mut envelope = Envelope::new(self.message_type, self.payload);
        envelope.id = parse_id(&self.id)?;
        envelope.headers = from_json::<BTreeMap<String, String>>(&self.headers)?;
        envelope.deduplication_id = self.deduplication_id;
        envelope.correlation_id = parse_optional_id(self.correlation_id)?;
        envelope.causation_id = parse_optional_id(self.causation_id)?;
        envelope.attempts = attempts;
        envelope.sent_at = time(self.sent_at)?;
        envelope.scheduled_for = self.scheduled_for.map(time).transpose()?;
        Ok(envelope)
    }
}

pub(crate) fn failures_from(text: Option<&str>) -> Result<Vec<AggregateError>, Error> {
    text.map(from_json)
        .transpose()
        .map(Option::unwrap_or_default)
}

pub(crate) fn reason_json(reason: &DeadLetterReason) -> Result<String, Error> {
    json(reason)
}

pub(crate) fn attempts(stored: i32) -> u32 {
    u32::try_from(stored).unwrap_or(0)
}

pub(crate) fn stored_attempts(attempts: u32) -> i32 {
    i32::try_from(attempts).unwrap_or(i32::MAX)
}

/// Binds an envelope's columns (an [`EnvelopeColumns`] named `$c`) to the first nine
/// parameters of `$query`, in the order every envelope table declares them.
macro_rules! bind_envelope {
    ($query:expr, $c:ident) => {
        $query
            .bind($c.id)
            .bind($c.message_type)
            .bind($c.payload)
            .bind($c.headers)
            .bind($c.deduplication_id)
            .bind($c.correlation_id)
            .bind($c.causation_id)
            .bind($c.sent_at)
            .bind($c.scheduled_for)
    };
}

pub(crate) use bind_envelope;

/// Reads an envelope's columns from `$row`, starting at column `$at`, in the order every
/// envelope table declares them. Needs `sqlx::Row` in scope; returns early on a bad column.
macro_rules! read_envelope {
    ($row:expr, $at:expr) => {{
        let get = |e: sqlx::Error| dacapo_actors::Error::store(e);
        $crate::store::sql::EnvelopeColumns {
            id: $row.try_get($at).map_err(get)?,
            message_type: $row.try_get($at + 1).map_err(get)?,
            payload: $row.try_get($at + 2).map_err(get)?,
            headers: $row.try_get($at + 3).map_err(get)?,
            deduplication_id: $row.try_get($at + 4).map_err(get)?,
            correlation_id: $row.try_get($at + 5).map_err(get)?,
            causation_id: $row.try_get($at + 6).map_err(get)?,
            sent_at: $row.try_get($at + 7).map_err(get)?,
            scheduled_for: $row.try_get($at + 8).map_err(get)?,
        }
    }};
}

pub(crate) use read_envelope;

/// Stamps a store over one sqlx database from the shared SQL.
///
/// `$claim` is the statement that claims unsettled rows for this node (it differs in how it
/// locks), `$begin` the statement that opens a write transaction.
macro_rules! sql_store {
    (
        $(#[$meta:meta])*
        $store:ident, $db:ty, $pool:ty, claim = $claim:expr, begin = $begin:expr,
        migrations = $migrations:expr, lock_migrations = $lock:expr,
        claims_has_node = $claims_has_node:expr
    ) => {
        $(#[$meta])*
        #[derive(Clone)]
        pub struct $store {
            pool: $pool,
            node: std::sync::Arc<str>,
            node_timeout: std::time::Duration,
            clock: std::sync::Arc<dyn dacapo_actors::ports::Clock>,
            /// Set once the claims table exists, so a claim never meets a missing table.
            claims_ready: std::sync::Arc<tokio::sync::OnceCell<()>>,
        }

        impl std::fmt::Debug for $store {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($store))
                    .field("node", &self.node)
                    .field("node_timeout", &self.node_timeout)
                    .finish_non_exhaustive()
            }
        }

        impl $store {
            /// A store over `pool`, whose schema is created (or brought up to date) first.
            ///
            /// # Errors
            ///
            /// The database's error when the schema cannot be applied.
            pub async fn with_pool(pool: $pool) -> Result<Self, dacapo_actors::Error> {
                let store = Self {
                    pool,
                    node: std::sync::Arc::from(format!("node-{}", uuid::Uuid::new_v4().simple())),
                    node_timeout: std::time::Duration::from_secs(30),
                    clock: std::sync::Arc::new(dacapo_actors::ports::SystemClock),
                    claims_ready: std::sync::Arc::default(),
                };
                store.migrate().await?;
                Ok(store)
            }

            /// This node's name in the store (default: random per process). Give each node of
            /// a fleet its own; a node restarted under the same name resumes its own deliveries
            /// at once.
            #[must_use]
            pub fn node_id(mut self, node: impl Into<std::sync::Arc<str>>) -> Self {
                self.node = node.into();
                self
            }

            /// How long a node may miss heartbeats before other nodes take over its unsettled
            /// deliveries (default 30 s). Keep it well above the runtime's recovery interval
            /// (default 10 s), which is how often a node heartbeats.
            #[must_use]
            pub fn node_timeout(mut self, timeout: std::time::Duration) -> Self {
                self.node_timeout = timeout;
                self
            }

            /// The wall clock used for stored times (default: the system's).
            #[must_use]
            pub fn clock(mut self, clock: std::sync::Arc<dyn dacapo_actors::ports::Clock>) -> Self {
                self.clock = clock;
                self
            }

            /// This node's name.
            pub fn node(&self) -> &str {
                &self.node
            }

            /// The current time on the store's clock.
            pub(crate) fn now(&self) -> chrono::DateTime<chrono::Utc> {
                self.clock.now()
            }

            /// A node that heartbeat since then is alive; others are taken for dead.
            fn alive_since(&self) -> chrono::DateTime<chrono::Utc> {
                let timeout = chrono::Duration::from_std(self.node_timeout).unwrap_or(chrono::TimeDelta::MAX);
                self.clock.now().checked_sub_signed(timeout).unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
            }

            /// The connection pool, for the application's own queries.
            pub fn pool(&self) -> &$pool {
                &self.pool
            }

            async fn migrate(&self) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                let store_error = $crate::store::sql::db_error;
                let mut tx = self.pool.begin_with($begin).await.map_err(store_error)?;
                for lock in $lock {
                    sqlx::query(lock).execute(&mut *tx).await.map_err(store_error)?;
                }
                sqlx::query(MIGRATIONS_TABLE).execute(&mut *tx).await.map_err(store_error)?;
                for migration in $migrations {
                    let applied: i64 = sqlx::query_scalar(APPLIED_MIGRATION)
                        .bind(migration.version)
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(store_error)?;
                    if applied > 0 {
                        continue;
                    }
                    sqlx::raw_sql(migration.sql).execute(&mut *tx).await.map_err(store_error)?;
                    sqlx::query(RECORD_MIGRATION)
                        .bind(migration.version)
                        .bind(migration.description)
                        .bind(millis(self.clock.now()))
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)
            }

            fn unsettled(row: &<$db as sqlx::Database>::Row) -> Result<dacapo_actors::ports::Resumable, dacapo_actors::Error> {
                use sqlx::Row;
                use $crate::store::sql::*;
                let get = |e: sqlx::Error| dacapo_actors::Error::store(e);
                let columns = $crate::store::sql::read_envelope!(row, 0);
                let stored_attempts: i32 = row.try_get(9).map_err(get)?;
                let execute_at: Option<i64> = row.try_get(10).map_err(get)?;
                let failures: Option<String> = row.try_get(11).map_err(get)?;
                let succeeded: Option<String> = row.try_get(12).map_err(get)?;
                let cascaded: Option<String> = row.try_get(13).map_err(get)?;
                Ok(dacapo_actors::ports::Resumable::new(
                    columns.into_envelope(attempts(stored_attempts))?,
                    execute_at.map(time).transpose()?,
                    failures_from(failures.as_deref())?,
                    succeeded.as_deref().map(from_json).transpose()?.unwrap_or_default(),
                    cascaded.as_deref().map(from_json).transpose()?.unwrap_or_default(),
                ))
            }

            /// A claimed row as a delivery to resume; a row that cannot be read (a column
            /// written by hand, say) is logged and left, owned by this node, instead of
            /// stopping the recovery of every row after it.
            fn readable(row: &<$db as sqlx::Database>::Row) -> Option<dacapo_actors::ports::Resumable> {
                match Self::unsettled(row) {
                    Ok(resumable) => Some(resumable),
                    Err(error) => {
                        use sqlx::Row;
                        let id: Option<String> = row.try_get("id").ok();
                        tracing::error!(messaging.message.id = ?id, %error, "an unsettled inbox row cannot be read; it is left for an operator");
                        None
                    }
                }
            }

            fn dead_letter_row(row: &<$db as sqlx::Database>::Row) -> Result<dacapo_actors::DeadLetter, dacapo_actors::Error> {
                use sqlx::Row;
                use $crate::store::sql::*;
                let get = |e: sqlx::Error| dacapo_actors::Error::store(e);
                let columns = $crate::store::sql::read_envelope!(row, 0);
                let reason: String = row.try_get(9).map_err(get)?;
                let failures: String = row.try_get(10).map_err(get)?;
                let stored_attempts: i32 = row.try_get(11).map_err(get)?;
                let first: i64 = row.try_get(12).map_err(get)?;
                let last: i64 = row.try_get(13).map_err(get)?;
                let mut letter = dacapo_actors::DeadLetter::failed(
                    columns.into_envelope(0)?,
                    from_json(&reason)?,
                    from_json(&failures)?,
                    time(first)?,
                    time(last)?,
                );
                letter.attempts = attempts(stored_attempts);
                Ok(letter)
            }
        }

        #[async_trait::async_trait]
        impl dacapo_actors::ports::Inbox for $store {
            async fn receive(
                &self,
                envelope: &dacapo_actors::Envelope,
            ) -> Result<dacapo_actors::ports::Receipt, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let c = EnvelopeColumns::of(envelope)?;
                let now = self.clock.now();
                if let Some(due_at) = envelope.scheduled_for.filter(|at| *at > now) {
                    let inserted = $crate::store::sql::bind_envelope!(sqlx::query(RECEIVE_SCHEDULED), c)
                        .bind(millis(due_at))
                        .bind(millis(now))
                        .execute(&self.pool)
                        .await
                        .map_err($crate::store::sql::db_error)?
                        .rows_affected();
                    return Ok(if inserted == 1 {
                        dacapo_actors::ports::Receipt::Scheduled
                    } else {
                        dacapo_actors::ports::Receipt::Duplicate
                    });
                }
                let inserted = $crate::store::sql::bind_envelope!(sqlx::query(RECEIVE), c)
                    .bind(stored_attempts(envelope.attempts.saturating_add(1)))
                    .bind(&*self.node)
                    .bind(millis(self.clock.now()))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                Ok(if inserted == 1 {
                    dacapo_actors::ports::Receipt::New
                } else {
                    dacapo_actors::ports::Receipt::Duplicate
                })
            }

            async fn begin_attempt(
                &self,
                id: uuid::Uuid,
                attempt: u32,
            ) -> Result<dacapo_actors::ports::Fenced, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let rows = sqlx::query(BEGIN_ATTEMPT)
                    .bind(id_text(id))
                    .bind(stored_attempts(attempt))
                    .bind(&*self.node)
                    .bind(stored_attempts(attempt.saturating_sub(1)))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                Ok(dacapo_actors::ports::Fenced::from_rows(rows))
            }

            async fn schedule_retry(
                &self,
                record: dacapo_actors::ports::RetryRecord<'_>,
            ) -> Result<dacapo_actors::ports::Fenced, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let rows = sqlx::query(SCHEDULE_RETRY)
                    .bind(id_text(record.envelope.id))
                    .bind(stored_attempts(record.envelope.attempts))
                    .bind(millis(record.due_at))
                    .bind(json(&record.failures)?)
                    .bind(json(&record.succeeded)?)
                    .bind(&*self.node)
                    .bind(if record.cascaded.is_empty() { None } else { Some(json(&record.cascaded)?) })
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                Ok(dacapo_actors::ports::Fenced::from_rows(rows))
            }

            async fn settle_handled(
                &self,
                id: uuid::Uuid,
                cascaded: &[dacapo_actors::Envelope],
            ) -> Result<dacapo_actors::ports::Handled, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let store_error = $crate::store::sql::db_error;
                let now = millis(self.clock.now());
                let mark = sqlx::query(MARK_HANDLED).bind(id_text(id)).bind(now).bind(&*self.node);
                if cascaded.is_empty() {
                    let rows = mark.execute(&self.pool).await.map_err(store_error)?.rows_affected();
                    return Ok(match dacapo_actors::ports::Fenced::from_rows(rows) {
                        dacapo_actors::ports::Fenced::Written => {
                            dacapo_actors::ports::Handled::Written { in_outbox: true }
                        }
                        _ => dacapo_actors::ports::Handled::OwnedElsewhere,
                    });
                }
                let mut tx = self.pool.begin_with($begin).await.map_err(store_error)?;
                let rows = mark.execute(&mut *tx).await.map_err(store_error)?.rows_affected();
                if rows == 0 {
                    tx.rollback().await.map_err(store_error)?;
                    return Ok(dacapo_actors::ports::Handled::OwnedElsewhere);
                }
                for envelope in cascaded {
                    let c = EnvelopeColumns::of(envelope)?;
                    // A retry of this commit writes the same deterministic ids: keep the first.
                    $crate::store::sql::bind_envelope!(sqlx::query(ENLIST_ONCE), c)
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)?;
                Ok(dacapo_actors::ports::Handled::Written { in_outbox: true })
            }

            async fn dead_letter(
                &self,
                letter: &dacapo_actors::DeadLetter,
                release_claims: bool,
            ) -> Result<dacapo_actors::ports::Fenced, dacapo_actors::Error> {
                use $crate::store::sql::*;
                use dacapo_actors::ports::Claims as _;
                let store_error = $crate::store::sql::db_error;
                if release_claims {
                    self.provision().await?;
                }
                let id = id_text(letter.envelope.id);
                let mut tx = self.pool.begin_with($begin).await.map_err(store_error)?;
                let rows = sqlx::query(MARK_HANDLED)
                    .bind(&id)
                    .bind(millis(self.clock.now()))
                    .bind(&*self.node)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?
                    .rows_affected();
                if rows == 0 {
                    tx.rollback().await.map_err(store_error)?;
                    return Ok(dacapo_actors::ports::Fenced::OwnedElsewhere);
                }
                let c = EnvelopeColumns::of(&letter.envelope)?;
                $crate::store::sql::bind_envelope!(sqlx::query(PUT_DEAD_LETTER), c)
                    .bind(reason_json(&letter.reason)?)
                    .bind(json(&letter.failures)?)
                    .bind(stored_attempts(letter.attempts))
                    .bind(millis(letter.first_failure_at))
                    .bind(millis(letter.last_failure_at))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                if release_claims {
                    sqlx::query(RELEASE_ENVELOPE_CLAIMS)
                        .bind(&id)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)?;
                Ok(dacapo_actors::ports::Fenced::Written)
            }

            async fn replay(
                &self,
                id: uuid::Uuid,
                to: dacapo_actors::ports::ReplayTo,
            ) -> Result<dacapo_actors::ports::Replay, dacapo_actors::Error> {
                use $crate::store::sql::*;
                use dacapo_actors::ports::Replay;
                let store_error = $crate::store::sql::db_error;
                let mut tx = self.pool.begin_with($begin).await.map_err(store_error)?;
                // Removed first, in the transaction: a concurrent replay waits for this one and
                // then finds nothing to remove.
                let row = sqlx::query(REMOVE_DEAD_LETTER)
                    .bind(id_text(id))
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(store_error)?;
                let Some(row) = row else {
                    let status: Option<String> = sqlx::query_scalar(INBOX_STATUS)
                        .bind(id_text(id))
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(store_error)?;
                    tx.rollback().await.map_err(store_error)?;
                    return Ok(match status.as_deref() {
                        Some("incoming" | "scheduled") => Replay::InProgress,
                        _ => Replay::NotFound,
                    });
                };
                let mut envelope = Self::dead_letter_row(&row)?.envelope;
                envelope.attempts = 0;
                let owner = match to {
                    dacapo_actors::ports::ReplayTo::ThisNode => Some(&*self.node),
                    _ => None,
                };
                let c = EnvelopeColumns::of(&envelope)?;
                let rows = $crate::store::sql::bind_envelope!(sqlx::query(REPLAY), c)
                    .bind(owner)
                    .bind(millis(self.clock.now()))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?
                    .rows_affected();
                if rows == 0 {
                    tx.rollback().await.map_err(store_error)?;
                    return Ok(Replay::InProgress);
                }
                tx.commit().await.map_err(store_error)?;
                Ok(Replay::Replayed(envelope))
            }

            async fn scheduled(
                &self,
                limit: usize,
            ) -> Result<Vec<dacapo_actors::ports::ScheduledEnvelope>, dacapo_actors::Error> {
                use sqlx::Row;
                use $crate::store::sql::*;
                let rows = sqlx::query(LIST_SCHEDULED)
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .fetch_all(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                let get = |e: sqlx::Error| dacapo_actors::Error::store(e);
                rows.iter()
                    .map(|row| {
                        let columns = $crate::store::sql::read_envelope!(row, 0);
                        let due_at: i64 = row.try_get(9).map_err(get)?;
                        Ok(dacapo_actors::ports::ScheduledEnvelope::new(
                            columns.into_envelope(0)?,
                            time(due_at)?,
                        ))
                    })
                    .collect()
            }

            async fn cancel_scheduled(&self, id: uuid::Uuid) -> Result<bool, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let rows = sqlx::query(CANCEL_SCHEDULED)
                    .bind(id_text(id))
                    .bind(millis(self.clock.now()))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                Ok(rows == 1)
            }
        }

        #[async_trait::async_trait]
        impl dacapo_actors::ports::DurableInbox for $store {
            async fn recover(
                &self,
                limit: usize,
                due_before: chrono::DateTime<chrono::Utc>,
            ) -> Result<Vec<dacapo_actors::ports::Resumable>, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let alive_since = self.alive_since();
                let mut tx = self.pool.begin_with($begin).await.map_err($crate::store::sql::db_error)?;
                let rows = sqlx::query($claim)
                    .bind(&*self.node)
                    .bind(millis(alive_since))
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .bind(millis(due_before))
                    .fetch_all(&mut *tx)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                tx.commit().await.map_err($crate::store::sql::db_error)?;
                Ok(rows.iter().filter_map(Self::readable).collect())
            }

            async fn delete_idempotency_keys_before(
                &self,
                before: chrono::DateTime<chrono::Utc>,
                limit: usize,
            ) -> Result<u64, dacapo_actors::Error> {
                use $crate::store::sql::*;
                Ok(sqlx::query(DELETE_IDEMPOTENCY_KEYS)
                    .bind(millis(before))
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected())
            }

            async fn orphaned(
                &self,
                before: chrono::DateTime<chrono::Utc>,
                running: &std::collections::HashSet<uuid::Uuid>,
                limit: usize,
            ) -> Result<Vec<dacapo_actors::ports::Resumable>, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let store_error = $crate::store::sql::db_error;
                let candidates: Vec<String> = sqlx::query_scalar(OWN_UNSETTLED)
                    .bind(&*self.node)
                    .bind(millis(before))
                    .bind(i64::try_from(running.len().saturating_add(limit)).unwrap_or(i64::MAX))
                    .fetch_all(&self.pool)
                    .await
                    .map_err(store_error)?;
                let mut orphans = Vec::new();
                for id in candidates {
                    if orphans.len() == limit || running.contains(&parse_id(&id)?) {
                        continue;
                    }
                    let row = sqlx::query(OWN_UNSETTLED_ROW)
                        .bind(&id)
                        .bind(&*self.node)
                        .fetch_optional(&self.pool)
                        .await
                        .map_err(store_error)?;
                    if let Some(resumable) = row.as_ref().and_then(Self::readable) {
                        orphans.push(resumable);
                    }
                }
                Ok(orphans)
            }

            async fn release_before(
                &self,
                started_at: chrono::DateTime<chrono::Utc>,
            ) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                sqlx::query(RELEASE_BEFORE)
                    .bind(&*self.node)
                    .bind(millis(started_at))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                Ok(())
            }

            async fn heartbeat(&self) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                sqlx::query(HEARTBEAT)
                    .bind(&*self.node)
                    .bind(millis(self.clock.now()))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                Ok(())
            }

            fn node_timeout(&self) -> std::time::Duration {
                self.node_timeout
            }

            async fn release(&self) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                let mut tx = self.pool.begin_with($begin).await.map_err($crate::store::sql::db_error)?;
                sqlx::query(RELEASE).bind(&*self.node).execute(&mut *tx).await.map_err($crate::store::sql::db_error)?;
                sqlx::query(FORGET_NODE).bind(&*self.node).execute(&mut *tx).await.map_err($crate::store::sql::db_error)?;
                tx.commit().await.map_err($crate::store::sql::db_error)
            }

            async fn delete_handled_before(
                &self,
                before: chrono::DateTime<chrono::Utc>,
                limit: usize,
            ) -> Result<u64, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                let mut removed = 0;
                for statement in [DELETE_HANDLED, $crate::transaction::DELETE_COMPLETIONS] {
                    removed += sqlx::query(statement)
                        .bind(millis(before))
                        .bind(limit)
                        .execute(&self.pool)
                        .await
                        .map_err($crate::store::sql::db_error)?
                        .rows_affected();
                }
                Ok(removed)
            }
        }

        #[async_trait::async_trait]
        impl dacapo_actors::ports::Claims for $store {
            async fn provision(&self) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                self.claims_ready
                    .get_or_try_init(|| async {
                        // Under the migrations' lock: nodes starting together create it once.
                        let mut tx = self.pool.begin_with($begin).await.map_err($crate::store::sql::db_error)?;
                        for lock in $lock {
                            sqlx::query(lock).execute(&mut *tx).await.map_err($crate::store::sql::db_error)?;
                        }
                        for statement in PROVISION_CLAIMS {
                            sqlx::query(statement).execute(&mut *tx).await.map_err($crate::store::sql::db_error)?;
                        }
                        let has_node: i64 = sqlx::query_scalar($claims_has_node)
                            .fetch_one(&mut *tx)
                            .await
                            .map_err($crate::store::sql::db_error)?;
                        if has_node == 0 {
                            sqlx::query(ADD_CLAIMS_NODE).execute(&mut *tx).await.map_err($crate::store::sql::db_error)?;
                        }
                        sqlx::query(RELEASE_OWN_UNCOMPLETED_CLAIMS)
                            .bind(&*self.node)
                            .execute(&mut *tx)
                            .await
                            .map_err($crate::store::sql::db_error)?;
                        tx.commit().await.map_err($crate::store::sql::db_error)
                    })
                    .await?;
                Ok(())
            }

            async fn claim(
                &self,
                claim: &dacapo_actors::ports::Claim,
            ) -> Result<dacapo_actors::ports::ClaimOutcome, dacapo_actors::Error> {
                use $crate::store::sql::*;
                self.provision().await?;
                // A claim released between the insert and the read is free: claim again.
                for _ in 0..3 {
                    let claimed = sqlx::query(CLAIM)
                        .bind(&claim.handler)
                        .bind(&claim.key_hash)
                        .bind(&claim.key)
                        .bind(&claim.fingerprint)
                        .bind(&claim.envelope_id)
                        .bind(millis(claim.claimed_at))
                        .bind(millis(claim.expires_at))
                        .bind(&*self.node)
                        .bind(millis(self.alive_since()))
                        .execute(&self.pool)
                        .await
                        .map_err($crate::store::sql::db_error)?
                        .rows_affected();
                    if claimed == 1 {
                        return Ok(dacapo_actors::ports::ClaimOutcome::Claimed);
                    }
                    // The insert decided; this read only tells a duplicate from a conflict, and
                    // both from this envelope's own completed claim.
                    let holder: Option<(String, String, i32, String)> = sqlx::query_as(CLAIM_HOLDER)
                        .bind(&claim.handler)
                        .bind(&claim.key_hash)
                        .fetch_optional(&self.pool)
                        .await
                        .map_err($crate::store::sql::db_error)?;
                    if let Some((fingerprint, envelope_id, completed, node)) = holder {
                        if envelope_id == claim.envelope_id {
                            if completed != 0 {
                                return Ok(dacapo_actors::ports::ClaimOutcome::Completed);
                            }
                            // Uncompleted, and not taken over: a live node's attempt of this
                            // very delivery may still run it. This attempt fails and retries
                            // until that one ends (it completes or releases the claim) or its
                            // node is taken for dead.
                            return Err(dacapo_actors::Error::store(format!(
                                "the deduplication claim of {} on {:?} is held by an attempt \
                                 of this delivery still running on node {node}",
                                claim.handler, claim.key
                            )));
                        }
                        return Ok(dacapo_actors::ports::ClaimOutcome::Held {
                            same_payload: fingerprint == claim.fingerprint,
                        });
                    }
                }
                Err(dacapo_actors::Error::store("a deduplication claim kept being released while claiming"))
            }

            async fn release(&self, claim: &dacapo_actors::ports::Claim) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                self.provision().await?;
                sqlx::query(RELEASE_CLAIM)
                    .bind(&claim.handler)
                    .bind(&claim.key_hash)
                    .bind(&claim.envelope_id)
                    .bind(&*self.node)
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                Ok(())
            }

            async fn complete(&self, claim: &dacapo_actors::ports::Claim) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                let rows = sqlx::query(COMPLETE_CLAIM)
                    .bind(&claim.handler)
                    .bind(&claim.key_hash)
                    .bind(&claim.envelope_id)
                    .bind(&*self.node)
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                if rows == 0 {
                    return Err(claim_lost(claim));
                }
                Ok(())
            }

            async fn reap(
                &self,
                now: chrono::DateTime<chrono::Utc>,
                limit: usize,
            ) -> Result<u64, dacapo_actors::Error> {
                use $crate::store::sql::*;
                self.provision().await?;
                let mut tx = self.pool.begin_with($begin).await.map_err($crate::store::sql::db_error)?;
                let removed = sqlx::query(REAP_CLAIMS)
                    .bind(millis(now))
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                tx.commit().await.map_err($crate::store::sql::db_error)?;
                Ok(removed)
            }
        }

        #[async_trait::async_trait]
        impl dacapo_actors::ports::OutboxStore for $store {
            async fn lease(
                &self,
                now: chrono::DateTime<chrono::Utc>,
                until: chrono::DateTime<chrono::Utc>,
            ) -> Result<bool, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let taken = sqlx::query(LEASE)
                    .bind(&*self.node)
                    .bind(millis(now))
                    .bind(millis(until))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected();
                Ok(taken == 1)
            }

            fn enlisted(&self) -> Option<futures::stream::BoxStream<'static, Result<(), dacapo_actors::Error>>> {
                self.enlisted_signals()
            }

            async fn unpublished(
                &self,
                after: i64,
                limit: usize,
            ) -> Result<Vec<(i64, dacapo_actors::Envelope)>, dacapo_actors::Error> {
                use sqlx::Row;
                use $crate::store::sql::*;
                let rows = sqlx::query(UNPUBLISHED)
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .bind(after)
                    .fetch_all(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                let get = |e: sqlx::Error| dacapo_actors::Error::store(e);
                rows.iter()
                    .map(|row| {
                        let position: i64 = row.try_get(0).map_err(get)?;
                        let columns = $crate::store::sql::read_envelope!(row, 1);
                        Ok((position, columns.into_envelope(0)?))
                    })
                    .collect()
            }

            async fn backlog(&self) -> Result<dacapo_actors::ports::OutboxBacklog, dacapo_actors::Error> {
                use sqlx::Row;
                use $crate::store::sql::*;
                let row = sqlx::query(BACKLOG).fetch_one(&self.pool).await.map_err($crate::store::sql::db_error)?;
                let depth: i64 = row.try_get(0).map_err($crate::store::sql::db_error)?;
                let oldest: Option<i64> = row.try_get(1).map_err($crate::store::sql::db_error)?;
                Ok(dacapo_actors::ports::OutboxBacklog::new(
                    u64::try_from(depth).unwrap_or(0),
                    oldest.map(time).transpose()?,
                ))
            }

            async fn delete_published_before(
                &self,
                before: chrono::DateTime<chrono::Utc>,
                limit: usize,
            ) -> Result<u64, dacapo_actors::Error> {
                use $crate::store::sql::*;
                Ok(sqlx::query(DELETE_PUBLISHED)
                    .bind(millis(before))
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected())
            }

            async fn mark_published(
                &self,
                positions: &[i64],
                at: chrono::DateTime<chrono::Utc>,
            ) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                if positions.is_empty() {
                    return Ok(());
                }
                let sql = mark_published(positions.len());
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(millis(at));
                for position in positions {
                    query = query.bind(*position);
                }
                query.execute(&self.pool).await.map_err($crate::store::sql::db_error)?;
                Ok(())
            }
        }

        #[async_trait::async_trait]
        impl dacapo_actors::ports::DeadLetterStore for $store {
            async fn put(&self, letter: dacapo_actors::DeadLetter) -> Result<(), dacapo_actors::Error> {
                use $crate::store::sql::*;
                let c = EnvelopeColumns::of(&letter.envelope)?;
                $crate::store::sql::bind_envelope!(sqlx::query(PUT_DEAD_LETTER), c)
                    .bind(reason_json(&letter.reason)?)
                    .bind(json(&letter.failures)?)
                    .bind(stored_attempts(letter.attempts))
                    .bind(millis(letter.first_failure_at))
                    .bind(millis(letter.last_failure_at))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                Ok(())
            }

            async fn list(&self) -> Result<Vec<dacapo_actors::DeadLetter>, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let rows = sqlx::query(LIST_DEAD_LETTERS)
                    .fetch_all(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                rows.iter().map(Self::dead_letter_row).collect()
            }

            async fn get(&self, id: uuid::Uuid) -> Result<Option<dacapo_actors::DeadLetter>, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let row = sqlx::query(GET_DEAD_LETTER)
                    .bind(id_text(id))
                    .fetch_optional(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                row.as_ref().map(Self::dead_letter_row).transpose()
            }

            async fn remove(&self, id: uuid::Uuid) -> Result<Option<dacapo_actors::DeadLetter>, dacapo_actors::Error> {
                use $crate::store::sql::*;
                let row = sqlx::query(REMOVE_DEAD_LETTER)
                    .bind(id_text(id))
                    .fetch_optional(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?;
                row.as_ref().map(Self::dead_letter_row).transpose()
            }

            async fn purge(&self) -> Result<u64, dacapo_actors::Error> {
                use $crate::store::sql::*;
                Ok(sqlx::query(PURGE_DEAD_LETTERS)
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::db_error)?
                    .rows_affected())
            }
        }
    };
}

pub(crate) use sql_store;

/// Claims unsettled rows with plain `UPDATE … RETURNING`; the caller's `BEGIN IMMEDIATE`
/// already holds SQLite's single write lock.
///
/// A row is claimable when released (no owner), or when its owner has not heartbeaten within
/// the node timeout *and* the row is older than that: a node that just started may receive
/// before its first heartbeat is written, and its fresh rows must not look orphaned.
#[cfg(feature = "sqlite")]
pub(crate) const CLAIM_SQLITE: &str = "UPDATE dacapo_inbox SET owner = $1 WHERE id IN (\
    SELECT id FROM dacapo_inbox WHERE status IN ('incoming', 'scheduled') \
    AND (owner IS NULL OR (owner <> $1 AND received_at < $2 \
    AND owner NOT IN (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $2))) \
    AND (execute_at IS NULL OR execute_at < $4) \
    ORDER BY received_at LIMIT $3) \
    RETURNING id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, \
    sent_at, scheduled_for, attempts, execute_at, failures, succeeded, cascaded";

/// Claims unsettled rows, skipping those another node is claiming at this moment.
#[cfg(feature = "postgres")]
pub(crate) const CLAIM_POSTGRES: &str = "UPDATE dacapo_inbox SET owner = $1 WHERE id IN (\
    SELECT id FROM dacapo_inbox WHERE status IN ('incoming', 'scheduled') \
    AND (owner IS NULL OR (owner <> $1 AND received_at < $2 \
    AND owner NOT IN (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $2))) \
    AND (execute_at IS NULL OR execute_at < $4) \
    ORDER BY received_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
    RETURNING id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, \
    sent_at, scheduled_for, attempts, execute_at, failures, succeeded, cascaded";
