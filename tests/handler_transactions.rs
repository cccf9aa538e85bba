//! Handler transactions on a real SQLite file and a real PostgreSQL server: a handler's rows,
//! its outbox rows, its deduplication claim and its completion record commit together, and a
//! rerun of the handler — whatever the retry scope — finds its work done instead of doing it
//! again.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dacapo::Envelope;
use dacapo::prelude::*;
use dacapo::testing::Recorder;
use dacapo::transaction::HandlerTransactions;
use dacapo::{DeadLetterReason, RetryScope};
use support::{MemberRemoved, WebhookQueued, member_removed};
use support_stores::Backend;

const WAIT: Duration = Duration::from_secs(20);

/// When the ledger handler fails, on its first attempt only.
#[derive(Clone, Copy, Debug, PartialEq)]
enum FailFirst {
    Never,
    /// After writing, before committing: the transaction rolls back.
    BeforeCommit,
    /// After committing: the work is done, yet the attempt fails and is retried.
    AfterCommit,
}

/// Writes a ledger row and enlists a `WebhookQueued`, in its own transaction.
#[derive(Clone)]
struct Ledger {
    backend: Backend,
    fail: FailFirst,
    runs: Arc<AtomicUsize>,
    opened: Arc<AtomicUsize>,
    /// The claim's `completed` flag as the handler saw it right after its commit.
    claim_completed_at_commit: Arc<Mutex<Vec<i64>>>,
}

impl Ledger {
    fn new(backend: Backend, fail: FailFirst) -> Self {
        Self {
            backend,
            fail,
            runs: Arc::default(),
            opened: Arc::default(),
            claim_completed_at_commit: Arc::default(),
        }
    }
}

const CLAIM_COMPLETED: &str = "SELECT completed FROM dacapo_deduplication";

macro_rules! ledger_work {
    ($self:ident, $ctx:ident, $db:ty) => {{
        let Some(mut tx) = $ctx.transaction::<$db>().await? else {
            return Ok(());
        };
        $self.opened.fetch_add(1, Ordering::SeqCst);
        let entry = dacapo::ids::derive(tx.message_id(), "ledger");
        sqlx::query("INSERT INTO ledger (entry) VALUES ($1)")
            .bind(&entry)
            .execute(&mut **tx)
            .await?;
        tx.enlist(&WebhookQueued { delivery_id: entry }).await?;
        let first = $ctx.attempt() == 1;
        if first && $self.fail == FailFirst::BeforeCommit {
            return Err("failed before committing".into());
        }
        tx.commit().await?;
        if $ctx.deduplication_claim().is_some() {
            let store = $ctx.store().and_then(|s| {
                s.downcast_ref::<dacapo::store::SqliteStore>()
                    .map(|s| s.pool().clone())
                    .map(either::Sqlite)
                    .or_else(|| {
                        s.downcast_ref::<dacapo::store::PostgresStore>()
                            .map(|s| either::Postgres(s.pool().clone()))
                    })
            });
            let completed = match store {
                Some(either::Sqlite(pool)) => {
                    sqlx::query_scalar(CLAIM_COMPLETED).fetch_one(&pool).await?
                }
                Some(either::Postgres(pool)) => {
                    sqlx::query_scalar::<_, i32>(CLAIM_COMPLETED)
                        .fetch_one(&pool)
                        .await? as i64
                }
                None => -1,
            };
            $self
                .claim_completed_at_commit
                .lock()
                .unwrap()
                .push(completed);
        }
        if first && $self.fail == FailFirst::AfterCommit {
            return Err("failed after committing".into());
        }
        Ok(())
    }};
}

mod either {
    pub(crate) enum Pool {
        Sqlite(sqlx::SqlitePool),
        Postgres(sqlx::PgPool),
    }
    pub(crate) use Pool::{Postgres, Sqlite};
}

