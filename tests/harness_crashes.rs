//! Crashes as one line: `harness.crash_at(Failpoint::…)` kills the runtime at a named point of
//! the durable path, `harness.restart()` starts the next process on the same store under the
//! same node id, and the application sees each handler's effects exactly once, nothing lost,
//! and the attempts the policy says — on a real SQLite file and a real PostgreSQL server.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::{
    Failpoint, Fault, Recorder, ScratchDatabase, TestHarness, TestHarnessBuilder,
};
use dacapo::transaction::HandlerTransactions;
use dacapo::{DeadLetterReason, DeliveryReport, DiscardReason, Error};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct MemberRemoved {
    member_id: u64,
}

impl Message for MemberRemoved {
    const TYPE: &'static str = "crashes.member_removed";
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct AccessRevoked {
    member_id: u64,
}

impl Message for AccessRevoked {
    const TYPE: &'static str = "crashes.access_revoked";
}

const EFFECTS: &str = "CREATE TABLE effects (id TEXT PRIMARY KEY, handler TEXT NOT NULL)";

/// Writes its effect in a handler transaction and announces it — in that transaction, or
/// with its context after the commit (and then, given store faults, in an outage): a rerun
/// finds the work committed and does nothing.
struct Revoke<P> {
    /// The pool's type names the database the transaction is on.
    database: std::marker::PhantomData<fn() -> P>,
    after_commit: bool,
    outage: Option<dacapo::testing::StoreFaults>,
}

impl<P> Revoke<P> {
    /// Announces in its transaction.
    fn enlisting(_pool: P) -> Self {
        Self {
            database: std::marker::PhantomData,
            after_commit: false,
            outage: None,
        }
    }

