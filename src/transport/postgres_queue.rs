//! A queue in PostgreSQL that nodes share, for fleets without a broker.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use dacapo_actors::Envelope;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row as _, Transaction};

use super::host::{Publish, Received, Sent, Subscribe, Transport};
use super::routes::{Routes, routing};
use super::wire::Unreadable;
use crate::Error;
use crate::store::PostgresStore;
use crate::store::sql::{EnvelopeColumns, millis};

const NAME: &str = "postgres-queue";

/// The channel each publishing commit notifies, with the queue's name as payload.
const CHANNEL: &str = "dacapo_queue";

/// The shortest poll interval a node takes.
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// The shortest [`PostgresQueue::reply_timeout`].
const MIN_REPLY_TIMEOUT: Duration = Duration::from_millis(100);

/// A deadline that never comes in practice, for intervals too long to add to the clock.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Envelopes published to a named queue in a PostgreSQL database, unowned until a node takes
/// a batch of them: every live node listening on the queue takes a share.
///
/// A node takes a batch with `FOR UPDATE SKIP LOCKED` in a transaction that stays open while
/// the node's inbox records them, and deletes them in that transaction once recorded (the
/// acknowledgement) — not once its engine has room to start them, which they wait for in the
/// inbox, the node taking no further batch meanwhile. A node killed in between holds nothing: its transaction rolls back and
/// another node takes the batch, whose copies the inbox discards by envelope id. Nodes are
/// woken by `LISTEN/NOTIFY` at every commit that published, and poll as a fallback.
///
/// Only the message types routed here leave the node ([`route`](Self::route),
/// [`route_module`](Self::route_module), [`route_all`](Self::route_all)); the rest stay
/// node-local, as on a runtime without a transport.
///
/// ```no_run
/// # use dacapo::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct OrderPlaced { n: u32 }
/// # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
/// # async fn run(store: dacapo::store::PostgresStore, module: Module) -> Result<(), dacapo::Error> {
/// use dacapo::transport::PostgresQueue;
///
/// let queue = PostgresQueue::on(&store, "orders").route::<OrderPlaced>();
/// let runtime = Runtime::builder().store(store).module(module).transport(queue).build()?;
/// runtime.listening().await?;
/// # Ok(())
/// # }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub struct PostgresQueue {
    options: PgConnectOptions,
    queue: String,
    routes: Routes,
    prefetch: u16,
    poll_interval: Duration,
    declare: bool,
    reply_timeout: Duration,
}

impl std::fmt::Debug for PostgresQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the connect options: they hold the password.
        f.debug_struct("PostgresQueue")
            .field("queue", &self.queue)
            .field("routes", &self.routes)
            .field("prefetch", &self.prefetch)
            .field("poll_interval", &self.poll_interval)
            .field("declare", &self.declare)
            .field("reply_timeout", &self.reply_timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresQueue {
    /// The queue `queue` in the database of `store` (its connection settings; the queue
    /// opens connections of its own, on its own thread).
    pub fn on(store: &PostgresStore, queue: impl Into<String>) -> Self {
        Self::with_options((*store.pool().connect_options()).clone(), queue)
    }

    /// The queue `queue` in the PostgreSQL database at `url`, which need not be the store's.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] for a URL that does not parse.
    pub fn connect(url: &str, queue: impl Into<String>) -> Result<Self, Error> {
        let options = PgConnectOptions::from_str(url).map_err(|error| {
            Error::Configuration(format!("{}: {error}", crate::store::sql::redacted(url)))
        })?;
        Ok(Self::with_options(options, queue))
    }

    fn with_options(options: PgConnectOptions, queue: impl Into<String>) -> Self {
        Self {
            options,
            queue: queue.into(),
            routes: Routes::default(),
            prefetch: 100,
            poll_interval: Duration::from_secs(1),
            declare: true,
            reply_timeout: Duration::from_secs(30),
        }
    }

    routing!();

    /// How many envelopes a node takes in one transaction (default 100).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How often a node looks at the queue when no notification came (default 1 s; at
    /// least 1 ms, so that an idle node never polls without pause).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(MIN_POLL_INTERVAL);
        self
    }

    /// How long a node's take of a batch, its acknowledgement, or the rollback that ends a take
    /// that found nothing or hands a batch back, waits for the server's answer before the
    /// connection counts as lost and the node connects again (default 30 s). A
    /// server gone without closing the connection (a host down, a network that drops
    /// packets) would otherwise leave the node waiting for as long as TCP takes to notice,
    /// still listening in name. The rows it held are freed by the server meanwhile, and the
    /// redelivery of a batch already recorded is discarded by the inbox. At least 100 ms: a
    /// timeout shorter than any answer would time out every take, and the node would connect
    /// again for ever without consuming.
    #[must_use]
    pub fn reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout.max(MIN_REPLY_TIMEOUT);
        self
    }

    /// Whether to create the queue's table at start (the default) or only check that it is
    /// there, for a database whose schema is managed elsewhere.
    #[must_use]
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }
}

