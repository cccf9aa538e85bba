//! The main job: a modular monolith whose modules react to `organization.member_removed`.
//!
//! - `organizations` announces the event through the transactional outbox, in the transaction
//!   that records the change;
//! - `workspaces` revokes access, and is made to fail once, so the whole delivery is retried;
//! - `webhooks` queues one delivery row per subscribed webhook, with ids derived from the
//!   message id, so the retry finds its rows and queues nothing twice, and sends each;
//! - `audit` records one entry per message under a unique index, and refuses to record one
//!   without a message id.
//!
//! Run it with `cargo run --example modular_monolith` (add `-- --database PATH` to choose the
//! SQLite file; the default is `dacapo.db`), or on PostgreSQL with
//! `cargo run --features postgres --example modular_monolith -- --database postgres://…`.
//! Killed at any point and run again, it first finishes what the killed run left, then checks
//! every event ever announced in the database had each of its effects.

// The modules of the monolith, one file each, in `examples/modular_monolith/`.
#[path = "modular_monolith/audit.rs"]
mod audit;
#[path = "modular_monolith/db.rs"]
mod db;
#[path = "modular_monolith/effects.rs"]
mod effects;
#[path = "modular_monolith/events.rs"]
mod events;
#[path = "modular_monolith/fleet.rs"]
mod fleet;
#[path = "modular_monolith/node_lock.rs"]
mod node_lock;
#[path = "modular_monolith/organizations.rs"]
mod organizations;
#[path = "modular_monolith/webhooks.rs"]
mod webhooks;
#[path = "modular_monolith/workspaces.rs"]
mod workspaces;

use dacapo::RuntimeBuilder;
use dacapo::prelude::*;
use dacapo::store::SqliteStore;
use dacapo::{DiscardReason, Outcome};

use crate::events::{MemberRemoved, WebhookDeliveryRequested};

