//! The main job as a fleet: two processes of the same service on one store, each consuming
//! `organization.member_removed` from a broker, so each handles a share of the events. This
//! process (the lead) starts the other (the follower, `--follow`), publishes the events through
//! the outbox, and checks, in the database both wrote to, that every event had its effects once.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::transport::Transport;
use dacapo::{DiscardReason, Outcome};

use crate::db::Db;
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "postgres"))]
use crate::events::MemberRemoved;
use crate::node_lock::NodeLock;
use crate::{Handlers, audit, effects, organizations, webhooks};

/// Events the lead publishes.
const EVENTS: i64 = 6;

/// How long either process waits for the other, or for the broker.
const WAIT: Duration = Duration::from_secs(60);

/// Which broker carries the events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    RabbitMq,
    Nats,
    PostgresQueue,
}

impl Kind {
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        match text {
            "rabbitmq" => Ok(Self::RabbitMq),
            "nats" => Ok(Self::Nats),
            "postgres-queue" => Ok(Self::PostgresQueue),
            other => Err(format!(
                "unknown transport {other:?}: choose rabbitmq, nats, postgres-queue"
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq",
            Self::Nats => "nats",
            Self::PostgresQueue => "postgres-queue",
        }
    }
}

/// `--transport KIND URL`, and `--follow` in the process the lead started.
#[derive(Debug)]
pub(crate) struct Fleet {
    pub(crate) kind: Kind,
    pub(crate) url: String,
    /// Set in the follower, which the lead started.
    pub(crate) follow: bool,
}

/// The service's queue (RabbitMQ), consumer (NATS) or queue (PostgreSQL).
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "postgres"))]
const SERVICE: &str = "modular-monolith";

fn transport(kind: Kind, url: &str) -> Result<Transport, Box<dyn std::error::Error>> {
    let _ = url;
    match kind {
        #[cfg(feature = "rabbitmq")]
        Kind::RabbitMq => Ok(dacapo::transport::RabbitMq::new(url, SERVICE)
            .route::<MemberRemoved>()
            .into()),
        #[cfg(feature = "nats")]
        Kind::Nats => Ok(dacapo::transport::Nats::new(url, SERVICE)
            .route::<MemberRemoved>()
            .into()),
        #[cfg(feature = "postgres")]
        Kind::PostgresQueue => Ok(dacapo::transport::PostgresQueue::connect(url, SERVICE)?
            .route::<MemberRemoved>()
            .into()),
        #[allow(unreachable_patterns)]
        other => Err(format!(
            "the {} transport needs its feature: cargo run --features {} --example modular_monolith -- …",
            other.name(),
            match other {
                Kind::PostgresQueue => "postgres",
                _ => other.name(),
            }
        )
        .into()),
    }
}

pub(crate) async fn run(target: String, fleet: Fleet) -> Result<(), Box<dyn std::error::Error>> {
    let postgres = target.starts_with("postgres://") || target.starts_with("postgresql://");
    let db = Db::connect(&target, postgres).await?;
    if fleet.follow {
        follow(&target, postgres, &db, &fleet).await
    } else {
        lead(&target, postgres, &db, &fleet).await
    }
}

/// One node of the service: the store, the modules and the broker, listening.
async fn node(
    target: &str,
    postgres: bool,
    db: &Db,
    fleet: &Fleet,
    name: &str,
) -> Result<(Runtime, crate::db::StorePool, Handlers), Box<dyn std::error::Error>> {
    let (builder, pool) = crate::runtime_with_store(target, postgres, name).await?;
    let (builder, handlers) = crate::with_modules(builder, db);
    let runtime = builder
        .transport(transport(fleet.kind, &fleet.url)?)
        .build()?;
    tokio::time::timeout(WAIT, runtime.listening())
        .await
        .map_err(|_| {
            format!(
                "{} at {} did not answer within {WAIT:?}",
                fleet.kind.name(),
                fleet.url
            )
        })??;
    Ok((runtime, pool, handlers))
}

/// Waits until each of `events` had all its effects, in whichever process, for up to [`WAIT`].
async fn effects_of(
    db: &Db,
    organization_id: i64,
    events: &[uuid::Uuid],
) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let effects = effects::of(db, organization_id, events).await?;
        if effects.complete() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "events without every effect after {WAIT:?}: {:?}",
                effects.incomplete
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The follower: handles its share until its standard input closes — the lead closes it when
/// it is done, and the system closes it when the lead dies — then reports its counts.
async fn follow(
    target: &str,
    postgres: bool,
    db: &Db,
    fleet: &Fleet,
) -> Result<(), Box<dyn std::error::Error>> {
    // Taken first, so it is let go last: after the runtime stopped.
    let _lock = NodeLock::take(target, postgres, "modular-monolith-2").await?;
    let (runtime, _, handlers) = node(target, postgres, db, fleet, "modular-monolith-2").await?;
    println!("listening");
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = closed_tx.send(());
    });
    let _ = closed.await;
    runtime.idle().await;
    let stats = runtime.stats();
    let clean = runtime.shutdown().await.is_clean();
    println!(
        "follower handled={} sent={} failures={} runs={} clean={clean}",
        stats.handled,
        handlers.sender.sent(),
        handlers.revoke.failures(),
        handlers.webhooks.runs()
    );
    if clean {
        Ok(())
    } else {
        Err("the follower did not shut down cleanly".into())
    }
}

