//! The envelope on the wire: which broker headers carry its fields, both ways.
#![cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
//!
//! | envelope field | dacapo header | CloudEvents attribute |
//! |---|---|---|
//! | `id` | `message-id` | `id` |
//! | `message_type` | `message-type` | `type` |
//! | `sent_at` (RFC 3339) | `sent-at` | `time` |
//! | `correlation_id` | `correlation-id` | `correlationid` (extension) |
//! | `causation_id` | `causation-id` | `causationid` (extension) |
//! | `deduplication_id` | `deduplication-id` | `deduplicationid` (extension) |
//! | `scheduled_for` (RFC 3339) | `scheduled-for` | `scheduledfor` (extension) |
//! | `headers` | each as itself | each as itself |
//! | `payload` | the body (JSON) | the body (`datacontenttype` `application/json`) |
//!
//! CloudEvents attributes travel in binary content mode, each in a header of its own named
//! with the binding's prefix: `cloudEvents_` on AMQP, `ce-` on NATS.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use dacapo_actors::Envelope;
use uuid::Uuid;

/// How envelopes a runtime sends travel on a broker. Either is read on receipt, whichever a
/// runtime sends: a message with CloudEvents headers is read as a CloudEvent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireFormat {
    /// dacapo's own headers (`message-id`, `message-type`, `deduplication-id`, …).
    #[default]
    Dacapo,
    /// The CloudEvents 1.0 binary content mode of the transport's protocol binding, so a
    /// service in another language reads and writes them with its CloudEvents SDK.
    CloudEvents,
}

/// The settings of how a broker transport writes envelopes, for its configuration's
/// `settings.format` and `settings.source`.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
macro_rules! wire_settings {
    () => {
        /// How published envelopes travel: dacapo's headers (default) or CloudEvents.
        #[must_use]
        pub fn wire_format(mut self, format: WireFormat) -> Self {
            self.settings.format = format;
            self
        }

        /// The CloudEvents `source` of what this node publishes (default `urn:dacapo`).
        #[must_use]
        pub fn source(mut self, source: impl Into<String>) -> Self {
            self.settings.source = source.into();
            self
        }
    };
}
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) use wire_settings;

/// The prefix of CloudEvents attribute headers in a protocol binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Binding {
    /// `cloudEvents_` (the AMQP binding's form that AMQP 0-9-1 and JMS also accept).
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    Amqp,
    /// `ce-`.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    Nats,
}

impl Binding {
    fn prefix(self) -> &'static str {
        match self {
            Self::Amqp => "cloudEvents_",
            Self::Nats => "ce-",
        }
    }
}

/// What a runtime sending CloudEvents names as their `source` unless told otherwise.
pub(crate) const DEFAULT_SOURCE: &str = "urn:dacapo";

const ID: &str = "message-id";
const TYPE: &str = "message-type";
const SENT_AT: &str = "sent-at";
const CORRELATION_ID: &str = "correlation-id";
const CAUSATION_ID: &str = "causation-id";
const DEDUPLICATION_ID: &str = "deduplication-id";
const SCHEDULED_FOR: &str = "scheduled-for";
const CONTENT_TYPE: &str = "content-type";
const JSON: &str = "application/json";

/// Ids on the wire that are not UUIDs (a foreign service's) become this namespace's v5 UUIDs
/// of their text, the same on every redelivery.
const FOREIGN_IDS: Uuid = Uuid::from_u128(0x6d2f_0a3c_51b4_4e0e_9a57_0d1c_a9c0_7a11);

