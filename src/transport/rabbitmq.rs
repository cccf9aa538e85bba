//! RabbitMQ, over lapin: publisher confirms, a prefetch, acknowledgements after the inbox.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use dacapo_actors::Envelope;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use super::host::{GatherError, Publish, Received, Sent, Subscribe, Transport, gather};
use super::routes::{Routes, routing};
use super::wire::{self, Binding, Fallback, WireFormat};
use crate::Error;

mod unreadable;

const NAME: &str = "rabbitmq";

/// The kind of queue a node listens on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueKind {
    /// A classic durable queue (the default).
    #[default]
    Classic,
    /// A quorum queue: replicated on a RabbitMQ cluster, always durable.
    Quorum,
}

/// RabbitMQ as a transport: routed message types are published to a durable topic exchange
/// (`dacapo` by default) with their type as routing key, with publisher confirms; each service
/// listens on a durable queue of its own, bound to the routed types it handles, which the
/// nodes of that service share (each message goes to one of them).
///
/// A node consumes with a prefetch, hands each batch to its inbox in one transaction, and
/// acknowledges the batch once it is recorded (a multiple ack); handling runs after, from the
/// inbox. What was delivered and not recorded when the runtime stops, or when the node dies,
/// goes back to the queue for another node. The exchange, the queue and its bindings are
/// declared at start, or only checked with [`declare(false)`](Self::declare).
///
/// ```no_run
/// # use dacapo::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct OrderPlaced { n: u32 }
/// # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
/// # async fn run(store: dacapo::store::SqliteStore, module: Module) -> Result<(), dacapo::Error> {
/// use dacapo::transport::RabbitMq;
///
/// let rabbit = RabbitMq::new("amqp://guest:guest@127.0.0.1:5672/%2f", "orders")
///     .route::<OrderPlaced>();
/// let runtime = Runtime::builder().store(store).module(module).transport(rabbit).build()?;
/// runtime.listening().await?;
/// # Ok(())
/// # }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
#[derive(Clone, Debug)]
pub struct RabbitMq {
    settings: Settings,
    routes: Routes,
}

#[derive(Clone)]
struct Settings {
    url: String,
    exchange: String,
    queue: String,
    kind: QueueKind,
    prefetch: u16,
    format: WireFormat,
    source: String,
    declare: bool,
    max_message_size: usize,
}

impl RabbitMq {
    /// The broker at `url` (`amqp://user:password@host:port/vhost`); this service listens on
    /// the queue `queue`.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            settings: Settings {
                url: url.into(),
                exchange: "dacapo".into(),
                queue: queue.into(),
                kind: QueueKind::Classic,
                prefetch: 100,
                format: WireFormat::Dacapo,
                source: wire::DEFAULT_SOURCE.into(),
                declare: true,
                max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            },
            routes: Routes::default(),
        }
    }

    routing!();

    /// The topic exchange routed types are published to and the queue is bound on (default
    /// `dacapo`).
    #[must_use]
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.settings.exchange = exchange.into();
        self
    }

    /// A classic (default) or quorum queue.
    #[must_use]
    pub fn queue_kind(mut self, kind: QueueKind) -> Self {
        self.settings.kind = kind;
        self
    }

    /// How many unacknowledged messages the broker hands this node at once, and so the
    /// largest batch its inbox records in one transaction (default 100).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch.max(1);
        self
    }

    wire::wire_settings!();

    /// Whether to declare the exchange, the queue and its bindings at start (the default) or
    /// only check that the exchange and the queue exist, for a broker whose topology is
    /// managed elsewhere. The bindings are declared either way (AMQP cannot check one), and
    /// the check is by name: an exchange or queue declared with other settings passes it.
    #[must_use]
    pub fn declare(mut self, declare: bool) -> Self {
        self.settings.declare = declare;
        self
    }

    /// The largest body the broker takes (its `max_message_size`): a larger one becomes a dead
    /// letter, undeliverable to the broker, instead of a publication the broker answers by
    /// closing the channel, every round (default 16 MiB, RabbitMQ 4's default; RabbitMQ 3
    /// takes 128 MiB).
    #[must_use]
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.settings.max_message_size = bytes;
        self
    }
}

