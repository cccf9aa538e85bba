//! One live process per node id on a database. A store under a node id resumes that id's
//! unsettled deliveries at start and sweeps up those nothing in its process runs: two live
//! processes under one id would each take the other's deliveries for their own and run them
//! twice. So a store named with [`node_id`](super::SqlStore::node_id) holds its node before
//! its first write under it — a lock on a file next to the SQLite file, an advisory lock in a
//! PostgreSQL session of its own — which the system lets go when the process dies, `kill -9`
//! included, so a restarted process takes its node back at once. Stores of one process share
//! a node's hold: the process is the node.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use dacapo_actors::Error;

/// How often a process waiting for another's node tries again.
const RETRY: Duration = Duration::from_millis(50);

/// How often the session holding a node on PostgreSQL is checked: a session the server or
/// the network lost lets its lock go, and the store takes it again before its next write.
#[cfg(feature = "postgres")]
const CHECK_SESSION: Duration = Duration::from_secs(2);

/// How long past its wait a take may spend connecting and asking, on a slow server.
#[cfg(feature = "postgres")]
const SETTLE: Duration = Duration::from_secs(5);

/// A deadline that never comes in practice.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The advisory lock of a node (`$1`), in the schema the store's tables are in (`$2`).
#[cfg(feature = "postgres")]
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(hashtextextended($1 || ':' || $2, 0))";

/// Where a node is held.
pub(crate) enum Target {
    /// The lock file of the node, next to this SQLite file.
    #[cfg(feature = "sqlite")]
    File(String),
    /// A session of its own on this PostgreSQL server.
    #[cfg(feature = "postgres")]
    Session(Box<Server>),
}

/// A PostgreSQL database and schema as the store's pool finds them, however its URL spells
/// the server.
#[cfg(feature = "postgres")]
pub(crate) struct Server {
    /// How the lock's own session connects.
    pub(crate) options: sqlx::postgres::PgConnectOptions,
    /// The server's instance — its port and when it started, in microseconds since the epoch —
    /// and the database's oid: the same for `localhost` and `127.0.0.1`, and for two servers
    /// of one host, different.
    pub(crate) instance: String,
    /// The schema the store's tables are in, which the lock is taken in.
    pub(crate) schema: String,
}

impl Target {
    /// The database and the node, as this process's holds are found by: its parts quoted,
    /// so that no two of them run together into another's (a file path and a PostgreSQL
    /// instance never read alike).
    fn key(&self, node: &str) -> String {
        match self {
            #[cfg(feature = "sqlite")]
            Self::File(file) => format!("{:?}", ("sqlite", file, node)),
            #[cfg(feature = "postgres")]
            Self::Session(server) => {
                format!("{:?}", ("postgres", &server.instance, &server.schema, node))
            }
        }
    }

    /// The database, to name it: the SQLite file, or the PostgreSQL server, database and
    /// schema (no credentials).
    fn place(&self) -> String {
        match self {
            #[cfg(feature = "sqlite")]
            Self::File(file) => file.clone(),
            #[cfg(feature = "postgres")]
            Self::Session(server) => {
                let database = format!(
                    "postgres://{}:{}/{}",
                    server.options.get_host(),
                    server.options.get_port(),
                    server.options.get_database().unwrap_or_default(),
                );
                if server.schema.is_empty() {
                    database
                } else {
                    format!("{database} (schema {})", server.schema)
                }
            }
        }
    }
}

/// A store's hold on its node: not taken yet, not needed (a database no other process
/// opens), or taken. Shared by the store's clones.
#[derive(Debug, Default)]
pub(crate) struct NodeHold {
    state: Mutex<State>,
    /// One take at a time for this store.
    taking: tokio::sync::Mutex<()>,
    /// The last take refused: when it ended, where, after how long.
    refused: Mutex<Option<(Instant, String, Duration)>>,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Untaken,
    Unneeded,
    Held(Arc<Held>),
}

impl NodeHold {
    /// Holds `node` on the database `target` names (`None`: nothing to hold), unless held
    /// already; waits up to `wait` for another process that holds it.
    ///
    /// # Errors
    ///
    /// [`Error::NodeHeld`] when another live process still holds the node after `wait`;
    /// [`Error::Store`] when the lock cannot be asked for.
    pub(crate) async fn ensure(
        &self,
        node: &str,
        wait: Duration,
        target: impl Future<Output = Result<Option<Target>, Error>> + Send,
    ) -> Result<(), Error> {
        if self.is_settled() {
            return Ok(());
        }
        let asked = Instant::now();
        let _taking = self.taking.lock().await;
        if self.is_settled() {
            return Ok(());
        }
        // Writes that queued behind a take that was refused share its answer, instead of
        // each waiting as long again.
        if let Some((at, place, waited)) = &*self.refused.lock().unwrap_or_else(|e| e.into_inner())
            && *at >= asked
        {
            return Err(Error::NodeHeld {
                node: node.to_owned(),
                at: place.clone(),
                waited: *waited,
            });
        }
        let state = match target.await? {
            None => State::Unneeded,
            Some(target) => match take(&target, node, wait).await {
                Ok(held) => State::Held(held),
                Err(error) => {
                    if let Error::NodeHeld { at, waited, .. } = &error {
                        *self.refused.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((Instant::now(), at.clone(), *waited));
                    }
                    return Err(error);
                }
            },
        };
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
        Ok(())
    }