impl From<PostgresQueue> for Transport {
    fn from(queue: PostgresQueue) -> Self {
        Transport {
            name: NAME,
            home: queue.queue.clone(),
            routes: queue.routes.clone(),
            // Every row of the queue is taken, whatever its type: what was routed here.
            open: Box::new(move |_listened| {
                // A node cut off from the server while it holds a batch must not keep its
                // rows locked for as long as TCP takes to notice: the server ends the
                // transaction, and the rows go to another node.
                let options = queue
                    .options
                    .clone()
                    .options([("idle_in_transaction_session_timeout", "60s")]);
                let pool = PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_secs(5))
                    .connect_lazy_with(options);
                let publisher = Publisher {
                    pool: pool.clone(),
                    routes: queue.routes.clone(),
                    home: queue.queue.clone(),
                    declare: queue.declare,
                    declared: false,
                    backlog_checked: None,
                };
                let subscriber = Subscriber {
                    pool,
                    queue: queue.queue,
                    prefetch: queue.prefetch,
                    poll_interval: queue.poll_interval,
                    declare: queue.declare,
                    reply_timeout: queue.reply_timeout,
                    notifications: None,
                    taken: None,
                };
                (Box::new(publisher), Box::new(subscriber))
            }),
        }
    }
}

/// Runs `work` (`what`: a take, an acknowledgement), its error a transport failure, and one
/// too of a server that does not answer within `timeout`: the connection counts as lost.
async fn answered_within<T>(
    timeout: Duration,
    what: &str,
    work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, work).await {
        Ok(done) => done.map_err(failed),
        Err(_) => Err(failed(format!(
            "the server did not answer {what} within {timeout:?}"
        ))),
    }
}

fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::transport(NAME, error)
}

/// What the server said, as a configuration error when no retry can change it — credentials
/// or privileges refused, a database that does not exist — so that a consumer that never
/// listened stops with the reason instead of trying again for ever.
fn refused(error: sqlx::Error) -> Error {
    let code = error
        .as_database_error()
        .and_then(|database| database.code())
        .unwrap_or_default();
    // 28: invalid authorization; 3D000: no such database; 42501: insufficient privilege.
    if code.starts_with("28") || code == "3D000" || code == "42501" {
        Error::Configuration(format!("the PostgreSQL queue's server refused: {error}"))
    } else {
        failed(error)
    }
}

const DECLARE: [&str; 3] = [
    "SELECT pg_advisory_xact_lock(7215143920911462)",
    "CREATE TABLE IF NOT EXISTS dacapo_queue (\
        seq              BIGSERIAL PRIMARY KEY, \
        queue            TEXT    NOT NULL, \
        id               TEXT    NOT NULL, \
        message_type     TEXT    NOT NULL, \
        payload          BYTEA   NOT NULL, \
        headers          TEXT    NOT NULL, \
        deduplication_id TEXT, \
        correlation_id   TEXT, \
        causation_id     TEXT, \
        sent_at          BIGINT  NOT NULL, \
        scheduled_for    BIGINT, \
        enqueued_at      BIGINT  NOT NULL)",
    "CREATE INDEX IF NOT EXISTS dacapo_queue_next ON dacapo_queue (queue, seq)",
];

