//! One handle on the database, whichever the backend: statements bound with [`Value`]s, rows
//! read by column name. The store's code is written once against it; only this file knows
//! which sqlx driver runs underneath.

use dacapo_actors::Error;
use sqlx::Row as _;

use super::db_error;
#[cfg(feature = "postgres")]
use super::kept::{KeptTransaction, on_a_kept_connection};
#[cfg(feature = "sqlite")]
use super::on_live_session;
use super::own_thread::caller_may_stall;

/// A statement parameter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Value<'a> {
    Text(&'a str),
    OptionalText(Option<&'a str>),
    Int64(i64),
    OptionalInt64(Option<i64>),
    Int32(i32),
    Bytes(&'a [u8]),
}

/// Binds `values` in order to `query`.
pub(crate) fn bind<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    values: &[Value<'q>],
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    for value in values {
        query = match *value {
            Value::Text(text) => query.bind(text),
            Value::OptionalText(text) => query.bind(text),
            Value::Int64(number) => query.bind(number),
            Value::OptionalInt64(number) => query.bind(number),
            Value::Int32(number) => query.bind(number),
            Value::Bytes(bytes) => query.bind(bytes),
        };
    }
    query
}

/// A statement parameter of its own, for a statement run on a task of its own.
#[derive(Debug)]
enum OwnedValue {
    Text(String),
    OptionalText(Option<String>),
    Int64(i64),
    OptionalInt64(Option<i64>),
    Int32(i32),
    Bytes(Vec<u8>),
}

impl OwnedValue {
    fn all_of(values: &[Value<'_>]) -> Vec<Self> {
        values
            .iter()
            .map(|value| match *value {
                Value::Text(text) => Self::Text(text.to_owned()),
                Value::OptionalText(text) => Self::OptionalText(text.map(str::to_owned)),
                Value::Int64(number) => Self::Int64(number),
                Value::OptionalInt64(number) => Self::OptionalInt64(number),
                Value::Int32(number) => Self::Int32(number),
                Value::Bytes(bytes) => Self::Bytes(bytes.to_vec()),
            })
            .collect()
    }

    fn value(&self) -> Value<'_> {
        match self {
            Self::Text(text) => Value::Text(text),
            Self::OptionalText(text) => Value::OptionalText(text.as_deref()),
            Self::Int64(number) => Value::Int64(*number),
            Self::OptionalInt64(number) => Value::OptionalInt64(*number),
            Self::Int32(number) => Value::Int32(*number),
            Self::Bytes(bytes) => Value::Bytes(bytes),
        }
    }
}

/// Runs `work` to its end on a task of its own, holding SQLite's `turn` until then, and
/// waits for it. A caller that stops waiting must not give the turn up while its statement,
/// commit or rollback still runs on the connection's thread, holding SQLite's lock: the next
/// writer would find the lock taken. The task runs where it is run to its end (see
/// [`lasting_runtime`](super::own_thread::lasting_runtime)): a caller's current-thread runtime
/// left idle would hold the turn for good. Without a turn (PostgreSQL), `work` runs in place,
/// but for a caller whose runtime may stall: the connection `work` ends with goes back to its
/// pool (or, its transaction left unfinished, rolls back) on a task of the runtime it is
/// dropped on.
///
/// # Errors
///
/// [`Error::Store`] when the runtime running `work` stopped under it.
///
/// # Panics
///
/// If `work` panics.
///
/// # Cancel safety
///
/// Cancelled, `work` still runs to its end, and the turn goes only then.
pub(crate) async fn to_the_end<T: Send + 'static>(
    turn: Option<tokio::sync::OwnedSemaphorePermit>,
    work: impl Future<Output = T> + Send + 'static,
) -> Result<T, Error> {
    if turn.is_none() && !caller_may_stall() {
        return Ok(work.await);
    }
    let work = async move {
        let done = work.await;
        drop(turn);
        done
    };
    match super::own_thread::lasting_runtime() {
        Some(runtime) => ended(runtime.spawn(work).await, "a write"),
        None => Ok(work.await),
    }
}

/// Runs `work`, which takes connections of a pool, on the lasting thread (see
/// [`lasting_runtime`](super::own_thread::lasting_runtime)) and waits for it: for a caller
/// whose runtime may stall. A connection opened on a runtime is driven by it — its replies
/// read, whichever task waits for them — and one a statement is done with goes back to its
/// pool on a task of the runtime it is dropped on: left to a runtime then idle, the runtime's
/// later statements on that connection would never be answered, and the connection would not
/// come back.
async fn off_a_runtime_that_may_stall<T: Send + 'static>(
    work: impl Future<Output = Result<T, Error>> + Send + 'static,
) -> Result<T, Error> {
    match super::own_thread::lasting_runtime() {
        Some(runtime) => ended(runtime.spawn(work).await, "a statement")?,
        None => work.await,
    }
}

/// What `$db.$here(sql, values)` answers, run on the lasting thread (with its own copy of the
/// values) when the caller's runtime may stall: see [`off_a_runtime_that_may_stall`].
macro_rules! here_or_off_a_runtime_that_may_stall {
    ($db:expr, $here:ident, $sql:expr, $values:expr) => {
        if caller_may_stall() {
            let (db, owned) = ($db.clone(), OwnedValue::all_of($values));
            off_a_runtime_that_may_stall(async move {
                let values: Vec<Value<'_>> = owned.iter().map(OwnedValue::value).collect();
                db.$here($sql, &values).await
            })
            .await
        } else {
            $db.$here($sql, $values).await
        }
    };
}