    /// Announces with its context after its commit, in an outage of `outage` if given.
    fn publishing_after_commit(_pool: P, outage: Option<dacapo::testing::StoreFaults>) -> Self {
        Self {
            database: std::marker::PhantomData,
            after_commit: true,
            outage,
        }
    }
}
/// Writes the announcement's effect in a handler transaction too.
struct Audit<P>(P);

macro_rules! handlers {
    ($pool:ty, $db:ty) => {
        impl Handler<MemberRemoved> for Revoke<$pool> {
            async fn handle(
                &self,
                event: &MemberRemoved,
                ctx: &MessageContext,
            ) -> Result<(), HandlerError> {
                let Some(mut tx) = ctx.transaction::<$db>().await? else {
                    return Ok(());
                };
                let id = dacapo::ids::derive(tx.message_id(), "revoke");
                dacapo::sqlx::query("INSERT INTO effects (id, handler) VALUES ($1, 'revoke')")
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
                let announcement = AccessRevoked {
                    member_id: event.member_id,
                };
                if !self.after_commit {
                    tx.enlist(&announcement).await?;
                }
                tx.commit().await?;
                if self.after_commit {
                    if let Some(outage) = &self.outage {
                        outage.inject(dacapo::testing::StoreFault::unavailable());
                    }
                    let published = ctx.publish(&announcement).await;
                    if let Some(outage) = &self.outage {
                        outage.end();
                    }
                    published?;
                }
                Ok(())
            }
        }

        impl Handler<AccessRevoked> for Audit<$pool> {
            async fn handle(
                &self,
                _: &AccessRevoked,
                ctx: &MessageContext,
            ) -> Result<(), HandlerError> {
                let Some(mut tx) = ctx.transaction::<$db>().await? else {
                    return Ok(());
                };
                let id = dacapo::ids::derive(tx.message_id(), "audit");
                dacapo::sqlx::query("INSERT INTO effects (id, handler) VALUES ($1, 'audit')")
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }
        }
    };
}

handlers!(dacapo::sqlx::SqlitePool, dacapo::sqlx::Sqlite);
handlers!(dacapo::sqlx::PgPool, dacapo::sqlx::Postgres);

/// A fresh database with the effects table, and a harness on it whose handlers write their
/// effects there; `faults` adds faults to the harness.
struct Setup {
    harness: TestHarness,
    effects: Box<dyn Fn() -> futures::future::BoxFuture<'static, Vec<String>>>,
    /// Where the announcements stand in the inbox: each one's status.
    announcements: Box<dyn Fn() -> futures::future::BoxFuture<'static, Vec<String>>>,
    _db: ScratchDatabase,
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

fn admin_url() -> String {
    std::env::var("DACAPO_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn builder() -> TestHarnessBuilder {
    TestHarness::builder().settle_timeout(Duration::from_secs(20))
}

/// A reader of the effects table on `$pool`, by handler name.
macro_rules! effects_of {
    ($pool:expr) => {{
        let pool = $pool;
        Box::new(move || {
            let pool = pool.clone();
            Box::pin(async move {
                dacapo::sqlx::query_scalar("SELECT handler FROM effects ORDER BY handler")
                    .fetch_all(&pool)
                    .await
                    .unwrap()
            }) as futures::future::BoxFuture<'static, Vec<String>>
        })
    }};
}

/// The setup on `$db`, a scratch database, and `$store`, its store: the effects table, the
/// two handlers on its pool, and a reader of the effects.
macro_rules! setup_on {
    ($db:ident, $store:ident, $faults:ident) => {{
        let pool = $store.pool().clone();
        dacapo::sqlx::query(EFFECTS).execute(&pool).await.unwrap();
        let harness =
            $faults(
                builder()
                    .store($store)
                    .module(Module::new("access").handle_named::<MemberRemoved, _>(
                        "revoke",
                        Revoke::enlisting(pool.clone()),
                    ))
                    .module(
                        Module::new("audit")
                            .handle_named::<AccessRevoked, _>("audit", Audit(pool.clone())),
                    ),
            )
            .build()
            .unwrap();
        let inbox = pool.clone();
        let announcements = Box::new(move || {
            let pool = inbox.clone();
            Box::pin(async move {
                dacapo::sqlx::query_scalar(
                    "SELECT status FROM dacapo_inbox WHERE message_type = 'crashes.access_revoked'",
                )
                .fetch_all(&pool)
                .await
                .unwrap()
            }) as futures::future::BoxFuture<'static, Vec<String>>
        });
        let effects = effects_of!(pool);
        Setup {
            harness,
            effects,
            announcements,
            _db: $db,
        }
    }};
}

async fn setup(
    backend: Backend,
    faults: impl FnOnce(TestHarnessBuilder) -> TestHarnessBuilder,
) -> Setup {
    match backend {
        Backend::Sqlite => {
            let db = ScratchDatabase::sqlite();
            let store = db.sqlite_store().await.unwrap();
            setup_on!(db, store, faults)
        }
        Backend::Postgres => {
            let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
            let store = db.postgres_store().await.unwrap();
            setup_on!(db, store, faults)
        }
    }
}

fn crashed_at(result: Result<impl std::fmt::Debug, Error>, point: Failpoint) {
    match result {
        Err(Error::Crashed { at }) => assert_eq!(at, point),
        other => panic!("expected a crash {point}, got {other:?}"),
    }
}

/// Every effect exactly once: the member's revocation and its audit.
async fn each_effect_once(setup: &Setup) {
    assert_eq!((setup.effects)().await, ["audit", "revoke"]);
}

/// The report of the last delivery of `message_type` that ran: a redelivery the inbox
/// discarded is not one, and its report can come after the recovered delivery's (the
/// recovered attempt may settle while the redelivery is still being received).
fn last_report(harness: &TestHarness, message_type: &str) -> DeliveryReport {
    harness
        .reports()
        .into_iter()
        .rev()
        .find(|r| {
            r.message_type == message_type
                && r.outcome != Outcome::Discarded(DiscardReason::DuplicateEnvelope)
        })
        .unwrap_or_else(|| panic!("no report of {message_type}"))
}

macro_rules! on_both_backends {
    ($sqlite:ident, $postgres:ident, $body:ident) => {
        #[tokio::test]
        async fn $sqlite() {
            $body(Backend::Sqlite).await;
        }

        #[tokio::test]
        async fn $postgres() {
            $body(Backend::Postgres).await;
        }
    };
}

on_both_backends!(
    a_crash_before_the_acknowledgement_runs_the_recorded_delivery_and_discards_the_redelivery_sqlite,
    a_crash_before_the_acknowledgement_runs_the_recorded_delivery_and_discards_the_redelivery_postgres,
    crash_before_acknowledge
);

async fn crash_before_acknowledge(backend: Backend) {
    let mut setup = setup(backend, |b| b).await;
    let envelope = setup
        .harness
        .runtime()
        .envelope(&MemberRemoved { member_id: 7 }, SendOptions::default())
        .unwrap();
    setup
        .harness
        .crash_at_message::<MemberRemoved>(Failpoint::BeforeAcknowledge)
        .unwrap();
    crashed_at(
        setup.harness.deliver(envelope.clone()).await,
        Failpoint::BeforeAcknowledge,
    );
    assert!(
        (setup.effects)().await.is_empty(),
        "nothing ran before the crash"
    );

    setup.harness.restart().await.unwrap();
    // The broker never saw an acknowledgement, so it delivers the envelope again.
    let redelivered = setup.harness.deliver(envelope).await.unwrap();
    assert_eq!(
        redelivered.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope)
    );
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    let report = last_report(&setup.harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    // The crashed process had started the first attempt: the store counted it.
    assert_eq!(report.attempts, 2);
}

on_both_backends!(
    a_crash_before_the_settle_resumes_and_finds_the_handlers_work_committed_sqlite,
    a_crash_before_the_settle_resumes_and_finds_the_handlers_work_committed_postgres,
    crash_before_settle
);

/// Publishes a member's removal and crashes before its settle. Only the member's delivery:
/// the announcement its handler committed may reach the point first.
async fn crashed_before_the_members_settle(setup: &Setup) {
    setup
        .harness
        .crash_at_message::<MemberRemoved>(Failpoint::BeforeSettle)
        .unwrap();
    crashed_at(
        setup.harness.publish(&MemberRemoved { member_id: 7 }).await,
        Failpoint::BeforeSettle,
    );
}

async fn crash_before_settle(backend: Backend) {
    let mut setup = setup(backend, |b| b).await;
    crashed_before_the_members_settle(&setup).await;
    assert_eq!(setup.harness.crashed(), Some(Failpoint::BeforeSettle));
    // The handler's transaction committed before the crash.
    assert_eq!((setup.effects)().await, ["revoke"]);

    setup.harness.restart().await.unwrap();
    assert_eq!(setup.harness.crashed(), None);
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    let report = last_report(&setup.harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(report.attempts, 2);
}

on_both_backends!(
    a_crash_after_the_settle_discards_the_redelivery_and_relays_the_outbox_sqlite,
    a_crash_after_the_settle_discards_the_redelivery_and_relays_the_outbox_postgres,
    crash_after_settle
);

async fn crash_after_settle(backend: Backend) {
    let mut setup = setup(backend, |b| b).await;
    let envelope = setup
        .harness
        .runtime()
        .envelope(&MemberRemoved { member_id: 7 }, SendOptions::default())
        .unwrap();
    setup
        .harness
        .crash_at_message::<MemberRemoved>(Failpoint::AfterSettle)
        .unwrap();
    crashed_at(
        setup.harness.deliver(envelope.clone()).await,
        Failpoint::AfterSettle,
    );

    setup.harness.restart().await.unwrap();
    let redelivered = setup.harness.deliver(envelope).await.unwrap();
    assert_eq!(
        redelivered.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope)
    );
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    // The announcement may have been handled before the crash — the handler's commit wakes
    // the relay, which can deliver it while the member's settle commits, its report then
    // going with the crashed runtime — or resumed after it, and published again by the relay
    // (then discarded): either way it is handled, once.
    assert_eq!((setup.announcements)().await, ["handled"]);
}

on_both_backends!(
    a_crash_during_the_cooldown_resumes_at_the_next_attempt_sqlite,
    a_crash_during_the_cooldown_resumes_at_the_next_attempt_postgres,
    crash_during_cooldown
);

async fn crash_during_cooldown(backend: Backend) {
    let mut setup = setup(backend, |b| {
        b.fault("access", "revoke", Fault::fail_times(1))
    })
    .await;
    setup.harness.crash_at(Failpoint::DuringCooldown).unwrap();
    crashed_at(
        setup.harness.publish(&MemberRemoved { member_id: 7 }).await,
        Failpoint::DuringCooldown,
    );
    assert!((setup.effects)().await.is_empty());

    setup.harness.restart().await.unwrap();
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    let report = last_report(&setup.harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    // One failed attempt, then the one the policy's first cooldown led to: nothing counted
    // twice, nothing skipped.
    assert_eq!(report.attempts, 2);
    let failures: Vec<_> = report.failures().map(|(attempt, _)| attempt).collect();
    assert_eq!(failures, [1]);
    // The first cooldown (1 s) was due a second after the first attempt; the restart came a
    // millisecond after it. The store keeps whole milliseconds, and the virtual clock starts on
    // one: the rest of the cooldown is the same in every run.
    assert_eq!(report.cooldowns(), [Duration::from_millis(999)]);
}

on_both_backends!(
    a_crash_in_the_middle_of_a_dead_letter_move_leaves_one_dead_letter_sqlite,
    a_crash_in_the_middle_of_a_dead_letter_move_leaves_one_dead_letter_postgres,
    crash_in_dead_letter_move
);

async fn crash_in_dead_letter_move(backend: Backend) {
    let mut setup = setup(backend, |b| {
        b.fault("access", "revoke", Fault::fail_permanently())
    })
    .await;
    setup.harness.crash_at(Failpoint::DeadLetterMove).unwrap();
    let id = {
        let envelope = setup
            .harness
            .runtime()
            .envelope(&MemberRemoved { member_id: 7 }, SendOptions::default())
            .unwrap();
        let id = envelope.id;
        crashed_at(
            setup.harness.deliver(envelope).await,
            Failpoint::DeadLetterMove,
        );
        id
    };

    setup.harness.restart().await.unwrap();
    // The move's transaction never committed: no dead letter yet, the delivery unsettled.
    setup.harness.idle().await.unwrap();
    let report = last_report(&setup.harness, MemberRemoved::TYPE);
    assert!(
        matches!(
            report.outcome,
            Outcome::DeadLettered(DeadLetterReason::Permanent)
        ),
        "{report:?}"
    );
    let letters = setup.harness.runtime().dead_letters().list().await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].envelope.id, id);
    assert!((setup.effects)().await.is_empty());
}

on_both_backends!(
    a_crash_between_publishing_and_marking_the_outbox_delivers_the_announcement_once_sqlite,
    a_crash_between_publishing_and_marking_the_outbox_delivers_the_announcement_once_postgres,
    crash_before_outbox_mark
);

async fn crash_before_outbox_mark(backend: Backend) {
    let mut setup = setup(backend, |b| b).await;
    setup.harness.crash_at(Failpoint::BeforeOutboxMark).unwrap();
    // The handler's commit wakes the relay at once: the crash may come before the member's
    // delivery reports, or after.
    match setup.harness.publish(&MemberRemoved { member_id: 7 }).await {
        Ok(report) => {
            assert!(report.is_handled(), "{report:?}");
            crashed_at(setup.harness.idle().await, Failpoint::BeforeOutboxMark);
        }
        crashed => crashed_at(crashed, Failpoint::BeforeOutboxMark),
    }

    setup.harness.restart().await.unwrap();
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    let audits: Vec<_> = setup
        .harness
        .reports()
        .into_iter()
        .filter(|r| r.message_type == AccessRevoked::TYPE && r.is_handled())
        .collect();
    assert_eq!(audits.len(), 1, "{audits:?}");
}

#[tokio::test]
async fn a_crash_needs_a_store_and_says_so() {
    let mut harness = TestHarness::builder()
        .module(Module::new("access").handle_named::<MemberRemoved, _>(
            "revoke",
            dacapo::testing::Recorder::<MemberRemoved>::new(),
        ))
        .build()
        .unwrap();
    assert!(matches!(
        harness.crash_at(Failpoint::BeforeSettle),
        Err(Error::Configuration(_))
    ));
    assert!(matches!(
        harness.restart().await,
        Err(Error::Configuration(_))
    ));
    assert!(matches!(
        harness.store_faults(),
        Err(Error::Configuration(_))
    ));
    // Taken from the builder, for a handler, they would strike nothing: refused at build.
    let builder = TestHarness::builder();
    let _faults = builder.store_faults();
    assert!(matches!(builder.build(), Err(Error::Configuration(_))));
}

/// The first recovery round after a restart meets the store down: `restart` (and so `idle`)
/// returns once a round got through and resumed the crashed delivery, not after the refused
/// one (which counted before: `idle` returned with the member's effects missing).
#[tokio::test]
async fn a_restart_whose_first_recovery_round_the_store_refuses_waits_for_the_next() {
    let mut setup = setup(Backend::Sqlite, |b| b).await;
    crashed_before_the_members_settle(&setup).await;
    let faults = setup.harness.store_faults().unwrap();
    faults.inject(dacapo::testing::StoreFault::unavailable().times(3));

    setup.harness.restart().await.unwrap();
    setup.harness.idle().await.unwrap();

    each_effect_once(&setup).await;
    let report = last_report(&setup.harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(faults.struck(), 3, "the first rounds met the outage");
}

#[tokio::test]
async fn a_retry_a_restart_left_in_the_store_runs_once_the_clock_reaches_it() {
    let policy = RetryPolicy {
        min_retry_interval: Duration::from_secs(60),
        ..RetryPolicy::default()
    };
    let mut setup = setup(Backend::Sqlite, |b| {
        b.fault("access", "revoke", Fault::fail_times(1))
            .retry_policy(policy)
    })
    .await;
    setup.harness.crash_at(Failpoint::DuringCooldown).unwrap();
    crashed_at(
        setup.harness.publish(&MemberRemoved { member_id: 7 }).await,
        Failpoint::DuringCooldown,
    );
    // A restart of a restart: the second run finds the delivery where the first left it.
    setup.harness.restart().await.unwrap();
    setup.harness.restart().await.unwrap();
    setup.harness.idle().await.unwrap();
    assert!(
        (setup.effects)().await.is_empty(),
        "the retry is due a minute after the failure"
    );
    setup
        .harness
        .advance(Duration::from_secs(60))
        .await
        .unwrap();
    setup.harness.idle().await.unwrap();
    each_effect_once(&setup).await;
    assert_eq!(last_report(&setup.harness, MemberRemoved::TYPE).attempts, 2);
}

/// Revokes without a handler transaction, under a deduplication claim, and announces it with
/// its context: once its claim is completed, a rerun skips it and announces nothing.
/// Given faults, it starts an outage of the runtime's store as it returns.
#[derive(Default)]
struct RevokeOnce(Option<dacapo::testing::StoreFaults>);

impl Handler<MemberRemoved> for RevokeOnce {
    async fn handle(
        &self,
        event: &MemberRemoved,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        ctx.publish(&AccessRevoked {
            member_id: event.member_id,
        })
        .await?;
        if let Some(faults) = &self.0 {
            faults.inject(
                dacapo::testing::StoreFault::unavailable().lasting(Duration::from_millis(300)),
            );
        }
        Ok(())
    }
}

/// Counts its calls, and succeeds.
struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Handler<MemberRemoved> for Counting {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

on_both_backends!(
    an_attempt_a_crash_cut_short_is_judged_by_its_modules_policy_sqlite,
    an_attempt_a_crash_cut_short_is_judged_by_its_modules_policy_postgres,
    crash_under_a_modules_policy
);

/// The runtime allows no retry, the module three: the attempt a crash cut short is the
/// module's delivery, and its policy decides what follows, as for any failure of its handlers.
async fn crash_under_a_modules_policy(backend: Backend) {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let patient = RetryPolicy {
        retry_limit: 3,
        ..RetryPolicy::default()
    };
    let module = Module::new("access")
        .retry_policy(patient)
        .handle_named::<MemberRemoved, _>("count", Counting(calls.clone()));
    let builder = builder()
        .retry_policy(RetryPolicy::no_retries())
        .module(module);
    let (mut harness, _db) = match backend {
        Backend::Sqlite => {
            let db = ScratchDatabase::sqlite();
            let store = db.sqlite_store().await.unwrap();
            (builder.store(store).build().unwrap(), db)
        }
        Backend::Postgres => {
            let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
            let store = db.postgres_store().await.unwrap();
            (builder.store(store).build().unwrap(), db)
        }
    };
    harness.crash_at(Failpoint::BeforeSettle).unwrap();
    crashed_at(
        harness.publish(&MemberRemoved { member_id: 7 }).await,
        Failpoint::BeforeSettle,
    );
    harness.restart().await.unwrap();
    harness.idle().await.unwrap();
    let report = last_report(&harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(report.attempts, 2);
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
}

on_both_backends!(
    a_crash_after_a_deduplicated_handler_completed_keeps_what_it_announced_sqlite,
    a_crash_after_a_deduplicated_handler_completed_keeps_what_it_announced_postgres,
    crash_after_a_deduplicated_handler
);

on_both_backends!(
    a_crash_after_a_deduplicated_handler_with_claims_apart_completed_keeps_what_it_announced_sqlite,
    a_crash_after_a_deduplicated_handler_with_claims_apart_completed_keeps_what_it_announced_postgres,
    crash_after_a_deduplicated_handler_with_claims_apart
);

/// Whether the runtime's store is down as `revoke` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outage {
    None,
    /// For 300 ms, from the moment `revoke` returns.
    AsRevokeReturns,
}

/// Where the deduplication claims live.
#[derive(Clone, Copy, Debug)]
enum ClaimsIn {
    /// The runtime's store: a claim's completion enlists the handler's cascades.
    Store,
    /// A SQLite database of their own: the cascades are enlisted after the completion.
    Apart,
}

/// A harness whose deduplicated `revoke` announces what it revoked (see [`RevokeOnce`]), and
/// whose `audit` writes an effect per announcement; `faults` adds to it. The reader lists the
/// effects; the databases must outlive the harness.
async fn announcing(
    backend: Backend,
    claims: ClaimsIn,
    outage: Outage,
    faults: impl FnOnce(TestHarnessBuilder) -> TestHarnessBuilder,
) -> (
    TestHarness,
    Box<dyn Fn() -> futures::future::BoxFuture<'static, Vec<String>>>,
    Vec<ScratchDatabase>,
) {
    let mut databases = Vec::new();
    let apart = match claims {
        ClaimsIn::Store => None,
        ClaimsIn::Apart => {
            let db = ScratchDatabase::sqlite();
            let claims = db.sqlite_store().await.unwrap();
            databases.push(db);
            Some(std::sync::Arc::new(claims))
        }
    };
    macro_rules! on {
        ($db:expr, $store:expr) => {{
            let db = $db;
            let store = $store(&db).await.unwrap();
            databases.push(db);
            let pool = store.pool().clone();
            dacapo::sqlx::query(EFFECTS).execute(&pool).await.unwrap();
            let builder = builder();
            let revoke = match outage {
                Outage::None => RevokeOnce::default(),
                Outage::AsRevokeReturns => RevokeOnce(Some(builder.store_faults())),
            };
            let harness = faults(
                builder
                    .store(store)
                    .configure(|runtime| {
                        let runtime = runtime.enable_deduplication();
                        match apart {
                            Some(claims) => runtime.claims(claims),
                            None => runtime,
                        }
                    })
                    .module(
                        Module::new("access")
                            .handle_named::<MemberRemoved, _>("revoke", revoke)
                            .deduplicate("revoke", Deduplication::from_envelope()),
                    )
                    .module(
                        Module::new("audit")
                            .handle_named::<AccessRevoked, _>("audit", Audit(pool.clone())),
                    ),
            )
            .build()
            .unwrap();
            let effects = effects_of!(pool);
            (harness, effects as _)
        }};
    }
    let (harness, effects) = match backend {
        Backend::Sqlite => on!(ScratchDatabase::sqlite(), ScratchDatabase::sqlite_store),
        Backend::Postgres => on!(
            ScratchDatabase::postgres(&admin_url()).await.unwrap(),
            ScratchDatabase::postgres_store
        ),
    };
    (harness, effects, databases)
}

async fn crash_after_a_deduplicated_handler(backend: Backend) {
    crash_after_completing(backend, ClaimsIn::Store).await;
}

async fn crash_after_a_deduplicated_handler_with_claims_apart(backend: Backend) {
    crash_after_completing(backend, ClaimsIn::Apart).await;
}

/// The crash comes after the handler's claim was completed and before the delivery settled:
/// the attempt after the restart skips the handler, so what it announced must already be in
/// the outbox.
async fn crash_after_completing(backend: Backend, claims: ClaimsIn) {
    let (mut harness, effects, _dbs) = announcing(backend, claims, Outage::None, |b| b).await;
    harness
        .crash_at_message::<MemberRemoved>(Failpoint::BeforeSettle)
        .unwrap();
    crashed_at(
        harness
            .publish_with(
                &MemberRemoved { member_id: 7 },
                SendOptions::new().deduplication_id("member-7"),
            )
            .await,
        Failpoint::BeforeSettle,
    );
    harness.restart().await.unwrap();
    harness.idle().await.unwrap();
    let report = last_report(&harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(
        effects().await,
        ["audit"],
        "the announcement was delivered, once"
    );
}

on_both_backends!(
    a_replayed_dead_letter_keeps_what_its_completed_deduplicated_handler_announced_sqlite,
    a_replayed_dead_letter_keeps_what_its_completed_deduplicated_handler_announced_postgres,
    replay_after_a_deduplicated_handler
);

on_both_backends!(
    a_replayed_dead_letter_keeps_what_its_completed_handler_with_claims_apart_announced_sqlite,
    a_replayed_dead_letter_keeps_what_its_completed_handler_with_claims_apart_announced_postgres,
    replay_after_a_deduplicated_handler_with_claims_apart
);

async fn replay_after_a_deduplicated_handler(backend: Backend) {
    replay_after_completing(backend, ClaimsIn::Store, Outage::None).await;
}

async fn replay_after_a_deduplicated_handler_with_claims_apart(backend: Backend) {
    replay_after_completing(backend, ClaimsIn::Apart, Outage::None).await;
}

/// `revoke` completes its claim while a sibling fails the only attempt: the delivery is
/// dead-lettered, and its replay skips `revoke`, so what `revoke` announced must not have
/// gone with the dead letter.
async fn replay_after_completing(backend: Backend, claims: ClaimsIn, outage: Outage) {
    let sibling = Recorder::<MemberRemoved>::new();
    let (harness, effects, _dbs) = announcing(backend, claims, outage, |b| {
        b.retry_policy(RetryPolicy {
            retry_limit: 0,
            ..RetryPolicy::default()
        })
        .module(Module::new("mail").handle_named::<MemberRemoved, _>("notify", sibling.clone()))
        .fault("mail", "notify", Fault::fail_times(1))
    })
    .await;
    let report = harness
        .publish_with(
            &MemberRemoved { member_id: 7 },
            SendOptions::new().deduplication_id("member-7"),
        )
        .await
        .unwrap();
    assert_eq!(
        report.outcome,
        Outcome::DeadLettered(DeadLetterReason::RetriesExhausted)
    );
    if outage == Outage::AsRevokeReturns {
        let faults = harness.store_faults().unwrap();
        assert!(
            faults.struck() > 0,
            "the store was down as the handler returned"
        );
    }
    harness
        .runtime()
        .dead_letters()
        .replay(report.envelope_id)
        .await
        .unwrap();
    harness.idle().await.unwrap();
    let replayed = last_report(&harness, MemberRemoved::TYPE);
    assert!(replayed.is_handled(), "{replayed:?}");
    assert_eq!(
        sibling.calls().len(),
        1,
        "the sibling ran again on the replay"
    );
    assert_eq!(
        effects().await,
        ["audit"],
        "the announcement was delivered, once"
    );
}

/// Claims kept in a database of their own, apart from the runtime's store: what the
/// deduplicated handler announced goes through the runtime's outbox, not into the claims
/// database's outbox, which nothing relays.
#[tokio::test]
async fn a_deduplicated_handler_with_claims_kept_apart_announces_through_the_runtimes_outbox() {
    let (harness, effects, databases) =
        announcing(Backend::Sqlite, ClaimsIn::Apart, Outage::None, |b| b).await;
    let report = harness
        .publish_with(
            &MemberRemoved { member_id: 7 },
            SendOptions::new().deduplication_id("member-7"),
        )
        .await
        .unwrap();
    assert!(report.is_handled(), "{report:?}");
    harness.idle().await.unwrap();
    assert_eq!(effects().await, ["audit"], "the announcement was delivered");
    let claims = databases[0].sqlite_store().await.unwrap();
    let completed: i64 =
        dacapo::sqlx::query_scalar("SELECT count(*) FROM dacapo_deduplication WHERE completed = 1")
            .fetch_one(claims.pool())
            .await
            .unwrap();
    assert_eq!(completed, 1, "the claim is kept apart, completed");
    let stray: i64 = dacapo::sqlx::query_scalar("SELECT count(*) FROM dacapo_outbox")
        .fetch_one(claims.pool())
        .await
        .unwrap();
    assert_eq!(stray, 0, "nothing enlisted where nothing relays");
}

/// Claims kept apart, and the runtime's store down as the deduplicated handler returns:
/// what it announced is enlisted once the store answers, before its claim is completed, so
/// the dead letter that a failing sibling makes, and its replay (which skips the handler),
/// lose nothing.
#[tokio::test]
async fn a_store_outage_as_a_handler_with_claims_apart_completes_loses_none_of_its_announcements() {
    replay_after_completing(Backend::Sqlite, ClaimsIn::Apart, Outage::AsRevokeReturns).await;
}

on_both_backends!(
    a_crash_after_a_handler_announced_past_its_commit_keeps_the_announcement_sqlite,
    a_crash_after_a_handler_announced_past_its_commit_keeps_the_announcement_postgres,
    crash_after_announcing_past_the_commit
);

/// The handler publishes after its transaction committed, and the runtime crashes before the
/// delivery settles: the rerun finds the work done and publishes nothing, so the announcement
/// must already be in the outbox.
async fn crash_after_announcing_past_the_commit(backend: Backend) {
    macro_rules! run {
        ($db:expr, $store:expr) => {{
            let db = $db;
            let store = $store(&db).await.unwrap();
            let pool = store.pool().clone();
            dacapo::sqlx::query(EFFECTS).execute(&pool).await.unwrap();
            let mut harness = builder()
                .store(store)
                .module(Module::new("access").handle_named::<MemberRemoved, _>(
                    "revoke",
                    Revoke::publishing_after_commit(pool.clone(), None),
                ))
                .module(
                    Module::new("audit")
                        .handle_named::<AccessRevoked, _>("audit", Audit(pool.clone())),
                )
                .build()
                .unwrap();
            crashed_before_the_settle_and_restarted(&mut harness).await;
            let mut effects: Vec<String> =
                dacapo::sqlx::query_scalar("SELECT handler FROM effects")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            effects.sort();
            assert_eq!(effects, ["audit", "revoke"], "each effect once");
        }};
    }
    match backend {
        Backend::Sqlite => run!(ScratchDatabase::sqlite(), ScratchDatabase::sqlite_store),
        Backend::Postgres => run!(
            ScratchDatabase::postgres(&admin_url()).await.unwrap(),
            ScratchDatabase::postgres_store
        ),
    }
}

/// A message published after the handler's commit that the outbox refuses to take at once
/// settles with the delivery instead: it is delivered all the same.
#[tokio::test]
async fn an_announcement_past_the_commit_the_outbox_refuses_settles_with_the_delivery() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let pool = store.pool().clone();
    dacapo::sqlx::query(EFFECTS).execute(&pool).await.unwrap();
    let builder = builder();
    let faults = builder.store_faults();
    let harness = builder
        .store(store)
        .module(Module::new("access").handle_named::<MemberRemoved, _>(
            "revoke",
            Revoke::publishing_after_commit(pool.clone(), Some(faults.clone())),
        ))
        .module(Module::new("audit").handle_named::<AccessRevoked, _>("audit", Audit(pool.clone())))
        .build()
        .unwrap();
    let report = harness
        .publish(&MemberRemoved { member_id: 7 })
        .await
        .unwrap();
    assert!(report.is_handled(), "{report:?}");
    assert_eq!(report.cascaded.len(), 1, "it settled with the delivery");
    assert!(faults.struck() > 0, "the outbox was refused");
    harness.idle().await.unwrap();
    let mut effects: Vec<String> = dacapo::sqlx::query_scalar("SELECT handler FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    effects.sort();
    assert_eq!(effects, ["audit", "revoke"], "each effect once");
}

/// Publishes a member's removal on `harness`, crashing before its settle, restarts, and
/// returns the report of the delivery the restart finished, checked handled.
async fn crashed_before_the_settle_and_restarted(harness: &mut TestHarness) -> DeliveryReport {
    harness
        .crash_at_message::<MemberRemoved>(Failpoint::BeforeSettle)
        .unwrap();
    crashed_at(
        harness.publish(&MemberRemoved { member_id: 7 }).await,
        Failpoint::BeforeSettle,
    );
    harness.restart().await.unwrap();
    harness.idle().await.unwrap();
    let report = last_report(harness, MemberRemoved::TYPE);
    assert!(report.is_handled(), "{report:?}");
    report
}

/// Revokes on a handler connection: an insert under an id derived from the message, with a
/// second connection open meanwhile (a read beside it), so that the pool opens one in the
/// runtime's own threads beside the one the store opened at start.
struct RevokeOnItsConnection;

impl Handler<MemberRemoved> for RevokeOnItsConnection {
    async fn handle(&self, _: &MemberRemoved, ctx: &MessageContext) -> Result<(), HandlerError> {
        let id = dacapo::ids::derive_or_random(ctx.message_id(), "revoke");
        let mut connection = ctx.connection::<dacapo::sqlx::Postgres>().await?;
        let mut beside = ctx.connection::<dacapo::sqlx::Postgres>().await?;
        dacapo::sqlx::query("SELECT count(*) FROM effects")
            .execute(&mut *beside)
            .await?;
        dacapo::sqlx::query(
            "INSERT INTO effects (id, handler) VALUES ($1, 'revoke') ON CONFLICT (id) DO NOTHING",
        )
        .bind(&id)
        .execute(&mut *connection)
        .await?;
        Ok(())
    }
}

/// The process a restart starts has handler connections of its own on PostgreSQL: the killed
/// one's went with its runtime, and a handler given one of them would fail its attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_handler_connections_on_postgres_are_the_new_processes() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let pool = store.pool().clone();
    dacapo::sqlx::query(EFFECTS).execute(&pool).await.unwrap();
    let mut harness = builder()
        .store(store)
        .module(
            Module::new("access").handle_named::<MemberRemoved, _>("revoke", RevokeOnItsConnection),
        )
        .build()
        .unwrap();
    let report = crashed_before_the_settle_and_restarted(&mut harness).await;
    assert_eq!(report.attempts, 2, "{report:?}");
    assert_eq!((effects_of!(pool))().await, ["revoke"]);
}

/// `advance` reports a crash on its way: a scheduled delivery that comes due within it and
/// crashes before its settle makes it return the crash (it returned nothing before).
#[tokio::test]
async fn an_advance_that_runs_into_a_crash_returns_it() {
    let setup = setup(Backend::Sqlite, |b| b).await;
    setup
        .harness
        .crash_at_message::<MemberRemoved>(Failpoint::BeforeSettle)
        .unwrap();
    let due = chrono::Utc::now() + chrono::Duration::seconds(30);
    let report = setup
        .harness
        .publish_with(
            &MemberRemoved { member_id: 7 },
            SendOptions::new().deliver_at(due),
        )
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Outcome::Scheduled(_)),
        "{report:?}"
    );

    crashed_at(
        setup.harness.advance(Duration::from_secs(60)).await,
        Failpoint::BeforeSettle,
    );
}

/// A restart cannot open a transport again: it says so, rather than starting a runtime that
/// delivers in-process what was routed to a broker and listens nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_whose_runtime_has_transports_refuses_to_restart() {
    let db = ScratchDatabase::postgres(&admin_url()).await.unwrap();
    let store = db.postgres_store().await.unwrap();
    let queue = dacapo::transport::PostgresQueue::connect(db.url(), "restarted").unwrap();
    let mut harness = builder()
        .store(store)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .configure(|runtime| runtime.transport(queue))
        .build()
        .unwrap();
    match harness.restart().await {
        Err(Error::Configuration(why)) => assert!(why.contains("transports"), "{why}"),
        other => panic!("restarted without its transports: {other:?}"),
    }
}

/// A listener's accept caught by the crash at its failpoint holds the virtual clock in the
/// caller's task, which the crash does not stop: the restart's first step on that clock is
/// bounded by the settle timeout, and says so, instead of waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_behind_an_accept_the_crash_caught_ends_within_the_settle_timeout() {
    let db = ScratchDatabase::sqlite();
    let store = db.sqlite_store().await.unwrap();
    let mut harness = TestHarness::builder()
        .settle_timeout(Duration::from_secs(2))
        .store(store)
        .module(Module::new("m").handle_named::<MemberRemoved, _>("h", Recorder::new()))
        .build()
        .unwrap();
    harness.crash_at(Failpoint::BeforeAcknowledge).unwrap();
    let listener = harness.runtime().listener();
    let envelope = Envelope::for_message(&MemberRemoved { member_id: 7 }).unwrap();
    let accepting = tokio::spawn(async move { listener.accept(envelope).await });
    crashed_at(harness.idle().await, Failpoint::BeforeAcknowledge);
    let restarted = tokio::time::timeout(Duration::from_secs(30), harness.restart())
        .await
        .expect("the restart ends");
    assert!(
        matches!(restarted, Ok(()) | Err(Error::NotSettled { .. })),
        "{restarted:?}"
    );
    accepting.abort();
}
