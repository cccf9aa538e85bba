//! The `dacapo` command-line tool against real SQLite files and a real PostgreSQL server.
#![cfg(all(feature = "cli", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::{MemberRemoved, WebhookQueued, member_removed};

const WAIT: Duration = Duration::from_secs(20);

struct AlwaysFails;

impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

/// Runs the tool with `args` and the environment variables `env`, without
/// `DACAPO_DATABASE_URL` unless `env` sets it; stdin is not a terminal.
async fn run_tool(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_dacapo"))
            .args(&args)
            .env_remove("DACAPO_DATABASE_URL")
            .envs(env)
            .output()
    })
    .await
    .unwrap()
    .expect("the tool runs")
}

/// Runs the tool; returns its standard output, or panics with its standard error.
async fn dacapo(args: &[&str]) -> String {
    let output = run_tool(args, &[]).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

on_both_backends!(
    dead_letters_are_listed_shown_replayed_and_purged_sqlite,
    dead_letters_are_listed_shown_replayed_and_purged_postgres,
    |db| {
        let failing = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .retry_policy(RetryPolicy::no_retries())
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", AlwaysFails))
            .build()
            .unwrap();
        let id = failing.publish(&member_removed()).await.unwrap();
        tokio::time::timeout(WAIT, failing.idle()).await.unwrap();
        failing.shutdown().await;
        let url = db.url.clone();

        let listed = dacapo(&["dead-letters", "list", "--database", &url]).await;
        assert!(listed.contains(&id.simple().to_string()), "{listed}");
        assert!(listed.contains("retries exhausted"), "{listed}");

        let json: serde_json::Value = serde_json::from_str(
            &dacapo(&["dead-letters", "list", "--database", &url, "--json"]).await,
        )
        .unwrap();
        assert_eq!(json.as_array().unwrap().len(), 1);
        assert_eq!(json[0]["id"], id.to_string());
        assert_eq!(json[0]["attempts"], 1);

        let shown = dacapo(&["dead-letters", "show", &id.to_string(), "--database", &url]).await;
        assert!(
            shown.contains("billing/charge failed: the downstream service is down"),
            "{shown}"
        );
        assert!(shown.contains("\"member_id\":7"), "{shown}");

        dacapo(&[
            "dead-letters",
            "replay",
            &id.to_string(),
            "--database",
            &url,
        ])
        .await;
        let purged = dacapo(&[
            "dead-letters",
            "purge",
            "--yes",
            "--database",
            &url,
            "--json",
        ])
        .await;
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&purged).unwrap()["purged"],
            0
        );

        // A running node picks the replayed envelope up: same id, fresh attempt count.
        let calls = Recorder::<MemberRemoved>::new();
        let node = db
            .store(Runtime::builder(), "node-b", Duration::from_secs(30))
            .await
            .recovery_interval(Duration::from_millis(100))
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", calls.clone()),
            )
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, async {
            while calls.count() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the replayed envelope was handled");
        let calls = calls.calls();
        assert_eq!((calls[0].message_id, calls[0].attempt), (Some(id), 1));
        node.shutdown().await;
    }
);

#[tokio::test]
async fn an_unknown_id_is_a_clear_error() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    let _ = db.sqlite().await;
    let output = run_tool(
        &[
            "dead-letters",
            "show",
            &uuid::Uuid::new_v4().to_string(),
            "--database",
            &db.url,
        ],
        &[],
    )
    .await;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("no dead letter with id"));
}

on_both_backends!(
    purge_removes_every_dead_letter_sqlite,
    purge_removes_every_dead_letter_postgres,
    |db| {
        let failing = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .retry_policy(RetryPolicy::no_retries())
            .module(Module::new("billing").handle_named::<MemberRemoved, _>("charge", AlwaysFails))
            .build()
            .unwrap();
        for _ in 0..2 {
            failing.publish(&member_removed()).await.unwrap();
        }
        tokio::time::timeout(WAIT, failing.idle()).await.unwrap();
        failing.shutdown().await;
        let url = db.url.clone();
        let purged = dacapo(&["dead-letters", "purge", "--yes", "--database", &url]).await;
        assert_eq!(purged.trim(), "purged 2 dead letter(s)");
        assert_eq!(
            dacapo(&["dead-letters", "list", "--database", &url])
                .await
                .trim(),
            "no dead letters"
        );
    }
);

