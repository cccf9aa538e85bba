//! NATS JetStream, over async-nats: a stream, a durable pull consumer, acks after the inbox.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use async_trait::async_trait;
use dacapo_actors::Envelope;
use futures::{FutureExt, StreamExt};

use super::host::{GatherError, Publish, Received, Sent, Subscribe, Transport, gather_from};
use super::routes::{Routes, routing};
use super::wire::{self, Binding, Fallback, WireFormat};
use crate::Error;

mod unreadable;

const NAME: &str = "nats";

/// The longest duration JetStream holds: nanoseconds in an `i64`.
const LONGEST: Duration = Duration::from_nanos(i64::MAX.unsigned_abs());

/// NATS JetStream as a transport: routed message types are published to the subject
/// `dacapo.<type>` (the prefix settable), which a file-backed stream (`DACAPO`) keeps; each
/// service listens through durable pull consumers of its own, one per routed type it handles
/// (filtered on that type's subject), which the nodes of that service share.
///
/// A consumer is named `<service>_<type>_<hash>`: the service name given to [`Nats::new`],
/// the message type with each character other than an ASCII letter, digit or `-` replaced by
/// `_` (JetStream names allow no `.`), and the first 8 hex digits of the type's SHA-256, which
/// keeps apart two types that read alike once replaced. Where that would pass JetStream's
/// 255 bytes, the type is cut and the hash is 16 hex digits. With
/// [`declare(false)`](Nats::declare) those are the consumers to create beforehand. A subject
/// over 3 KiB (prefix and type) is refused: a NATS server closes the connection on a protocol
/// line over 4 KiB by default. Sent, such a message is dead-lettered; listened to, the node
/// stops listening with [`Error::Configuration`](crate::Error::Configuration), as it does for a
/// service name that cannot name a consumer (empty, with `.`, `*`, `>`, a slash or whitespace,
/// or too long to leave room for a type).
///
/// Each publication carries `Nats-Msg-Id` set to the envelope id, so JetStream's duplicate
/// window drops a republication before the inbox has to. A node acknowledges a message once
/// its inbox recorded it; handling comes after, from the inbox, so the consumer's ack wait is
/// sized for that write (30 s by default), not for handling. What a node received and did not
/// record when it stops is negatively acknowledged, never acknowledged: another node gets it
/// at once, or after the ack wait when JetStream redelivered it to the stopping node's pull
/// requests still open on the server.
///
/// ```no_run
/// # use dacapo::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct OrderPlaced { n: u32 }
/// # impl Message for OrderPlaced { const TYPE: &'static str = "orders.placed"; }
/// # async fn run(store: dacapo::store::SqliteStore, module: Module) -> Result<(), dacapo::Error> {
/// use dacapo::transport::Nats;
///
/// let nats = Nats::new("nats://127.0.0.1:4222", "orders").route::<OrderPlaced>();
/// let runtime = Runtime::builder().store(store).module(module).transport(nats).build()?;
/// runtime.listening().await?;
/// # Ok(())
/// # }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Clone, Debug)]
pub struct Nats {
    settings: Settings,
    routes: Routes,
}

#[derive(Clone)]
struct Settings {
    url: String,
    consumer: String,
    stream: String,
    prefix: String,
    prefetch: u16,
    ack_wait: Duration,
    duplicate_window: Duration,
    max_age: Duration,
    format: WireFormat,
    source: String,
    declare: bool,
}