/// RabbitMQ 4's `max_message_size`.
const DEFAULT_MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("url", &super::redacted(&self.url))
            .finish_non_exhaustive()
    }
}

impl From<RabbitMq> for Transport {
    fn from(rabbit: RabbitMq) -> Self {
        let RabbitMq { settings, routes } = rabbit;
        Transport {
            name: NAME,
            home: settings.exchange.clone(),
            routes: routes.clone(),
            open: Box::new(move |listened| {
                let settings = Arc::new(settings);
                let publisher = Publisher {
                    settings: Arc::clone(&settings),
                    routes,
                    listened: listened.clone(),
                    channel: None,
                    declared: HashSet::new(),
                };
                let subscriber = Subscriber {
                    settings,
                    listened,
                    consuming: None,
                    last_tag: None,
                    cut_short: None,
                    head: None,
                    subscribed: false,
                };
                (Box::new(publisher), Box::new(subscriber))
            }),
        }
    }
}

/// `envelopes` held, untried, when one at a time ran out of time.
fn not_tried(envelopes: &[Envelope]) -> impl Iterator<Item = (uuid::Uuid, String)> + '_ {
    envelopes.iter().map(|envelope| {
        (
            envelope.id,
            "not tried: a publication the broker refused took the batch's time".to_owned(),
        )
    })
}

/// How long after its start a publication whose batch the broker closed the channel on may
/// send it one envelope at a time: within the publication's timeout of 5 s at least.
const ONE_AT_A_TIME_FOR: std::time::Duration = std::time::Duration::from_secs(3);

fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::transport(NAME, error)
}

/// A name the protocol limits to 255 bytes.
fn short(text: &str) -> Result<ShortString, Error> {
    ShortString::try_new(text)
        .map_err(|error| Error::Configuration(format!("{text:?} cannot be an AMQP name: {error}")))
}

async fn connect(settings: &Settings) -> Result<(Connection, Channel), Error> {
    let connection = Connection::connect(&settings.url, ConnectionProperties::default())
        .await
        .map_err(|error| match error.kind() {
            // Refused credentials or virtual host: waiting does not cure them.
            lapin::ErrorKind::ProtocolError(amqp) if matches!(amqp.get_id(), 403 | 530) => {
                Error::Configuration(format!(
                    "RabbitMQ at {} refuses the connection: {error}",
                    super::redacted(&settings.url)
                ))
            }
            _ => failed(error),
        })?;
    let channel = connection.create_channel().await.map_err(failed)?;
    Ok((connection, channel))
}

/// Declares (or, with `declare` off, checks) a durable topic exchange. A passive declare of a
/// missing exchange closes the channel: the error says so, and is not retried.
async fn exchange(channel: &Channel, name: &str, declare: bool) -> Result<(), Error> {
    let options = ExchangeDeclareOptions {
        durable: true,
        passive: !declare,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            short(name)?,
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
        .map_err(|error| missing(declare, format!("exchange {name:?}"), error))
}

/// A declaration's error: the broker's answer that the object is missing (404, when only
/// checked) or declared otherwise (406, a classic queue where a quorum one is asked for) is
/// a configuration error, which waiting does not cure; anything else (a connection lost
/// meanwhile) is the broker's, and retried.
fn missing(declare: bool, what: String, error: lapin::Error) -> Error {
    let code = match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    };
    match code {
        Some(404) if !declare => Error::Configuration(format!(
            "RabbitMQ has no {what} (the transport only checks its topology: {error})"
        )),
        Some(406) => Error::Configuration(format!(
            "RabbitMQ has {what} declared with other settings: {error}"
        )),
        Some(403) => Error::Configuration(format!(
            "RabbitMQ refuses this user access to {what}: {error}"
        )),
        _ => failed(error),
    }
}