const CHECK: &str = "SELECT to_regclass('dacapo_queue') IS NOT NULL AS present";

const ENQUEUE: &str = "INSERT INTO dacapo_queue \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, queue, enqueued_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

const NOTIFY: &str = "SELECT pg_notify($1, $2)";

const TAKE: &str = "SELECT seq, id, message_type, payload, headers, deduplication_id, \
    correlation_id, causation_id, sent_at, scheduled_for FROM dacapo_queue \
    WHERE queue = $1 ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED";

const DELETE: &str = "DELETE FROM dacapo_queue WHERE seq = ANY($1)";

/// The columns of a row [`TAKE`] reads as text, and the headers that keep them in an
/// unreadable row's dead letter (its type under the header a dead letter takes its type from).
const TEXT_COLUMNS: [(&str, &str); 6] = [
    ("id", "message-id"),
    ("message_type", "message-type"),
    ("headers", "queue-row-headers"),
    ("deduplication_id", "queue-row-deduplication-id"),
    ("correlation_id", "queue-row-correlation-id"),
    ("causation_id", "queue-row-causation-id"),
];

/// Those it reads as numbers.
const NUMBER_COLUMNS: [(&str, &str); 2] = [
    ("sent_at", "queue-row-sent-at"),
    ("scheduled_for", "queue-row-scheduled-for"),
];

/// Whether this role may take rows (`FOR UPDATE`) and delete them once recorded.
const MAY_TAKE: &str = "SELECT has_any_column_privilege('dacapo_queue', 'UPDATE') \
    AND has_table_privilege('dacapo_queue', 'DELETE') AS may_take";

/// Creates the queue's table, or checks it is there, in a database that holds any text: in
/// another encoding, one row with a character it lacks would fail every take, and every node
/// would stop taking from the queue.
async fn declare(pool: &PgPool, create: bool) -> Result<(), Error> {
    match crate::store::holds_any_text(pool).await {
        Ok(()) => {}
        Err(Error::Configuration(why)) => {
            return Err(Error::Configuration(format!(
                "the PostgreSQL queue's {why}"
            )));
        }
        Err(other) => return Err(failed(other)),
    }
    if create {
        let mut tx = pool.begin().await.map_err(refused)?;
        for statement in DECLARE {
            sqlx::query(statement)
                .execute(&mut *tx)
                .await
                .map_err(refused)?;
        }
        return tx.commit().await.map_err(failed);
    }
    let present: bool = sqlx::query(CHECK)
        .fetch_one(pool)
        .await
        .map_err(refused)?
        .get("present");
    if present {
        Ok(())
    } else {
        Err(Error::Configuration(
            "the PostgreSQL queue's table dacapo_queue does not exist, and the queue was \
             asked only to check it (PostgresQueue::declare(false))"
                .into(),
        ))
    }
}

struct Publisher {
    pool: PgPool,
    routes: Routes,
    home: String,
    declare: bool,
    declared: bool,
    /// When the queues it publishes to were last looked at for rows nobody took.
    backlog_checked: Option<std::time::Instant>,
}

/// How often a publisher looks at the queues it publishes to for old rows, and how old a row
/// must be to be warned of: RabbitMQ says when a message has no queue to go to, NATS when no
/// stream captures its subject; a queue table takes any row, and rows routed to a queue no
/// node takes (a mistyped `route_to`, a service gone) would otherwise wait there unsaid.
const BACKLOG_CHECK: Duration = Duration::from_secs(60);

/// The oldest row of a queue, by the queue's index.
const OLDEST: &str = "SELECT enqueued_at FROM dacapo_queue WHERE queue = $1 ORDER BY seq LIMIT 1";

