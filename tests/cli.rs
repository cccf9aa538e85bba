//! The `dacapo` command-line tool against real SQLite files and a real PostgreSQL server.
#![cfg(all(feature = "cli", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/stores.rs"]
mod support_stores;

use std::time::Duration;

use dacapo::prelude::*;
use dacapo::testing::Recorder;
use support::{MemberRemoved, member_removed};

const WAIT: Duration = Duration::from_secs(20);

struct AlwaysFails;

impl Handler<MemberRemoved> for AlwaysFails {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        Err("the downstream service is down".into())
    }
}

/// Runs the tool; returns its standard output, or panics with its standard error.
async fn dacapo(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_dacapo"))
            .args(&args)
            .output()
    })
    .await
    .unwrap()
    .expect("the tool runs");
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
        let purged = dacapo(&["dead-letters", "purge", "--database", &url, "--json"]).await;
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
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_dacapo"))
        .args([
            "dead-letters",
            "show",
            &uuid::Uuid::new_v4().to_string(),
            "--database",
            &db.url,
        ])
        .output()
        .unwrap();
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
        let purged = dacapo(&["dead-letters", "purge", "--database", &url]).await;
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
