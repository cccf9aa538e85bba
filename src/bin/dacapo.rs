//! `dacapo`: inspect and act on a store's dead letters and scheduled envelopes from the
//! command line.
//!
//! ```text
//! dacapo dead-letters list [--type T] [--since 1h|2026-12-01T10:00:00Z] [--limit N]
//! dacapo dead-letters show ID
//! dacapo dead-letters replay ID | --type T | --all
//! dacapo dead-letters purge [--type T] [--since …] [--yes]
//! dacapo scheduled list
//! dacapo scheduled cancel ID
//! ```
//!
//! The database comes from `--database` (a SQLite file path, a `sqlite:` URL, or a
//! `postgres://` URL) or `DACAPO_DATABASE_URL`. The tool never creates or migrates a schema:
//! a database without one is an error. `--json` prints machine-readable output, errors
//! included. A replay hands the envelope back to the inbox, unowned and with a fresh attempt
//! count, for a running node to pick up.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand};
use dacapo::ports::{DeadLetterStore, Inbox, Replay, ReplayTo};
use dacapo::store::{PostgresStore, SqliteStore};
use dacapo::{DeadLetter, DeadLetterFilter};
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(
    name = "dacapo",
    version,
    about = "Inspect and replay dacapo dead letters; list and cancel scheduled envelopes"
)]
struct Cli {
    /// A SQLite file path (or `sqlite:` URL), or a `postgres://` URL.
    #[arg(long, global = true, env = "DACAPO_DATABASE_URL")]
    database: Option<String>,
    /// Print JSON instead of text, errors included.
    #[arg(long, global = true)]
    json: bool,
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
    List,
    /// Cancels a scheduled envelope that has not started: it is settled and never runs.
    Cancel {
        /// The envelope id.
        id: Uuid,
    },
}

#[derive(Debug, Subcommand)]
enum DeadLetters {
    /// Dead letters, oldest failure first.
    List(Filter),
    /// One dead letter: its envelope, reason and its attempts' failures.
    Show {
        /// The envelope id.
        id: Uuid,
    },
    /// Hands envelopes back to the inbox (same id, fresh attempt count) for a running node.
    Replay {
        /// The envelope id (or `--type`, or `--all`).
        #[arg(required_unless_present_any = ["message_type", "all"], conflicts_with_all = ["message_type", "all"])]
        id: Option<Uuid>,
        /// Every dead letter (narrowed by `--since`, `--limit`).
        #[arg(long, conflicts_with = "message_type")]
        all: bool,
        #[command(flatten)]
        filter: Filter,
    },
    /// Removes dead letters for good (all of them unless narrowed).
    Purge {
        #[command(flatten)]
        filter: Filter,
        /// Do not ask for confirmation (needed when standard input is not a terminal).
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Args)]
struct Filter {
    /// Only this message type.
    #[arg(long = "type", value_name = "TYPE")]
    message_type: Option<String>,
    /// Only letters whose last failure is this recent: a duration ago (`90s`, `30m`, `2h`,
    /// `7d`) or an RFC 3339 time.
    #[arg(long, value_parser = parse_since, value_name = "WHEN")]
    since: Option<DateTime<Utc>>,
    /// At most this many, oldest failure first.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
}

impl Filter {
    fn to_filter(&self) -> DeadLetterFilter {
        let mut filter = DeadLetterFilter::all();
        if let Some(message_type) = &self.message_type {
            filter = filter.message_type(message_type.clone());
        }
        if let Some(since) = self.since {
            filter = filter.since(since);
        }
        if let Some(limit) = self.limit {
            filter = filter.limit(limit);
        }
        filter
    }
}

