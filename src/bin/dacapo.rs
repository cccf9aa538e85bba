//! `dacapo`: inspect and act on a store's dead letters and scheduled envelopes from the
//! command line.
//!
//! ```text
//! dacapo dead-letters list        --database dacapo.db
//! dacapo dead-letters show ID     --database postgres://postgres@127.0.0.1/app
//! dacapo dead-letters replay ID   --database dacapo.db
//! dacapo dead-letters purge       --database dacapo.db
//! dacapo scheduled list           --database dacapo.db
//! dacapo scheduled cancel ID      --database dacapo.db
//! ```
//!
//! `--json` prints machine-readable output. A replay hands the envelope back to the inbox,
//! unowned and with a fresh attempt count, for a running node to pick up.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use dacapo::DeadLetter;
use dacapo::ports::{DeadLetterStore, Inbox, Replay, ReplayTo};
use dacapo::store::{PostgresStore, SqliteStore};
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(
    name = "dacapo",
    version,
    about = "Inspect and replay dacapo dead letters; list and cancel scheduled envelopes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Messages the runtime gave up on.
    #[command(subcommand)]
    DeadLetters(DeadLetters),
    /// Envelopes published for a later time and not started yet.
    #[command(subcommand)]
    Scheduled(Scheduled),
}

#[derive(Debug, Subcommand)]
enum Scheduled {
    /// Every scheduled envelope, soonest first.
    List(Target),
    /// Cancels a scheduled envelope that has not started: it is settled and never runs.
    Cancel {
        /// The envelope id.
        id: Uuid,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Debug, Subcommand)]
enum DeadLetters {
    /// Every dead letter, oldest failure first.
    List(Target),
    /// One dead letter: its envelope, reason and every attempt's failures.
    Show {
        /// The envelope id.
        id: Uuid,
        #[command(flatten)]
        target: Target,
    },
    /// Hands the envelope back to the inbox (same id, fresh attempt count) for a running node.
    Replay {
        /// The envelope id.
        id: Uuid,
        #[command(flatten)]
        target: Target,
    },
    /// Removes every dead letter.
    Purge(Target),
}

#[derive(Debug, Args)]
struct Target {
    /// A SQLite file path (or `sqlite:` URL), or a `postgres://` URL.
    #[arg(long)]
    database: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// The store behind `--database`.
enum Store {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

impl Store {
    async fn open(database: &str) -> Result<Self, dacapo::EngineError> {
        if database.starts_with("postgres://") || database.starts_with("postgresql://") {
            Ok(Self::Postgres(PostgresStore::connect(database).await?))
        } else {
            Ok(Self::Sqlite(SqliteStore::open(database).await?))
        }
    }

    fn dead_letters(&self) -> &dyn DeadLetterStore {
        match self {
            Self::Sqlite(store) => store,
            Self::Postgres(store) => store,
        }
    }