    /// Runs `first` once for the process's hold of this node, whichever of its stores asks
    /// first — the work of a run that begins: what an earlier run under the node left, the
    /// stores of this one must not each undo again behind the others' backs. Without a hold
    /// (a database no other process opens), once per asking.
    ///
    /// # Errors
    ///
    /// `first`'s error; it is run again on the next asking.
    pub(crate) async fn once_per_hold<F, Fut>(&self, first: F) -> Result<(), Error>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let held = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Held(held) => Some(Arc::clone(held)),
            State::Untaken | State::Unneeded => None,
        };
        match held {
            Some(held) => held.begun.get_or_try_init(first).await.map(|_| ()),
            None => first().await,
        }
    }

    fn is_settled(&self) -> bool {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Untaken => false,
            State::Unneeded => true,
            State::Held(held) => !held.lost.load(Ordering::SeqCst),
        }
    }
}

/// A node held by this process, let go when the last store holding it is dropped.
#[derive(Debug)]
struct Held {
    /// Set when the session holding it on PostgreSQL was lost, and with it the lock.
    lost: Arc<AtomicBool>,
    /// Set once the run's first work was done ([`NodeHold::once_per_hold`]).
    begun: tokio::sync::OnceCell<()>,
    _lock: Lock,
}

#[derive(Debug)]
enum Lock {
    /// The locked file: closed, it is unlocked.
    #[cfg(feature = "sqlite")]
    File(#[allow(dead_code)] std::fs::File),
    /// Dropped, it stops the thread keeping the session, which closes it.
    #[cfg(feature = "postgres")]
    Session(#[allow(dead_code)] tokio::sync::oneshot::Sender<()>),
}

/// This process's holds, by [`Target::key`]: each behind a lock of its own, so that two
/// stores of the process taking one node at once do not wait for each other, and a node held
/// elsewhere keeps no other waiting.
type Slot = Arc<tokio::sync::Mutex<Weak<Held>>>;
static HOLDS: Mutex<Option<HashMap<String, Slot>>> = Mutex::new(None);

/// The process's hold of `node` on `target`, taken now unless the process holds it.
async fn take(target: &Target, node: &str, wait: Duration) -> Result<Arc<Held>, Error> {
    let key = target.key(node);
    let slot = {
        let mut holds = HOLDS.lock().unwrap_or_else(|e| e.into_inner());
        let holds = holds.get_or_insert_with(HashMap::new);
        // Slots nobody waits on and whose hold is gone.
        holds.retain(|_, slot| {
            Arc::strong_count(slot) > 1 || slot.try_lock().is_ok_and(|held| held.strong_count() > 0)
        });
        Arc::clone(holds.entry(key).or_default())
    };
    let mut slot = slot.lock().await;
    if let Some(held) = slot
        .upgrade()
        .filter(|held| !held.lost.load(Ordering::SeqCst))
    {
        return Ok(held);
    }
    let now = Instant::now();
    // A node timeout too long to add to the clock waits as if for ever.
    let deadline = now.checked_add(wait).unwrap_or_else(|| now + FAR_FUTURE);
    let lock = match target {
        #[cfg(feature = "sqlite")]
        Target::File(file) => lock_file(file, node, deadline).await,
        #[cfg(feature = "postgres")]
        Target::Session(server) => {
            lock_session(
                server.options.clone(),
                node,
                server.schema.clone(),
                deadline,
            )
            .await
        }
    };
    let (lock, lost) = lock?.ok_or_else(|| Error::NodeHeld {
        node: node.to_owned(),
        at: target.place(),
        waited: wait,
    })?;
    let held = Arc::new(Held {
        lost,
        begun: tokio::sync::OnceCell::new(),
        _lock: lock,
    });
    *slot = Arc::downgrade(&held);
    Ok(held)
}

/// The file `<database>.node-<uuid of node>.lock`, locked (`None` while another process
/// still locks it at `deadline`). The node's name goes in as a name-based UUID, so that any
/// name makes a valid file name.
#[cfg(feature = "sqlite")]
async fn lock_file(
    database: &str,
    node: &str,
    deadline: Instant,
) -> Result<Option<(Lock, Arc<AtomicBool>)>, Error> {
    let name = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, node.as_bytes()).simple();
    let path = format!("{database}.node-{name}.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|error| Error::store(format!("cannot open the node lock {path}: {error}")))?;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Some((Lock::File(file), Arc::default()))),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                tokio::time::sleep(RETRY).await;
            }
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(error)) => {
                return Err(Error::store(format!(
                    "cannot lock the node lock {path}: {error}"
                )));
            }
        }
    }
}