impl Nats {
    /// The server at `url` (`nats://host:port`); this service consumes through durable
    /// consumers named after `consumer`, one per routed type (see [`Nats`] for the names).
    pub fn new(url: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            settings: Settings {
                url: url.into(),
                consumer: consumer.into(),
                stream: "DACAPO".into(),
                prefix: "dacapo".into(),
                prefetch: 100,
                ack_wait: Duration::from_secs(30),
                duplicate_window: Duration::from_secs(120),
                max_age: Duration::from_secs(7 * 24 * 60 * 60),
                format: WireFormat::Dacapo,
                source: wire::DEFAULT_SOURCE.into(),
                declare: true,
            },
            routes: Routes::default(),
        }
    }

    routing!();

    /// The stream that keeps the routed subjects (default `DACAPO`).
    #[must_use]
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.settings.stream = stream.into();
        self
    }

    /// The subject prefix: a type is published to `<prefix>.<type>`, and the stream keeps
    /// `<prefix>.>` (default `dacapo`).
    #[must_use]
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = prefix.into();
        self
    }

    /// How many messages this node holds unacknowledged at once, and so the largest batch its
    /// inbox records in one transaction (default 100).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch.max(1);
        self
    }

    /// How long JetStream waits for an acknowledgement before it redelivers (default 30 s):
    /// the time to record a batch in the inbox — and, when the runtime has
    /// [`max_in_flight`](crate::RuntimeBuilder::max_in_flight) deliveries already, to wait for
    /// room — not to handle it.
    ///
    /// JetStream counts it in nanoseconds in 64 bits: a longer wait (`Duration::MAX`) is
    /// taken as the longest it can hold, about 292 years.
    #[must_use]
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.settings.ack_wait = wait.min(LONGEST);
        self
    }

    /// The stream's duplicate window for `Nats-Msg-Id` (default 2 min), when it is created;
    /// at most about 292 years, as [`ack_wait`](Self::ack_wait), and shortened to the
    /// stream's [`max_age`](Self::max_age) where that is shorter (JetStream refuses a longer
    /// one).
    #[must_use]
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.settings.duplicate_window = window.min(LONGEST);
        self
    }

    /// How long the stream keeps a message, when it is created (default 7 days): a consumer
    /// created later, or renamed, starts from what the stream still has. Zero, or an age
    /// JetStream cannot count (`Duration::MAX`), keeps messages without an age limit.
    #[must_use]
    pub fn max_age(mut self, age: Duration) -> Self {
        self.settings.max_age = if age >= LONGEST { Duration::ZERO } else { age };
        self
    }

    wire::wire_settings!();

    /// Whether to create the stream and the consumers at start (the default; each
    /// consumer's filter is brought up to date) or only check that they exist.
    #[must_use]
    pub fn declare(mut self, declare: bool) -> Self {
        self.settings.declare = declare;
        self
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("url", &super::redacted(&self.url))
            .finish_non_exhaustive()
    }
}

impl From<Nats> for Transport {
    fn from(nats: Nats) -> Self {
        let Nats { settings, routes } = nats;
        Transport {
            name: NAME,
            home: settings.prefix.clone(),
            routes: routes.clone(),
            open: Box::new(move |listened| {
                let publisher = Publisher {
                    settings: settings.clone(),
                    routes,
                    context: None,
                };
                let subscriber = Subscriber {
                    settings,
                    listened,
                    messages: None,
                    client: None,
                    batch: Vec::new(),
                    cut_short: None,
                    held: None,
                    disconnected: Arc::default(),
                    found: Vec::new(),
                };
                (Box::new(publisher), Box::new(subscriber))
            }),
        }
    }
}

fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::transport(NAME, error)
}

fn subject(prefix: &str, message_type: &str) -> String {
    format!("{prefix}.{message_type}")
}

/// The longest consumer name JetStream takes.
const MAX_CONSUMER_NAME: usize = 255;

/// The longest subject this transport publishes to or listens on. A NATS server reads protocol
/// lines of 4 KiB by default and closes the connection on a longer one; the longest line a
/// subject goes into is the request that creates its consumer, beside the stream's name and
/// the consumer's (255 bytes each at most).
const MAX_SUBJECT: usize = 3 * 1024;

/// The durable consumer of `service` for `message_type`: JetStream names allow no `.`, `*`,
/// `>` or whitespace, so those become `_`, and a hash of the type keeps two types apart. A
/// type too long for the name is cut, with a longer hash.
///
/// # Errors
///
/// [`Error::Configuration`] for a service name no consumer can carry.
fn consumer_name(service: &str, message_type: &str) -> Result<String, Error> {
    use sha2::Digest;
    let unfit = |why: &str| {
        Err(Error::Configuration(format!(
            "the NATS service name {service:?} cannot name a JetStream consumer: {why}"
        )))
    };
    if service.is_empty()
        || service.chars().any(|c| {
            matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace() || c.is_control()
        })
    {
        return unfit("it must be a non-empty name without '.', '*', '>', slashes or whitespace");
    }
    let plain: String = message_type
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let hash = sha2::Sha256::digest(message_type.as_bytes());
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let name = format!("{service}_{plain}_{}", hex(&hash[..4]));
    if name.len() <= MAX_CONSUMER_NAME {
        return Ok(name);
    }
    // Names that fit stay as they were: a consumer renamed would start over on its stream.
    let tail = hex(&hash[..8]);
    match MAX_CONSUMER_NAME.checked_sub(service.len() + tail.len() + 2) {
        // `plain` is ASCII: any byte is a character's end.
        Some(room) if room > 0 => Ok(format!("{service}_{}_{tail}", &plain[..room])),
        _ => unfit(&format!(
            "over {} bytes",
            MAX_CONSUMER_NAME - tail.len() - 3
        )),
    }
}