/// Declares (or checks) this service's queue and binds it to each type it listens for.
async fn home_queue(
    channel: &Channel,
    settings: &Settings,
    listened: &[String],
) -> Result<ShortString, Error> {
    exchange(channel, &settings.exchange, settings.declare).await?;
    let mut arguments = FieldTable::default();
    if settings.kind == QueueKind::Quorum {
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    let options = QueueDeclareOptions {
        durable: true,
        passive: !settings.declare,
        ..QueueDeclareOptions::default()
    };
    let queue = short(&settings.queue)?;
    channel
        .queue_declare(queue.clone(), options, arguments)
        .await
        .map_err(|error| {
            missing(
                settings.declare,
                format!("queue {:?}", settings.queue),
                error,
            )
        })?;
    // Bindings cannot be checked without the management API: they are declared either
    // way, which is idempotent.
    for message_type in listened {
        channel
            .queue_bind(
                queue.clone(),
                short(&settings.exchange)?,
                short(message_type)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed)?;
    }
    Ok(queue)
}

struct Publisher {
    settings: Arc<Settings>,
    routes: Routes,
    /// The types this service listens for: their queue and bindings are declared before the
    /// first publication, so a routed message never finds its home exchange unbound.
    listened: Vec<String>,
    /// The connection and its confirming channel, until a call fails.
    channel: Option<(Connection, Channel)>,
    /// Exchanges declared (or checked) on this connection.
    declared: HashSet<String>,
}

impl Publisher {
    /// A new channel on the connection, after the broker closed the last one on a publication
    /// it refused: cheaper than a new connection, which is made instead if this fails.
    async fn reopen(&mut self) {
        let reopened = match &self.channel {
            Some((connection, _)) => match connection.create_channel().await {
                Ok(channel) => channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .ok()
                    .map(|()| channel),
                Err(_) => None,
            },
            None => None,
        };
        match (reopened, &mut self.channel) {
            (Some(channel), Some((_, closed))) => {
                *closed = channel;
                // Declared (or checked) again at the next send: the refusal may have been an
                // exchange deleted under us (404), which a declaration makes again.
                self.declared.clear();
            }
            _ => self.reset(),
        }
    }

    async fn channel(&mut self) -> Result<&Channel, Error> {
        if self.channel.is_none() {
            let (connection, channel) = connect(&self.settings).await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(failed)?;
            self.declared.clear();
            if !self.listened.is_empty() {
                home_queue(&channel, &self.settings, &self.listened).await?;
                self.declared.insert(self.settings.exchange.clone());
            }
            self.channel = Some((connection, channel));
        }
        match &self.channel {
            Some((_, channel)) => Ok(channel),
            None => Err(failed("not connected")),
        }
    }

    /// Sends `envelopes` one at a time, each confirmed before the next: after a batch in which
    /// the broker closed the channel on one of them, those it takes go, and the one it refused
    /// is held. A failure of the connection itself holds the rest, or fails the whole call if
    /// none went.
    async fn send_one_at_a_time(
        &mut self,
        envelopes: &[Envelope],
        deadline: tokio::time::Instant,
    ) -> Result<Sent, Error> {
        let mut all = Sent::refusing(Vec::new());
        let mut confirmed = 0usize;
        for (index, envelope) in envelopes.iter().enumerate() {
            if tokio::time::Instant::now() >= deadline {
                all.held.extend(not_tried(&envelopes[index..]));
                break;
            }
            let Ok(single) =
                tokio::time::timeout_at(deadline, self.send(std::slice::from_ref(envelope))).await
            else {
                // Cut short where it stood: its channel is in no known state.
                self.reset();
                all.held.extend(not_tried(&envelopes[index..]));
                break;
            };
            match single {
                // Closed on this one: held, alone; its pause grows each time it is, and the
                // others go meanwhile.
                Ok(Batch::Answered(sent) | Batch::ChannelClosed(sent)) => {
                    confirmed += usize::from(sent.held.is_empty() && sent.refused.is_empty());
                    all.refused.extend(sent.refused);
                    all.held.extend(sent.held);
                }
                Err(error) if confirmed == 0 => return Err(error),
                Err(error) => {
                    let why = format!("not sent: {error}");
                    all.held.extend(
                        envelopes[index..]
                            .iter()
                            .map(|envelope| (envelope.id, why.clone())),
                    );
                    break;
                }
            }
        }
        Ok(all)
    }

    async fn send(&mut self, envelopes: &[Envelope]) -> Result<Batch, Error> {
        let settings = Arc::clone(&self.settings);
        let mut channel = self.channel().await?.clone();
        let frame_max = match &self.channel {
            Some((connection, _)) => connection.configuration().frame_max(),
            None => 0,
        };
        // What AMQP cannot carry is refused before anything is sent.
        let mut refused = Vec::new();
        let mut sendable = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            let exchange = self
                .routes
                .destination(&envelope.message_type, &settings.exchange);
            match publication(envelope, exchange, &settings, frame_max) {
                Ok(publication) => sendable.push((envelope, publication)),
                Err(why) => refused.push((envelope.id, why)),
            }
        }
        // Exchanges the broker refuses (missing where only checked, declared otherwise, not
        // this user's), with why: their envelopes wait for an operator, the rest go on.
        let mut refused_exchanges: HashMap<String, String> = HashMap::new();
        for (_, publication) in &sendable {
            let name = publication.exchange.as_str();
            if self.declared.contains(name) || refused_exchanges.contains_key(name) {
                continue;
            }
            match exchange(&channel, name, settings.declare).await {
                Ok(()) => {
                    self.declared.insert(name.to_owned());
                }
                Err(Error::Configuration(why)) => {
                    refused_exchanges.insert(name.to_owned(), why);
                    // The broker closes a channel whose declaration it refused.
                    self.reset();
                    channel = self.channel().await?.clone();
                }
                Err(error) => return Err(error),
            }
        }
        // Every publication goes out before the first confirm is awaited: one round trip for
        // the batch, not one per envelope. Each envelope is answered for on its own: one
        // that fails is held, so that those the broker confirmed are not sent again with it.
        let mut held = Vec::new();
        let mut broken = None;
        let mut confirms = Vec::with_capacity(sendable.len());
        for (envelope, publication) in sendable {
            if let Some(why) = refused_exchanges.get(publication.exchange.as_str()) {
                held.push((envelope.id, format!("not sent: {why}")));
                continue;
            }
            if broken.is_some() {
                held.push((envelope.id, "not sent: the channel failed".to_owned()));
                continue;
            }
            let home = publication.exchange.as_str() == settings.exchange;
            let published = channel
                .basic_publish(
                    publication.exchange,
                    publication.routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &envelope.payload,
                    publication.properties,
                )
                .await;
            match published {
                Ok(confirm) => confirms.push((envelope.id, &envelope.message_type, home, confirm)),
                Err(error) => {
                    held.push((envelope.id, format!("not sent: {error}")));
                    broken = Some(failed(error));
                }
            }
        }
        let mut confirmed = 0usize;
        let mut nacked = None;
        let mut rebind = false;
        for (id, message_type, home, confirm) in confirms {
            let confirmation = match confirm.await {
                Ok(confirmation) => confirmation,
                Err(error) => {
                    held.push((id, format!("not confirmed: {error}")));
                    broken.get_or_insert(failed(error));
                    continue;
                }
            };
            if confirmation.is_nack() {
                held.push((id, "the broker refused it (nack)".to_owned()));
                nacked.get_or_insert(id);
                continue;
            }
            if confirmation.take_message().is_none() {
                confirmed += 1;
                continue;
            }
            // No queue is bound for the type: this service's own is bound before publishing,
            // so the topology changed under us, or another service's is not bound yet. Held
            // for a later round, never counted as sent; the rest of the batch was placed, and
            // sending it again each round would repeat it past the receivers' memory of ids.
            let whose = if home { "this service's" } else { "its" };
            // A binding of this service's own queue removed under us is made again on the
            // next connection, which declares them all.
            rebind |= home
                && self
                    .listened
                    .iter()
                    .any(|listened| **listened == **message_type);
            held.push((
                id,
                format!("came back unrouted: no queue is bound for its type on {whose} exchange"),
            ));
        }
        // A channel the broker closed on a connection still up: it refused one publication
        // (an exchange this user may not write to, a message over its size limit), and the
        // rest of the batch failed with the channel.
        let refused_one = broken.is_some()
            && self
                .channel
                .as_ref()
                .is_some_and(|(connection, _)| connection.status().connected());
        if rebind || (broken.is_some() && !refused_one) {
            self.reset();
        } else if refused_one {
            self.reopen().await;
        }
        // Nothing went through: the broker is down or refusing everything, not one envelope
        // (failed, the batch is left to the publisher's backoff) — unless it closed the
        // channel on one of them, which one at a time tells apart from the rest.
        if confirmed == 0 {
            if let Some(error) = broken {
                if !refused_one {
                    return Err(error);
                }
                let mut sent = Sent::refusing(refused);
                sent.held = held;
                return Ok(Batch::ChannelClosed(sent));
            }
            if let Some(id) = nacked {
                return Err(failed(format!("the broker refused envelope {id} (nack)")));
            }
        }
        let mut sent = Sent::refusing(refused);
        sent.held = held;
        Ok(Batch::Answered(sent))
    }
}