fn main() -> std::process::ExitCode {
    let (target, fleet) = match parse_args(std::env::args().skip(1)) {
        Ok(Args::Run { database, fleet }) => (database, fleet),
        Ok(Args::Help) => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("modular_monolith: {error}\n\n{USAGE}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let job = async move {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            // Logs on stderr: stdout is the job's report (and the follower's to the lead).
            .with_writer(std::io::stderr)
            .init();
        match fleet {
            None => run(target).await,
            Some(fleet) => fleet::run(target, fleet).await,
        }
    };
    match runtime.block_on(job) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("modular_monolith: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(target: String) -> Result<(), Box<dyn std::error::Error>> {
    // One database holds the runtime's inbox and dead letters and the modules' own tables: a
    // SQLite file by default, PostgreSQL when given a URL.
    let postgres = target.starts_with("postgres://") || target.starts_with("postgresql://");
    let _node = node_lock::NodeLock::take(&target, postgres, "modular-monolith").await?;
    let (builder, store_pool) = runtime_with_store(&target, postgres, "modular-monolith").await?;
    let db = db::Db::connect(&target, postgres).await?;
    organizations::migrate(&db).await?;
    webhooks::migrate(&db).await?;
    audit::migrate(&db).await?;
    let organization_id = organizations::seed(&db).await?;
    // What earlier runs published within the last four minutes, to replay below: well inside
    // the inbox's retention (5 minutes), so that every one is still there to be discarded.
    let earlier = organizations::recently_published(&db, 4).await?;

    let (
        builder,
        Handlers {
            revoke,
            webhooks,
            sender: _,
        },
    ) = with_modules(builder, &db);
    let runtime = builder.build()?;
    // A run that was cut short (a kill -9, a power cut) left deliveries unsettled and
    // envelopes in the outbox: restarted under the same node id, the runtime finishes them
    // first, and this run reports on its own events only.
    runtime.first_recovery().await;
    runtime.idle().await;
    let leftovers = runtime.stats().handled;

    let organizations = organizations::Organizations::new(&runtime, store_pool);
    let mut published = Vec::new();
    for member_id in 1..=3 {
        let envelope = organizations
            .remove_member(organization_id, member_id)
            .await?;
        published.push(envelope);
    }
    runtime.idle().await;

    // The broker redelivers the first event (say its ack was lost), and, after this restart,
    // everything earlier runs published: the durable inbox discards all of them.
    let mut replayed = vec![published[0].clone()];
    replayed.extend(earlier.iter().cloned());
    let mut discarded = 0;
    for envelope in replayed.iter().cloned() {
        let report = runtime.receive_tracked(envelope).await?.await?;
        if report.outcome == Outcome::Discarded(DiscardReason::DuplicateEnvelope) {
            discarded += 1;
        }
    }
    runtime.idle().await;

    // Outside a consumer there is no message id: the audit refuses to invent one.
    let detached = audit::RecordEntry::new(db.clone())
        .handle(
            &MemberRemoved {
                organization_id,
                member_id: 99,
            },
            &MessageContext::detached(),
        )
        .await;

    let backlog = runtime.outbox_backlog().await?.map_or(0, |b| b.depth);
    let stats = runtime.stats();
    let ours: Vec<_> = published.iter().map(|envelope| envelope.id).collect();
    let this_run = effects::of(&db, organization_id, &ours).await?;
    let all_runs = effects::of(&db, organization_id, &effects::announced(&db).await?).await?;
    let subscribed = webhooks::subscribed(&db, organization_id).await?;
    let report = runtime.shutdown().await;

    println!("dacapo — modular monolith on {target}");
    if leftovers > 0 {
        println!("  left by a run cut short     {leftovers} deliveries, finished first");
    }
    println!(
        "  events published            {} (each enlisted in the outbox with its change)",
        published.len()
    );
    println!(
        "  deliveries handled          {} (events and the webhook sends they cascaded)",
        stats.handled - leftovers
    );
    println!("  outbox backlog after idle   {backlog}");
    println!("  attempts                    {}", stats.attempts);
    println!("  retries                     {}", stats.retried);
    println!("  dead letters                {}", stats.dead_lettered);
    println!(
        "  redeliveries discarded      {discarded} of {} (1 from this run, {} from earlier runs)",
        replayed.len(),
        earlier.len()
    );
    println!("  workspaces handler failures {}", revoke.failures());
    println!("  webhooks handler runs       {}", webhooks.runs());
    println!(
        "  webhook rows written        {} ({} events x {subscribed} webhooks)",
        this_run.rows, this_run.events
    );
    println!("  webhook rows found existing {}", webhooks.skipped());
    println!(
        "  webhook sends               {} ({} repeated)",
        this_run.sent, this_run.repeated_sends
    );
    println!("  audit entries written       {}", this_run.audited);
    println!(
        "  audit without a message id  {}",
        detached
            .err()
            .map_or_else(|| "accepted (wrong!)".into(), |e| format!("refused: {e}"))
    );
    println!("{}", all_runs.of_all_runs());

    let expected_rows = this_run.events * usize::try_from(subscribed)?;
    let verdict = this_run.complete()
        && this_run.rows == expected_rows
        && this_run.repeated_sends == 0
        && all_runs.complete()
        && discarded == replayed.len()
        && backlog == 0
        && stats.retried >= 1
        && report.is_clean();
    if verdict {
        println!("OK: the retry reran every handler and wrote no duplicate");
        Ok(())
    } else {
        Err(format!(
            "duplicates or losses: this run {this_run:?}; all runs: events without every \
             effect {:?}",
            all_runs.incomplete
        )
        .into())
    }
}

/// The handlers whose counts the job reports.
pub(crate) struct Handlers {
    pub(crate) revoke: workspaces::RevokeAccess,
    pub(crate) webhooks: webhooks::QueueDeliveries,
    pub(crate) sender: webhooks::SendDelivery,
}

/// `builder` with the modules that react to `organization.member_removed`.
pub(crate) fn with_modules(builder: RuntimeBuilder, db: &db::Db) -> (RuntimeBuilder, Handlers) {
    let webhooks = webhooks::QueueDeliveries::new(db.clone());
    let sender = webhooks::SendDelivery::new(db.clone());
    let revoke = workspaces::RevokeAccess::failing_once();
    let builder = builder
        .module(Module::new("workspaces").handle::<MemberRemoved, _>(revoke.clone()))
        .module(
            Module::new("webhooks")
                .handle::<MemberRemoved, _>(webhooks.clone())
                .handle::<WebhookDeliveryRequested, _>(sender.clone()),
        )
        .module(
            Module::new("audit").handle::<MemberRemoved, _>(audit::RecordEntry::new(db.clone())),
        );
    (
        builder,
        Handlers {
            revoke,
            webhooks,
            sender,
        },
    )
}

/// The runtime builder with the store for `target`, and the store's pool for the outbox.
pub(crate) async fn runtime_with_store(
    target: &str,
    postgres: bool,
    node: &str,
) -> Result<(RuntimeBuilder, db::StorePool), Box<dyn std::error::Error>> {
    if !postgres {
        let store = SqliteStore::open(target).await?.node_id(node);
        let pool = db::StorePool::Sqlite(store.pool().clone());
        return Ok((Runtime::builder().store(store), pool));
    }
    #[cfg(feature = "postgres")]
    {
        let store = dacapo::store::PostgresStore::connect(target)
            .await?
            .node_id(node);
        let pool = db::StorePool::Postgres(store.pool().clone());
        Ok((Runtime::builder().store(store), pool))
    }
    #[cfg(not(feature = "postgres"))]
    {
        Err("a PostgreSQL URL needs the `postgres` feature: cargo run --features postgres --example modular_monolith -- --database URL".into())
    }
}

const USAGE: &str = "\
The main job: a modular monolith whose modules react to organization.member_removed; a retry
reruns every handler and writes no duplicate.

Usage: modular_monolith [--database TARGET] [--transport KIND URL]

Options:
  --database TARGET     a SQLite file path (default dacapo.db) or a postgres:// URL
                        (PostgreSQL needs --features postgres)
  --transport KIND URL  run as two processes (this one starts the other) sharing the
                        store and consuming member_removed from a broker: KIND is
                        rabbitmq (amqp://…, --features rabbitmq), nats (nats://…,
                        --features nats) or postgres-queue (postgres://…, --features
                        postgres)
  -h, --help            print this help

Logs: RUST_LOG (default warn), e.g. RUST_LOG=dacapo=info.";

/// What the command line asks for.
#[derive(Debug)]
enum Args {
    Run {
        database: String,
        fleet: Option<fleet::Fleet>,
    },
    Help,
}

/// `--database TARGET` (default `dacapo.db`), `--transport KIND URL`, `--help`, and the
/// second process's own `--follow`; anything else is refused.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut database = None;
    let mut transport = None;
    let mut follow = false;
    let value = |arg: Option<String>, what: &str| match arg {
        Some(value) if !value.starts_with("--") => Ok(value),
        _ => Err(what.to_owned()),
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(Args::Help),
            "--database" => {
                database = Some(value(
                    args.next(),
                    "--database needs a value: a SQLite file path or a postgres:// URL",
                )?);
            }
            "--transport" => {
                let kind = value(
                    args.next(),
                    "--transport needs a kind (rabbitmq, nats, postgres-queue) and a URL",
                )?;
                let kind = fleet::Kind::parse(&kind)?;
                let url = value(args.next(), "--transport needs a URL after its kind")?;
                transport = Some((kind, url));
            }
            "--follow" => follow = true,
            other => {
                if let Some(target) = other.strip_prefix("--database=") {
                    database = Some(target.to_owned());
                } else {
                    return Err(format!("unknown argument {other:?}"));
                }
            }
        }
    }
    let fleet = match (transport, follow) {
        (Some((kind, url)), follow) => Some(fleet::Fleet { kind, url, follow }),
        (None, true) => return Err("--follow is for the second process of --transport".into()),
        (None, false) => None,
    };
    Ok(Args::Run {
        database: database.unwrap_or_else(|| "dacapo.db".to_owned()),
        fleet,
    })
}