on_both_backends!(
    scheduled_envelopes_are_listed_and_cancelled_sqlite,
    scheduled_envelopes_are_listed_and_cancelled_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing").handle_named::<MemberRemoved, _>("charge", Recorder::new()),
            )
            .build()
            .unwrap();
        let next_year = chrono::Utc::now() + chrono::Duration::days(365);
        let id = runtime
            .publish_at(&member_removed(), next_year)
            .await
            .unwrap();
        runtime.shutdown().await;
        let url = db.url.clone();

        let listed = dacapo(&["scheduled", "list", "--database", &url]).await;
        assert!(listed.contains(&id.simple().to_string()), "{listed}");
        assert!(listed.contains("organization.member_removed"), "{listed}");
        let cancelled = dacapo(&["scheduled", "cancel", &id.to_string(), "--database", &url]).await;
        assert!(cancelled.contains("cancelled"), "{cancelled}");
        let listed = dacapo(&["scheduled", "list", "--json", "--database", &url]).await;
        let rows: serde_json::Value = serde_json::from_str(&listed).unwrap();
        assert_eq!(rows, serde_json::json!([]));
        assert_eq!(db.inbox_status(id).await.as_deref(), Some("handled"));
    }
);

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Fails every `MemberRemoved` and panics on every `WebhookQueued`.
struct FailsOrPanics;

impl Handler<MemberRemoved> for FailsOrPanics {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

impl Handler<WebhookQueued> for FailsOrPanics {
    async fn handle(&self, _: &WebhookQueued, _: &MessageContext) -> Result<(), HandlerError> {
        panic!("the webhook table is gone")
    }
}

/// `members` dead letters of `MemberRemoved` and `webhooks` of `WebhookQueued` in `db`.
async fn dead_letters_of_two_types(
    db: &support_stores::TestDatabase,
    members: usize,
    webhooks: usize,
) {
    let failing = db
        .store(Runtime::builder(), "node-a", Duration::from_secs(30))
        .await
        .retry_policy(RetryPolicy::no_retries())
        .module(
            Module::new("billing")
                .handle_named::<MemberRemoved, _>("charge", FailsOrPanics)
                .handle_named::<WebhookQueued, _>("notify", FailsOrPanics),
        )
        .build()
        .unwrap();
    for _ in 0..members {
        failing.publish(&member_removed()).await.unwrap();
    }
    for n in 0..webhooks {
        failing
            .publish(&WebhookQueued {
                delivery_id: n.to_string(),
            })
            .await
            .unwrap();
    }
    tokio::time::timeout(WAIT, failing.idle()).await.unwrap();
    failing.shutdown().await;
}

on_both_backends!(
    reading_a_database_without_the_schema_creates_and_migrates_nothing_sqlite,
    reading_a_database_without_the_schema_creates_and_migrates_nothing_postgres,
    |db| {
        for args in [
            &["dead-letters", "list"][..],
            &["dead-letters", "purge", "--yes"][..],
            &["scheduled", "list"][..],
        ] {
            let mut args = args.to_vec();
            args.extend(["--database", db.url.as_str()]);
            let output = run_tool(&args, &[]).await;
            assert_eq!(output.status.code(), Some(1), "{args:?}");
            assert!(
                stderr(&output).contains("no dacapo schema at"),
                "{args:?}: {}",
                stderr(&output)
            );
        }
        match db.backend {
            support_stores::Backend::Sqlite => assert!(
                !std::path::Path::new(&db.url).exists(),
                "the SQLite file was not created"
            ),
            support_stores::Backend::Postgres => {
                // Looked at with a plain connection: opening a store would create the schema.
                let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
                let tables: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'dacapo%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                assert_eq!(tables, 0, "no schema created");
            }
        }
    }
);

#[tokio::test]
async fn an_unreachable_server_fails_within_seconds_naming_it_and_the_cause() {
    let started = std::time::Instant::now();
    let output = run_tool(
        &[
            "dead-letters",
            "list",
            "--database",
            "postgres://postgres:secret@127.0.0.1:1/app",
        ],
        &[],
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(output.status.code(), Some(1));
    let error = stderr(&output);
    assert!(error.contains("127.0.0.1:1"), "{error}");
    assert!(error.to_lowercase().contains("refused"), "{error}");
    assert!(
        !error.contains("secret"),
        "the password is not shown: {error}"
    );

    // With --json, the error is JSON too.
    let output = run_tool(
        &[
            "dead-letters",
            "list",
            "--json",
            "--database",
            "postgres://postgres@127.0.0.1:1/app",
        ],
        &[],
    )
    .await;
    let error: serde_json::Value = serde_json::from_str(stderr(&output).trim()).unwrap();
    assert!(error["error"].as_str().unwrap().contains("127.0.0.1:1"));
}

#[tokio::test]
async fn a_database_url_of_an_unsupported_kind_is_refused_by_name() {
    let output = run_tool(
        &[
            "dead-letters",
            "list",
            "--database",
            "mysql://root@127.0.0.1/app",
        ],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("mysql:// databases are not supported"),
        "{}",
        stderr(&output)
    );
    // No database at all names both ways to give one.
    let output = run_tool(&["dead-letters", "list"], &[]).await;
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("DACAPO_DATABASE_URL"));
}

on_both_backends!(
    the_database_comes_from_dacapo_database_url_sqlite,
    the_database_comes_from_dacapo_database_url_postgres,
    |db| {
        dead_letters_of_two_types(&db, 1, 0).await;
        let output = run_tool(
            &["dead-letters", "list", "--json"],
            &[("DACAPO_DATABASE_URL", &db.url)],
        )
        .await;
        assert!(output.status.success(), "{}", stderr(&output));
        let rows: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(rows.as_array().unwrap().len(), 1);
    }
);

#[tokio::test]
async fn a_reader_that_goes_away_ends_the_tool_quietly() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    dead_letters_of_two_types(&db, 3, 0).await;
    let url = db.url.clone();
    let output = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dacapo"))
            .args(["dead-letters", "list", "--database", &url])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader closes its end before the tool writes, as `| head -0` would.
        drop(child.stdout.take());
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stderr(&output), "");
}