#[async_trait]
impl Publish for Publisher {
    async fn publish(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error> {
        // One at a time ends by then, within the publication's own timeout (5 s at least):
        // what is left is held for the next rounds, rather than the whole call failing and all
        // of it sent again.
        let deadline = tokio::time::Instant::now() + ONE_AT_A_TIME_FOR;
        let sent = match self.send(envelopes).await {
            Ok(Batch::Answered(sent)) => Ok(sent),
            Ok(Batch::ChannelClosed(sent)) if envelopes.len() == 1 => Ok(sent),
            Ok(Batch::ChannelClosed(_)) => self.send_one_at_a_time(envelopes, deadline).await,
            Err(error) => Err(error),
        };
        if sent.is_err() {
            self.reset();
        }
        sent
    }

    fn reset(&mut self) {
        // Connect afresh next time: a channel that saw an error may be closed.
        self.channel = None;
    }
}

/// What a batch came to, when the broker answered for it.
enum Batch {
    /// Each envelope confirmed, or held or refused with why.
    Answered(Sent),
    /// Nothing confirmed: the broker closed the channel on one publication it refused, and
    /// the rest failed with it (all of them held here).
    ChannelClosed(Sent),
}

/// Where an envelope goes and what it carries, or why AMQP cannot carry it.
struct Publication {
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
}

/// `frame_max` is the connection's largest frame (0: no limit).
fn publication(
    envelope: &Envelope,
    exchange: &str,
    settings: &Settings,
    frame_max: u32,
) -> Result<Publication, String> {
    let name = |text: &str, what: &str| {
        ShortString::try_new(text)
            .map_err(|error| format!("its {what} cannot travel on AMQP: {error}"))
    };
    if envelope.payload.len() > settings.max_message_size {
        return Err(format!(
            "its body of {} bytes is over the broker's max_message_size of {} bytes",
            envelope.payload.len(),
            settings.max_message_size
        ));
    }
    Ok(Publication {
        exchange: name(exchange, "exchange name")?,
        routing_key: name(&envelope.message_type, "type, the routing key,")?,
        properties: properties(envelope, settings, frame_max)?,
    })
}

/// What a header frame spends besides the headers, at most: the frame's own 8 bytes, the
/// content header's 14, and the other properties (a type of up to 255 bytes, two ids, the
/// content type, the timestamp, the delivery mode).
const HEADER_FRAME_BESIDES_HEADERS: usize = 512;

/// The AMQP properties and headers of `envelope`: persistent, its ids in both the properties
/// (for AMQP tools) and the headers (the wire format's); why not, for a header name over the
/// protocol's 255 bytes, or headers over one frame of `frame_max` bytes — AMQP sends the
/// properties in a single frame, and RabbitMQ closes the connection on a larger one.
fn properties(
    envelope: &Envelope,
    settings: &Settings,
    frame_max: u32,
) -> Result<BasicProperties, String> {
    let mut headers = FieldTable::default();
    // The field table's length, then per header its short-string name, a type tag and a
    // long string's length before its bytes.
    let mut encoded = 4usize;
    for (name, value) in wire::encode(envelope, settings.format, Binding::Amqp, &settings.source) {
        encoded += 1 + name.len() + 1 + 4 + value.len();
        let name = ShortString::try_new(name)
            .map_err(|error| format!("a header name cannot travel on AMQP: {error}"))?;
        headers.insert(name, AMQPValue::LongString(LongString::from(value)));
    }
    let frame_max = usize::try_from(frame_max).unwrap_or(usize::MAX);
    if frame_max > 0 && encoded + HEADER_FRAME_BESIDES_HEADERS > frame_max {
        return Err(format!(
            "its headers take {encoded} bytes, and AMQP carries them in one frame of at most \
             {frame_max} bytes (the connection's frame_max)"
        ));
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(envelope.id.simple().to_string().into())
        .with_timestamp(u64::try_from(envelope.sent_at.timestamp()).unwrap_or(0))
        .with_headers(headers);
    if let Ok(kind) = ShortString::try_new(envelope.message_type.to_string()) {
        properties = properties.with_type(kind);
    }
    if let Some(correlation) = envelope.correlation_id {
        properties = properties.with_correlation_id(correlation.simple().to_string().into());
    }
    Ok(properties)
}

/// How long the look at the head of the queue, and the acknowledgement of what it found, may
/// take before the subscription goes on without them.
const HEAD_LOOK: std::time::Duration = std::time::Duration::from_secs(10);

struct Subscriber {
    settings: Arc<Settings>,
    listened: Vec<String>,
    consuming: Option<(Connection, Channel, lapin::Consumer)>,
    /// The last delivery of the last batch, acknowledged (or released) with all before it.
    last_tag: Option<u64>,
    /// The error that ended the last batch early: the answer to the next call.
    cut_short: Option<Error>,
    /// Messages lapin cannot read, found at the head of the queue as the subscription began,
    /// held on a connection of their own; and whether the last batch handed them over.
    head: Option<(unreadable::Held, bool)>,
    /// Whether a subscription was made before: each one after it follows a lost connection.
    subscribed: bool,
}

#[async_trait]
impl Subscribe for Subscriber {
    async fn subscribe(&mut self) -> Result<(), Error> {
        self.consuming = None;
        self.last_tag = None;
        self.cut_short = None;
        let settings = &self.settings;
        let (connection, channel) = connect(settings).await?;
        let queue = home_queue(&channel, settings, &self.listened).await?;
        // Before anything is consumed: such a message would end this connection at once. Only
        // after a lost connection (which such a message causes): each look returns the
        // readable messages it took, and a quorum queue counts each return.
        self.head = None;
        let looked_for = std::mem::replace(&mut self.subscribed, true);
        let count = usize::from(settings.prefetch).max(1);
        let looking = async {
            if looked_for {
                unreadable::at_head(&settings.url, queue.as_str(), count).await
            } else {
                Ok(None)
            }
        };
        self.head = match tokio::time::timeout(HEAD_LOOK, looking).await {
            Ok(Ok(held)) => held.map(|held| (held, false)),
            Ok(Err(error)) => {
                tracing::warn!(transport = NAME, %error, "could not look at the head of the queue for a message lapin cannot read");
                None
            }
            Err(_) => {
                tracing::warn!(transport = NAME, waited = ?HEAD_LOOK, "could not look at the head of the queue for a message lapin cannot read: no answer");
                None
            }
        };
        channel
            .basic_qos(settings.prefetch, BasicQosOptions::default())
            .await
            .map_err(failed)?;
        let consumer = channel
            .basic_consume(
                queue,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed)?;
        self.consuming = Some((connection, channel, consumer));
        Ok(())
    }

    async fn next(&mut self) -> Result<Vec<Received>, Error> {
        if let Some((held, handed)) = &mut self.head
            && !*handed
        {
            *handed = true;
            for (_, found) in &held.found {
                tracing::warn!(transport = NAME, why = %found.why, "a message lapin cannot read goes to the dead letters");
            }
            return Ok(held
                .found
                .iter()
                .map(|(_, found)| Err(found.clone()))
                .collect());
        }
        let prefetch = usize::from(self.settings.prefetch);
        let Some((_, _, consumer)) = self.consuming.as_mut() else {
            return Err(failed("not subscribed"));
        };
        if let Some(error) = self.cut_short.take() {
            return Err(error);
        }
        let gathered = gather(consumer, prefetch)
            .await
            .map_err(|error| match error {
                GatherError::Ended => failed("the broker cancelled the consumer"),
                GatherError::Failed(error) => failed(error),
            })?;
        self.cut_short = gathered.cut_short.map(failed);
        let deliveries = gathered.taken;
        self.last_tag = deliveries.last().map(|delivery| delivery.delivery_tag);
        // A topology of the operator's own (declare(false)) may bind wider than a type.
        let exchange = self
            .settings
            .declare
            .then_some(self.settings.exchange.as_str());
        Ok(deliveries
            .into_iter()
            .map(|delivery| read(delivery, exchange))
            .collect())
    }

    async fn ack(&mut self) -> Result<(), Error> {
        // Their dead letters are kept: acknowledged on the connection that holds them.
        if let Some((held, true)) = self.head.take() {
            return match tokio::time::timeout(HEAD_LOOK, held.acknowledge()).await {
                Ok(acknowledged) => acknowledged.map_err(failed),
                // Unacknowledged, they go back to the queue: found again, under the dead
                // letters they have.
                Err(_) => Err(failed(
                    "no answer to the acknowledgement of unreadable messages",
                )),
            };
        }
        let (Some(tag), Some((_, channel, _))) = (self.last_tag.take(), self.consuming.as_ref())
        else {
            return Ok(());
        };
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
            .map_err(failed)
    }

    async fn release(&mut self) {
        // Its connection closed, what it held goes back to the head of the queue.
        self.head = None;
        if let (Some(tag), Some((_, channel, _))) = (self.last_tag.take(), self.consuming.as_ref())
        {
            let requeue = BasicNackOptions {
                multiple: true,
                requeue: true,
            };
            if let Err(error) = channel.basic_nack(tag, requeue).await {
                // Closing the connection returns them to the queue all the same.
                tracing::debug!(transport = NAME, %error, "returning deliveries failed");
            }
        }
        if let Some((connection, ..)) = self.consuming.take() {
            let _ = connection.close(200, "dacapo stops listening".into()).await;
        }
    }
}

/// A delivery as an envelope, reading the AMQP properties where a header is missing. One that
/// came through `exchange` (the transport's own, whose bindings it declared: one per type) has
/// the type its routing key names; one sent to the queue itself (through the default
/// exchange) has the type its headers say.
fn read(delivery: Delivery, exchange: Option<&str>) -> Received {
    let properties = &delivery.properties;
    let mut headers = BTreeMap::new();
    let mut more = other_properties(properties);
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            if is_the_brokers(name.as_str()) {
                continue;
            }
            match text(value) {
                Some(value) => headers.insert(name.to_string(), value),
                // Kept, as it reads, should the message be unreadable.
                None => {
                    more.push((name.to_string(), format!("{value:?}")));
                    None
                }
            };
        }
    }
    let fallback = Fallback {
        id: properties.message_id().as_ref().map(ToString::to_string),
        message_type: properties.kind().as_ref().map(ToString::to_string),
        correlation_id: properties
            .correlation_id()
            .as_ref()
            .map(ToString::to_string),
        sent_at: properties
            .timestamp()
            .and_then(|seconds| i64::try_from(seconds).ok())
            .and_then(|seconds| chrono::DateTime::from_timestamp(seconds, 0)),
        in_headers: false,
        more,
        addressed_type: (Some(delivery.exchange.as_str()) == exchange)
            .then(|| delivery.routing_key.to_string()),
    };
    wire::decode(headers, delivery.data, fallback)
}