impl Handler<MemberRemoved> for Ledger {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        match self.backend {
            Backend::Sqlite => ledger_work!(self, ctx, sqlx::Sqlite),
            Backend::Postgres => ledger_work!(self, ctx, sqlx::Postgres),
        }
    }
}

/// Publishes a `MemberRemoved` and waits until its delivery settles.
async fn tracked(runtime: &Runtime) -> dacapo::DeliveryReport {
    let envelope = runtime
        .envelope(&member_removed(), SendOptions::default())
        .unwrap();
    let report = runtime.receive_tracked(envelope).await.unwrap();
    tokio::time::timeout(WAIT, report).await.unwrap().unwrap()
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy {
        retry_limit: 3,
        min_retry_interval: Duration::from_millis(20),
        retry_interval_delta: Duration::from_millis(10),
        max_retry_interval: Duration::from_millis(100),
    }
}

struct Outcome {
    runs: usize,
    opened: usize,
    ledger_rows: i64,
    completions: i64,
    published: usize,
    attempts: u32,
    /// Outbox rows whose deduplication id came from the runtime's rule.
    ruled: i64,
}

async fn run_ledger(
    db: &support_stores::TestDatabase,
    fail: FailFirst,
    scope: RetryScope,
) -> Outcome {
    db.execute("CREATE TABLE IF NOT EXISTS ledger (entry TEXT NOT NULL)")
        .await;
    db.execute("DELETE FROM ledger").await;
    let ledger = Ledger::new(db.backend, fail);
    let queued = Recorder::<WebhookQueued>::new();
    let runtime = db
        .store(Runtime::builder(), "local", Duration::from_secs(30))
        .await
        .retry_policy(quick_retries())
        .retry_scope(scope)
        .relay_interval(Duration::from_millis(20))
        .deduplicate_by::<WebhookQueued>(|m| Some(format!("rule:{}", m.delivery_id)))
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("ledger", ledger.clone()))
        .module(Module::new("webhooks").handle_named::<WebhookQueued, _>("send", queued.clone()))
        .build()
        .unwrap();
    let report = tracked(&runtime).await;
    assert!(report.is_handled(), "{report:?}");
    tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
    let outcome = Outcome {
        runs: ledger.runs.load(Ordering::SeqCst),
        opened: ledger.opened.load(Ordering::SeqCst),
        ledger_rows: db.scalar("SELECT count(*) FROM ledger").await,
        completions: db
            .scalar("SELECT count(*) FROM dacapo_handler_completions")
            .await,
        published: queued.count(),
        attempts: report.attempts,
        ruled: db
            .scalar("SELECT count(*) FROM dacapo_outbox WHERE deduplication_id LIKE 'rule:%'")
            .await,
    };
    runtime.shutdown().await;
    db.execute("DELETE FROM dacapo_handler_completions").await;
    db.execute("DELETE FROM dacapo_inbox").await;
    db.execute("DELETE FROM dacapo_outbox").await;
    outcome
}

on_both_backends!(
    work_committed_by_an_earlier_attempt_is_not_done_again_sqlite,
    work_committed_by_an_earlier_attempt_is_not_done_again_postgres,
    |db| {
        for scope in [RetryScope::AllHandlers, RetryScope::FailedHandlers] {
            let outcome = run_ledger(&db, FailFirst::AfterCommit, scope).await;
            assert_eq!(
                outcome.attempts, 2,
                "{scope:?}: the failed attempt is retried"
            );
            assert_eq!(outcome.runs, 2, "{scope:?}: the handler runs again");
            assert_eq!(
                outcome.opened, 1,
                "{scope:?}: its transaction is not opened again"
            );
            assert_eq!(outcome.ledger_rows, 1, "{scope:?}: one row");
            assert_eq!(outcome.published, 1, "{scope:?}: one publish");
            assert_eq!(outcome.completions, 1, "{scope:?}: one completion record");
        }
    }
);