/// What a task that ran `what` came to: its panic goes on up, as it would have in place; a
/// runtime that stopped under it is a store error.
fn ended<T>(joined: Result<T, tokio::task::JoinError>, what: &str) -> Result<T, Error> {
    match joined {
        Ok(done) => Ok(done),
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Err(Error::store(format!(
            "{what} stopped before its end: {error}"
        ))),
    }
}

/// A statement built with `$N` parameters, as SQLite runs it fastest: every parameter a `?`,
/// and the values in the order the `?`s stand. SQLite looks a named parameter up by a linear
/// search of the statement's names, once per parameter at each execution: for the hundreds
/// of parameters of a many-row statement, that search took more time than the writing. Text
/// between quotes — a literal, a quoted name — is left as it is (the statements it rewrites,
/// the store's own, hold no comments).
#[cfg(feature = "sqlite")]
fn positional<'v>(sql: &str, values: &[Value<'v>]) -> Result<(String, Vec<Value<'v>>), Error> {
    let mut text = String::with_capacity(sql.len());
    let mut ordered = Vec::with_capacity(values.len());
    // The quote that opened the literal or quoted name the text is in, if any.
    let mut quoted: Option<u8> = None;
    let mut rest = sql;
    while let Some(at) = rest.find(['$', '\'', '"']) {
        text.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let found = rest.as_bytes()[at];
        if found != b'$' {
            // A doubled quote inside closes and reopens it: the same either way.
            quoted = match quoted {
                None => Some(found),
                Some(open) if open == found => None,
                inside => inside,
            };
            text.push(char::from(found));
            rest = after;
            continue;
        }
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if quoted.is_some() || digits == 0 {
            text.push('$');
            rest = after;
            continue;
        }
        let number: usize = after[..digits].parse().unwrap_or(0);
        let value = number
            .checked_sub(1)
            .and_then(|index| values.get(index))
            .ok_or_else(|| {
                Error::store(format!(
                    "statement parameter ${number} has no value ({} given)",
                    values.len()
                ))
            })?;
        text.push('?');
        ordered.push(*value);
        rest = &after[digits..];
    }
    text.push_str(rest);
    Ok((text, ordered))
}

/// The connection pool, whichever the backend, and what a test does to its statements.
#[derive(Clone, Debug)]
pub(crate) struct Database {
    pool: Pool,
    hooks: Hooks,
    /// SQLite's one writer, taken in the process before the database's lock.
    writer: Option<Writer>,
    /// The PostgreSQL pool's connections kept between statements, out of sqlx's ping.
    #[cfg(feature = "postgres")]
    kept: std::sync::Arc<super::kept::KeptConnections>,
    /// On PostgreSQL, the connections of the pool that handler transactions may hold at once:
    /// all but two, one for the outbox's listener, which holds one for good, and one for the
    /// runtime's own statements (accepts, settles, heartbeats). Handler transactions held
    /// open — a handler's slow work inside one — would otherwise take the whole pool, and the
    /// runtime's statements wait out the pool's timeout with them, its heartbeats too, until
    /// other nodes take this one for dead.
    #[cfg(feature = "postgres")]
    handler_transactions: Option<std::sync::Arc<tokio::sync::Semaphore>>,
}

/// The turn to write on a SQLite database, handed out in the order writers asked for it.
/// SQLite lets one connection write at a time, and one that finds the lock taken sleeps and
/// polls (1 ms, then 2, 5, 10 … up to 100 ms between polls): the pool's own writes, queued
/// here instead, start as soon as the one before them commits.
///
/// The handler connection that last had the turn is parked with it ([`super::parking`]): a
/// writer of the runtime's waits for it to finish before it writes.
///
/// Handler connections queue for the turn a few at a time ([`HANDLERS_AHEAD`]), so that a
/// writer of the runtime's waits behind those few, not behind every delivery in flight.
#[derive(Clone, Debug)]
struct Writer {
    turn: std::sync::Arc<tokio::sync::Semaphore>,
    #[cfg(feature = "sqlite")]
    handlers_ahead: std::sync::Arc<tokio::sync::Semaphore>,
    #[cfg(feature = "sqlite")]
    parking: super::Parking,
}

/// How many handler connections may queue for the turn at once. A settle makes its
/// delivery's handler writes durable and frees its slot in the engine: behind every other
/// handler of a thousand deliveries in flight, it would wait for all of their writes, and a
/// crash meanwhile would run all of them again. A few dozen keep the settles' groups large.
#[cfg(feature = "sqlite")]
const HANDLERS_AHEAD: usize = 64;