/// The headers that carry `envelope` in `format`.
pub(crate) fn encode(
    envelope: &Envelope,
    format: WireFormat,
    binding: Binding,
    source: &str,
) -> Vec<(String, String)> {
    let mut headers: Vec<(String, String)> = envelope
        .headers
        .iter()
        .filter(|(name, _)| !is_reserved(&name.to_ascii_lowercase()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    let time = |at: DateTime<Utc>| at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    match format {
        WireFormat::Dacapo => {
            headers.push((ID.into(), envelope.id.simple().to_string()));
            headers.push((TYPE.into(), envelope.message_type.to_string()));
            headers.push((SENT_AT.into(), time(envelope.sent_at)));
            headers.push((CONTENT_TYPE.into(), JSON.into()));
            let optional = [
                (
                    CORRELATION_ID,
                    envelope.correlation_id.map(|id| id.simple().to_string()),
                ),
                (
                    CAUSATION_ID,
                    envelope.causation_id.map(|id| id.simple().to_string()),
                ),
                (DEDUPLICATION_ID, envelope.deduplication_id.clone()),
                (SCHEDULED_FOR, envelope.scheduled_for.map(time)),
            ];
            headers.extend(
                optional
                    .into_iter()
                    .filter_map(|(name, value)| Some((name.to_owned(), value?))),
            );
        }
        WireFormat::CloudEvents => {
            let prefix = binding.prefix();
            let attribute = |name: &str, value: String| (format!("{prefix}{name}"), value);
            headers.push(attribute("specversion", "1.0".into()));
            headers.push(attribute("id", envelope.id.simple().to_string()));
            headers.push(attribute("type", envelope.message_type.to_string()));
            headers.push(attribute("source", source.to_owned()));
            headers.push(attribute("time", time(envelope.sent_at)));
            headers.push(attribute("datacontenttype", JSON.into()));
            let optional = [
                (
                    "correlationid",
                    envelope.correlation_id.map(|id| id.simple().to_string()),
                ),
                (
                    "causationid",
                    envelope.causation_id.map(|id| id.simple().to_string()),
                ),
                ("deduplicationid", envelope.deduplication_id.clone()),
                ("scheduledfor", envelope.scheduled_for.map(time)),
            ];
            headers.extend(
                optional
                    .into_iter()
                    .filter_map(|(name, value)| Some(attribute(name, value?))),
            );
        }
    }
    headers
}

/// What a transport's client says of a message besides its headers, read where a header is
/// missing (an AMQP publisher sets `message_id` and `type` properties, JetStream has
/// `Nats-Msg-Id`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Fallback {
    pub(crate) id: Option<String>,
    pub(crate) message_type: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) sent_at: Option<DateTime<Utc>>,
    /// Read from the message's own headers (JetStream's `Nats-Msg-Id`): an unreadable
    /// message's dead letter keeps them already, and they are not added again.
    pub(crate) in_headers: bool,
    /// What else the message came with that no header holds as text — the transport's other
    /// properties (AMQP's `app_id`, `reply_to`, … as `property-app-id`, …), headers of other
    /// types, a header's earlier values — by name: an unreadable message's dead letter keeps
    /// it, and two messages told apart only by it keep a dead letter each.
    pub(crate) more: Vec<(String, String)>,
    /// The type the message's address names — the type in its JetStream subject, its routing
    /// key on the transport's own exchange — where it names one. The broker's permissions
    /// judged the address, not the headers: a type header that says another type is refused,
    /// or a publisher allowed one type's subject could have any other type's handlers run.
    pub(crate) addressed_type: Option<String>,
}

/// A message that could not be read as an envelope, as it arrived: it becomes a dead letter.
#[derive(Clone, Debug)]
pub(crate) struct Unreadable {
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) body: Vec<u8>,
    pub(crate) why: String,
    /// The transport's own properties (AMQP's `message_id`, `type`, …) by `property-` name,
    /// and what else it came with ([`Fallback::more`]).
    pub(crate) properties: Vec<(String, String)>,
}

impl Unreadable {
    /// The envelope its dead letter keeps: the headers and body as they arrived, under an id
    /// derived from them, so a redelivery of the same message replaces its dead letter.
    pub(crate) fn into_envelope(self, now: DateTime<Utc>) -> Envelope {
        // Each part after its length, so no part can pass for another (a header for a
        // property, headers for the start of a body): two messages told apart by any part
        // keep a dead letter each.
        let mut identity = Vec::with_capacity(self.body.len() + 64);
        let mut part = |bytes: &[u8]| {
            identity.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            identity.extend_from_slice(bytes);
        };
        part(&(self.headers.len() as u64).to_le_bytes());
        for (name, value) in &self.headers {
            part(name.as_bytes());
            part(value.as_bytes());
        }
        part(&(self.properties.len() as u64).to_le_bytes());
        for (name, value) in &self.properties {
            part(name.as_bytes());
            part(value.as_bytes());
        }
        part(&self.body);
        let message_type = self
            .headers
            .iter()
            .find(|(name, _)| {
                let name = name.to_ascii_lowercase();
                [TYPE, "cloudevents_type", "cloudevents:type", "ce-type"].contains(&name.as_str())
            })
            .map(|(_, value)| value.clone())
            .filter(|value| !value.is_empty() && !value.contains('\0'))
            .unwrap_or_else(|| "unknown".to_owned());
        let mut envelope = Envelope::new(message_type, self.body);
        envelope.id = Uuid::new_v5(&FOREIGN_IDS, &identity);
        envelope.correlation_id = None;
        let mut headers = self.headers;
        // Shown beside the headers for an operator, where no header has the name already.
        for (name, value) in self.properties {
            headers.entry(name).or_insert(value);
        }
        envelope.headers = headers;
        envelope.sent_at = now;
        envelope
    }
}