on_both_backends!(
    a_handler_that_fails_before_committing_leaves_nothing_behind_sqlite,
    a_handler_that_fails_before_committing_leaves_nothing_behind_postgres,
    |db| {
        let outcome = run_ledger(&db, FailFirst::BeforeCommit, RetryScope::AllHandlers).await;
        assert_eq!(outcome.attempts, 2);
        assert_eq!(
            outcome.opened, 2,
            "the rolled-back completion does not stop the retry"
        );
        assert_eq!(
            outcome.ledger_rows, 1,
            "the first attempt's row rolled back"
        );
        assert_eq!(outcome.published, 1, "its outbox row rolled back too");
        assert_eq!(outcome.completions, 1);
    }
);

on_both_backends!(
    a_handler_that_succeeds_first_time_commits_once_sqlite,
    a_handler_that_succeeds_first_time_commits_once_postgres,
    |db| {
        let outcome = run_ledger(&db, FailFirst::Never, RetryScope::AllHandlers).await;
        assert_eq!((outcome.attempts, outcome.runs, outcome.opened), (1, 1, 1));
        assert_eq!((outcome.ledger_rows, outcome.published), (1, 1));
        assert_eq!(
            outcome.ruled, 1,
            "enlisted with the runtime's deduplication rule"
        );
    }
);