#[cfg(test)]
mod tests {
    use super::{Args, parse_args};

    fn parse(args: &[&str]) -> Result<Args, String> {
        parse_args(args.iter().map(|a| (*a).to_owned()))
    }

    #[test]
    fn help_is_answered_instead_of_running() {
        assert!(matches!(parse(&["--help"]), Ok(Args::Help)));
        assert!(matches!(
            parse(&["--database", "x.db", "-h"]),
            Ok(Args::Help)
        ));
    }

    #[test]
    fn the_database_defaults_to_a_file_and_is_taken_in_both_spellings() {
        assert!(
            matches!(parse(&[]), Ok(Args::Run { database, fleet: None }) if database == "dacapo.db")
        );
        assert!(
            matches!(parse(&["--database", "a.db"]), Ok(Args::Run { database, .. }) if database == "a.db")
        );
        assert!(
            matches!(parse(&["--database=b.db"]), Ok(Args::Run { database, .. }) if database == "b.db")
        );
    }

    #[test]
    fn a_transport_takes_a_known_kind_and_a_url() {
        let parsed = parse(&["--transport", "nats", "nats://127.0.0.1:4222"]);
        assert!(
            matches!(&parsed, Ok(Args::Run { fleet: Some(fleet), .. })
                if fleet.url == "nats://127.0.0.1:4222" && !fleet.follow),
            "{parsed:?}"
        );
        assert!(
            parse(&["--transport", "kafka", "x"])
                .unwrap_err()
                .contains("rabbitmq, nats, postgres-queue")
        );
        assert!(
            parse(&["--transport", "nats"])
                .unwrap_err()
                .contains("needs a URL")
        );
        assert!(parse(&["--follow"]).unwrap_err().contains("second process"));
    }

    #[test]
    fn unknown_flags_and_a_missing_value_are_refused() {
        assert_eq!(
            parse(&["--databse", "a.db"]).err().unwrap(),
            "unknown argument \"--databse\""
        );
        assert!(
            parse(&["--database"])
                .unwrap_err()
                .contains("needs a value")
        );
        assert!(
            parse(&["--database", "--help"])
                .unwrap_err()
                .contains("needs a value")
        );
    }
}
