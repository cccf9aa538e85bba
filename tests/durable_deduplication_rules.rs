//! The deduplication rules that do not depend on the store, run again on a real SQLite file and
//! a real PostgreSQL server: a missing required id, optional ids at no round trip, a policy
//! filter, a handler asking for deduplication on a runtime without it, and the publisher-side
//! id precedence as the durable inbox and outbox store it.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "testing"))]

#[path = "support/messages.rs"]
mod support;
#[path = "support/counting_claims.rs"]
mod support_claims;
#[path = "support/stores.rs"]
mod support_stores;
#[path = "support/warnings.rs"]
mod support_warnings;

use std::sync::Arc;
use std::time::Duration;

use dacapo::ports::Claims;
use dacapo::prelude::*;
use dacapo::{DeadLetterReason, DeliveryReport, Outcome};
use serde::{Deserialize, Serialize};
use support::Counter;
use support_claims::CountingClaims;
use support_stores::{Backend, TestDatabase};

const WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct ArchiveInvoice {
    invoice_number: String,
}

impl Message for ArchiveInvoice {
    const TYPE: &'static str = "billing.archive_invoice";

    fn deduplication_id(&self) -> Option<String> {
        (!self.invoice_number.is_empty()).then(|| self.invoice_number.clone())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[allow(non_snake_case)]
struct ReceiveShipment {
    IdempotencyKey: Option<String>,
}

impl Message for ReceiveShipment {
    const TYPE: &'static str = "warehouse.receive_shipment";
}

/// Declares its own id, and has rules configured for it too.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RebuildProjection {
    name: String,
}

impl Message for RebuildProjection {
    const TYPE: &'static str = "projections.rebuild";

    fn deduplication_id(&self) -> Option<String> {
        Some(format!("declared:{}", self.name))
    }
}

fn rebuild(name: &str) -> RebuildProjection {
    RebuildProjection { name: name.into() }
}

fn invoice(number: &str) -> ArchiveInvoice {
    ArchiveInvoice {
        invoice_number: number.into(),
    }
}

fn keyed(id: &str) -> SendOptions {
    SendOptions::new().deduplication_id(id)
}

async fn tracked<M: Message>(
    runtime: &Runtime,
    message: &M,
    options: SendOptions,
) -> DeliveryReport {
    let envelope = runtime.envelope(message, options).unwrap();
    let report = runtime.receive_tracked(envelope).await.unwrap();
    tokio::time::timeout(WAIT, report).await.unwrap().unwrap()
}

async fn store_claims(db: &TestDatabase) -> Box<dyn Claims> {
    match db.backend {
        Backend::Sqlite => Box::new(db.sqlite().await),
        Backend::Postgres => Box::new(db.postgres().await),
    }
}

on_both_backends!(
    a_message_without_a_required_id_is_dead_lettered_durably_sqlite,
    a_message_without_a_required_id_is_dead_lettered_durably_postgres,
    |db| {
        let effects = Counter::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .module(
                Module::new("billing")
                    .handle_named::<ArchiveInvoice, _>("archive", effects.clone())
                    .deduplicate("archive", Deduplication::from_envelope()),
            )
            .build()
            .unwrap();
        let report = tracked(&runtime, &invoice(""), SendOptions::new()).await;
        let reason = DeadLetterReason::MissingDeduplicationId("billing/archive".into());
        assert_eq!(report.outcome, Outcome::DeadLettered(reason.clone()));
        assert_eq!(effects.count(), 0);
        runtime.shutdown().await;
        // Read back from the store by a runtime that did not write it.
        let reader = db
            .store(Runtime::builder(), "reader", Duration::from_secs(30))
            .await
            .build()
            .unwrap();
        let letters = reader.dead_letters().list().await.unwrap();
        assert_eq!(letters.len(), 1);
        assert_eq!(letters[0].reason, reason);
        assert_eq!(
            letters[0].reason.to_string(),
            "missing deduplication id (required by billing/archive)"
        );
        // The table is provisioned in the background at startup; whether or not it is there
        // yet, it holds no claim.
        if db.has_table("dacapo_deduplication").await {
            assert_eq!(
                db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
                0
            );
        }
        reader.shutdown().await;
    }
);

on_both_backends!(
    optional_ids_cost_unkeyed_messages_no_claim_round_trip_sqlite,
    optional_ids_cost_unkeyed_messages_no_claim_round_trip_postgres,
    |db| {
        let claims = Arc::new(CountingClaims::around(store_claims(&db).await));
        let effects = Counter::default();
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .claims(Arc::clone(&claims) as Arc<dyn Claims>)
            .module(
                Module::new("billing")
                    .handle_named::<ArchiveInvoice, _>("archive", effects.clone())
                    .deduplicate("archive", Deduplication::from_envelope().optional()),
            )
            .build()
            .unwrap();
        for _ in 0..3 {
            assert!(
                tracked(&runtime, &invoice(""), SendOptions::new())
                    .await
                    .is_handled()
            );
        }
        assert_eq!(claims.calls(), 0, "unkeyed: no claim");
        assert_eq!(effects.count(), 3);
        for _ in 0..2 {
            tracked(&runtime, &invoice("INV-9"), SendOptions::new()).await;
        }
        assert_eq!(claims.calls(), 2, "keyed: one claim each");
        assert_eq!(effects.count(), 4, "the keyed duplicate was discarded");
        assert_eq!(runtime.stats().duplicate_intents, 1, "and counted");
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            1
        );
        runtime.shutdown().await;
    }
);