fn parse_since(text: &str) -> Result<DateTime<Utc>, String> {
    let unit = |suffix: char, seconds: i64| {
        text.strip_suffix(suffix)
            .and_then(|n| n.parse::<i64>().ok())
            .and_then(|n| n.checked_mul(seconds))
    };
    let ago = unit('s', 1)
        .or_else(|| unit('m', 60))
        .or_else(|| unit('h', 3_600))
        .or_else(|| unit('d', 86_400));
    if let Some(seconds) = ago {
        return chrono::TimeDelta::try_seconds(seconds)
            .and_then(|ago| Utc::now().checked_sub_signed(ago))
            .ok_or_else(|| format!("{text} is too far back"));
    }
    DateTime::parse_from_rfc3339(text)
        .map(|at| at.with_timezone(&Utc))
        .map_err(|_| {
            format!("{text:?} is neither a duration (90s, 30m, 2h, 7d) nor an RFC 3339 time")
        })
}

/// Why the tool stopped, to tell the user.
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(error: E) -> Self {
        Self(error.to_string())
    }
}

/// The store behind `--database`, opened without creating or migrating anything.
enum Store {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

impl Store {
    async fn open(database: Option<&str>) -> Result<Self, Failure> {
        let Some(database) = database.filter(|d| !d.is_empty()) else {
            return Err(Failure(
                "no database given: pass --database, or set DACAPO_DATABASE_URL".to_owned(),
            ));
        };
        if database.starts_with("postgres://") || database.starts_with("postgresql://") {
            return Ok(Self::Postgres(
                PostgresStore::connect_existing(database).await?,
            ));
        }
        if let Some((kind, _)) = database.split_once("://")
            && kind != "sqlite"
        {
            return Err(Failure(format!(
                "{kind}:// databases are not supported: give a SQLite file path, a sqlite: URL \
                 or a postgres:// URL"
            )));
        }
        Ok(Self::Sqlite(SqliteStore::open_existing(database).await?))
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

/// Says what was wrong with the command line (or prints the help or version asked for), as
/// JSON when `--json` was among the arguments: a script that asked for JSON reads its errors
/// as JSON too, usage errors included.
fn usage(error: &clap::Error) -> ExitCode {
    let asked = matches!(
        error.kind(),
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
    );
    if asked || !std::env::args_os().any(|arg| arg == "--json") {
        let _ = error.print();
    } else {
        let rendered = error.render().to_string();
        let first = rendered.lines().next().unwrap_or_default();
        let message = first.strip_prefix("error: ").unwrap_or(first);
        eprintln!(
            "{}",
            serde_json::json!({ "error": message, "usage": rendered.trim_end() })
        );
    }
    ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage(&error),
    };
    // What the store warns of (a dead letter this build cannot read, left out of a listing)
    // reaches the operator, beside the output: as JSON lines under --json.
    // The store's own, not its driver's: sqlx warns of slow statements with their text.
    let warnings = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn,sqlx=error"))
        .with_ansi(std::io::stderr().is_terminal())
        .without_time()
        .with_target(false);
    if cli.json {
        warnings.json().init();
    } else {
        warnings.init();
    }
    let json = cli.json;
    let mut out = String::new();
    let result = run(cli, &mut out).await;
    // What was gathered is printed even after a failure. A reader that went away (`| head`)
    // is no failure of the tool's, but hides none of its own: they are still said, on
    // standard error, and in the exit code.
    let written = std::io::stdout()
        .lock()
        .write_all(out.as_bytes())
        .and_then(|()| std::io::stdout().flush());
    if let Err(Failure(message)) = result {
        if json {
            eprintln!("{}", serde_json::json!({ "error": message }));
        } else {
            eprintln!("dacapo: {message}");
        }
        return ExitCode::FAILURE;
    }
    match written {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("dacapo: could not write the output: {error}");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
}

/// Appends a line to the output.
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

async fn run(cli: Cli, out: &mut String) -> Result<(), Failure> {
    let database = cli.database.as_deref();
    let json = cli.json;
    match cli.command {
        Command::DeadLetters(command) => dead_letters(command, database, json, out).await,
        Command::Scheduled(command) => scheduled(command, database, json, out).await,
    }
}

async fn dead_letters(
    command: DeadLetters,
    database: Option<&str>,
    json: bool,
    out: &mut String,
) -> Result<(), Failure> {
    let store = Store::open(database).await?;
    match command {
        DeadLetters::List(filter) => {
            let letters = store.dead_letters().list(&filter.to_filter()).await?;
            if json {
                let rows: Vec<_> = letters.iter().map(summary).collect();
                say!(out, "{}", serde_json::to_string_pretty(&rows)?);
            } else if letters.is_empty() {
                say!(out, "no dead letters");
            } else {
                say!(
                    out,
                    "{:<32}  {:<32}  {:>8}  {:<25}  reason",
                    "id",
                    "type",
                    "attempts",
                    "last failure"
                );
                for letter in &letters {
                    say!(
                        out,
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
        DeadLetters::Show { id } => {
            let letter = store
                .dead_letters()
                .get(id)
                .await?
                .ok_or_else(|| format!("no dead letter with id {id}"))?;
            if json {
                say!(out, "{}", serde_json::to_string_pretty(&detail(&letter))?);
            } else {
                print_detail(&letter, out);
            }
        }
        DeadLetters::Replay { id, all, filter } => {
            let ids = match id {
                Some(id) => vec![id],
                None => {
                    debug_assert!(all || filter.message_type.is_some());
                    let letters = store.dead_letters().list(&filter.to_filter()).await?;
                    letters.iter().map(|l| l.envelope.id).collect()
                }
            };
            let single = id.is_some();
            let listed = ids.len();
            let (mut replayed, mut skipped, mut unreadable) = (Vec::new(), Vec::new(), Vec::new());
            // The replay that failed, which ends a bulk replay: what moved before it is still
            // reported, so that a script knows what left the dead letters.
            let mut stopped = None;
            for id in ids {
                // One transaction each: the letter leaves the dead letters exactly when its
                // envelope is back in the inbox, unowned, for a running node to pick up.
                let outcome = match store.inbox().replay(id, ReplayTo::AnyNode).await {
                    Ok(outcome) => outcome,
                    Err(error) if !single => {
                        stopped = Some((id, error));
                        break;
                    }
                    Err(error) => return Err(error.into()),
                };
                match outcome {
                    // Refused by the broker on its way out: back in the outbox, for a
                    // running node's relay to send.
                    Replay::Replayed(_) | Replay::Enlisted(_) => replayed.push(id),
                    Replay::InProgress if single => {
                        return Err(Failure(format!(
                            "{id} has no dead letter: it is being delivered (replayed \
                             already) or scheduled; nothing was replayed"
                        )));
                    }
                    Replay::Unreadable if single => {
                        return Err(Failure(format!(
                            "{id} is a message that could not be read as an envelope; it stays \
                             a dead letter, as it arrived: have its sender send it again, or \
                             purge it"
                        )));
                    }
                    Replay::Unreadable => unreadable.push(id),
                    _ if single => {
                        return Err(Failure(format!("no dead letter with id {id}")));
                    }
                    // Replayed or removed by someone else since the listing.
                    _ => skipped.push(id),
                }
            }
            if json {
                say!(
                    out,
                    "{}",
                    serde_json::json!({
                        "replayed": replayed.len(),
                        "ids": replayed,
                        "skipped": skipped,
                        "unreadable": unreadable,
                        "failed": stopped.as_ref().map(|(id, _)| id),
                    })
                );
            } else {
                for id in &replayed {
                    say!(out, "replayed {}", id.simple());
                }
                for id in &skipped {
                    say!(
                        out,
                        "skipped {}: replayed or removed meanwhile",
                        id.simple()
                    );
                }
                for id in &unreadable {
                    say!(
                        out,
                        "kept {}: unreadable as it arrived, not replayable (purge it, or have \
                         its sender send it again)",
                        id.simple()
                    );
                }
                say!(
                    out,
                    "replayed {} dead letter(s): back in the inbox for a running node, \
                     attempts reset",
                    replayed.len()
                );
            }
            if let Some((id, error)) = stopped {
                let left = listed - replayed.len() - skipped.len() - unreadable.len();
                return Err(Failure(format!(
                    "replaying {} failed, and the {left} dead letter(s) from it on were not \
                     replayed (they are still dead letters): {error}",
                    id.simple()
                )));
            }
        }
        DeadLetters::Purge { filter, yes } => {
            let filter = filter.to_filter();
            let purged = if yes {
                store.dead_letters().purge(&filter).await?
            } else {
                // What the operator was asked about, and nothing else: a letter dead-lettered
                // while they read the question is not theirs to remove unseen.
                let asked = confirm_purge(&store, &filter, database.unwrap_or_default()).await?;
                let mut removed = 0u64;
                for (id, last_failure_at) in asked {
                    // Gone meanwhile (replayed or purged by someone else), or replayed and
                    // failed again while the question waited (a letter the operator never
                    // saw, under the same id): not theirs to remove.
                    if store
                        .dead_letters()
                        .remove_if_unchanged(id, last_failure_at)
                        .await?
                    {
                        removed += 1;
                    }
                }
                removed
            };
            if json {
                say!(out, "{}", serde_json::json!({ "purged": purged }));
            } else {
                say!(out, "purged {purged} dead letter(s)");
            }
        }
    }
    Ok(())
}

/// Asks on the terminal before a purge; refuses without a terminal to ask on. The ids of the
/// letters it asked about, with their last failure's time, once the answer is yes.
async fn confirm_purge(
    store: &Store,
    filter: &DeadLetterFilter,
    database: &str,
) -> Result<Vec<(Uuid, DateTime<Utc>)>, Failure> {
    if !std::io::stdin().is_terminal() {
        return Err(Failure(
            "purge removes dead letters for good: pass --yes to confirm (standard input is \
             not a terminal to ask on)"
                .to_owned(),
        ));
    }
    let listed: Vec<(Uuid, DateTime<Utc>)> = store
        .dead_letters()
        .list(filter)
        .await?
        .iter()
        .map(|letter| (letter.envelope.id, letter.last_failure_at))
        .collect();
    eprint!(
        "remove {} dead letter(s) from {} for good? [y/N] ",
        listed.len(),
        dacapo::store::redacted_url(database)
    );
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(listed)
    } else {
        Err(Failure("nothing purged".to_owned()))
    }
}

async fn scheduled(
    command: Scheduled,
    database: Option<&str>,
    json: bool,
    out: &mut String,
) -> Result<(), Failure> {
    let store = Store::open(database).await?;
    match command {
        Scheduled::List => {
            let waiting = store.inbox().scheduled(usize::MAX).await?;
            if json {
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
                say!(out, "{}", serde_json::to_string_pretty(&rows)?);
            } else if waiting.is_empty() {
                say!(out, "no scheduled envelopes");
            } else {
                say!(out, "{:<32}  {:<32}  due at", "id", "type");
                for s in &waiting {
                    say!(
                        out,
                        "{:<32}  {:<32}  {}",
                        s.envelope.id.simple(),
                        s.envelope.message_type,
                        s.due_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    );
                }
            }
        }
        Scheduled::Cancel { id } => {
            if !store.inbox().cancel_scheduled(id).await? {
                return Err(Failure(format!(
                    "no scheduled envelope {id} waits (unknown, started, or settled)"
                )));
            }
            if json {
                say!(out, "{}", serde_json::json!({ "cancelled": id }));
            } else {
                say!(out, "cancelled {}: it will not run", id.simple());
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

fn print_detail(letter: &DeadLetter, out: &mut String) {
    let envelope = &letter.envelope;
    say!(out, "dead letter {}", envelope.id);
    say!(out, "  type            {}", envelope.message_type);
    say!(out, "  reason          {}", letter.reason);
    say!(out, "  attempts        {}", letter.attempts);
    say!(
        out,
        "  first failure   {}",
        letter.first_failure_at.to_rfc3339()
    );
    say!(
        out,
        "  last failure    {}",
        letter.last_failure_at.to_rfc3339()
    );
    if let Some(id) = envelope.correlation_id {
        say!(out, "  correlation id  {id}");
    }
    say!(
        out,
        "  payload         {}",
        String::from_utf8_lossy(&envelope.payload)
    );
    for failure in &letter.failures {
        say!(out, "  attempt {}: {}", failure.attempt, failure);
        for handler in &failure.failures {
            say!(out, "    - {handler}");
        }
    }
}