/// Reads the envelope that `headers` and `body` carry, in whichever format they are.
pub(crate) fn decode(
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
    fallback: Fallback,
) -> Result<Envelope, Unreadable> {
    match read(&headers, &fallback) {
        Ok(fields) => {
            let mut envelope = Envelope::new(fields.message_type, body);
            envelope.id = fields.id;
            envelope.sent_at = fields.sent_at.unwrap_or_else(Utc::now);
            envelope.correlation_id = fields.correlation_id;
            envelope.causation_id = fields.causation_id;
            envelope.deduplication_id = fields.deduplication_id;
            envelope.scheduled_for = fields.scheduled_for;
            envelope.headers = headers
                .into_iter()
                .filter(|(name, _)| !is_reserved(&name.to_ascii_lowercase()))
                .collect();
            Ok(envelope)
        }
        Err(why) => Err(Unreadable {
            headers,
            body,
            why,
            properties: properties(fallback),
        }),
    }
}

/// The transport's own properties (AMQP's `message_id`, `type`, …) an unreadable message
/// came with, under `property-` names, then what else it came with.
fn properties(fallback: Fallback) -> Vec<(String, String)> {
    let read = if fallback.in_headers {
        Vec::new()
    } else {
        vec![
            ("property-message-id", fallback.id),
            ("property-type", fallback.message_type),
            ("property-correlation-id", fallback.correlation_id),
            (
                "property-timestamp",
                fallback.sent_at.map(|at| at.to_rfc3339()),
            ),
        ]
    };
    let mut more = fallback.more;
    // In one order whatever order the client gave them in (a hash map's, for JetStream's
    // headers): a redelivery keeps its dead letter's id.
    more.sort_unstable();
    read.into_iter()
        .filter_map(|(name, value)| value.map(|value| (name.to_owned(), value)))
        .chain(more)
        .collect()
}

struct Fields {
    id: Uuid,
    message_type: String,
    sent_at: Option<DateTime<Utc>>,
    correlation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    deduplication_id: Option<String>,
    scheduled_for: Option<DateTime<Utc>>,
}

fn read(headers: &BTreeMap<String, String>, fallback: &Fallback) -> Result<Fields, String> {
    let lowered: BTreeMap<String, &str> = headers
        .iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), value.as_str()))
        .collect();
    let prefix = ["cloudevents_", "cloudevents:", "ce-"]
        .into_iter()
        .find(|prefix| lowered.contains_key(&format!("{prefix}id")));
    let get = |name: &str| -> Option<String> {
        lowered
            .get(name)
            .map(|value| (*value).to_owned())
            .filter(|value| !value.is_empty())
    };
    let (names, source) = match prefix {
        Some(prefix) => {
            let names = [
                "id",
                "type",
                "time",
                "correlationid",
                "causationid",
                "deduplicationid",
                "scheduledfor",
            ]
            .map(|name| format!("{prefix}{name}"));
            (names, get(&format!("{prefix}source")))
        }
        None => (
            [
                ID,
                TYPE,
                SENT_AT,
                CORRELATION_ID,
                CAUSATION_ID,
                DEDUPLICATION_ID,
                SCHEDULED_FOR,
            ]
            .map(str::to_owned),
            None,
        ),
    };
    let [
        id,
        message_type,
        sent_at,
        correlation,
        causation,
        deduplication,
        scheduled,
    ] = names;
    let id = get(&id)
        .or_else(|| fallback.id.clone())
        .ok_or_else(|| format!("no {id} header: the message has no id to deduplicate on"))?;
    // A CloudEvent is identified by its source and id together.
    let id = match &source {
        Some(source) if Uuid::parse_str(&id).is_err() => foreign_id(&format!("{source}\n{id}")),
        _ => foreign_id(&id),
    };
    // Every message a sender stamps with the nil UUID (an unset GUID) would share one id, and
    // the inbox would discard all but the first as redeliveries.
    if id.is_nil() {
        return Err("the message's id is the nil UUID, which cannot tell it from another".into());
    }
    let message_type_header = message_type;
    let message_type = get(&message_type_header)
        .or_else(|| fallback.message_type.clone())
        .ok_or_else(|| format!("no {message_type_header} header: the message's type is unknown"))?;
    // Kept in text columns, where PostgreSQL refuses a NUL: refused here, the message becomes
    // a dead letter that keeps it (its headers are kept as escaped JSON).
    let no_nul = |header: &str, value: &str| {
        if value.contains('\0') {
            Err(format!(
                "{header} header holds a NUL character, which no store keeps as text"
            ))
        } else {
            Ok(())
        }
    };
    no_nul(&message_type_header, &message_type)?;
    if let Some(addressed) = &fallback.addressed_type
        && *addressed != message_type
    {
        return Err(format!(
            "{message_type_header} header says {message_type:?}, but the message was \
             addressed to {addressed:?}"
        ));
    }
    let time = |name: &str| -> Result<Option<DateTime<Utc>>, String> {
        get(name)
            .map(|text| {
                DateTime::parse_from_rfc3339(&text)
                    .map(|at| at.with_timezone(&Utc))
                    .map_err(|error| {
                        format!("{name} header {text:?} is not an RFC 3339 time: {error}")
                    })
            })
            .transpose()
    };
    Ok(Fields {
        id,
        message_type,
        sent_at: time(&sent_at)?.or(fallback.sent_at),
        correlation_id: get(&correlation)
            .or_else(|| fallback.correlation_id.clone())
            .map(|id| foreign_id(&id)),
        causation_id: get(&causation).map(|id| foreign_id(&id)),
        deduplication_id: match get(&deduplication) {
            Some(value) => {
                no_nul(&deduplication, &value)?;
                Some(value)
            }
            None => None,
        },
        scheduled_for: time(&scheduled)?,
    })
}