on_both_backends!(
    a_policy_opts_matching_handlers_in_on_the_store_sqlite,
    a_policy_opts_matching_handlers_in_on_the_store_postgres,
    |db| {
        let (create, other) = (Counter::default(), Counter::default());
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .require_deduplication(
                |id, _message_type| id.name.starts_with("create"),
                Deduplication::from_envelope(),
            )
            .module(
                Module::new("orders")
                    .handle_named::<ArchiveInvoice, _>("create_order", create.clone())
                    .handle_named::<ArchiveInvoice, _>("notify", other.clone()),
            )
            .build()
            .unwrap();
        for _ in 0..2 {
            tracked(&runtime, &invoice("INV-1"), SendOptions::new()).await;
        }
        assert_eq!((create.count(), other.count()), (1, 2));
        assert_eq!(runtime.stats().duplicate_intents, 1);
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_deduplication WHERE handler = 'orders/create_order'"
            )
            .await,
            1
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_deduplication").await,
            1
        );
        runtime.shutdown().await;
    }
);

on_both_backends!(
    asking_for_deduplication_without_enabling_it_warns_and_fails_clearly_sqlite,
    asking_for_deduplication_without_enabling_it_warns_and_fails_clearly_postgres,
    |db| {
        let _ = support_warnings::warnings();
        let handler = match db.backend {
            Backend::Sqlite => "archive_sqlite",
            Backend::Postgres => "archive_postgres",
        };
        let (deduplicated, plain) = (Counter::default(), Counter::default());
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .module(
                Module::new("billing")
                    .handle_named::<ArchiveInvoice, _>(handler, deduplicated.clone())
                    .deduplicate(handler, Deduplication::from_envelope()),
            )
            .module(
                Module::new("warehouse")
                    .handle_named::<ReceiveShipment, _>("receive", plain.clone()),
            )
            .build()
            .expect("the rest of the runtime starts");
        // The startup warning names the handler.
        tokio::time::timeout(WAIT, async {
            loop {
                let logged = support_warnings::warnings()
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|w| {
                        w.contains(&format!("billing/{handler}")) && w.contains("has not enabled")
                    });
                if logged {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("a startup warning");
        let report = tracked(&runtime, &invoice("INV-1"), SendOptions::new()).await;
        assert_eq!(
            report.outcome,
            Outcome::DeadLettered(DeadLetterReason::Permanent)
        );
        assert!(
            report.failures[0].failures[0]
                .error
                .contains("which this runtime has not enabled")
        );
        assert_eq!(deduplicated.count(), 0);
        let shipment = ReceiveShipment {
            IdempotencyKey: None,
        };
        assert!(
            tracked(&runtime, &shipment, SendOptions::new())
                .await
                .is_handled()
        );
        assert_eq!(plain.count(), 1);
        assert!(!db.has_table("dacapo_deduplication").await);
        runtime.shutdown().await;
    }
);

/// The deduplication id the durable inbox stored for envelope `id`.
async fn stored_id(db: &TestDatabase, id: uuid::Uuid) -> Option<String> {
    db.value_for(
        "SELECT deduplication_id FROM dacapo_inbox WHERE id = $1",
        id.simple().to_string(),
    )
    .await
}

on_both_backends!(
    publisher_side_ids_are_stored_in_precedence_order_sqlite,
    publisher_side_ids_are_stored_in_precedence_order_postgres,
    |db| {
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .deduplicate_by::<RebuildProjection>(|m| {
                Some(if m.name == "opt-out" {
                    String::new()
                } else {
                    format!("first:{}", m.name)
                })
            })
            .deduplicate_by::<RebuildProjection>(|m| Some(format!("second:{}", m.name)))
            .deduplicate_by_member_named(&["IdempotencyKey"])
            .module(
                Module::new("billing")
                    .handle_named::<ArchiveInvoice, _>("archive", Counter::default()),
            )
            .module(
                Module::new("projections")
                    .handle_named::<RebuildProjection, _>("rebuild", Counter::default()),
            )
            .module(
                Module::new("warehouse")
                    .handle_named::<ReceiveShipment, _>("receive", Counter::default()),
            )
            .build()
            .unwrap();
        let cases: Vec<(DeliveryReport, Option<&str>, &str)> = vec![
            (
                tracked(&runtime, &rebuild("orders"), keyed("explicit")).await,
                Some("explicit"),
                "explicit wins over rules and declaration",
            ),
            (
                tracked(&runtime, &rebuild("orders"), SendOptions::new()).await,
                Some("first:orders"),
                "rules in registration order, over the declaration",
            ),
            (
                tracked(&runtime, &invoice("INV-3"), SendOptions::new()).await,
                Some("INV-3"),
                "the type's own declaration, without rules for it",
            ),
            (
                tracked(&runtime, &rebuild("opt-out"), SendOptions::new()).await,
                None,
                "an empty result opts out",
            ),
            (
                tracked(
                    &runtime,
                    &ReceiveShipment {
                        IdempotencyKey: Some("member".into()),
                    },
                    SendOptions::new(),
                )
                .await,
                Some("member"),
                "the first member whose name matches",
            ),
        ];
        for (report, expected, rule) in cases {
            assert!(report.is_handled(), "{rule}");
            assert_eq!(
                stored_id(&db, report.envelope_id).await.as_deref(),
                expected,
                "{rule}"
            );
        }
        runtime.shutdown().await;
    }
);

on_both_backends!(
    the_id_can_come_from_the_message_or_a_header_sqlite,
    the_id_can_come_from_the_message_or_a_header_postgres,
    |db| {
        let (by_key, by_header) = (Counter::default(), Counter::default());
        let runtime = db
            .store(Runtime::builder(), "local", Duration::from_secs(30))
            .await
            .enable_deduplication()
            .module(
                Module::new("projections")
                    .handle_named::<RebuildProjection, _>("by_key", by_key.clone())
                    .handle_named::<RebuildProjection, _>("by_header", by_header.clone())
                    .deduplicate(
                        "by_key",
                        Deduplication::by_key(|m: &RebuildProjection| Some(m.name.clone())),
                    )
                    .deduplicate(
                        "by_header",
                        Deduplication::from_header("idempotency-key").optional(),
                    ),
            )
            .build()
            .unwrap();
        let header = |key: &str| SendOptions::new().header("idempotency-key", key);
        tracked(&runtime, &rebuild("orders"), header("h1")).await;
        tracked(&runtime, &rebuild("orders"), header("h1")).await;
        tracked(&runtime, &rebuild("invoices"), header("h1")).await;
        assert_eq!(by_key.count(), 2, "keyed on the message: orders, invoices");
        assert_eq!(by_header.count(), 1, "keyed on the header: h1 once");
        assert_eq!(
            db.scalar(
                "SELECT count(*) FROM dacapo_deduplication WHERE handler = 'projections/by_key'"
            )
            .await,
            2
        );
        runtime.shutdown().await;
    }
);