/// An advisory lock on `node`, in a session kept by a thread of its own (so that it outlives
/// whichever tokio runtime asked for it), checked every [`CHECK_SESSION`]; `None` while
/// another session still holds it at `deadline`.
#[cfg(feature = "postgres")]
async fn lock_session(
    options: sqlx::postgres::PgConnectOptions,
    node: &str,
    schema: String,
    deadline: Instant,
) -> Result<Option<(Lock, Arc<AtomicBool>)>, Error> {
    let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let lost = Arc::new(AtomicBool::new(false));
    let key = format!("dacapo.node:{node}");
    let keeper_lost = Arc::clone(&lost);
    super::own_thread::spawn("dacapo-node-hold", move |runtime| match runtime {
        Ok(runtime) => runtime.block_on(keep_session(
            options,
            (key, schema),
            deadline,
            taken_tx,
            stop_rx,
            keeper_lost,
        )),
        Err(error) => {
            let _ = taken_tx.send(Err(Error::store(error)));
        }
    })
    .map_err(Error::store)?;
    let taken = taken_rx
        .await
        .map_err(|_| Error::store("the thread taking the node's lock ended"))??;
    Ok(taken.then(|| (Lock::Session(stop_tx), lost)))
}

/// Takes the lock (telling `taken` whether it did by `deadline`), then keeps its session
/// until `stop` or until the session is lost, which `lost` tells.
#[cfg(feature = "postgres")]
async fn keep_session(
    options: sqlx::postgres::PgConnectOptions,
    (key, schema): (String, String),
    deadline: Instant,
    taken: tokio::sync::oneshot::Sender<Result<bool, Error>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    lost: Arc<AtomicBool>,
) {
    use sqlx::Connection;
    let mut session = match locked_session(&options, (&key, &schema), deadline, &taken).await {
        Ok(Some(session)) => session,
        Ok(None) => {
            let _ = taken.send(Ok(false));
            return;
        }
        Err(error) => {
            let _ = taken.send(Err(error));
            return;
        }
    };
    if taken.send(Ok(true)).is_err() {
        // Nobody waits for it any more: let it go.
        let _ = session.close().await;
        return;
    }
    // A host that vanished lets its lock go within about 15 s rather than after the system's
    // keepalive of hours: the server gives up on this session once it stops answering.
    for setting in [
        "SET tcp_keepalives_idle = 5",
        "SET tcp_keepalives_interval = 2",
        "SET tcp_keepalives_count = 3",
        "SET tcp_user_timeout = 10000",
    ] {
        if let Err(error) = sqlx::query(setting).execute(&mut session).await {
            tracing::debug!(%error, setting, "a keepalive setting of the node's session");
        }
    }
    loop {
        tokio::select! {
            _ = &mut stop => break,
            () = tokio::time::sleep(CHECK_SESSION) => {
                let alive = tokio::time::timeout(CHECK_SESSION, session.ping()).await;
                if !matches!(alive, Ok(Ok(()))) {
                    tracing::warn!(
                        lock = %key,
                        "the session holding this node was lost; the node is taken again \
                         before its next write"
                    );
                    lost.store(true, Ordering::SeqCst);
                    return;
                }
            }
        }
    }
    let _ = session.close().await;
}

/// A session holding the advisory lock of `key` in `schema`; `None` when another session still holds it
/// at `deadline`, or when nobody waits for it any more. Neither a server that never answers
/// nor a slow one keeps the caller long past its wait.
#[cfg(feature = "postgres")]
async fn locked_session(
    options: &sqlx::postgres::PgConnectOptions,
    (key, schema): (&str, &str),
    deadline: Instant,
    taken: &tokio::sync::oneshot::Sender<Result<bool, Error>>,
) -> Result<Option<sqlx::PgConnection>, Error> {
    use sqlx::Connection;
    let late = |_| Error::store("the PostgreSQL server did not answer the node's lock in time");
    let wait_until = tokio::time::Instant::from_std(deadline);
    let give_up = wait_until + SETTLE;
    let mut session = tokio::time::timeout_at(give_up, sqlx::PgConnection::connect_with(options))
        .await
        .map_err(late)?
        .map_err(Error::store)?;
    loop {
        if taken.is_closed() {
            let _ = session.close().await;
            return Ok(None);
        }
        // Advisory locks are the database's: the schema tells apart services sharing one. It
        // is the pool's, which may set it as its sessions start, where this one does not.
        let locked = tokio::time::timeout_at(
            give_up,
            sqlx::query_scalar::<_, bool>(TRY_LOCK)
                .bind(key)
                .bind(schema)
                .fetch_one(&mut session),
        )
        .await
        .map_err(late)?
        .map_err(Error::store)?;
        if locked {
            return Ok(Some(session));
        }
        if tokio::time::Instant::now() >= wait_until {
            let _ = session.close().await;
            return Ok(None);
        }
        tokio::time::sleep(RETRY).await;
    }
}