on_both_backends!(
    purge_without_a_terminal_needs_yes_and_removes_nothing_sqlite,
    purge_without_a_terminal_needs_yes_and_removes_nothing_postgres,
    |db| {
        dead_letters_of_two_types(&db, 2, 0).await;
        let output = run_tool(&["dead-letters", "purge", "--database", &db.url], &[]).await;
        assert_eq!(output.status.code(), Some(1));
        assert!(stderr(&output).contains("--yes"), "{}", stderr(&output));
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            2
        );
    }
);

on_both_backends!(
    show_names_a_panic_once_sqlite,
    show_names_a_panic_once_postgres,
    |db| {
        dead_letters_of_two_types(&db, 0, 1).await;
        let listed: serde_json::Value = serde_json::from_str(
            &dacapo(&["dead-letters", "list", "--json", "--database", &db.url]).await,
        )
        .unwrap();
        let id = listed[0]["id"].as_str().unwrap().to_owned();
        let shown = dacapo(&["dead-letters", "show", &id, "--database", &db.url]).await;
        assert!(
            shown.contains("billing/notify panicked: the webhook table is gone"),
            "{shown}"
        );
        assert!(!shown.contains("panicked: panicked"), "{shown}");
    }
);

on_both_backends!(
    dead_letters_are_listed_replayed_and_purged_in_bulk_sqlite,
    dead_letters_are_listed_replayed_and_purged_in_bulk_postgres,
    |db| {
        dead_letters_of_two_types(&db, 3, 2).await;
        let url = db.url.clone();
        assert_eq!(count(&url, &["dead-letters", "list"]).await, 5);
        assert_eq!(
            count(
                &url,
                &["dead-letters", "list", "--type", "webhooks.delivery_queued"]
            )
            .await,
            2
        );
        assert_eq!(
            count(&url, &["dead-letters", "list", "--limit", "4"]).await,
            4
        );
        assert_eq!(
            count(&url, &["dead-letters", "list", "--since", "1h"]).await,
            5
        );
        let tomorrow = (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339();
        assert_eq!(
            count(&url, &["dead-letters", "list", "--since", &tomorrow]).await,
            0
        );
        // Usage errors exit 2, as JSON under --json: what the JSON says of each.
        let cases: [(&[&str], &str, &str); 3] = [
            (&["dead-letters", "list", "--since", "yesterday"], "", ""),
            (
                &["dead-letters", "list", "--since", "yesterday", "--json"],
                "error",
                "yesterday",
            ),
            (&["--json", "dead-letters"], "usage", "replay"),
        ];
        for (args, field, says) in cases {
            let mut args = args.to_vec();
            args.extend(["--database", &url]);
            let bad = run_tool(&args, &[]).await;
            assert_eq!(bad.status.code(), Some(2), "a usage error: {args:?}");
            if !field.is_empty() {
                let said: serde_json::Value = serde_json::from_slice(&bad.stderr)
                    .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&bad.stderr)));
                assert!(said[field].as_str().unwrap().contains(says), "{said}");
            }
        }

        let replayed: serde_json::Value = serde_json::from_str(
            &dacapo(&[
                "dead-letters",
                "replay",
                "--type",
                "organization.member_removed",
                "--json",
                "--database",
                &url,
            ])
            .await,
        )
        .unwrap();
        assert_eq!(replayed["replayed"], 3);
        assert_eq!(count(&url, &["dead-letters", "list"]).await, 2);
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_inbox WHERE status = 'incoming' AND owner IS NULL"
            )
            .await,
            3,
            "back in the inbox for any node"
        );

        let purged = dacapo(&[
            "dead-letters",
            "purge",
            "--type",
            "webhooks.delivery_queued",
            "--yes",
            "--database",
            &url,
        ])
        .await;
        assert_eq!(purged.trim(), "purged 2 dead letter(s)");
        assert_eq!(count(&url, &["dead-letters", "list"]).await, 0);

        // --all replays whatever is left: nothing now.
        let replayed = dacapo(&["dead-letters", "replay", "--all", "--database", &url]).await;
        assert!(replayed.contains("replayed 0 dead letter(s)"), "{replayed}");
        // An id, --type and --all exclude one another; one of them is needed.
        let neither = run_tool(&["dead-letters", "replay", "--database", &url], &[]).await;
        assert_eq!(neither.status.code(), Some(2));
    }
);

