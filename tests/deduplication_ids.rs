//! Publisher-side logical ids: explicit on the send, then configured rules in registration
//! order, then the message type's own declaration; nothing overwrites an id already set, and an
//! empty result opts out.

use dacapo::RuntimeBuilder;
use dacapo::prelude::*;
use dacapo::testing::{Recorder, TestHarness};
use serde::{Deserialize, Serialize};

/// Declares its own identity: the invoice number.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ArchiveInvoice {
    invoice_number: String,
    as_of: String,
}

impl Message for ArchiveInvoice {
    const TYPE: &'static str = "billing.archive_invoice";

    fn deduplication_id(&self) -> Option<String> {
        Some(self.invoice_number.clone())
    }
}

/// A generated contract: no declaration, but an `IdempotencyKey` member.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[allow(non_snake_case)]
struct ReceiveShipment {
    ShipmentId: u64,
    IdempotencyKey: Option<String>,
    DeduplicationId: Option<String>,
}

impl Message for ReceiveShipment {
    const TYPE: &'static str = "warehouse.receive_shipment";
}

fn invoice() -> ArchiveInvoice {
    ArchiveInvoice {
        invoice_number: "INV-7".into(),
        as_of: "2026-11-30".into(),
    }
}

fn shipment(key: Option<&str>, dedup: Option<&str>) -> ReceiveShipment {
    ReceiveShipment {
        ShipmentId: 42,
        IdempotencyKey: key.map(Into::into),
        DeduplicationId: dedup.map(Into::into),
    }
}

async fn id_of<M: Message + Clone>(
    configure: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder,
    message: &M,
    options: SendOptions,
) -> Option<String> {
    let harness = TestHarness::builder()
        .configure(configure)
        .module(Module::new("m").handle_named::<M, _>("h", Recorder::<M>::new()))
        .build()
        .unwrap();
    let envelope = harness.runtime().envelope(message, options).unwrap();
    envelope.deduplication_id
}

#[tokio::test]
async fn the_type_declares_its_own_id() {
    assert_eq!(
        id_of(|r| r, &invoice(), SendOptions::new())
            .await
            .as_deref(),
        Some("INV-7")
    );
}

#[tokio::test]
async fn an_explicit_id_wins_over_rules_and_declaration() {
    let explicit = SendOptions::new().deduplication_id("explicit");
    let id = id_of(
        |r| r.deduplicate_by::<ArchiveInvoice>(|_| Some("rule".into())),
        &invoice(),
        explicit,
    )
    .await;
    assert_eq!(id.as_deref(), Some("explicit"));
}

#[tokio::test]
async fn a_configured_rule_wins_over_the_declaration() {
    let rule = |r: RuntimeBuilder| {
        r.deduplicate_by::<ArchiveInvoice>(|m| Some(format!("{}|{}", m.invoice_number, m.as_of)))
    };
    assert_eq!(
        id_of(rule, &invoice(), SendOptions::new()).await.as_deref(),
        Some("INV-7|2026-11-30")
    );
}

#[tokio::test]
async fn rules_apply_in_registration_order() {
    let rules = |r: RuntimeBuilder| {
        r.deduplicate_by::<ArchiveInvoice>(|_| Some("first".into()))
            .deduplicate_by::<ArchiveInvoice>(|_| Some("second".into()))
    };
    assert_eq!(
        id_of(rules, &invoice(), SendOptions::new())
            .await
            .as_deref(),
        Some("first")
    );
}

#[tokio::test]
async fn the_first_member_whose_name_matches_gives_the_id() {
    let rule =
        |r: RuntimeBuilder| r.deduplicate_by_member_named(&["IdempotencyKey", "DeduplicationId"]);
    let both = shipment(Some("key"), Some("dedup"));
    assert_eq!(
        id_of(rule, &both, SendOptions::new()).await.as_deref(),
        Some("key"),
        "first name in the list wins"
    );
    let other =
        |r: RuntimeBuilder| r.deduplicate_by_member_named(&["DeduplicationId", "IdempotencyKey"]);
    assert_eq!(
        id_of(other, &both, SendOptions::new()).await.as_deref(),
        Some("dedup")
    );
    let number = |r: RuntimeBuilder| r.deduplicate_by_member_named(&["ShipmentId"]);
    assert_eq!(
        id_of(number, &both, SendOptions::new()).await.as_deref(),
        Some("42"),
        "non-strings as text"
    );
}

#[tokio::test]
async fn an_empty_result_opts_the_message_out() {
    let opt_out = |r: RuntimeBuilder| r.deduplicate_by::<ArchiveInvoice>(|_| Some(String::new()));
    assert_eq!(
        id_of(opt_out, &invoice(), SendOptions::new()).await,
        None,
        "the declaration is not consulted"
    );
    let none = |r: RuntimeBuilder| r.deduplicate_by::<ArchiveInvoice>(|_| None);
    assert_eq!(id_of(none, &invoice(), SendOptions::new()).await, None);
    let null_member = |r: RuntimeBuilder| r.deduplicate_by_member_named(&["IdempotencyKey"]);
    assert_eq!(
        id_of(null_member, &shipment(None, Some("x")), SendOptions::new()).await,
        None
    );
}

#[tokio::test]
async fn a_rule_for_another_type_or_a_missing_member_leaves_the_decision_to_the_next_source() {
    let unrelated = |r: RuntimeBuilder| {
        r.deduplicate_by::<ReceiveShipment>(|_| Some("shipment".into()))
            .deduplicate_by_member_named(&["Nope"])
    };
    assert_eq!(
        id_of(unrelated, &invoice(), SendOptions::new())
            .await
            .as_deref(),
        Some("INV-7")
    );
}

/// Cascades an invoice archive.
struct Cascade;

impl Handler<ReceiveShipment> for Cascade {
    async fn handle(
        &self,
        _: &ReceiveShipment,
        context: &MessageContext,
    ) -> Result<(), HandlerError> {
        context.publish(&invoice()).await?;
        Ok(())
    }
}

#[tokio::test]
async fn cascaded_messages_get_their_ids_the_same_way() {
    let harness = TestHarness::builder()
        .configure(|r| {
            r.deduplicate_by::<ArchiveInvoice>(|m| Some(format!("rule:{}", m.invoice_number)))
        })
        .module(Module::new("warehouse").handle_named::<ReceiveShipment, _>("receive", Cascade))
        .module(
            Module::new("billing").handle_named::<ArchiveInvoice, _>("archive", Recorder::new()),
        )
        .build()
        .unwrap();
    let report = harness.publish(&shipment(None, None)).await.unwrap();
    assert_eq!(
        report.cascaded[0].deduplication_id.as_deref(),
        Some("rule:INV-7")
    );
}