/// Connects to the server; `disconnected` is told of each connection the client loses.
async fn connect(
    settings: &Settings,
    disconnected: Option<Arc<tokio::sync::Notify>>,
) -> Result<jetstream::Context, Error> {
    let options = async_nats::ConnectOptions::new().event_callback(move |event| {
        let disconnected = disconnected.clone();
        async move {
            if let (async_nats::Event::Disconnected, Some(disconnected)) = (event, disconnected) {
                disconnected.notify_one();
            }
        }
    });
    let client = options
        .connect(settings.url.as_str())
        .await
        .map_err(|error| match error.kind() {
            // No retry changes refused credentials: a consumer that never listened stops
            // with the reason instead of trying again for ever.
            async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication => {
                Error::Configuration(format!("the NATS server refused the connection: {error}"))
            }
            _ => failed(error),
        })?;
    Ok(jetstream::new(client))
}

/// The stream, created if asked, checked otherwise.
async fn stream(
    context: &jetstream::Context,
    settings: &Settings,
) -> Result<stream::Stream, Error> {
    if settings.declare {
        let created = context
            .get_or_create_stream(stream::Config {
                name: settings.stream.clone(),
                subjects: vec![format!("{}.>", settings.prefix)],
                storage: stream::StorageType::File,
                // No longer than the age: JetStream refuses the stream otherwise.
                duplicate_window: if settings.max_age.is_zero() {
                    settings.duplicate_window
                } else {
                    settings.duplicate_window.min(settings.max_age)
                },
                max_age: settings.max_age,
                ..stream::Config::default()
            })
            .await;
        let error = match created {
            Ok(stream) => return Ok(stream),
            Err(error) => error,
        };
        // Subjects another stream keeps, or a stream of that name with other subjects — or
        // another node that created this very stream between our look and our create.
        let conflict = matches!(error.kind(), jetstream::context::CreateStreamErrorKind::JetStream(ref js)
            if matches!(js.error_code().0, 10065 | 10058));
        if !conflict {
            return Err(failed(error));
        }
        let subjects = format!("{}.>", settings.prefix);
        let misconfigured = || {
            Error::Configuration(format!(
                "JetStream cannot create stream {:?} for {subjects}: {error}",
                settings.stream
            ))
        };
        // Only the server's word that no such stream exists, or that it keeps other subjects,
        // is a configuration error; any other failed lookup (a dropped connection) is tried
        // again like any other.
        let mut stream = match context.get_stream(&settings.stream).await {
            Ok(stream) => stream,
            Err(lookup)
                if matches!(lookup.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                return Err(misconfigured());
            }
            Err(lookup) => return Err(failed(lookup)),
        };
        return match stream.info().await {
            Ok(info) if info.config.subjects.contains(&subjects) => Ok(stream),
            Ok(_) => Err(misconfigured()),
            Err(lookup) => Err(failed(lookup)),
        };
    }
    match context.get_stream(&settings.stream).await {
        Ok(stream) => Ok(stream),
        Err(error)
            if matches!(error.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref js)
                if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            Err(Error::Configuration(format!(
                "JetStream has no stream {:?} (the transport only checks its topology: {error})",
                settings.stream
            )))
        }
        Err(error) => Err(failed(error)),
    }
}

struct Publisher {
    settings: Settings,
    routes: Routes,
    context: Option<jetstream::Context>,
}