/// How many rows `args` list, as JSON.
/// Keeps a dead letter as a listener keeps a broker message it could not read; its id.
async fn unreadable_dead_letter(db: &support_stores::TestDatabase) -> uuid::Uuid {
    use dacapo::ports::DeadLetterStore;
    let envelope = Envelope::new("unknown", b"\x00\x01 not an envelope".to_vec());
    let letter = dacapo::DeadLetter::rejected(
        envelope.clone(),
        dacapo::DeadLetterReason::Unreadable("no message-id header".into()),
        chrono::Utc::now(),
    );
    match db.backend {
        support_stores::Backend::Sqlite => db.sqlite().await.put(letter).await.unwrap(),
        support_stores::Backend::Postgres => db.postgres().await.put(letter).await.unwrap(),
    }
    envelope.id
}

on_both_backends!(
    an_unreadable_dead_letter_is_kept_not_replayed_sqlite,
    an_unreadable_dead_letter_is_kept_not_replayed_postgres,
    |db| {
        dead_letters_of_two_types(&db, 1, 0).await;
        let unreadable = unreadable_dead_letter(&db).await;
        let url = db.url.clone();
        assert_eq!(count(&url, &["dead-letters", "list"]).await, 2);

        let one = run_tool(
            &[
                "dead-letters",
                "replay",
                &unreadable.to_string(),
                "--database",
                &url,
            ],
            &[],
        )
        .await;
        assert!(!one.status.success());
        let said = String::from_utf8_lossy(&one.stderr);
        assert!(said.contains("could not be read as an envelope"), "{said}");
        assert_eq!(count(&url, &["dead-letters", "list"]).await, 2, "kept");

        let all: serde_json::Value = serde_json::from_str(
            &dacapo(&[
                "dead-letters",
                "replay",
                "--all",
                "--json",
                "--database",
                &url,
            ])
            .await,
        )
        .unwrap();
        assert_eq!(all["replayed"], 1, "{all}");
        assert_eq!(all["unreadable"], serde_json::json!([unreadable]), "{all}");
        let left: serde_json::Value = serde_json::from_str(
            &dacapo(&["dead-letters", "list", "--json", "--database", &url]).await,
        )
        .unwrap();
        assert_eq!(left.as_array().unwrap().len(), 1);
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_inbox WHERE status = 'incoming'")
                .await,
            1,
            "only the readable one went back to the inbox"
        );

        // A runtime's own replay refuses it alike.
        let runtime = db
            .store(Runtime::builder(), "node-a", Duration::from_secs(30))
            .await
            .build()
            .unwrap();
        assert!(matches!(
            runtime.dead_letters().replay(unreadable).await,
            Err(dacapo::Error::UnreadableReplay(id)) if id == unreadable
        ));
        runtime.dead_letters().inspect(unreadable).await.unwrap();
        runtime.shutdown().await;
    }
);