    fn inbox(&self) -> &dyn Inbox {
        match self {
            Self::Sqlite(store) => store,
            Self::Postgres(store) => store,
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("dacapo: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let command = match cli.command {
        Command::DeadLetters(command) => command,
        Command::Scheduled(command) => return scheduled(command).await,
    };
    match command {
        DeadLetters::List(target) => {
            let store = Store::open(&target.database).await?;
            let letters = store.dead_letters().list().await?;
            if target.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&letters.iter().map(summary).collect::<Vec<_>>())?
                );
            } else if letters.is_empty() {
                println!("no dead letters");
            } else {
                println!(
                    "{:<32}  {:<32}  {:>8}  {:<25}  reason",
                    "id", "type", "attempts", "last failure"
                );
                for letter in &letters {
                    println!(
                        "{:<32}  {:<32}  {:>8}  {:<25}  {}",
                        letter.envelope.id.simple(),
                        letter.envelope.message_type,
                        letter.attempts,
                        letter
                            .last_failure_at
                            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                        letter.reason
                    );
                }
            }
        }
        DeadLetters::Show { id, target } => {
            let store = Store::open(&target.database).await?;
            let letter = store
                .dead_letters()
                .get(id)
                .await?
                .ok_or_else(|| format!("no dead letter with id {id}"))?;
            if target.json {
                println!("{}", serde_json::to_string_pretty(&detail(&letter))?);
            } else {
                print_detail(&letter);
            }
        }
        DeadLetters::Replay { id, target } => {
            let store = Store::open(&target.database).await?;
            // One transaction: the letter leaves the dead letters exactly when its envelope
            // is back in the inbox, unowned, for a running node to pick up.
            match store.inbox().replay(id, ReplayTo::AnyNode).await? {
                Replay::Replayed(_) => {}
                Replay::InProgress => {
                    return Err(format!(
                        "{id} is being delivered right now (replayed already); nothing was replayed"
                    )
                    .into());
                }
                _ => return Err(format!("no dead letter with id {id}").into()),
            }
            if target.json {
                println!("{}", serde_json::json!({ "replayed": id }));
            } else {
                println!(
                    "replayed {}: back in the inbox for a running node, attempts reset",
                    id.simple()
                );
            }
        }
        DeadLetters::Purge(target) => {
            let store = Store::open(&target.database).await?;
            let purged = store.dead_letters().purge().await?;
            if target.json {
                println!("{}", serde_json::json!({ "purged": purged }));
            } else {
                println!("purged {purged} dead letter(s)");
            }
        }
    }
    Ok(())
}

async fn scheduled(command: Scheduled) -> Result<(), Box<dyn std::error::Error>> {
    match command {
        Scheduled::List(target) => {
            let store = Store::open(&target.database).await?;
            let waiting = store.inbox().scheduled(usize::MAX).await?;
            if target.json {
                let rows: Vec<serde_json::Value> = waiting
                    .iter()
                    .map(|s| {
                        serde_json::json!({
                            "id": s.envelope.id,
                            "message_type": s.envelope.message_type,
                            "due_at": s.due_at,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if waiting.is_empty() {
                println!("no scheduled envelopes");
            } else {
                println!("{:<32}  {:<32}  due at", "id", "type");
                for s in &waiting {
                    println!(
                        "{:<32}  {:<32}  {}",
                        s.envelope.id.simple(),
                        s.envelope.message_type,
                        s.due_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    );
                }
            }
        }
        Scheduled::Cancel { id, target } => {
            let store = Store::open(&target.database).await?;
            if !store.inbox().cancel_scheduled(id).await? {
                return Err(format!(
                    "no scheduled envelope {id} waits (unknown, started, or settled)"
                )
                .into());
            }
            if target.json {
                println!("{}", serde_json::json!({ "cancelled": id }));
            } else {
                println!("cancelled {}: it will not run", id.simple());
            }
        }
    }
    Ok(())
}

fn summary(letter: &DeadLetter) -> serde_json::Value {
    serde_json::json!({
        "id": letter.envelope.id,
        "message_type": letter.envelope.message_type,
        "reason": letter.reason.to_string(),
        "attempts": letter.attempts,
        "first_failure_at": letter.first_failure_at,
        "last_failure_at": letter.last_failure_at,
    })
}

fn detail(letter: &DeadLetter) -> serde_json::Value {
    let mut value = summary(letter);
    value["payload"] = serde_json::from_slice(&letter.envelope.payload).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&letter.envelope.payload).into_owned())
    });
    value["headers"] = serde_json::json!(letter.envelope.headers);
    value["correlation_id"] = serde_json::json!(letter.envelope.correlation_id);
    value["failures"] = serde_json::json!(letter.failures);
    value
}

fn print_detail(letter: &DeadLetter) {
    let envelope = &letter.envelope;
    println!("dead letter {}", envelope.id);
    println!("  type            {}", envelope.message_type);
    println!("  reason          {}", letter.reason);
    println!("  attempts        {}", letter.attempts);
    println!("  first failure   {}", letter.first_failure_at.to_rfc3339());
    println!("  last failure    {}", letter.last_failure_at.to_rfc3339());
    if let Some(id) = envelope.correlation_id {
        println!("  correlation id  {id}");
    }
    println!(
        "  payload         {}",
        String::from_utf8_lossy(&envelope.payload)
    );
    for failure in &letter.failures {
        println!("  attempt {}: {}", failure.attempt, failure);
        for handler in &failure.failures {
            println!("    - {handler}");
        }
    }
}