impl Publisher {
    async fn send(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error> {
        if self.context.is_none() {
            let context = connect(&self.settings, None).await?;
            stream(&context, &self.settings).await?;
            self.context = Some(context);
        }
        let Some(context) = &self.context else {
            return Err(failed("not connected"));
        };
        let prefix = self.settings.prefix.as_str();
        let mut refused = Vec::new();
        // Each envelope is answered for on its own: one that fails is held, so that those the
        // stream acknowledged are not sent again with it (a subject no stream captures fails
        // alone).
        let mut held = Vec::new();
        let mut failure = None;
        let mut acknowledged = 0usize;
        let mut acks = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            let (to, own) = match self.routes.destination(&envelope.message_type, prefix) {
                own if own == prefix => (subject(prefix, &envelope.message_type), true),
                elsewhere => (elsewhere.to_owned(), false),
            };
            if let Some(why) = unpublishable(&to) {
                refused.push((envelope.id, why));
                continue;
            }
            let headers = match headers(envelope, &self.settings) {
                Ok(headers) => headers,
                Err(why) => {
                    refused.push((envelope.id, why));
                    continue;
                }
            };
            match context
                .publish_with_headers(to, headers, envelope.payload.clone().into())
                .await
            {
                Ok(ack) => acks.push((envelope.id, own, ack)),
                Err(error) => match never_passes(error.kind()) {
                    Some(why) => refused.push((envelope.id, format!("{why}: {error}"))),
                    None => {
                        held.push((envelope.id, error.to_string()));
                        failure.get_or_insert(failed(error));
                    }
                },
            }
        }
        // Every publication is on its way before the first ack is awaited.
        for (id, own, ack) in acks {
            match ack.await {
                Ok(_) => acknowledged += 1,
                Err(error) => match never_passes(error.kind()) {
                    Some(why) => refused.push((id, format!("{why}: {error}"))),
                    // No stream captures a subject of another service's, which the server
                    // answered: this envelope's failure, not the server's, even if the whole
                    // batch is such. On this service's own subjects it is the server's (its
                    // stream restarting, electing a leader, or deleted: made again once the
                    // failure resets the connection).
                    None if !own
                        && error.kind() == jetstream::context::PublishErrorKind::StreamNotFound =>
                    {
                        held.push((id, error.to_string()));
                    }
                    None => {
                        held.push((id, error.to_string()));
                        failure.get_or_insert(failed(error));
                    }
                },
            }
        }
        // Nothing went through: the server is down, not one subject (some did, so the
        // connection stands).
        if let Some(error) = failure
            && acknowledged == 0
        {
            return Err(error);
        }
        let mut sent = Sent::refusing(refused);
        sent.held = held;
        Ok(sent)
    }
}

/// Why a publication that failed so can never pass, or `None` when it may later. No stream
/// answering is not one: JetStream answers so while it elects a leader or restarts.
fn never_passes(kind: jetstream::context::PublishErrorKind) -> Option<&'static str> {
    use jetstream::context::PublishErrorKind;
    match kind {
        PublishErrorKind::MaxPayloadExceeded => Some("over the server's max_payload"),
        _ => None,
    }
}

/// Why `subject` is no subject to publish to: empty tokens, wildcards, whitespace, a length
/// the server would close the connection on.
fn unpublishable(subject: &str) -> Option<String> {
    if subject.len() > MAX_SUBJECT {
        let start: String = subject.chars().take(64).collect();
        return Some(format!(
            "the subject {start:?}… is {} bytes long, over the {MAX_SUBJECT} a NATS subject may have",
            subject.len()
        ));
    }
    let bad = subject.is_empty()
        || subject
            .split('.')
            .any(|token| token.is_empty() || token == "*" || token == ">")
        || subject.chars().any(|c| c.is_whitespace() || c.is_control());
    bad.then(|| format!("{subject:?} is not a NATS subject to publish to"))
}

/// The NATS headers of `envelope`, or why one of them cannot travel (a name that is no NATS
/// header name, a value with a line break).
fn headers(envelope: &Envelope, settings: &Settings) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", envelope.id.simple().to_string());
    for (name, value) in wire::encode(envelope, settings.format, Binding::Nats, &settings.source) {
        let header = async_nats::HeaderName::from_str(&name)
            .map_err(|error| format!("header {name:?} cannot travel on NATS: {error}"))?;
        let value = async_nats::HeaderValue::from_str(&value).map_err(|error| {
            format!("the value of header {name:?} cannot travel on NATS: {error}")
        })?;
        headers.insert(header, value);
    }
    Ok(headers)
}