/// How long a write waits for its turn before it fails (then, with its turn, it may still
/// wait out SQLite's busy timeout behind a writer outside the runtime). The wait is on tokio's
/// clock: under a paused test clock it would end at once whenever every task waits.
const WRITER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl Writer {
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    fn new() -> Self {
        Self {
            turn: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            #[cfg(feature = "sqlite")]
            handlers_ahead: std::sync::Arc::new(tokio::sync::Semaphore::new(HANDLERS_AHEAD)),
            #[cfg(feature = "sqlite")]
            parking: super::Parking::default(),
        }
    }

    /// This writer's turn, once the writes before it ended, the parked handler connection's
    /// included.
    async fn turn(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        let turn = self.turn_alone().await?;
        #[cfg(feature = "sqlite")]
        self.parking.quiesce().await?;
        Ok(turn)
    }

    /// The turn, with whatever the parked handler connection may still be running.
    async fn turn_alone(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        self.within_wait(std::sync::Arc::clone(&self.turn).acquire_owned())
            .await
    }

    /// The turn for a handler's write on the runtime's pool (a handler transaction, a handler
    /// connection where there is no handler pool): queued as a handler's, written as the
    /// runtime's, once the parked connection finished.
    async fn handler_write_turn(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        #[cfg(feature = "sqlite")]
        let turn = {
            let turn = self.handler_turn().await?;
            self.parking.quiesce().await?;
            turn
        };
        #[cfg(not(feature = "sqlite"))]
        let turn = self.turn().await?;
        Ok(turn)
    }

    /// The turn for a handler connection, once fewer than [`HANDLERS_AHEAD`] others queue
    /// for it.
    #[cfg(feature = "sqlite")]
    async fn handler_turn(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        let queued = async {
            let _queued = std::sync::Arc::clone(&self.handlers_ahead)
                .acquire_owned()
                .await?;
            std::sync::Arc::clone(&self.turn).acquire_owned().await
        };
        self.within_wait(queued).await
    }

    /// What `acquired` gives, within [`WRITER_WAIT`].
    async fn within_wait(
        &self,
        acquired: impl std::future::Future<
            Output = Result<tokio::sync::OwnedSemaphorePermit, tokio::sync::AcquireError>,
        >,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        match tokio::time::timeout(WRITER_WAIT, acquired).await {
            Ok(Ok(turn)) => Ok(turn),
            Ok(Err(_)) => Err(Error::store("the SQLite writer's queue is closed")),
            Err(_) => Err(Error::store(format!(
                "waited over {WRITER_WAIT:?} for the turn to write on SQLite"
            ))),
        }
    }
}

#[derive(Clone, Debug)]
enum Pool {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

/// What the test harness does to the runtime's statements: crash fences and store faults.
#[cfg(feature = "testing")]
type Hooks = Option<std::sync::Arc<crate::testing::StoreHooks>>;
#[cfg(not(feature = "testing"))]
type Hooks = NoHooks;

/// Without the test harness, statements run as they are.
#[cfg(not(feature = "testing"))]
#[derive(Clone, Debug, Default)]
struct NoHooks;

/// A write transaction on a [`Database`].
#[derive(Debug)]
pub(crate) struct Tx {
    /// `None` once committed or rolled back.
    inner: Option<TxInner>,
    hooks: Hooks,
    /// SQLite's turn to write, held until the transaction ended.
    turn: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Tx {
    /// A transaction dropped unfinished (an error on the way, a cancelled caller) would roll
    /// back later, on its connection's thread, still holding SQLite's lock: its turn is given
    /// back once that rollback ran, so the next writer never finds the lock taken.
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let turn = self.turn.take();
        // Without a turn (PostgreSQL) the transaction rolls back as it drops, on a task of this
        // runtime, before its connection is used again: not on one that may stall.
        if turn.is_none() && !caller_may_stall() {
            return;
        }
        // Not on a caller's runtime that may not run it: every later write would wait.
        if let Some(runtime) = super::own_thread::lasting_runtime() {
            runtime.spawn(async move {
                let _ = inner.rollback().await;
                drop(turn);
            });
        }
    }
}

impl TxInner {
    async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(tx) => tx.rollback().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(tx) => tx.rollback().await,
        }
    }
}

#[derive(Debug)]
enum TxInner {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(KeptTransaction),
}

/// A row read back, whichever the backend; columns are read by name.
#[derive(Debug)]
pub(crate) enum Row {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::sqlite::SqliteRow),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::postgres::PgRow),
}

/// A column type the store reads.
pub(crate) trait Column: Sized {
    #[cfg(feature = "sqlite")]
    fn from_sqlite(row: &sqlx::sqlite::SqliteRow, name: &str) -> Result<Self, sqlx::Error>;
    #[cfg(feature = "postgres")]
    fn from_postgres(row: &sqlx::postgres::PgRow, name: &str) -> Result<Self, sqlx::Error>;
}

/// Implements [`Column`] for a type both drivers decode: the two bodies are the same call on
/// each driver's row.
macro_rules! column {
    ($($ty:ty),*) => {$(
        impl Column for $ty {
            #[cfg(feature = "sqlite")]
            fn from_sqlite(row: &sqlx::sqlite::SqliteRow, name: &str) -> Result<Self, sqlx::Error> {
                row.try_get(name)
            }
            #[cfg(feature = "postgres")]
            fn from_postgres(row: &sqlx::postgres::PgRow, name: &str) -> Result<Self, sqlx::Error> {
                row.try_get(name)
            }
        }
    )*};
}

column!(String, Option<String>, i64, Option<i64>, i32, Vec<u8>);

impl Row {
    /// The value of column `name`.
    pub(crate) fn get<T: Column>(&self, name: &str) -> Result<T, Error> {
        let value = match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(row) => T::from_sqlite(row, name),
            #[cfg(feature = "postgres")]
            Self::Postgres(row) => T::from_postgres(row, name),
        };
        value.map_err(|error| Error::store(format!("column {name}: {error}")))
    }
}

impl Database {
    /// The SQLite pool `pool`.
    #[cfg(feature = "sqlite")]
    pub(crate) fn sqlite(pool: sqlx::SqlitePool) -> Self {
        Self {
            pool: Pool::Sqlite(pool),
            hooks: Hooks::default(),
            writer: Some(Writer::new()),
            #[cfg(feature = "postgres")]
            kept: std::sync::Arc::default(),
            #[cfg(feature = "postgres")]
            handler_transactions: None,
        }
    }