/// The AMQP properties no header or envelope field reads, by `property-` name: kept with an
/// unreadable message, whose dead letter they tell apart from another's.
fn other_properties(properties: &BasicProperties) -> Vec<(String, String)> {
    let short = |value: &Option<lapin::types::ShortString>| value.as_ref().map(ToString::to_string);
    [
        ("property-content-type", short(properties.content_type())),
        (
            "property-content-encoding",
            short(properties.content_encoding()),
        ),
        (
            "property-delivery-mode",
            properties.delivery_mode().map(|mode| mode.to_string()),
        ),
        (
            "property-priority",
            properties.priority().map(|priority| priority.to_string()),
        ),
        ("property-reply-to", short(properties.reply_to())),
        // Not `expiration`: RabbitMQ removes it from a message it dead-letters, which may
        // come back to this queue.
        ("property-user-id", short(properties.user_id())),
        ("property-app-id", short(properties.app_id())),
        ("property-cluster-id", short(properties.cluster_id())),
    ]
    .into_iter()
    .filter_map(|(name, value)| value.map(|value| (name.to_owned(), value)))
    .collect()
}

/// Whether RabbitMQ added the header (a quorum queue's delivery count, dead-lettering's
/// history): the broker's, not the envelope's.
fn is_the_brokers(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name == "x-delivery-count"
        || name == "x-acquired-count"
        || name == "x-death"
        || name == "x-received-from"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// A header's value as text; values of no textual form (tables, arrays, floats, bytes that
/// are not UTF-8) are not read as headers (an unreadable message keeps them as they read).
/// Bytes are never mended into text: two binary ids that differ only where they are not UTF-8
/// would read as one id, and the second message be discarded as the first's duplicate.
fn text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok()?.to_owned(),
        AMQPValue::ShortString(text) => text.to_string(),
        AMQPValue::Boolean(value) => value.to_string(),
        AMQPValue::ShortShortInt(value) => value.to_string(),
        AMQPValue::ShortShortUInt(value) => value.to_string(),
        AMQPValue::ShortInt(value) => value.to_string(),
        AMQPValue::ShortUInt(value) => value.to_string(),
        AMQPValue::LongInt(value) => value.to_string(),
        AMQPValue::LongUInt(value) => value.to_string(),
        AMQPValue::LongLongInt(value) => value.to_string(),
        AMQPValue::Timestamp(value) => value.to_string(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_of_bytes_that_are_not_utf8_is_no_text() {
        let bytes = |b: &[u8]| AMQPValue::LongString(b.to_vec().into());
        assert_eq!(text(&bytes(b"id-1")), Some("id-1".to_owned()));
        assert_eq!(text(&bytes(&[0, 0, 0, 0x80])), None);
        assert_eq!(text(&bytes(&[0, 0, 0, 0x81])), None);
    }

    #[test]
    fn a_body_over_the_brokers_max_message_size_is_refused_before_it_is_sent() {
        let settings = RabbitMq::new("amqp://localhost", "q")
            .max_message_size(1024)
            .settings;
        let publishable = |bytes: usize| {
            let envelope = Envelope::new("t", vec![b'x'; bytes]);
            publication(&envelope, "dacapo", &settings, 131_072).map(|_| ())
        };
        assert!(publishable(1024).is_ok());
        let why = publishable(1025).unwrap_err();
        assert!(why.contains("max_message_size of 1024 bytes"), "{why}");
    }

    #[test]
    fn headers_over_one_frame_are_refused_and_no_limit_means_none() {
        let settings = RabbitMq::new("amqp://localhost", "q").settings;
        let mut envelope = Envelope::new("t", b"{}".to_vec());
        envelope.headers.insert("big".into(), "v".repeat(8 * 1024));
        assert!(publication(&envelope, "dacapo", &settings, 16 * 1024).is_ok());
        let why = publication(&envelope, "dacapo", &settings, 8 * 1024)
            .map(|_| ())
            .unwrap_err();
        assert!(why.contains("frame of at most 8192 bytes"), "{why}");
        assert!(publication(&envelope, "dacapo", &settings, 0).is_ok());
    }

    #[test]
    fn the_headers_rabbitmq_adds_on_a_redelivery_are_the_brokers() {
        for name in [
            "x-delivery-count",
            "X-Acquired-Count",
            "x-death",
            "x-first-death-queue",
            "x-last-death-reason",
            "x-received-from",
        ] {
            assert!(is_the_brokers(name), "{name}");
        }
        for name in ["x-tenant", "tenant", "x-deaths"] {
            assert!(!is_the_brokers(name), "{name}");
        }
    }
}