#[async_trait]
impl Publish for Publisher {
    async fn publish(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error> {
        let sent = self.send(envelopes).await;
        if sent.is_err() {
            self.reset();
        }
        sent
    }

    fn reset(&mut self) {
        self.context = None;
    }
}

/// How often an idle server tells a pull stream that it is still there.
const IDLE_HEARTBEAT: Duration = Duration::from_secs(5);

/// The stream a subscription pulls from, and each consumer with the subject it filters on.
struct Held {
    context: jetstream::Context,
    stream: stream::Stream,
    consumers: Vec<(String, jetstream::consumer::PullConsumer)>,
}

struct Subscriber {
    settings: Settings,
    listened: Vec<String>,
    messages: Option<futures::stream::SelectAll<pull::Stream>>,
    /// The connection the streams pull on, flushed before it goes.
    client: Option<async_nats::Client>,
    /// The last batch, acknowledged (or released) one by one.
    batch: Vec<jetstream::Message>,
    /// The error that ended the last batch early: the answer to the next call.
    cut_short: Option<Error>,
    /// Where to look for what the client cannot read.
    held: Option<Held>,
    /// Told of each lost connection, after which a message the client cannot read may hold
    /// the consumers up.
    disconnected: Arc<tokio::sync::Notify>,
    /// The stream sequences of the unreadable messages the last batch brought, deleted from
    /// the stream once their dead letters are kept.
    found: Vec<u64>,
}

#[async_trait]
impl Subscribe for Subscriber {
    async fn subscribe(&mut self) -> Result<(), Error> {
        // What the lost subscription still holds goes back now, not after its ack wait.
        if self.messages.is_some() || !self.batch.is_empty() {
            self.release().await;
        }
        self.cut_short = None;
        self.found.clear();
        // A lost client's callback tells no longer: its permit would search for nothing.
        self.disconnected = Arc::default();
        let settings = &self.settings;
        let context = connect(settings, Some(Arc::clone(&self.disconnected))).await?;
        self.client = Some(context.client());
        let stream = stream(&context, settings).await?;
        let mut consumers = Vec::with_capacity(self.listened.len());
        // One durable consumer per message type, each filtered on its subject: a filter of
        // several subjects needs a 2.10 server, and a server before it would ignore it.
        let mut streams = Vec::with_capacity(self.listened.len());
        for message_type in &self.listened {
            let filter_subject = subject(&settings.prefix, message_type);
            if let Some(why) = unpublishable(&filter_subject) {
                return Err(Error::Configuration(format!(
                    "cannot listen to {message_type:?} on NATS: {why}"
                )));
            }
            let name = consumer_name(&settings.consumer, message_type)?;
            let consumer: jetstream::consumer::PullConsumer = if settings.declare {
                stream
                    .create_consumer(pull::Config {
                        durable_name: Some(name),
                        filter_subject: filter_subject.clone(),
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        ack_wait: settings.ack_wait,
                        ..pull::Config::default()
                    })
                    .await
                    .map_err(failed)?
            } else {
                match stream.consumer_info(&name).await {
                    Err(error)
                        if error.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound =>
                    {
                        return Err(Error::Configuration(format!(
                            "JetStream has no consumer {name:?} on stream {:?} (the transport \
                             only checks its topology: {error})",
                            settings.stream
                        )));
                    }
                    Err(error) => return Err(failed(error)),
                    Ok(_) => stream.get_consumer(&name).await.map_err(failed)?,
                }
            };
            streams.push(
                consumer
                    .stream()
                    .max_messages_per_batch(usize::from(settings.prefetch))
                    // The client reconnects by itself, and a pull stream without heartbeats
                    // shows nothing while the server is gone: with them, two missed ones end
                    // the subscription, so that the transport reports the outage.
                    .heartbeat(IDLE_HEARTBEAT)
                    .messages()
                    .await
                    .map_err(failed)?,
            );
            consumers.push((filter_subject, consumer));
        }
        let messages = futures::stream::select_all(streams);
        self.messages = Some(messages);
        self.held = Some(Held {
            context,
            stream,
            consumers,
        });
        // Searched once now too: a message the client cannot read may also make it panic, on
        // a connection that then goes without a word (its values with a carriage return), and
        // the consumer comes back here.
        self.disconnected.notify_one();
        Ok(())
    }