impl Publisher {
    /// Warns of each of `queues` whose oldest row waited longer than [`BACKLOG_CHECK`]; the
    /// caller looks once a [`BACKLOG_CHECK`] at most.
    async fn warn_of_backlog(&mut self, queues: &[String], now: i64) {
        self.backlog_checked = Some(std::time::Instant::now());
        for queue in queues {
            let oldest = sqlx::query(OLDEST)
                .bind(queue.as_str())
                .fetch_optional(&self.pool)
                .await;
            match oldest {
                Ok(Some(row)) => {
                    // Not `get`: a table of the operator's (`declare(false)`) may let it be
                    // NULL, and a panic here would report a committed publication as failed.
                    let Ok(enqueued_at) = row.try_get::<i64, _>("enqueued_at") else {
                        continue;
                    };
                    let waited = Duration::from_millis(
                        u64::try_from(now.saturating_sub(enqueued_at)).unwrap_or(0),
                    );
                    if waited > BACKLOG_CHECK {
                        tracing::warn!(
                            transport = NAME,
                            queue = queue.as_str(),
                            ?waited,
                            "the PostgreSQL queue holds rows older than a minute: does any node take from it?"
                        );
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(transport = NAME, queue = queue.as_str(), %error, "could not look at the queue's oldest row");
                }
            }
        }
    }
}

#[async_trait]
impl Publish for Publisher {
    async fn publish(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error> {
        if !self.declared {
            declare(&self.pool, self.declare).await?;
            self.declared = true;
        }
        let now = millis(chrono::Utc::now());
        let mut refused = Vec::new();
        let mut queues: Vec<&str> = Vec::new();
        let mut tx = self.pool.begin().await.map_err(failed)?;
        for envelope in envelopes {
            // PostgreSQL text holds no NUL: such a row would fail its whole batch, every time.
            let columns = EnvelopeColumns::of(envelope)?;
            let texts = [
                Some(columns.message_type.as_str()),
                Some(columns.headers.as_str()),
                columns.deduplication_id.as_deref(),
            ];
            if texts.iter().flatten().any(|text| text.contains('\0')) {
                refused.push((
                    envelope.id,
                    "a NUL character cannot be stored in PostgreSQL text".to_owned(),
                ));
                continue;
            }
            let queue = self.routes.destination(&envelope.message_type, &self.home);
            let enqueued = sqlx::query(ENQUEUE)
                .bind(&columns.id)
                .bind(&columns.message_type)
                .bind(&columns.payload)
                .bind(&columns.headers)
                .bind(&columns.deduplication_id)
                .bind(&columns.correlation_id)
                .bind(&columns.causation_id)
                .bind(columns.sent_at)
                .bind(columns.scheduled_for)
                .bind(queue)
                .bind(now)
                .execute(&mut *tx)
                .await;
            if let Err(error) = enqueued {
                // The table may have gone (dropped by an operator, a restore): declared again
                // before the next publication, which a node that only publishes would
                // otherwise never do.
                if error
                    .as_database_error()
                    .and_then(|database| database.code())
                    .is_some_and(|code| code == "42P01")
                {
                    self.declared = false;
                }
                return Err(failed(error));
            }
            if !queues.contains(&queue) {
                queues.push(queue);
            }
        }
        for queue in &queues {
            sqlx::query(NOTIFY)
                .bind(CHANNEL)
                .bind(queue)
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
        }
        tx.commit().await.map_err(failed)?;
        if self
            .backlog_checked
            .is_none_or(|checked| checked.elapsed() >= BACKLOG_CHECK)
        {
            let queues: Vec<String> = queues.into_iter().map(str::to_owned).collect();
            self.warn_of_backlog(&queues, now).await;
        }
        Ok(Sent::refusing(refused))
    }

    fn reset(&mut self) {
        // The pool replaces its broken connections itself; the table may have gone.
        self.declared = false;
    }
}

struct Subscriber {
    pool: PgPool,
    queue: String,
    prefetch: u16,
    poll_interval: Duration,
    declare: bool,
    reply_timeout: Duration,
    notifications: Option<PgListener>,
    /// The open transaction holding the last batch's rows, and their positions.
    taken: Option<(Transaction<'static, Postgres>, Vec<i64>)>,
}

#[async_trait]
impl Subscribe for Subscriber {
    async fn subscribe(&mut self) -> Result<(), Error> {
        self.taken = None;
        declare(&self.pool, self.declare).await?;
        // A role that may read the rows but not delete them would take the same batch after
        // every failed acknowledgement, and run its handlers again each time the inbox forgot
        // it (past `keep_after_handling`).
        let may_take: bool = sqlx::query(MAY_TAKE)
            .fetch_one(&self.pool)
            .await
            .map_err(refused)?
            .try_get("may_take")
            .map_err(failed)?;
        if !may_take {
            return Err(Error::Configuration(
                "the PostgreSQL queue's role may not update and delete rows of dacapo_queue, \
                 which taking a row and acknowledging it need: GRANT SELECT, UPDATE, DELETE \
                 ON dacapo_queue"
                    .into(),
            ));
        }
        let mut listener = PgListener::connect_with(&self.pool)
            .await
            .map_err(refused)?;
        listener.listen(CHANNEL).await.map_err(failed)?;
        self.notifications = Some(listener);
        Ok(())
    }