async fn count(url: &str, args: &[&str]) -> usize {
    let mut args = args.to_vec();
    args.extend(["--json", "--database", url]);
    let rows: serde_json::Value = serde_json::from_str(&dacapo(&args).await).unwrap();
    rows.as_array().unwrap().len()
}

on_both_backends!(
    a_purge_asked_on_a_terminal_removes_only_the_letters_it_asked_about_sqlite,
    a_purge_asked_on_a_terminal_removes_only_the_letters_it_asked_about_postgres,
    |db| {
        use std::io::{Read, Write};
        use std::sync::{Arc, Mutex};
        dead_letters_of_two_types(&db, 2, 0).await;
        // A terminal for the tool to ask on: `script` runs it on a pseudo-terminal, whose
        // input is this test's writes and whose output comes back on `script`'s.
        // On PostgreSQL a password in the URL (which trust authentication does not ask for):
        // the question names the database without it.
        let url = db
            .url
            .replacen("postgres://postgres@", "postgres://postgres:s3cret@", 1);
        let command = format!(
            "{} dead-letters purge --database '{url}'",
            env!("CARGO_BIN_EXE_dacapo"),
        );
        let mut child = std::process::Command::new("script")
            .args(["-qec", &command, "/dev/null"])
            .env_remove("DACAPO_DATABASE_URL")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("script (util-linux) runs");
        let shown = Arc::new(Mutex::new(String::new()));
        let reader = {
            let shown = Arc::clone(&shown);
            let mut stdout = child.stdout.take().unwrap();
            std::thread::spawn(move || {
                let mut buffer = [0u8; 1024];
                while let Ok(read) = stdout.read(&mut buffer) {
                    if read == 0 {
                        break;
                    }
                    shown
                        .lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buffer[..read]));
                }
            })
        };
        tokio::time::timeout(WAIT, async {
            while !shown.lock().unwrap().contains("[y/N]") {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no question within {WAIT:?}: {}", shown.lock().unwrap()));
        assert!(shown.lock().unwrap().contains("remove 2 dead letter(s)"));
        assert!(
            !shown.lock().unwrap().contains("s3cret"),
            "{}",
            shown.lock().unwrap()
        );

        // A third letter while the operator reads the question, and one of the two it asked
        // about replayed and failed again (a new last failure, the same id).
        dead_letters_of_two_types(&db, 1, 0).await;
        db.execute(
            "UPDATE dacapo_dead_letters SET last_failure_at = last_failure_at + 1000 \
             WHERE id = (SELECT id FROM dacapo_dead_letters ORDER BY first_failure_at, id LIMIT 1)",
        )
        .await;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"y\n").unwrap();
        stdin.flush().unwrap();
        let status = tokio::task::spawn_blocking(move || {
            let status = child.wait();
            drop(stdin);
            status
        });
        let status = tokio::time::timeout(WAIT, status)
            .await
            .expect("the tool ends once answered")
            .unwrap()
            .unwrap();
        reader.join().unwrap();
        assert!(status.success(), "{}", shown.lock().unwrap());
        assert!(
            shown.lock().unwrap().contains("purged 1 dead letter(s)"),
            "{}",
            shown.lock().unwrap()
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
            2,
            "the letters it never showed are kept: the new one, and the one that failed again"
        );
    }
);