    async fn next(&mut self) -> Result<Vec<Received>, Error> {
        let prefetch = usize::from(self.settings.prefetch);
        let Some(messages) = self.messages.as_mut() else {
            return Err(failed("not subscribed"));
        };
        if let Some(error) = self.cut_short.take() {
            return Err(error);
        }
        let disconnected = Arc::clone(&self.disconnected);
        // The first message, or a lost connection (or a fresh subscription) first: then the
        // consumers may hold a message the client cannot read, which would stop them. Only
        // the wait for the first message is cut short, which takes nothing.
        let first = loop {
            tokio::select! {
                biased;
                () = disconnected.notified() => {
                    let found =
                        find_unreadable(self.held.as_ref(), &self.settings.stream).await;
                    if !found.is_empty() {
                        self.found = found.iter().map(|found| found.sequence).collect();
                        return Ok(found.into_iter().map(|found| Err(found.unreadable)).collect());
                    }
                }
                first = messages.next() => break first,
            }
        };
        let gathered =
            gather_from(first, messages, prefetch)
                .await
                .map_err(|error| match error {
                    GatherError::Ended => failed("the consumer's message stream ended"),
                    GatherError::Failed(error) => failed(error),
                })?;
        self.cut_short = gathered.cut_short.map(failed);
        self.batch = gathered.taken;
        // A topology of the operator's own (declare(false)) may filter wider than a type.
        let addressed = self
            .settings
            .declare
            .then_some(self.settings.prefix.as_str());
        Ok(self
            .batch
            .iter()
            .map(|message| read(message, addressed))
            .collect())
    }

    async fn ack(&mut self) -> Result<(), Error> {
        for message in std::mem::take(&mut self.batch) {
            message.ack().await.map_err(failed)?;
        }
        // Their dead letters are kept: the stream lets them go, or they would stop this
        // consumer again at their next delivery. Deleted, they are gone for every consumer of
        // the stream, which would stop on them alike.
        for sequence in std::mem::take(&mut self.found) {
            if let Some(held) = &self.held
                && let Err(error) = held.stream.delete_message(sequence).await
            {
                // Deleted by another node that found it too, or not now: still there, it is
                // found again at the next lost connection, under the dead letter it has.
                tracing::warn!(transport = NAME, %error, sequence, "could not delete a message the NATS client cannot read from the stream");
            }
        }
        Ok(())
    }

    async fn release(&mut self) {
        // Found again at the next lost connection: their dead letters keep one id.
        self.found.clear();
        // What the pull streams hold beyond the batch goes back too, not after the ack wait.
        let mut held = std::mem::take(&mut self.batch);
        if let Some(messages) = self.messages.as_mut() {
            while let Some(Some(Ok(message))) = messages.next().now_or_never() {
                held.push(message);
            }
        }
        for message in held {
            if let Err(error) = message.ack_with(AckKind::Nak(None)).await {
                // Its ack wait ends all the same, and JetStream redelivers it then.
                tracing::debug!(transport = NAME, %error, "returning a message failed");
            }
        }
        self.messages = None;
        self.held = None;
        // The negative acknowledgements are buffered: they must leave before the connection.
        if let Some(client) = self.client.take() {
            match tokio::time::timeout(Duration::from_secs(1), client.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(transport = NAME, %error, "flushing the returns failed");
                }
                // Reconnecting: the ack wait returns them instead.
                Err(_) => tracing::debug!(transport = NAME, "flushing the returns timed out"),
            }
        }
    }
}

/// The messages the consumers hold that the client cannot read; none when the server cannot
/// be asked (the next lost connection asks again).
async fn find_unreadable(held: Option<&Held>, stream_name: &str) -> Vec<unreadable::Found> {
    let Some(held) = held else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (subject, consumer) in &held.consumers {
        match unreadable::held_by(&held.context, stream_name, consumer, subject).await {
            Ok(more) => found.extend(more),
            Err(error) => {
                // The server is likely gone: the other consumers would each wait for it too.
                tracing::warn!(transport = NAME, %error, subject, "could not look for a message the NATS client cannot read");
                break;
            }
        }
    }
    for found in &found {
        tracing::warn!(transport = NAME, sequence = found.sequence, why = %found.unreadable.why, "a message the NATS client cannot read goes to the dead letters");
    }
    found
}