on_both_backends!(
    a_deduplicated_handler_commits_its_claim_with_its_work_sqlite,
    a_deduplicated_handler_commits_its_claim_with_its_work_postgres,
    |db| {
        db.execute("CREATE TABLE ledger (entry TEXT NOT NULL)")
            .await;
        let ledger = Ledger::new(db.backend, FailFirst::AfterCommit);
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(quick_retries())
            .enable_deduplication()
            .module(
                Module::new("billing")
                    .handle_named::<MemberRemoved, _>("ledger", ledger.clone())
                    .deduplicate("ledger", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        let keyed = SendOptions::new().deduplication_id("charge-7");
        runtime
            .publish_with(&member_removed(), keyed.clone())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(
            *ledger.claim_completed_at_commit.lock().unwrap(),
            [1],
            "the claim was completed by the handler's own commit"
        );
        // The failure after the commit released nothing: the claim holds, and a second
        // message with the same intent is a duplicate.
        runtime
            .publish_with(&member_removed(), keyed)
            .await
            .unwrap();
        tokio::time::timeout(WAIT, runtime.idle()).await.unwrap();
        assert_eq!(db.scalar("SELECT count(*) FROM ledger").await, 1);
        assert_eq!(
            ledger.runs.load(Ordering::SeqCst),
            1,
            "the retry after the commit finds the claim completed, and so does the duplicate"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication WHERE completed = 1")
                .await,
            1
        );
        assert_eq!(
            runtime.stats().duplicate_intents,
            1,
            "the second message is a duplicate intent; the first one's retry is not"
        );
        runtime.shutdown().await;
    }
);

/// Opens a SQLite handler transaction, whatever the runtime's store.
struct OpensSqlite;

impl Handler<MemberRemoved> for OpensSqlite {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        ctx.transaction::<sqlx::Sqlite>().await?;
        Ok(())
    }
}

#[tokio::test]
async fn a_handler_transaction_needs_a_store_of_its_database() {
    let runtime = Runtime::builder()
        .retry_policy(RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        })
        .module(Module::new("billing").handle_named::<MemberRemoved, _>("ledger", OpensSqlite))
        .build()
        .unwrap();
    let report = tracked(&runtime).await;
    assert!(!report.is_handled());
    let letters = runtime.dead_letters().list().await.unwrap();
    let letter = &letters[0];
    assert_eq!(letter.envelope.id, report.envelope_id);
    assert_eq!(letter.reason, DeadLetterReason::RetriesExhausted);
    let failure = &letter.failures[0].failures[0].error;
    assert!(failure.contains("SqliteStore"), "{failure}");
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_detached_context_opens_no_transaction() {
    let error = MessageContext::detached()
        .transaction::<sqlx::Sqlite>()
        .await
        .unwrap_err();
    assert!(matches!(error, dacapo::Error::Detached), "{error}");
}

/// Records that handler `m/h` committed for `envelope`, `age` ago.
async fn completion(
    db: &support_stores::TestDatabase,
    envelope: uuid::Uuid,
    age: chrono::Duration,
) {
    let sql = "INSERT INTO dacapo_handler_completions (envelope_id, handler, completed_at) \
               VALUES ($1, 'm/h', $2)";
    let (id, at) = (
        envelope.simple().to_string(),
        (chrono::Utc::now() - age).timestamp_millis(),
    );
    match db.backend {
        Backend::Sqlite => {
            sqlx::query(sql)
                .bind(id)
                .bind(at)
                .execute(db.sqlite().await.pool())
                .await
                .unwrap();
        }
        Backend::Postgres => {
            sqlx::query(sql)
                .bind(id)
                .bind(at)
                .execute(db.postgres().await.pool())
                .await
                .unwrap();
        }
    }
}

on_both_backends!(
    completions_leave_with_their_settled_envelope_but_stay_while_it_may_run_again_sqlite,
    completions_leave_with_their_settled_envelope_but_stay_while_it_may_run_again_postgres,
    |db| {
        use dacapo::ports::{DeadLetterStore, DurableInbox};
        let store: (Box<dyn DurableInbox>, Box<dyn DeadLetterStore>) = match db.backend {
            Backend::Sqlite => (Box::new(db.sqlite().await), Box::new(db.sqlite().await)),
            Backend::Postgres => (Box::new(db.postgres().await), Box::new(db.postgres().await)),
        };
        let (inbox, dead_letters) = store;
        let old = chrono::Duration::minutes(10);
        let envelope = || Envelope::for_message(&member_removed()).unwrap();

        let handled = envelope();
        inbox.receive(&handled).await.unwrap();
        inbox.settle_handled(handled.id, 1, &[]).await.unwrap();
        completion(&db, handled.id, old).await;

        let cooling_down = envelope();
        inbox.receive(&cooling_down).await.unwrap();
        inbox
            .schedule_retry(dacapo::ports::RetryRecord::new(
                &cooling_down,
                chrono::Utc::now(),
                &[],
                &[],
                &[],
            ))
            .await
            .unwrap();
        completion(&db, cooling_down.id, old).await;

        let dead = envelope();
        let now = chrono::Utc::now();
        dead_letters
            .put(dacapo::DeadLetter::failed(
                dead.clone(),
                DeadLetterReason::RetriesExhausted,
                Vec::new(),
                now,
                now,
            ))
            .await
            .unwrap();
        completion(&db, dead.id, old).await;

        let recent = envelope();
        completion(&db, recent.id, chrono::Duration::zero()).await;

        let before = chrono::Utc::now() - chrono::Duration::minutes(5);
        let removed = inbox.delete_handled_before(before, 100).await.unwrap();
        // The handled envelope's row is older than `before` only by its handling time, which is
        // now: it stays; its completion, older and settled, goes.
        assert_eq!(removed, 1);
        let left = |id: uuid::Uuid| {
            db.value_for::<i64>(
                "SELECT count(*) FROM dacapo_handler_completions WHERE envelope_id = $1",
                id.simple().to_string(),
            )
        };
        assert_eq!(left(handled.id).await, 0, "settled and old: removed");
        assert_eq!(left(cooling_down.id).await, 1, "its envelope may run again");
        assert_eq!(
            left(dead.id).await,
            1,
            "a replay of the dead letter must not redo it"
        );
        assert_eq!(left(recent.id).await, 1, "within the retention");
    }
);

/// The store's clock, stopped at one instant.
struct StoppedClock(chrono::DateTime<chrono::Utc>);

impl dacapo::ports::Clock for StoppedClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.0
    }
}