    async fn next(&mut self) -> Result<Vec<Received>, Error> {
        let take = async {
            let mut tx = self.pool.begin().await?;
            let rows = sqlx::query(TAKE)
                .bind(&self.queue)
                .bind(i64::from(self.prefetch))
                .fetch_all(&mut *tx)
                .await?;
            Ok::<_, sqlx::Error>((tx, rows))
        };
        let (tx, rows) = answered_within(self.reply_timeout, "a take", take).await?;
        if rows.is_empty() {
            answered_within(self.reply_timeout, "a rollback", tx.rollback()).await?;
            self.wait().await?;
            return Ok(Vec::new());
        }
        let mut positions = Vec::with_capacity(rows.len());
        let mut received = Vec::with_capacity(rows.len());
        for row in &rows {
            let position = row.try_get::<i64, _>("seq").map_err(failed)?;
            positions.push(position);
            received.push(self.read(row, position));
        }
        self.taken = Some((tx, positions));
        Ok(received)
    }

    async fn ack(&mut self) -> Result<(), Error> {
        let Some((mut tx, positions)) = self.taken.take() else {
            return Ok(());
        };
        let acknowledge = async {
            let deleted = sqlx::query(DELETE)
                .bind(&positions)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok(deleted)
        };
        // A privilege the role lacks is refused for good, as at the start.
        let deleted = match tokio::time::timeout(self.reply_timeout, acknowledge).await {
            Ok(deleted) => deleted.map_err(refused)?,
            Err(_) => {
                return Err(failed(format!(
                    "the server did not answer an acknowledgement within {:?}",
                    self.reply_timeout
                )));
            }
        };
        // The rows are locked by this transaction: a delete that left some (a trigger, row
        // security) would leave them to be taken again, again and again — and run again once
        // the inbox forgot them.
        if deleted < positions.len() as u64 {
            return Err(Error::Configuration(format!(
                "the PostgreSQL queue's acknowledgement deleted {deleted} of the {} rows taken: \
                 a trigger or a row security policy on dacapo_queue keeps them",
                positions.len()
            )));
        }
        Ok(())
    }

