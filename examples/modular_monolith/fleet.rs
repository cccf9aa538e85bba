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
use crate::events::MemberRemoved;
use crate::{Handlers, audit, organizations, webhooks};

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

/// `--transport KIND URL`, and `--follow COUNT` in the process the lead started.
#[derive(Debug)]
pub(crate) struct Fleet {
    pub(crate) kind: Kind,
    pub(crate) url: String,
    /// Set in the follower: it stops once the audit holds this many entries.
    pub(crate) follow: Option<i64>,
}

/// The service's queue (RabbitMQ), consumer (NATS) or queue (PostgreSQL).
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
    match fleet.follow {
        Some(until) => follow(&target, postgres, &db, &fleet, until).await,
        None => lead(&target, postgres, &db, &fleet).await,
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

/// Waits until the audit holds `until` entries.
async fn audit_reaches(db: &Db, until: i64) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while audit::count(db).await? < until {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the audit did not reach {until} entries within {WAIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The follower: handles its share until every event is audited, then reports its counts.
async fn follow(
    target: &str,
    postgres: bool,
    db: &Db,
    fleet: &Fleet,
    until: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    let (runtime, _, handlers) = node(target, postgres, db, fleet, "modular-monolith-2").await?;
    println!("listening");
    audit_reaches(db, until).await?;
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
    let rows_before = webhooks::count(db).await?;
    let audit_before = audit::count(db).await?;
    let until = audit_before + EVENTS;
    let (runtime, pool, handlers) = node(target, postgres, db, fleet, "modular-monolith-1").await?;

    let mut follower = Command::new(std::env::current_exe()?)
        .args([
            "--database",
            target,
            "--transport",
            fleet.kind.name(),
            &fleet.url,
        ])
        .args(["--follow", &until.to_string()])
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
    let mut first = None;
    for member_id in 1..=EVENTS {
        let envelope = organizations
            .remove_member(organization_id, member_id)
            .await?;
        first.get_or_insert(envelope);
    }
    audit_reaches(db, until).await?;
    runtime.idle().await;
    // The broker redelivers the first event: the store both processes share discards it.
    let first = first.ok_or("events were published")?;
    let redelivered = runtime.receive_tracked(first).await?.await?;
    let discarded = redelivered.outcome == Outcome::Discarded(DiscardReason::DuplicateEnvelope);

    let exit = tokio::task::spawn_blocking(move || follower.wait()).await??;
    let theirs = lines
        .try_iter()
        .find_map(|line| Follower::parse(&line))
        .ok_or("the follower reported nothing")?;
    // Counted before this runtime stops: the handlers opened connections of `db` on the
    // runtime's threads, which a PostgreSQL connection cannot outlive.
    let rows = webhooks::count(db).await? - rows_before;
    let audit_rows = audit::count(db).await? - audit_before;
    let subscribed = webhooks::subscribed(db, organization_id).await?;
    let sent = handlers.sender.sent() + theirs.sent;
    let stats = runtime.stats();
    let clean = runtime.shutdown().await.is_clean();

    println!(
        "dacapo — modular monolith as two processes on {target}, events over {} at {}",
        fleet.kind.name(),
        fleet.url
    );
    println!("  events published            {EVENTS} (through the outbox, to the broker)");
    println!(
        "  handled here / there        {} / {} deliveries (events and the sends they cascaded)",
        stats.handled, theirs.handled
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
    println!("  webhook rows written        {rows} ({EVENTS} events x {subscribed} webhooks)");
    println!("  webhook sends requested     {sent}");
    println!("  audit entries written       {audit_rows}");
    println!("  redelivery discarded        {discarded}");

    let verdict = rows == EVENTS * subscribed
        && sent == rows
        && audit_rows == EVENTS
        && discarded
        && clean
        && theirs.clean
        && exit.success();
    if verdict {
        println!("OK: two processes on one broker and one store, each effect once");
        Ok(())
    } else {
        Err(format!(
            "duplicates or losses: {rows} rows, {sent} sends, {audit_rows} audit entries, \
             follower {exit}"
        )
        .into())
    }
}