/// A bulk replay that fails part-way (the store refuses one letter's move) stops there, says
/// which failed, and still reports what it replayed before: a script knows what left the dead
/// letters, and the rest are still dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_replay_that_fails_part_way_reports_what_it_replayed() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    dead_letters_of_two_types(&db, 3, 0).await;
    let second: String = db
        .value_for(
            "SELECT id FROM dacapo_dead_letters WHERE $1 = $1 \
             ORDER BY first_failure_at, id LIMIT 1 OFFSET 1",
            String::new(),
        )
        .await;
    db.execute("CREATE TABLE test_refused (id TEXT NOT NULL)")
        .await;
    let _: String = db
        .value_for(
            "INSERT INTO test_refused (id) VALUES ($1) RETURNING id",
            second.clone(),
        )
        .await;
    for event in ["INSERT", "UPDATE"] {
        let trigger = match event {
            "INSERT" => {
                "CREATE TRIGGER test_refuse_insert BEFORE INSERT ON dacapo_inbox \
                 WHEN NEW.id IN (SELECT id FROM test_refused) \
                 BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
            }
            _ => {
                "CREATE TRIGGER test_refuse_update BEFORE UPDATE ON dacapo_inbox \
                 WHEN NEW.id IN (SELECT id FROM test_refused) \
                 BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
            }
        };
        db.execute(trigger).await;
    }
    let output = run_tool(
        &[
            "dead-letters",
            "replay",
            "--all",
            "--json",
            "--database",
            &db.url,
        ],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(stderr(&output).contains(&second), "{}", stderr(&output));
    let reported: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|_| panic!("a report on stdout: {:?}", output));
    assert_eq!(reported["replayed"], 1, "{reported}");
    assert_eq!(
        reported["failed"],
        uuid::Uuid::parse_str(&second).unwrap().to_string(),
        "{reported}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_dead_letters").await,
        2,
        "the one that failed and the one after it are still dead letters"
    );

    // Again, with a reader that went away (`| head`): the failure is still said, and the exit
    // code still tells it (it was 0, and nothing said, before).
    let url = db.url.clone();
    let quiet = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dacapo"))
            .args(["dead-letters", "replay", "--all", "--database", &url])
            .env_remove("DACAPO_DATABASE_URL")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the tool runs");
        drop(child.stdout.take());
        child.wait_with_output()
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(quiet.status.code(), Some(1), "{}", stderr(&quiet));
    assert!(stderr(&quiet).contains(&second), "{}", stderr(&quiet));
}

/// A dead letter this build cannot read is left out of a listing, and the tool says so on
/// standard error (it was a log line no one saw).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_letter_that_cannot_be_read_is_left_out_and_said() {
    let db = support_stores::TestDatabase::new(support_stores::Backend::Sqlite).await;
    dead_letters_of_two_types(&db, 2, 0).await;
    db.execute(
        "UPDATE dacapo_dead_letters SET reason = '\"FromANewerBuild\"' \
         WHERE id = (SELECT id FROM dacapo_dead_letters ORDER BY first_failure_at, id LIMIT 1)",
    )
    .await;

    let output = run_tool(
        &["dead-letters", "list", "--json", "--database", &db.url],
        &[],
    )
    .await;

    assert!(output.status.success(), "{}", stderr(&output));
    let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    let warning: serde_json::Value = serde_json::from_str(stderr(&output).lines().next().unwrap())
        .unwrap_or_else(|_| panic!("a JSON line: {}", stderr(&output)));
    assert!(
        warning["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("a dead letter that cannot be read is left out"),
        "{warning}"
    );
}