    async fn release(&mut self) {
        if let Some((tx, _)) = self.taken.take() {
            // Given up, the connection goes with the transaction, and the server ends it.
            let _ = tokio::time::timeout(self.reply_timeout, tx.rollback()).await;
        }
    }
}

impl Subscriber {
    /// Waits for a notification for this queue, or the poll interval.
    async fn wait(&mut self) -> Result<(), Error> {
        let Some(listener) = self.notifications.as_mut() else {
            tokio::time::sleep(self.poll_interval).await;
            return Ok(());
        };
        let now = tokio::time::Instant::now();
        // An interval too long to add to the clock waits for a notification alone.
        let deadline = now
            .checked_add(self.poll_interval)
            .unwrap_or_else(|| now + FAR_FUTURE);
        loop {
            // A lost connection ends the wait: a notification sent while it was down is lost
            // with it, so the queue is looked at before the next call listens again.
            match tokio::time::timeout_at(deadline, listener.try_recv()).await {
                Err(_) | Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(notification))) if notification.payload() == self.queue => {
                    return Ok(());
                }
                Ok(Ok(Some(_))) => {}
                Ok(Err(error)) => {
                    self.notifications = None;
                    return Err(failed(error));
                }
            }
        }
    }

    /// A row as an envelope; a row another writer filled with something else is unreadable.
    fn read(&self, row: &PgRow, position: i64) -> Received {
        let columns = || -> Result<EnvelopeColumns, sqlx::Error> {
            Ok(EnvelopeColumns {
                id: row.try_get("id")?,
                message_type: row.try_get("message_type")?,
                payload: row.try_get("payload")?,
                headers: row.try_get("headers")?,
                deduplication_id: row.try_get("deduplication_id")?,
                correlation_id: row.try_get("correlation_id")?,
                causation_id: row.try_get("causation_id")?,
                sent_at: row.try_get("sent_at")?,
                scheduled_for: row.try_get("scheduled_for")?,
            })
        };
        // The row as it was — its payload, each column that can be read as text, the queue and
        // the row's position (two broken rows are two dead letters, and a row at a position a
        // re-created table gives again keeps a letter of its own unless it is the same row).
        let unreadable = |why: String| {
            let mut headers: std::collections::BTreeMap<String, String> = [
                ("queue".to_owned(), self.queue.clone()),
                ("queue-position".to_owned(), position.to_string()),
            ]
            .into();
            for (column, header) in TEXT_COLUMNS {
                if let Ok(Some(value)) = row.try_get::<Option<String>, _>(column) {
                    headers.insert(header.to_owned(), value);
                }
            }
            for (column, header) in NUMBER_COLUMNS {
                if let Ok(Some(value)) = row.try_get::<Option<i64>, _>(column) {
                    headers.insert(header.to_owned(), value.to_string());
                }
            }
            Unreadable {
                headers,
                body: row.try_get("payload").unwrap_or_default(),
                why,
                properties: Vec::new(),
            }
        };
        match columns() {
            Ok(columns) => {
                let envelope = columns.into_envelope(0).map_err(|error| error.to_string());
                // As on the brokers' wire: every row of a writer that never sets its ids would
                // share the nil one, and the inbox would discard all but the first as
                // redeliveries; a row without a type has no handler to run.
                let envelope = envelope.and_then(|envelope| {
                    if envelope.id.is_nil() {
                        Err(
                            "the row's id is the nil UUID, which cannot tell it from another"
                                .to_owned(),
                        )
                    } else if envelope.message_type.is_empty() {
                        Err("the row's message type is empty".to_owned())
                    } else {
                        Ok(envelope)
                    }
                });
                envelope.map_err(|error| unreadable(format!("queue row: {error}")))
            }
            Err(error) => Err(unreadable(format!("queue row: {error}"))),
        }
    }
}

#[cfg(test)]
mod reply_timeout_tests {
    use super::*;

    #[test]
    fn a_reply_timeout_of_zero_is_the_shortest_one_instead() {
        let queue = PostgresQueue::with_options(PgConnectOptions::new(), "q");
        assert_eq!(
            queue.reply_timeout(Duration::ZERO).reply_timeout,
            MIN_REPLY_TIMEOUT
        );
        let queue = PostgresQueue::with_options(PgConnectOptions::new(), "q");
        let long = Duration::from_secs(90);
        assert_eq!(queue.reply_timeout(long).reply_timeout, long);
    }
}