/// What the follower printed last: its counts.
#[derive(Debug, Default)]
struct Follower {
    handled: u64,
    sent: i64,
    failures: usize,
    runs: usize,
    clean: bool,
}

impl Follower {
    fn parse(line: &str) -> Option<Self> {
        let mut follower = Self::default();
        for field in line.strip_prefix("follower ")?.split_whitespace() {
            let (name, value) = field.split_once('=')?;
            match name {
                "handled" => follower.handled = value.parse().ok()?,
                "sent" => follower.sent = value.parse().ok()?,
                "failures" => follower.failures = value.parse().ok()?,
                "runs" => follower.runs = value.parse().ok()?,
                "clean" => follower.clean = value.parse().ok()?,
                _ => return None,
            }
        }
        Some(follower)
    }
}

async fn lead(
    target: &str,
    postgres: bool,
    db: &Db,
    fleet: &Fleet,
) -> Result<(), Box<dyn std::error::Error>> {
    organizations::migrate(db).await?;
    webhooks::migrate(db).await?;
    audit::migrate(db).await?;
    let organization_id = organizations::seed(db).await?;
    // Taken first, so it is let go last: after the runtime stopped.
    let _lock = NodeLock::take(target, postgres, "modular-monolith-1").await?;
    let (runtime, pool, handlers) = node(target, postgres, db, fleet, "modular-monolith-1").await?;
    // What a run cut short left under this node's id is finished before this run's events.
    runtime.first_recovery().await;
    runtime.idle().await;
    let leftovers = runtime.stats().handled;

    let mut follower = Command::new(std::env::current_exe()?)
        .args([
            "--database",
            target,
            "--transport",
            fleet.kind.name(),
            &fleet.url,
            "--follow",
        ])
        // The follower runs until its standard input closes: when this process says so, or
        // when it dies.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = follower.stdout.take().ok_or("the follower has no stdout")?;
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let listening = tokio::task::block_in_place(|| lines.recv_timeout(WAIT));
    if listening.as_deref() != Ok("listening") {
        let _ = follower.kill();
        return Err("the follower did not start listening".into());
    }

    let organizations = organizations::Organizations::new(&runtime, pool);
    let mut ours = Vec::new();
    let mut first = None;
    for member_id in 1..=EVENTS {
        let envelope = organizations
            .remove_member(organization_id, member_id)
            .await?;
        ours.push(envelope.id);
        first.get_or_insert(envelope);
    }
    // Every event announced so far, this run's and any a run cut short left with the broker:
    // a message a killed node had taken and not acknowledged comes back after the broker's
    // own timeout (JetStream's ack wait).
    effects_of(db, organization_id, &effects::announced(db).await?).await?;
    runtime.idle().await;
    // The broker redelivers the first event: the store both processes share discards it.
    let first = first.ok_or("events were published")?;
    let redelivered = runtime.receive_tracked(first).await?.await?;
    let discarded = redelivered.outcome == Outcome::Discarded(DiscardReason::DuplicateEnvelope);

    drop(follower.stdin.take());
    let exit = tokio::task::spawn_blocking(move || follower.wait()).await??;
    let theirs = lines
        .try_iter()
        .find_map(|line| Follower::parse(&line))
        .ok_or("the follower reported nothing")?;
    // Counted before this runtime stops: the handlers opened connections of `db` on the
    // runtime's threads, which a PostgreSQL connection cannot outlive.
    let this_run = effects::of(db, organization_id, &ours).await?;
    let all_runs = effects::of(db, organization_id, &effects::announced(db).await?).await?;
    let subscribed = webhooks::subscribed(db, organization_id).await?;
    let stats = runtime.stats();
    let clean = runtime.shutdown().await.is_clean();

    println!(
        "dacapo — modular monolith as two processes on {target}, events over {} at {}",
        fleet.kind.name(),
        fleet.url
    );
    if leftovers > 0 {
        println!("  left by a run cut short     {leftovers} deliveries, finished first");
    }
    println!("  events published            {EVENTS} (through the outbox, to the broker)");
    println!(
        "  handled here / there        {} / {} deliveries (events and the sends they cascaded)",
        stats.handled - leftovers,
        theirs.handled
    );
    println!(
        "  webhooks handler runs       {} here, {} there",
        handlers.webhooks.runs(),
        theirs.runs
    );
    println!(
        "  workspaces failures         {} here, {} there (each retried)",
        handlers.revoke.failures(),
        theirs.failures
    );
    println!(
        "  webhook rows written        {} ({EVENTS} events x {subscribed} webhooks)",
        this_run.rows
    );
    println!(
        "  webhook sends               {} ({} here, {} there; {} repeated)",
        this_run.sent,
        handlers.sender.sent(),
        theirs.sent,
        this_run.repeated_sends
    );
    println!("  audit entries written       {}", this_run.audited);
    println!("  redelivery discarded        {discarded}");
    println!("{}", all_runs.of_all_runs());

    let verdict = this_run.complete()
        && this_run.rows == ours.len() * usize::try_from(subscribed)?
        && this_run.repeated_sends == 0
        && all_runs.complete()
        && discarded
        && clean
        && theirs.clean
        && exit.success();
    if verdict {
        println!("OK: two processes on one broker and one store, each effect once");
        Ok(())
    } else {
        Err(format!(
            "duplicates or losses: this run {this_run:?}; all runs: events without every \
             effect {:?}; follower {exit}",
            all_runs.incomplete
        )
        .into())
    }
}