/// A JetStream message as an envelope; `Nats-Msg-Id` stands in for a missing id header. Under
/// `prefix` (the transport's own consumers, each filtered on one type's subject), its type is
/// the one its subject (`<prefix>.<type>`) names.
fn read(message: &jetstream::Message, prefix: Option<&str>) -> Received {
    let mut headers = BTreeMap::new();
    let mut msg_id = None;
    let mut more = Vec::new();
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            let Some(value) = values.last() else { continue };
            if AsRef::<str>::as_ref(name).eq_ignore_ascii_case("Nats-Msg-Id") {
                msg_id = Some(value.as_str().to_owned());
            }
            headers.insert(name.to_string(), value.as_str().to_owned());
            // The last value is the header's; all of them, should the message be unreadable.
            if values.len() > 1 {
                let all: Vec<&str> = values.iter().map(|value| value.as_str()).collect();
                more.push((format!("{name}-all-values"), format!("{all:?}")));
            }
        }
    }
    let addressed_type = prefix
        .and_then(|prefix| message.subject.as_str().strip_prefix(prefix))
        .and_then(|rest| rest.strip_prefix('.'))
        .map(str::to_owned);
    let fallback = Fallback {
        id: msg_id,
        in_headers: true,
        more,
        addressed_type,
        ..Fallback::default()
    };
    wire::decode(headers, message.payload.to_vec(), fallback)
}

#[cfg(test)]
mod tests {
    use super::{Nats, connect, consumer_name, stream};

    /// Against the real server (`DACAPO_TEST_NATS`, by default the one `.ci/run` starts).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nodes_creating_one_stream_at_once_all_find_it() {
        let url = std::env::var("DACAPO_TEST_NATS")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let nats = Nats::new(url, "racing")
            .stream(format!("RACE{}", &unique[..12]))
            .subject_prefix(format!("race{}", &unique[..12]));
        let settings = &nats.settings;
        let mut contexts = Vec::new();
        for _ in 0..8 {
            contexts.push(
                connect(settings, None)
                    .await
                    .expect("NATS runs for the tests"),
            );
        }
        // Each looks, finds nothing and creates, at the same moment.
        let created =
            futures::future::join_all(contexts.iter().map(|context| stream(context, settings)))
                .await;
        let _ = contexts[0].delete_stream(&settings.stream).await;
        for outcome in created {
            assert!(outcome.is_ok(), "{:?}", outcome.err());
        }
    }

    #[test]
    fn a_consumer_is_named_after_its_service_its_type_and_the_types_hash() {
        assert_eq!(
            consumer_name("billing", "orders.placed").unwrap(),
            "billing_orders_placed_456a4dba"
        );
        // Alike once `.` is replaced, kept apart by the hash.
        assert_eq!(
            consumer_name("billing", "orders_placed").unwrap(),
            "billing_orders_placed_abc363bf"
        );
    }

    #[test]
    fn a_type_too_long_for_a_consumer_name_is_cut_and_kept_apart_by_a_longer_hash() {
        let long = "a".repeat(300);
        let cut = consumer_name("billing", &format!("{long}.x")).unwrap();
        let other = consumer_name("billing", &format!("{long}.y")).unwrap();
        assert_eq!(cut.len(), 255);
        assert_eq!(other.len(), 255);
        assert_ne!(cut, other);
        assert!(cut.starts_with("billing_aaaa"), "{cut}");
        // 16 hex digits of the hash, where a name that fits has 8.
        assert_eq!(cut.rsplit_once('_').unwrap().1.len(), 16);
        // The longest name that fits is not cut.
        let fits = "b".repeat(255 - "billing__12345678".len());
        assert_eq!(consumer_name("billing", &fits).unwrap().len(), 255);
    }

    #[test]
    fn a_service_name_no_consumer_can_carry_is_a_configuration_error() {
        for service in [
            "",
            "bill.ing",
            "bill ing",
            "bill>",
            "bill/ing",
            &"s".repeat(240),
        ] {
            assert!(
                matches!(
                    consumer_name(service, "orders.placed"),
                    Err(crate::Error::Configuration(_))
                ),
                "{service:?}"
            );
        }
    }
}