/// Records an idempotency key in its handler transaction.
#[derive(Clone)]
struct RecordsAKey(Backend);

impl Handler<MemberRemoved> for RecordsAKey {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        macro_rules! record {
            ($db:ty) => {{
                let Some(mut tx) = ctx.transaction::<$db>().await? else {
                    return Ok(());
                };
                assert!(dacapo::idempotency::record_key(&mut tx, "charge:1").await?);
                tx.commit().await?;
            }};
        }
        match self.0 {
            Backend::Sqlite => record!(sqlx::Sqlite),
            Backend::Postgres => record!(sqlx::Postgres),
        }
        Ok(())
    }
}

// A key recorded in a handler transaction is stamped on the store's clock, like the inbox's
// rows — not on the system's — and a runtime given no clock of its own cleans up by the
// store's: a key stamped then stays, while one older than the retention on that clock goes.
on_both_backends!(
    a_key_recorded_in_a_handler_transaction_is_stamped_and_cleaned_up_on_the_stores_clock_sqlite,
    a_key_recorded_in_a_handler_transaction_is_stamped_and_cleaned_up_on_the_stores_clock_postgres,
    |db| {
        let at = chrono::DateTime::from_timestamp_millis(1_000_000_000_000).unwrap();
        let clock = Arc::new(StoppedClock(at));
        let builder = match db.backend {
            Backend::Sqlite => Runtime::builder().store(db.sqlite().await.clock(clock)),
            Backend::Postgres => Runtime::builder().store(db.postgres().await.clock(clock)),
        };
        let runtime = builder
            .idempotency_key_retention(Duration::from_secs(3600))
            .cleanup_interval(Duration::from_millis(20))
            .module(
                Module::new("billing")
                    .handle_named::<MemberRemoved, _>("charge", RecordsAKey(db.backend)),
            )
            .build()
            .unwrap();
        let report = tracked(&runtime).await;
        assert!(report.is_handled(), "{report:?}");
        assert_eq!(
            db.scalar("SELECT recorded_at FROM dacapo_idempotency_keys WHERE key = 'charge:1'")
                .await,
            1_000_000_000_000
        );
        // A key two hours older on that clock: the cleanup's next round takes it, and would
        // take the handler's with it if it went by the system's clock.
        db.execute(
            "INSERT INTO dacapo_idempotency_keys (key, recorded_at) \
             VALUES ('charge:old', 999992800000)",
        )
        .await;
        tokio::time::timeout(WAIT, async {
            while db
                .scalar("SELECT count(*) FROM dacapo_idempotency_keys WHERE key = 'charge:old'")
                .await
                > 0
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the cleanup removed the old key");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_idempotency_keys WHERE key = 'charge:1'")
                .await,
            1,
            "the handler's key stays"
        );
        runtime.shutdown().await;
    }
);

/// Opens its handler transaction, counts it open, and holds it until `go` turns true.
#[derive(Clone)]
struct HoldsItsTransaction {
    open: Arc<AtomicUsize>,
    go: tokio::sync::watch::Receiver<bool>,
}

impl Handler<MemberRemoved> for HoldsItsTransaction {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let Some(tx) = ctx.transaction::<sqlx::Postgres>().await? else {
            return Ok(());
        };
        self.open.fetch_add(1, Ordering::SeqCst);
        let mut go = self.go.clone();
        let _ = go.wait_for(|go| *go).await;
        self.open.fetch_sub(1, Ordering::SeqCst);
        tx.commit().await?;
        Ok(())
    }
}

/// Takes a handler connection, says so, and holds it until told to go.
#[derive(Clone)]
struct HoldsItsConnection {
    open: Arc<AtomicUsize>,
    go: tokio::sync::watch::Receiver<bool>,
}