    /// The PostgreSQL pool `pool`.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(pool: sqlx::PgPool) -> Self {
        let size = pool.options().get_max_connections();
        let handler_transactions = usize::try_from(size.saturating_sub(2).max(1)).unwrap_or(1);
        Self {
            kept: std::sync::Arc::new(super::kept::KeptConnections::of_a_pool_of(size)),
            handler_transactions: Some(std::sync::Arc::new(tokio::sync::Semaphore::new(
                handler_transactions,
            ))),
            pool: Pool::Postgres(pool),
            hooks: Hooks::default(),
            writer: None,
        }
    }

    /// Where a node of this database is held ([`super::node_hold`]): `None` for a SQLite
    /// database in memory or in a temporary file, which no other process opens.
    pub(crate) async fn node_target(&self) -> Result<Option<super::node_hold::Target>, Error> {
        if caller_may_stall() {
            let db = self.clone();
            return off_a_runtime_that_may_stall(async move { db.node_target_here().await }).await;
        }
        self.node_target_here().await
    }

    /// [`node_target`](Self::node_target) on the caller's runtime.
    async fn node_target_here(&self) -> Result<Option<super::node_hold::Target>, Error> {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                // The file as SQLite opened it: absolute, links resolved, whatever its name.
                let file: String =
                    sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
                        .fetch_one(pool)
                        .await
                        .map_err(db_error)?;
                Ok((!file.is_empty()).then_some(super::node_hold::Target::File(file)))
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                // Asked of the pool's own session: its schema may come from a setting its
                // sessions make as they start, and its server by any name.
                let (instance, schema): (String, String) = sqlx::query_as(
                    "SELECT current_setting('port') || ' '
                         || (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint
                         || ' ' || (SELECT oid FROM pg_database
                                    WHERE datname = current_database()),
                            coalesce(current_schema(), '')",
                )
                .fetch_one(pool)
                .await
                .map_err(db_error)?;
                Ok(Some(super::node_hold::Target::Session(Box::new(
                    super::node_hold::Server {
                        options: (*pool.connect_options()).clone(),
                        instance,
                        schema,
                    },
                ))))
            }
        }
    }

    /// This database with the test harness's `hooks` on its statements.
    #[cfg(feature = "testing")]
    pub(crate) fn with_hooks(&self, hooks: std::sync::Arc<crate::testing::StoreHooks>) -> Self {
        Self {
            pool: self.pool.clone(),
            hooks: Some(hooks),
            writer: self.writer.clone(),
            #[cfg(feature = "postgres")]
            kept: self.kept.clone(),
            #[cfg(feature = "postgres")]
            handler_transactions: self.handler_transactions.clone(),
        }
    }

    /// The test harness's hooks on this database's statements.
    #[cfg(feature = "testing")]
    pub(crate) fn hooks(&self) -> Option<std::sync::Arc<crate::testing::StoreHooks>> {
        self.hooks.clone()
    }

    /// Stops a crashed runtime's statement, or fails it as a faulty store would.
    async fn before_statement(&self) -> Result<(), Error> {
        before_statement(&self.hooks, false).await
    }

    /// Passes `point` (a crash there never returns).
    pub(crate) async fn pass(&self, point: dacapo_actors::Failpoint, message_type: &str) {
        #[cfg(feature = "testing")]
        if let Some(hooks) = &self.hooks {
            hooks.pass(point, message_type).await;
        }
        #[cfg(not(feature = "testing"))]
        let _ = (point, message_type);
    }

    /// The turn to write, on SQLite; PostgreSQL's writers need none.
    pub(crate) async fn turn(&self) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        match &self.writer {
            Some(writer) => writer.turn().await.map(Some),
            None => Ok(None),
        }
    }

    /// The turn to write for a handler's own write on the runtime's pool, on SQLite: in the
    /// handlers' queue, so that the runtime's writes wait behind a few of them only.
    pub(crate) async fn handler_write_turn(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        match &self.writer {
            Some(writer) => writer.handler_write_turn().await.map(Some),
            None => Ok(None),
        }
    }

    /// The turn of a handler transaction on the runtime's pool: SQLite's turn to write, in the
    /// handlers' queue ([`handler_write_turn`](Self::handler_write_turn)); on PostgreSQL, a
    /// [`handler_slot`](Self::handler_slot).
    pub(crate) async fn handler_transaction_turn(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        match self.handler_slot().await? {
            Some(slot) => Ok(Some(slot)),
            None => self.handler_write_turn().await,
        }
    }

    /// On PostgreSQL, one of the runtime's connections that handler transactions, and handler
    /// connections taken from the runtime's pool, may hold between them (all but two, so the
    /// runtime's own statements always find one), waited for as long as the pool waits for a
    /// connection. `None` on SQLite, whose handlers take turns to write instead.
    pub(crate) async fn handler_slot(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        #[cfg(feature = "postgres")]
        if let (Some(slots), Pool::Postgres(pool)) = (&self.handler_transactions, &self.pool) {
            let wait = pool.options().get_acquire_timeout();
            let slot = std::sync::Arc::clone(slots).acquire_owned();
            return match tokio::time::timeout(wait, slot).await {
                Ok(Ok(slot)) => Ok(Some(slot)),
                Ok(Err(_)) => Err(Error::store("the handler transactions' slots are closed")),
                Err(_) => Err(Error::store(format!(
                    "no connection for a handler transaction or connection within {wait:?}: \
                     other handlers hold all the runtime's pool leaves them"
                ))),
            };
        }
        Ok(None)
    }

    /// The turn to write for a handler connection, and the connection parked with it: the
    /// handler's statements queue behind what the last handler left running on it. No turn
    /// and no connection on PostgreSQL.
    #[cfg(feature = "sqlite")]
    pub(crate) async fn handler_turn(
        &self,
    ) -> Result<
        (
            Option<tokio::sync::OwnedSemaphorePermit>,
            Option<super::Taken>,
        ),
        Error,
    > {
        match &self.writer {
            Some(writer) => {
                let turn = writer.handler_turn().await?;
                Ok((Some(turn), writer.parking.take().await?))
            }
            None => Ok((None, None)),
        }
    }

    /// Where a handler connection is parked with the turn, on SQLite.
    #[cfg(feature = "sqlite")]
    pub(crate) fn parking(&self) -> Option<&super::Parking> {
        self.writer.as_ref().map(|writer| &writer.parking)
    }

    /// How many times a statement is tried on connections whose session the server ended.
    fn tries(&self) -> u32 {
        let size = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => pool.options().get_max_connections(),
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => pool.options().get_max_connections(),
        };
        size.saturating_add(1)
    }

    /// Opens a write transaction: `BEGIN IMMEDIATE` on SQLite, which takes the write lock at
    /// once (a transaction that reads, then writes, would otherwise fail as busy).
    pub(crate) async fn begin(&self) -> Result<Tx, Error> {
        self.before_statement().await?;
        let turn = self.turn().await?;
        let inner = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) if caller_may_stall() => {
                let (pool, tries) = (pool.clone(), self.tries());
                TxInner::Sqlite(
                    off_a_runtime_that_may_stall(async move {
                        on_live_session(tries, || pool.begin_with("BEGIN IMMEDIATE"))
                            .await
                            .map_err(db_error)
                    })
                    .await?,
                )
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => TxInner::Sqlite(
                on_live_session(self.tries(), || pool.begin_with("BEGIN IMMEDIATE"))
                    .await
                    .map_err(db_error)?,
            ),
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) if caller_may_stall() => {
                let (pool, kept, tries) = (pool.clone(), self.kept.clone(), self.tries());
                TxInner::Postgres(
                    off_a_runtime_that_may_stall(async move {
                        KeptTransaction::begin(&kept, &pool, tries)
                            .await
                            .map_err(db_error)
                    })
                    .await?,
                )
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => TxInner::Postgres(
                KeptTransaction::begin(&self.kept, pool, self.tries())
                    .await
                    .map_err(db_error)?,
            ),
        };
        Ok(Tx {
            inner: Some(inner),
            hooks: self.hooks.clone(),
            turn,
        })
    }

    /// Runs `sql` on a connection of the pool, committed on its own; how many rows it changed.
    pub(crate) async fn execute(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<u64, Error> {
        self.execute_made(sql, || values).await
    }

    /// [`execute`](Self::execute) with its values made once the statement has its turn to
    /// write (SQLite's): a time among them is the time it writes, not the time it began to
    /// wait behind other writes.
    pub(crate) async fn execute_made<'v, V: AsRef<[Value<'v>]>>(
        &self,
        sql: &'static str,
        make: impl FnOnce() -> V,
    ) -> Result<u64, Error> {
        // Moved into SQLite's commit; PostgreSQL's runs in place, within its scope.
        #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
        let committing = before_commit(&self.hooks, false).await?;
        // SQLite's alone: PostgreSQL has no turn to hold.
        #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
        let turn = self.turn().await?;
        let made = make();
        let values = made.as_ref();
        let done = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                let (pool, tries, owned) = (pool.clone(), self.tries(), OwnedValue::all_of(values));
                to_the_end(turn, async move {
                    // Counted until the commit ended, even if the caller stopped waiting (not
                    // if the runtime it runs on stops: see `Committing`).
                    let _committing = committing;
                    let values: Vec<Value<'_>> = owned.iter().map(OwnedValue::value).collect();
                    on_live_session(tries, || bind(sqlx::query(sql), &values).execute(&pool))
                        .await
                        .map(|done| done.rows_affected())
                })
                .await?
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) if caller_may_stall() => {
                let (db, pool, owned) = (self.clone(), pool.clone(), OwnedValue::all_of(values));
                return off_a_runtime_that_may_stall(async move {
                    // Counted until the statement ended, even if the caller stopped waiting.
                    let _committing = committing;
                    let values: Vec<Value<'_>> = owned.iter().map(OwnedValue::value).collect();
                    on_a_kept_connection!(db.kept, &pool, db.tries(), |connection| {
                        bind(sqlx::query(sql), &values).execute(connection)
                    })
                    .map(|done| done.rows_affected())
                    .map_err(db_error)
                })
                .await;
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                on_a_kept_connection!(self.kept, pool, self.tries(), |connection| {
                    bind(sqlx::query(sql), values).execute(connection)
                })
                .map(|done| done.rows_affected())
            }
        };
        done.map_err(db_error)
    }

    /// [`execute`](Self::execute) for a statement built at run time from trusted parts.
    pub(crate) async fn execute_built(
        &self,
        sql: String,
        values: &[Value<'_>],
    ) -> Result<u64, Error> {
        // Moved into SQLite's commit; PostgreSQL's runs in place, within its scope.
        #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
        let committing = before_commit(&self.hooks, false).await?;
        // SQLite's alone: PostgreSQL has no turn to hold.
        #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
        let turn = self.turn().await?;
        let done = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                let (sql, values) = positional(&sql, values)?;
                let (pool, tries, owned) =
                    (pool.clone(), self.tries(), OwnedValue::all_of(&values));
                to_the_end(turn, async move {
                    let _committing = committing;
                    let values: Vec<Value<'_>> = owned.iter().map(OwnedValue::value).collect();
                    on_live_session(tries, || {
                        bind(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), &values).execute(&pool)
                    })
                    .await
                    .map(|done| done.rows_affected())
                })
                .await?
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) if caller_may_stall() => {
                let (db, pool, owned) = (self.clone(), pool.clone(), OwnedValue::all_of(values));
                return off_a_runtime_that_may_stall(async move {
                    let _committing = committing;
                    let values: Vec<Value<'_>> = owned.iter().map(OwnedValue::value).collect();
                    on_a_kept_connection!(db.kept, &pool, db.tries(), |connection| {
                        bind(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), &values)
                            .execute(connection)
                    })
                    .map(|done| done.rows_affected())
                    .map_err(db_error)
                })
                .await;
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                on_a_kept_connection!(self.kept, pool, self.tries(), |connection| {
                    bind(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), values).execute(connection)
                })
                .map(|done| done.rows_affected())
            }
        };
        done.map_err(db_error)
    }

    /// Every row `sql` answers.
    pub(crate) async fn fetch_all(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Vec<Row>, Error> {
        self.before_statement().await?;
        here_or_off_a_runtime_that_may_stall!(self, fetch_all_here, sql, values)
    }

    /// [`fetch_all`](Self::fetch_all) on the caller's runtime.
    async fn fetch_all_here(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Vec<Row>, Error> {
        let rows = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => on_live_session(self.tries(), || {
                bind(sqlx::query(sql), values).fetch_all(pool)
            })
            .await
            .map(|rows| rows.into_iter().map(Row::Sqlite).collect()),
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                on_a_kept_connection!(self.kept, pool, self.tries(), |connection| {
                    bind(sqlx::query(sql), values).fetch_all(connection)
                })
                .map(|rows| rows.into_iter().map(Row::Postgres).collect())
            }
        };
        rows.map_err(db_error)
    }

    /// The row `sql` answers, if any.
    pub(crate) async fn fetch_optional(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Option<Row>, Error> {
        self.before_statement().await?;
        here_or_off_a_runtime_that_may_stall!(self, fetch_optional_here, sql, values)
    }

    /// [`fetch_optional`](Self::fetch_optional) on the caller's runtime.
    async fn fetch_optional_here(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Option<Row>, Error> {
        let row = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => on_live_session(self.tries(), || {
                bind(sqlx::query(sql), values).fetch_optional(pool)
            })
            .await
            .map(|row| row.map(Row::Sqlite)),
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                on_a_kept_connection!(self.kept, pool, self.tries(), |connection| {
                    bind(sqlx::query(sql), values).fetch_optional(connection)
                })
                .map(|row| row.map(Row::Postgres))
            }
        };
        row.map_err(db_error)
    }

    /// The one row `sql` answers.
    pub(crate) async fn fetch_one(
        &self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Row, Error> {
        self.fetch_optional(sql, values)
            .await?
            .ok_or_else(|| Error::store(format!("no row answered: {sql}")))
    }
}