/// `text` as a UUID, or the UUID derived from it when it is not one.
fn foreign_id(text: &str) -> Uuid {
    Uuid::parse_str(text).unwrap_or_else(|_| Uuid::new_v5(&FOREIGN_IDS, text.as_bytes()))
}

/// Whether a (lowercased) header name carries an envelope field, or belongs to the broker,
/// rather than being one of the envelope's own headers.
fn is_reserved(name: &str) -> bool {
    matches!(
        name,
        ID | TYPE
            | SENT_AT
            | CORRELATION_ID
            | CAUSATION_ID
            | DEDUPLICATION_ID
            | SCHEDULED_FOR
            | CONTENT_TYPE
    ) || name.starts_with("cloudevents_")
        || name.starts_with("cloudevents:")
        || name.starts_with("ce-")
        || name.starts_with("nats-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope() -> Envelope {
        let mut envelope = Envelope::new("orders.placed", br#"{"n":1}"#.to_vec());
        envelope.deduplication_id = Some("order-7".into());
        envelope.causation_id = Some(Uuid::new_v4());
        envelope.headers.insert("tenant".into(), "acme".into());
        envelope.scheduled_for = Some(Utc::now());
        envelope
    }

    fn map(headers: Vec<(String, String)>) -> BTreeMap<String, String> {
        headers.into_iter().collect()
    }

    #[test]
    fn both_formats_carry_every_field_there_and_back() {
        for (format, binding) in [
            (WireFormat::Dacapo, Binding::Amqp),
            (WireFormat::CloudEvents, Binding::Amqp),
            (WireFormat::CloudEvents, Binding::Nats),
        ] {
            let sent = envelope();
            let headers = map(encode(&sent, format, binding, DEFAULT_SOURCE));
            let got = decode(headers, sent.payload.clone(), Fallback::default()).unwrap();
            assert_eq!(got.id, sent.id, "{format:?}");
            assert_eq!(got.message_type, sent.message_type);
            assert_eq!(got.payload, sent.payload);
            assert_eq!(got.deduplication_id, sent.deduplication_id);
            assert_eq!(got.correlation_id, sent.correlation_id);
            assert_eq!(got.causation_id, sent.causation_id);
            assert_eq!(got.headers, sent.headers);
            assert_eq!(
                got.sent_at.timestamp_micros(),
                sent.sent_at.timestamp_micros()
            );
            assert_eq!(
                got.scheduled_for.map(|at| at.timestamp_micros()),
                sent.scheduled_for.map(|at| at.timestamp_micros())
            );
        }
    }

    #[test]
    fn a_foreign_id_that_is_not_a_uuid_gets_the_same_uuid_every_time() {
        let headers = || {
            map(vec![
                ("ce-id".into(), "A-234-1234-1234".into()),
                ("ce-source".into(), "/billing".into()),
                ("ce-type".into(), "billing.invoice_paid".into()),
                ("ce-specversion".into(), "1.0".into()),
            ])
        };
        let first = decode(headers(), b"{}".to_vec(), Fallback::default()).unwrap();
        let again = decode(headers(), b"{}".to_vec(), Fallback::default()).unwrap();
        assert_eq!(first.id, again.id);
        assert_eq!(first.message_type, "billing.invoice_paid");
        let elsewhere = map(vec![
            ("ce-id".into(), "A-234-1234-1234".into()),
            ("ce-source".into(), "/shipping".into()),
            ("ce-type".into(), "billing.invoice_paid".into()),
        ]);
        let other = decode(elsewhere, b"{}".to_vec(), Fallback::default()).unwrap();
        assert_ne!(
            first.id, other.id,
            "the same id from another source is another event"
        );
    }

    #[test]
    fn a_message_without_an_id_or_a_type_is_unreadable_and_says_why() {
        let no_id = decode(
            map(vec![(TYPE.into(), "orders.placed".into())]),
            b"{}".to_vec(),
            Fallback::default(),
        )
        .unwrap_err();
        assert!(no_id.why.contains("message-id"), "{}", no_id.why);
        let no_type = decode(
            map(vec![(ID.into(), Uuid::new_v4().to_string())]),
            b"{}".to_vec(),
            Fallback::default(),
        )
        .unwrap_err();
        assert!(no_type.why.contains("message-type"), "{}", no_type.why);
        let bad_time = decode(
            map(vec![
                (ID.into(), Uuid::new_v4().to_string()),
                (TYPE.into(), "orders.placed".into()),
                (SENT_AT.into(), "yesterday".into()),
            ]),
            b"{}".to_vec(),
            Fallback::default(),
        )
        .unwrap_err();
        assert!(bad_time.why.contains("RFC 3339"), "{}", bad_time.why);
    }

    #[test]
    fn a_nil_id_is_unreadable() {
        let nil = decode(
            map(vec![
                (ID.into(), Uuid::nil().to_string()),
                (TYPE.into(), "orders.placed".into()),
            ]),
            b"{}".to_vec(),
            Fallback::default(),
        )
        .unwrap_err();
        assert!(nil.why.contains("nil UUID"), "{}", nil.why);
        let from_the_client = decode(
            BTreeMap::new(),
            b"{}".to_vec(),
            Fallback {
                id: Some(Uuid::nil().to_string()),
                message_type: Some("orders.placed".into()),
                ..Fallback::default()
            },
        )
        .unwrap_err();
        assert!(from_the_client.why.contains("nil UUID"));
    }

    #[test]
    fn a_type_header_other_than_the_addressed_type_is_unreadable() {
        let headers = || {
            map(vec![
                (ID.into(), Uuid::new_v4().to_string()),
                (TYPE.into(), "admin.purge_tenant".into()),
            ])
        };
        let addressed = |to: &str| Fallback {
            addressed_type: Some(to.to_owned()),
            ..Fallback::default()
        };
        let forged = decode(headers(), b"{}".to_vec(), addressed("orders.placed")).unwrap_err();
        assert!(
            forged.why.contains("addressed to \"orders.placed\""),
            "{}",
            forged.why
        );
        let honest = decode(headers(), b"{}".to_vec(), addressed("admin.purge_tenant")).unwrap();
        assert_eq!(honest.message_type, "admin.purge_tenant");
        let unaddressed = decode(headers(), b"{}".to_vec(), Fallback::default()).unwrap();
        assert_eq!(unaddressed.message_type, "admin.purge_tenant");
    }

    #[test]
    fn the_clients_own_fields_stand_in_for_missing_headers() {
        let id = Uuid::new_v4();
        let got = decode(
            BTreeMap::new(),
            b"{}".to_vec(),
            Fallback {
                id: Some(id.to_string()),
                message_type: Some("orders.placed".into()),
                ..Fallback::default()
            },
        )
        .unwrap();
        assert_eq!((got.id, got.message_type.as_ref()), (id, "orders.placed"));
    }

    #[test]
    fn an_unreadable_message_keeps_the_transports_properties_in_its_dead_letter() {
        // A message without a type, with `header`, that came with the property `id`.
        let dead_letter = |header: (&str, &str), id: &str| {
            decode(
                map(vec![(header.0.into(), header.1.into())]),
                b"junk".to_vec(),
                Fallback {
                    id: Some(id.to_owned()),
                    ..Fallback::default()
                },
            )
            .unwrap_err()
            .into_envelope(Utc::now())
        };
        let in_headers = decode(
            map(vec![("Nats-Msg-Id".into(), "a".into())]),
            b"junk".to_vec(),
            Fallback {
                id: Some("a".to_owned()),
                in_headers: true,
                ..Fallback::default()
            },
        )
        .unwrap_err();
        assert!(in_headers.properties.is_empty(), "kept once, as a header");
        let with_id = |id: &str| dead_letter(("x", "1"), id);
        let (first, second) = (with_id("a"), with_id("b"));
        assert_ne!(first.id, second.id, "two messages, two dead letters");
        assert_eq!(first.id, with_id("a").id, "one message, one dead letter");
        assert_eq!(
            first.headers.get("property-message-id").map(String::as_str),
            Some("a")
        );
        // A header of the property's name stands in for neither its display nor its identity.
        let posing = |id: &str| dead_letter(("property-message-id", "posing"), id);
        assert_ne!(posing("a").id, posing("b").id);
        assert_eq!(
            posing("a")
                .headers
                .get("property-message-id")
                .map(String::as_str),
            Some("posing"),
            "the header as it arrived"
        );
    }

    #[test]
    fn what_else_an_unreadable_message_came_with_tells_its_dead_letter_apart() {
        let dead_letter = |more: &[(&str, &str)]| {
            decode(
                map(vec![("x".into(), "1".into())]),
                b"junk".to_vec(),
                Fallback {
                    more: more
                        .iter()
                        .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                        .collect(),
                    ..Fallback::default()
                },
            )
            .unwrap_err()
            .into_envelope(Utc::now())
        };
        let billing = dead_letter(&[("property-app-id", "billing")]);
        assert_ne!(billing.id, dead_letter(&[]).id);
        assert_ne!(billing.id, dead_letter(&[("property-app-id", "orders")]).id);
        assert_eq!(
            billing.id,
            dead_letter(&[("property-app-id", "billing")]).id
        );
        assert_eq!(
            billing.headers.get("property-app-id").map(String::as_str),
            Some("billing"),
            "shown beside the headers"
        );
        // A header's value stays the header's; what the header held besides counts apart.
        let all_values = dead_letter(&[("x-all-values", "[\"0\", \"1\"]")]);
        assert_ne!(all_values.id, dead_letter(&[]).id);
        assert_eq!(all_values.headers.get("x").map(String::as_str), Some("1"));
        // Given in another order (a hash map's), the same message.
        assert_eq!(
            dead_letter(&[("a", "1"), ("b", "2")]).id,
            dead_letter(&[("b", "2"), ("a", "1")]).id
        );
    }

    #[test]
    fn no_part_of_an_unreadable_message_passes_for_another_in_its_dead_letter_id() {
        let id = |headers: Vec<(&str, &str)>, body: &[u8]| {
            let headers = headers
                .into_iter()
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .collect();
            decode(map(headers), body.to_vec(), Fallback::default())
                .unwrap_err()
                .into_envelope(Utc::now())
                .id
        };
        // Read as names and values ended by NULs, each pair would be the same bytes.
        assert_ne!(id(vec![("a", "b")], b"X"), id(vec![], b"a\0b\0X"));
        assert_ne!(
            id(vec![("a", "b\0c\0d")], b""),
            id(vec![("a", "b"), ("c", "d")], b"")
        );
    }

    #[test]
    fn an_unreadable_message_keeps_the_same_dead_letter_id_on_redelivery() {
        let unreadable = || {
            decode(
                map(vec![("x".into(), "1".into())]),
                b"junk".to_vec(),
                Fallback::default(),
            )
            .unwrap_err()
        };
        let now = Utc::now();
        let first = unreadable().into_envelope(now);
        let typed = decode(
            map(vec![
                (CONTENT_TYPE.into(), JSON.into()),
                ("cloudEvents_datacontenttype".into(), JSON.into()),
                ("cloudEvents_type".into(), "orders.placed".into()),
            ]),
            b"{}".to_vec(),
            Fallback::default(),
        )
        .unwrap_err()
        .into_envelope(now);
        assert_eq!(
            typed.message_type, "orders.placed",
            "its type, not its content type"
        );
        assert_eq!(first.id, unreadable().into_envelope(now).id);
        assert_eq!(first.payload, b"junk");
        assert_eq!(first.headers.get("x").map(String::as_str), Some("1"));
    }
}