impl Handler<MemberRemoved> for HoldsItsConnection {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let mut connection = ctx.connection::<sqlx::Postgres>().await?;
        sqlx::query("SELECT 1").execute(&mut *connection).await?;
        self.open.fetch_add(1, Ordering::SeqCst);
        let mut go = self.go.clone();
        let _ = go.wait_for(|go| *go).await;
        self.open.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_transactions_held_open_leave_the_runtime_its_connections_postgres() {
    let (go, waiting) = tokio::sync::watch::channel(false);
    let holds = HoldsItsTransaction {
        open: Arc::default(),
        go: waiting,
    };
    let open = Arc::clone(&holds.open);
    held_open_leave_the_runtime_its_connections(holds, open, go, false).await;
}

/// Where the server's commits do not wait for the flush, handler connections come from the
/// runtime's own pool, and are counted with the handler transactions there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_connections_from_the_runtimes_pool_leave_it_its_connections_postgres() {
    let (go, waiting) = tokio::sync::watch::channel(false);
    let holds = HoldsItsConnection {
        open: Arc::default(),
        go: waiting,
    };
    let open = Arc::clone(&holds.open);
    held_open_leave_the_runtime_its_connections(holds, open, go, true).await;
}

/// Four messages for `holds`, which counts in `open` what it holds until `go`, on a pool of
/// four (with `synchronous_commit = off` when `unflushed`): two are held, and an accept meanwhile
/// does not wait.
async fn held_open_leave_the_runtime_its_connections(
    holds: impl Handler<MemberRemoved> + Clone,
    open: Arc<AtomicUsize>,
    go: tokio::sync::watch::Sender<bool>,
    unflushed: bool,
) {
    // A pool of four: the outbox's listener holds one for good, and handlers holding a
    // transaction or a connection of the runtime's pool open (slow work inside one) may hold
    // all but two. Without that bound they took the rest, and the runtime's own statements
    // (this accept, the settles, the heartbeats) waited out the pool's 10 s with them.
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    let mut options: sqlx::postgres::PgConnectOptions = db.url.parse().unwrap();
    if unflushed {
        options = options.options([("synchronous_commit", "off")]);
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options);
    let store = dacapo::store::PostgresStore::with_pool(pool).await.unwrap();
    let runtime = Runtime::builder()
        .store(store)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", holds))
        .build()
        .unwrap();
    for _ in 0..4 {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(20), async {
        while open.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("two handlers hold theirs open");
    let accepted =
        tokio::time::timeout(Duration::from_secs(5), runtime.publish(&member_removed())).await;
    assert!(
        matches!(accepted, Ok(Ok(_))),
        "the accept waited for the pool: {accepted:?}"
    );
    assert_eq!(open.load(Ordering::SeqCst), 2);
    go.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(20), runtime.idle())
        .await
        .expect("all five handled");
    assert_eq!(runtime.stats().handled, 5);
    assert!(runtime.shutdown().await.is_clean());
}

/// Opens a handler connection, says so, and holds it for ever.
#[derive(Clone, Default)]
struct HoldsItsConnectionForEver {
    open: Arc<AtomicUsize>,
}

impl Handler<MemberRemoved> for HoldsItsConnectionForEver {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let mut connection = ctx.connection::<sqlx::Postgres>().await?;
        sqlx::query("BEGIN").execute(&mut *connection).await?;
        self.open.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// Runs `module` until `open` counts two handlers holding what they opened, then shuts down
/// past the drain: no worker panics as it stops, and the server is left with no transaction
/// of theirs open.
async fn stopped_under_two_open(module: Module, open: Arc<AtomicUsize>) {
    // The panic hook counted in is the process's: one such test at a time.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE_AT_A_TIME.lock().await;
    let db = support_stores::TestDatabase::new(Backend::Postgres).await;
    let store = db.postgres().await;
    let pool = store.pool().clone();
    let runtime = Runtime::builder()
        .store(store)
        .drain_timeout(Duration::from_millis(50))
        .module(module)
        .build()
        .unwrap();
    for _ in 0..2 {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(20), async {
        while open.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("two handlers hold theirs open");
    let panics = Arc::new(AtomicUsize::new(0));
    let hook = std::panic::take_hook();
    {
        let panics = Arc::clone(&panics);
        std::panic::set_hook(Box::new(move |info| {
            panics.fetch_add(1, Ordering::SeqCst);
            eprintln!("{info}");
        }));
    }
    let report = runtime.shutdown().await;
    let _ = std::panic::take_hook();
    std::panic::set_hook(hook);
    assert_eq!(report.still_running.len(), 2, "{report:?}");
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "a worker panicked as it stopped"
    );
    // Ended a moment later: the server holds no transaction of theirs open.
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND state LIKE 'idle in transaction%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if open == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both transactions ended");
}

// The shutdown's drain ends with the handlers still holding theirs: stopping the workers drops
// them where no tokio runtime runs, and sqlx cannot take a connection back there (it panicked
// in the worker's thread, and the connection never went back to its pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_stopped_under_open_handler_transactions_rolls_them_back_postgres() {
    let (_go, waiting) = tokio::sync::watch::channel(false);
    let holds = HoldsItsTransaction {
        open: Arc::default(),
        go: waiting,
    };
    let open = Arc::clone(&holds.open);
    stopped_under_two_open(
        Module::new("m").handle_named::<MemberRemoved, _>("h", holds),
        open,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_stopped_under_open_handler_connections_ends_them_postgres() {
    let holds = HoldsItsConnectionForEver::default();
    let open = Arc::clone(&holds.open);
    stopped_under_two_open(
        Module::new("m").handle_named::<MemberRemoved, _>("h", holds),
        open,
    )
    .await;
}

/// Waits at its gate before it opens its transaction — a node paused there — then writes a
/// ledger row in it; tells what opening it gave.
#[derive(Clone)]
struct PausedBeforeItsTransaction {
    backend: Backend,
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Semaphore>,
    opened: Arc<Mutex<Option<Result<bool, String>>>>,
    done: Arc<tokio::sync::Notify>,
}

macro_rules! paused_work {
    ($self:ident, $ctx:ident, $db:ty) => {{
        $self.started.notify_one();
        $self.gate.acquire().await?.forget();
        let opened = $ctx.transaction::<$db>().await;
        *$self.opened.lock().unwrap() = Some(match &opened {
            Ok(tx) => Ok(tx.is_some()),
            Err(error) => Err(error.to_string()),
        });
        $self.done.notify_one();
        let Some(mut tx) = opened? else {
            return Ok(());
        };
        sqlx::query("INSERT INTO ledger (entry) VALUES ($1)")
            .bind(dacapo::ids::derive(tx.message_id(), "ledger"))
            .execute(&mut **tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }};
}

impl Handler<MemberRemoved> for PausedBeforeItsTransaction {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        match self.backend {
            Backend::Sqlite => paused_work!(self, ctx, sqlx::Sqlite),
            Backend::Postgres => paused_work!(self, ctx, sqlx::Postgres),
        }
    }
}

on_both_backends!(
    a_handler_paused_while_its_delivery_went_elsewhere_opens_no_transaction_sqlite,
    a_handler_paused_while_its_delivery_went_elsewhere_opens_no_transaction_postgres,
    |db| {
        db.execute("CREATE TABLE IF NOT EXISTS ledger (entry TEXT NOT NULL)")
            .await;
        // What another node did while this one was paused: took the delivery over (and runs
        // it), or ran and settled it — and, past the retention, its cleanup deleted the
        // completion records that would have told this attempt the work was done.
        for taken in [
            "UPDATE dacapo_inbox SET owner = 'the-node-that-took-over'",
            "UPDATE dacapo_inbox SET status = 'handled', owner = NULL",
        ] {
            db.execute("DELETE FROM dacapo_inbox").await;
            let handler = PausedBeforeItsTransaction {
                backend: db.backend,
                started: Arc::default(),
                gate: Arc::new(tokio::sync::Semaphore::new(0)),
                opened: Arc::default(),
                done: Arc::default(),
            };
            let runtime = db
                .store(Runtime::builder(), "paused", Duration::from_secs(30))
                .await
                .module(
                    Module::new("billing")
                        .handle_named::<MemberRemoved, _>("ledger", handler.clone()),
                )
                .build()
                .unwrap();
            runtime.publish(&member_removed()).await.unwrap();
            tokio::time::timeout(WAIT, handler.started.notified())
                .await
                .expect("the handler started");
            db.execute(taken).await;
            let done = handler.done.notified();
            handler.gate.add_permits(1);
            tokio::time::timeout(WAIT, done)
                .await
                .expect("the handler tried to open its transaction");
            let opened = handler.opened.lock().unwrap().clone();
            assert!(
                matches!(&opened, Some(Err(why)) if why.contains("detached")),
                "{taken}: {opened:?}"
            );
            assert_eq!(
                db.scalar("SELECT count(*) FROM ledger").await,
                0,
                "{taken}: no effect"
            );
            assert_eq!(
                db.scalar("SELECT count(*) FROM dacapo_handler_completions")
                    .await,
                0,
                "{taken}: no completion"
            );
            runtime.shutdown().await;
        }
    }
);

/// Writes a ledger row, then — on its first attempt only — runs `breaking` (a statement that
/// fails, or one that ends the transaction) and goes on past it; tells what each commit gave.
#[derive(Clone)]
struct GoesOnPastAFailedStatement {
    breaking: &'static str,
    commits: Arc<Mutex<Vec<Result<(), String>>>>,
}

impl Handler<MemberRemoved> for GoesOnPastAFailedStatement {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let Some(mut tx) = ctx.transaction::<sqlx::Postgres>().await? else {
            return Ok(());
        };
        sqlx::query("INSERT INTO ledger (entry) VALUES ($1)")
            .bind(dacapo::ids::derive(tx.message_id(), "ledger"))
            .execute(&mut **tx)
            .await?;
        if ctx.attempt() == 1 {
            // "Already there" and carried on: the error is dropped.
            let _ = sqlx::query(self.breaking).execute(&mut **tx).await;
        }
        let committed = tx.commit().await;
        self.commits
            .lock()
            .unwrap()
            .push(committed.as_ref().map(|_| ()).map_err(ToString::to_string));
        committed?;
        Ok(())
    }
}

/// On PostgreSQL a statement that failed aborts the transaction, and its COMMIT answers
/// ROLLBACK with no error: a handler that went on past the failure was told its work
/// committed, and its delivery settled with the work gone. The commit now fails, the attempt
/// is retried, and the row is written once.
/// The same for a transaction the handler ended itself with a `ROLLBACK` sent on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_a_failed_statement_fails_on_postgres_instead_of_losing_the_work() {
    for (breaking, said) in [("SELECT 1 / 0", "aborted"), ("ROLLBACK", "was ended")] {
        let db = support_stores::TestDatabase::new(Backend::Postgres).await;
        db.execute("CREATE TABLE ledger (entry TEXT NOT NULL)")
            .await;
        let handler = GoesOnPastAFailedStatement {
            breaking,
            commits: Arc::default(),
        };
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .retry_policy(quick_retries())
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("ledger", handler.clone()),
            )
            .build()
            .unwrap();
        let report = tracked(&runtime).await;
        assert!(report.is_handled(), "{breaking}: {report:?}");
        assert_eq!(
            report.attempts, 2,
            "{breaking}: the first attempt's commit failed"
        );
        let commits = handler.commits.lock().unwrap().clone();
        assert!(
            matches!(&commits[..], [Err(why), Ok(())] if why.contains(said)),
            "{breaking}: {commits:?}"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM ledger").await,
            1,
            "{breaking}"
        );
        runtime.shutdown().await;
    }
}