impl Tx {
    /// Runs `sql` in the transaction; how many rows it changed.
    pub(crate) async fn execute(
        &mut self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<u64, Error> {
        before_statement(&self.hooks, true).await?;
        let done = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => bind(sqlx::query(sql), values)
                .execute(&mut **tx)
                .await
                .map(|done| done.rows_affected()),
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => bind(sqlx::query(sql), values)
                .execute(tx.connection())
                .await
                .map(|done| done.rows_affected()),
        };
        done.map_err(db_error)
    }

    /// Runs a script of several statements (a migration) in the transaction.
    pub(crate) async fn execute_script(&mut self, script: &'static str) -> Result<(), Error> {
        before_statement(&self.hooks, true).await?;
        let done = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => sqlx::raw_sql(script).execute(&mut **tx).await.map(drop),
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => sqlx::raw_sql(script)
                .execute(tx.connection())
                .await
                .map(drop),
        };
        done.map_err(db_error)
    }

    /// Every row `sql` answers in the transaction.
    pub(crate) async fn fetch_all(
        &mut self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Vec<Row>, Error> {
        before_statement(&self.hooks, true).await?;
        let rows = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => bind(sqlx::query(sql), values)
                .fetch_all(&mut **tx)
                .await
                .map(|rows| rows.into_iter().map(Row::Sqlite).collect()),
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => bind(sqlx::query(sql), values)
                .fetch_all(tx.connection())
                .await
                .map(|rows| rows.into_iter().map(Row::Postgres).collect()),
        };
        rows.map_err(db_error)
    }

    /// [`fetch_all`](Self::fetch_all) for a statement built at run time from trusted parts.
    pub(crate) async fn fetch_all_built(
        &mut self,
        sql: String,
        values: &[Value<'_>],
    ) -> Result<Vec<Row>, Error> {
        before_statement(&self.hooks, true).await?;
        let rows = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => {
                let (sql, values) = positional(&sql, values)?;
                bind(sqlx::query(sqlx::AssertSqlSafe(sql)), &values)
                    .fetch_all(&mut **tx)
                    .await
                    .map(|rows| rows.into_iter().map(Row::Sqlite).collect())
            }
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => bind(sqlx::query(sqlx::AssertSqlSafe(sql)), values)
                .fetch_all(tx.connection())
                .await
                .map(|rows| rows.into_iter().map(Row::Postgres).collect()),
        };
        rows.map_err(db_error)
    }

    /// [`execute`](Self::execute) for a statement built at run time from trusted parts.
    pub(crate) async fn execute_built(
        &mut self,
        sql: String,
        values: &[Value<'_>],
    ) -> Result<u64, Error> {
        before_statement(&self.hooks, true).await?;
        let done = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => {
                let (sql, values) = positional(&sql, values)?;
                bind(sqlx::query(sqlx::AssertSqlSafe(sql)), &values)
                    .execute(&mut **tx)
                    .await
                    .map(|done| done.rows_affected())
            }
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => bind(sqlx::query(sqlx::AssertSqlSafe(sql)), values)
                .execute(tx.connection())
                .await
                .map(|done| done.rows_affected()),
        };
        done.map_err(db_error)
    }

    /// The row `sql` answers in the transaction, if any.
    pub(crate) async fn fetch_optional(
        &mut self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Option<Row>, Error> {
        before_statement(&self.hooks, true).await?;
        let row = match self.open()? {
            #[cfg(feature = "sqlite")]
            TxInner::Sqlite(tx) => bind(sqlx::query(sql), values)
                .fetch_optional(&mut **tx)
                .await
                .map(|row| row.map(Row::Sqlite)),
            #[cfg(feature = "postgres")]
            TxInner::Postgres(tx) => bind(sqlx::query(sql), values)
                .fetch_optional(tx.connection())
                .await
                .map(|row| row.map(Row::Postgres)),
        };
        row.map_err(db_error)
    }

    /// The one row `sql` answers in the transaction.
    pub(crate) async fn fetch_one(
        &mut self,
        sql: &'static str,
        values: &[Value<'_>],
    ) -> Result<Row, Error> {
        self.fetch_optional(sql, values)
            .await?
            .ok_or_else(|| Error::store(format!("no row answered: {sql}")))
    }

    /// The transaction, while it is open.
    fn open(&mut self) -> Result<&mut TxInner, Error> {
        self.inner
            .as_mut()
            .ok_or_else(|| Error::store("the transaction already ended"))
    }

    pub(crate) async fn commit(mut self) -> Result<(), Error> {
        let committing = before_commit(&self.hooks, true).await?;
        let inner = self
            .inner
            .take()
            .ok_or_else(|| Error::store("the transaction already ended"))?;
        // The turn goes once the commit returned. One that failed as busy would leave the
        // transaction open until sqlx's rollback ran; under `BEGIN IMMEDIATE` in WAL mode, which
        // holds the lock from the start, it does not fail so, and other errors roll back.
        to_the_end(self.turn.take(), async move {
            let _committing = committing;
            match inner {
                #[cfg(feature = "sqlite")]
                TxInner::Sqlite(tx) => tx.commit().await,
                #[cfg(feature = "postgres")]
                TxInner::Postgres(tx) => tx.commit().await,
            }
        })
        .await?
        .map_err(db_error)
    }

    pub(crate) async fn rollback(mut self) -> Result<(), Error> {
        let inner = self
            .inner
            .take()
            .ok_or_else(|| Error::store("the transaction already ended"))?;
        to_the_end(self.turn.take(), inner.rollback())
            .await?
            .map_err(db_error)
    }
}

#[cfg(feature = "testing")]
async fn before_statement(hooks: &Hooks, in_transaction: bool) -> Result<(), Error> {
    match hooks {
        Some(hooks) => hooks.before_statement(in_transaction).await,
        None => Ok(()),
    }
}

#[cfg(not(feature = "testing"))]
#[allow(clippy::unused_async)]
async fn before_statement(_: &Hooks, _: bool) -> Result<(), Error> {
    Ok(())
}

/// A commit under way, for the test harness to let end before a restart.
#[cfg(feature = "testing")]
type Committing = Option<crate::testing::Committing>;
#[cfg(not(feature = "testing"))]
type Committing = NoHooks;

#[cfg(feature = "testing")]
async fn before_commit(hooks: &Hooks, transaction: bool) -> Result<Committing, Error> {
    match hooks {
        Some(hooks) => hooks.before_commit(transaction).await.map(Some),
        None => Ok(None),
    }
}

#[cfg(not(feature = "testing"))]
#[allow(clippy::unused_async)]
async fn before_commit(_: &Hooks, _: bool) -> Result<Committing, Error> {
    Ok(NoHooks)
}

/// What tells the backends apart, chosen by the pool's kind.
impl Database {
    /// The statement that claims unsettled rows for this node: SQLite's single writer needs no
    /// row locks; PostgreSQL skips the rows another node is claiming at this moment.
    pub(crate) fn claim_statement(&self) -> &'static str {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => super::statements::CLAIM_SQLITE,
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => super::statements::CLAIM_POSTGRES,
        }
    }

    /// Statements that make nodes starting together apply schema changes one at a time.
    pub(crate) fn lock_migrations(&self) -> &'static [&'static str] {
        match &self.pool {
            // `BEGIN IMMEDIATE` already holds the database's one write lock.
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => &[],
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => &[super::statements::LOCK_MIGRATIONS_POSTGRES],
        }
    }

    /// The query that tells whether the claims table has its `node` column.
    pub(crate) fn claims_have_node(&self) -> &'static str {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => super::statements::CLAIMS_HAVE_NODE_SQLITE,
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => super::statements::CLAIMS_HAVE_NODE_POSTGRES,
        }
    }

    /// The query that tells whether the schema's migrations table exists.
    pub(crate) fn has_schema(&self) -> &'static str {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => super::statements::HAS_SCHEMA_SQLITE,
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => super::statements::HAS_SCHEMA_POSTGRES,
        }
    }

    /// This backend's schema changes.
    pub(crate) fn migrations(&self) -> &'static [super::Migration] {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => crate::store::sqlite::MIGRATIONS,
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => crate::store::postgres::MIGRATIONS,
        }
    }

    /// Signals of enlists made by other processes: PostgreSQL's `NOTIFY`; SQLite has none, so
    /// its relay polls (local enlists wake it directly).
    pub(crate) fn enlisted_signals(
        &self,
    ) -> Option<futures::stream::BoxStream<'static, Result<(), Error>>> {
        match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => None,
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => Some(crate::store::postgres::enlisted_signals(pool.clone())),
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::{Value, positional};

    fn texts(values: &[Value<'_>]) -> Vec<String> {
        values.iter().map(|value| format!("{value:?}")).collect()
    }

    #[test]
    fn parameters_become_question_marks_with_their_values_in_the_order_they_stand() {
        let values = [Value::Int64(1), Value::Text("a"), Value::Text("b")];
        let (sql, ordered) = positional(
            "UPDATE t SET x = $1 WHERE y = $3 AND z IN ($2, $3)",
            &values,
        )
        .unwrap();
        assert_eq!(sql, "UPDATE t SET x = ? WHERE y = ? AND z IN (?, ?)");
        assert_eq!(
            texts(&ordered),
            texts(&[values[0], values[2], values[1], values[2]])
        );
    }

    #[test]
    fn a_dollar_without_a_number_is_left_as_it_is() {
        let (sql, ordered) = positional("SELECT $1 || '$'", &[Value::Int32(7)]).unwrap();
        assert_eq!(sql, "SELECT ? || '$'");
        assert_eq!(ordered.len(), 1);
    }

    #[test]
    fn a_dollar_number_inside_a_literal_is_text() {
        let values = [Value::Int32(7), Value::Int32(8)];
        let (sql, ordered) = positional("SELECT '$2 it''s $1', $2 WHERE x = $1", &values).unwrap();
        assert_eq!(sql, "SELECT '$2 it''s $1', ? WHERE x = ?");
        assert_eq!(texts(&ordered), texts(&[values[1], values[0]]));
    }

    #[test]
    fn a_quoted_name_is_a_name_whatever_it_holds() {
        let values = [Value::Int32(7)];
        let (sql, ordered) =
            positional(r#"SELECT "it's $1" FROM t WHERE x = $1"#, &values).unwrap();
        assert_eq!(sql, r#"SELECT "it's $1" FROM t WHERE x = ?"#);
        assert_eq!(ordered.len(), 1);
    }

    #[test]
    fn a_parameter_without_a_value_is_an_error() {
        let error = positional("SELECT $2", &[Value::Int32(7)]).unwrap_err();
        assert!(error.to_string().contains("$2"), "{error}");
        assert!(positional("SELECT $0", &[Value::Int32(7)]).is_err());
    }

    /// A writer of the runtime's asking for the turn while 200 handler connections wait for
    /// it gets it behind at most [`HANDLERS_AHEAD`](super::HANDLERS_AHEAD) of them, not
    /// behind all 200.
    #[cfg(feature = "sqlite")]
    #[tokio::test(flavor = "current_thread")]
    async fn a_runtime_writer_waits_behind_a_few_handler_connections_not_all() {
        use std::sync::{Arc, Mutex};

        const RUNTIME: usize = usize::MAX;
        let writer = super::Writer::new();
        let held = writer.turn().await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let turn_taken = |n: usize, runtime: bool| {
            let (writer, order) = (writer.clone(), Arc::clone(&order));
            tokio::spawn(async move {
                let _turn = if runtime {
                    writer.turn().await.unwrap()
                } else {
                    writer.handler_turn().await.unwrap()
                };
                order.lock().unwrap().push(n);
            })
        };
        let mut tasks: Vec<_> = (0..200).map(|n| turn_taken(n, false)).collect();
        // On this one thread, a yield lets every spawned task run up to its wait.
        tokio::task::yield_now().await;
        tasks.push(turn_taken(RUNTIME, true));
        tokio::task::yield_now().await;
        drop(held);
        for task in tasks {
            task.await.unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 201);
        let place = order.iter().position(|&n| n == RUNTIME).unwrap();
        assert!(
            place <= super::HANDLERS_AHEAD,
            "behind {place} handler connections"
        );
    }

    /// A statement whose caller stopped waiting still runs on its connection's thread, holding
    /// SQLite's lock: its turn goes only once it ended, so the next writer — on another
    /// connection, with SQLite's busy timeout at zero — never finds the database locked.
    #[cfg(feature = "sqlite")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_whose_caller_stopped_waiting_keeps_the_turn_until_it_ended() {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

        /// About a second of SQLite's time before its row is written.
        const SLOW_INSERT: &str = "INSERT INTO rows (n) SELECT max(x) FROM \
            (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3000000) \
             SELECT x FROM c)";
        let directory =
            std::env::temp_dir().join(format!("dacapo-turn-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&directory).unwrap();
        let options = SqliteConnectOptions::new()
            .filename(directory.join("db.sqlite"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::ZERO);
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .unwrap();
        let db = super::Database::sqlite(pool.clone());
        db.execute("CREATE TABLE rows (n INTEGER)", &[])
            .await
            .unwrap();

        let given_up = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            db.execute(SLOW_INSERT, &[]),
        )
        .await;
        assert!(given_up.is_err(), "the insert is slow");
        db.execute("INSERT INTO rows (n) VALUES ($1)", &[Value::Int64(7)])
            .await
            .expect("the next write waited for the turn, not SQLite's lock");

        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rows")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 2, "the insert given up on ran to its end");
        pool.close().await;
        let _ = std::fs::remove_dir_all(&directory);
    }
}
