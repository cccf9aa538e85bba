//! Runs a transport on a thread of its own: its broker connections, its publishing for the
//! outbox relay, and its consuming into the listener. The broker clients' I/O then belongs to
//! neither the application's tokio runtime nor the engine's.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dacapo_actors::ports::{Clock, DeadLetterStore, Outbound};
use dacapo_actors::{Backoff, DeadLetter, DeadLetterReason, Envelope, Persisted};
use futures::FutureExt;
use tokio::sync::{mpsc, oneshot, watch};

use super::Listener;
use super::routes::Routes;
use super::wire::Unreadable;
use crate::Error;

/// What a broker consumer handed over: an envelope, or a message that is not one.
pub(crate) type Received = Result<Envelope, Unreadable>;

/// What a broker made of a batch beyond the envelopes it confirmed: those it can never take,
/// and those it could not place now.
pub(crate) use dacapo_actors::ports::Sent;

/// A broker's publishing side. A failed call leaves nothing half-sent that the next call
/// would not send again, and the next call reconnects if the connection is gone.
#[async_trait]
pub(crate) trait Publish: Send + 'static {
    /// Publishes `envelopes`; `Ok` once the broker confirmed each but those it answers with:
    /// refused (checked it can never carry them, not sent) or held (not placed now).
    async fn publish(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error>;

    /// Forgets the connection, so the next call makes a new one: after a publication timed
    /// out or panicked, which `publish` did not see end.
    fn reset(&mut self);
}

/// A broker's consuming side, driven one batch at a time: `next`, then `ack` or `release`.
#[async_trait]
pub(crate) trait Subscribe: Send + 'static {
    /// Connects, declares or checks the topology, and starts consuming. A non-retryable
    /// error (a topology that is missing when only checked) stops the transport's listening.
    async fn subscribe(&mut self) -> Result<(), Error>;

    /// The next messages, at most the prefetch: waits for one, then takes what else is
    /// ready. An empty batch (a quiet poll) is fine.
    ///
    /// Cancel safety: cancelled (at shutdown), what it had received is released by
    /// [`release`](Subscribe::release) or by the broker when the connection goes.
    async fn next(&mut self) -> Result<Vec<Received>, Error>;

    /// Acknowledges every message of the last batch: they are in the store.
    async fn ack(&mut self) -> Result<(), Error>;

    /// Hands every unacknowledged message back to the broker, for this or another node.
    async fn release(&mut self);
}

/// Takes the next messages of `stream`: waits for the first, then takes what else arrives
/// while the runtime yields, up to `max`. A burst from a broker lands over many socket reads:
/// gathering it makes one inbox transaction of what would have been many. Yielding costs
/// microseconds, so a lone message is not held back.
///
/// An error after the first message ends the batch without dropping what came before it:
/// those messages are still recorded and acknowledged, and the error comes back with them for
/// the caller to answer its next call with. Dropped unanswered, they would wait out the
/// broker's redelivery timer (JetStream's ack wait, 30 s by default).
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) async fn gather<S, T, E>(
    stream: &mut S,
    max: usize,
) -> Result<Gathered<T, E>, GatherError<E>>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
{
    use futures::StreamExt;
    let first = stream.next().await;
    gather_from(first, stream, max).await
}

/// [`gather`], its first message (or the end or error in its place) already taken from
/// `stream`.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) async fn gather_from<S, T, E>(
    first: Option<Result<T, E>>,
    stream: &mut S,
    max: usize,
) -> Result<Gathered<T, E>, GatherError<E>>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
{
    use futures::StreamExt;
    let first = first
        .ok_or(GatherError::Ended)?
        .map_err(GatherError::Failed)?;
    let mut taken = vec![first];
    // Rounds of yields that brought nothing, in a row.
    let mut quiet = 0;
    while taken.len() < max && quiet < GATHER_QUIET_ROUNDS {
        match stream.next().now_or_never() {
            Some(Some(Ok(item))) => {
                taken.push(item);
                quiet = 0;
            }
            Some(Some(Err(error))) => {
                return Ok(Gathered {
                    taken,
                    cut_short: Some(error),
                });
            }
            Some(None) => break,
            None => {
                quiet += 1;
                tokio::task::yield_now().await;
            }
        }
    }
    Ok(Gathered {
        taken,
        cut_short: None,
    })
}

/// What [`gather`] took: at least one message, and the error that ended the batch early, if
/// one did.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) struct Gathered<T, E> {
    pub(crate) taken: Vec<T>,
    pub(crate) cut_short: Option<E>,
}

/// How many yields in a row may bring nothing before a batch is taken as it is.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
const GATHER_QUIET_ROUNDS: u32 = 8;

/// Why [`gather`] took nothing.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) enum GatherError<E> {
    /// The stream ended: the broker cancelled the consumer, or the connection went.
    Ended,
    /// The stream failed.
    Failed(E),
}

/// A broker the runtime sends routed message types to and listens on; made from a
/// transport's configuration ([`RabbitMq`](crate::transport::RabbitMq),
/// [`Nats`](crate::transport::Nats), [`PostgresQueue`](crate::transport::PostgresQueue)) and
/// given to [`RuntimeBuilder::transport`](crate::RuntimeBuilder::transport).
pub struct Transport {
    pub(crate) name: &'static str,
    pub(crate) routes: Routes,
    /// Where this node listens: the destination of the types routed without one of their own.
    pub(crate) home: String,
    /// Makes the two halves, given the message types this node listens for.
    #[allow(clippy::type_complexity)]
    pub(crate) open:
        Box<dyn FnOnce(Vec<String>) -> (Box<dyn Publish>, Box<dyn Subscribe>) + Send + Sync>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("name", &self.name)
            .field("routes", &self.routes)
            .field("home", &self.home)
            .finish_non_exhaustive()
    }
}

/// Where a transport's listening stands, from [`Runtime::transports`](crate::Runtime::transports).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportState {
    /// Connecting, or connecting again after `last_error`.
    Connecting {
        /// Why the last connection failed or ended, if one did.
        last_error: Option<String>,
    },
    /// Subscribed: messages flow.
    Listening,
    /// Stopped for good, before it ever listened: the cause waiting cannot cure (refused
    /// credentials, a topology only checked and missing). Once it listened, the same causes
    /// are waited out in [`Connecting`](Self::Connecting).
    Failed(String),
    /// Stopped by a shutdown.
    Stopped,
}

/// One publication the relay asked for.
struct Request {
    envelopes: Vec<Envelope>,
    reply: oneshot::Sender<Result<Sent, Error>>,
}

/// The relay's handle on the transports' publishing sides.
pub(crate) struct Outbounds {
    transports: Vec<(Routes, &'static str, mpsc::Sender<Request>)>,
}

#[async_trait]
impl Outbound for Outbounds {
    fn carries(&self, message_type: &str) -> bool {
        self.transports
            .iter()
            .any(|(routes, ..)| routes.carries(message_type))
    }

    /// Fails only when every transport it had envelopes for failed. One that fails while
    /// another confirms has its envelopes held, so that what the others confirmed is marked
    /// and not sent again round after round while the one is down.
    async fn send(&self, envelopes: &[Envelope]) -> Result<Sent, dacapo_actors::Error> {
        // Each envelope leaves through the first transport that carries its type.
        let mut remaining: Vec<&Envelope> = envelopes.iter().collect();
        let mut sent = Sent::default();
        let mut answered_any = false;
        let mut first_failure = None;
        for (routes, name, requests) in &self.transports {
            let (mine, rest): (Vec<&Envelope>, Vec<&Envelope>) = remaining
                .into_iter()
                .partition(|envelope| routes.carries(&envelope.message_type));
            remaining = rest;
            if mine.is_empty() {
                continue;
            }
            let ids: Vec<_> = mine.iter().map(|envelope| envelope.id).collect();
            let (reply, answer) = oneshot::channel();
            let request = Request {
                envelopes: mine.into_iter().cloned().collect(),
                reply,
            };
            let answered = match requests.send(request).await {
                Ok(()) => answer
                    .await
                    .unwrap_or_else(|_| Err(Error::TransportStopped(name))),
                Err(_) => Err(Error::TransportStopped(name)),
            };
            match answered {
                Ok(answered) => {
                    answered_any = true;
                    sent.refused.extend(answered.refused);
                    sent.held.extend(answered.held);
                }
                Err(error) => {
                    let why = error.to_string();
                    sent.held
                        .extend(ids.into_iter().map(|id| (id, why.clone())));
                    first_failure.get_or_insert(match error {
                        Error::Transport { transport, source } => {
                            dacapo_actors::Error::Transport { transport, source }
                        }
                        other => dacapo_actors::Error::transport(name, other.to_string()),
                    });
                }
            }
        }
        if let Some(failure) = first_failure
            && !answered_any
        {
            return Err(failure);
        }
        sent.refused.extend(
            remaining
                .into_iter()
                .map(|envelope| (envelope.id, "no transport carries its type".to_owned())),
        );
        Ok(sent)
    }
}

/// A running transport, as the runtime holds it.
pub(crate) struct Host {
    name: &'static str,
    stop: watch::Sender<bool>,
    state: watch::Receiver<TransportState>,
}

/// A transport made ready before the engine starts (the relay needs its publishing side),
/// started once the engine's listener exists.
pub(crate) struct Pending {
    transport: Transport,
    requests: mpsc::Receiver<Request>,
}

impl Pending {
    /// Readies `transports`: their publishing handle for the relay, and what starts them.
    pub(crate) fn prepare(transports: Vec<Transport>) -> (Option<Outbounds>, Vec<Pending>) {
        if transports.is_empty() {
            return (None, Vec::new());
        }
        let mut outbounds = Vec::with_capacity(transports.len());
        let mut pending = Vec::with_capacity(transports.len());
        for transport in transports {
            let (requests_tx, requests) = mpsc::channel(16);
            outbounds.push((transport.routes.clone(), transport.name, requests_tx));
            pending.push(Pending {
                transport,
                requests,
            });
        }
        (
            Some(Outbounds {
                transports: outbounds,
            }),
            pending,
        )
    }

    /// Starts the transport's thread: it listens for the types of `handled` routed to it.
    pub(crate) fn start(
        self,
        handled: &[&'static str],
        listener: Listener,
        dead_letters: Arc<dyn DeadLetterStore>,
        clock: Arc<dyn Clock>,
        max_envelope_size: usize,
    ) -> Result<Host, Error> {
        let Pending {
            transport,
            requests,
        } = self;
        let name = transport.name;
        let listened = transport
            .routes
            .listened(handled.iter().copied(), &transport.home);
        let (stop, stopping) = watch::channel(false);
        let (state_tx, state) = watch::channel(TransportState::Connecting { last_error: None });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| Error::Startup(error.to_string()))?;
        let open = transport.open;
        std::thread::Builder::new()
            .name(format!("dacapo-{name}"))
            .spawn(move || {
                // Its accepts commit on this runtime, which runs as long as the thread.
                #[cfg(any(feature = "sqlite", feature = "postgres"))]
                crate::store::sql::driven_for_its_life();
                runtime.block_on(async move {
                    // Made here: what the clients spawn runs on this thread's runtime.
                    let (publisher, subscriber) = open(listened.clone());
                    let publishing = tokio::spawn(publish(name, publisher, requests));
                    let state_tx = Arc::new(state_tx);
                    if listened.is_empty() {
                        let _ = state_tx.send(TransportState::Listening);
                        let mut stopping = stopping;
                        let _ = stopping.wait_for(|stop| *stop).await;
                        let _ = state_tx.send(TransportState::Stopped);
                    } else {
                        let consumer = Consumer {
                            name,
                            subscriber,
                            listener,
                            dead_letters,
                            clock,
                            max_envelope_size,
                            stopping,
                            state: Arc::clone(&state_tx),
                        };
                        if std::panic::AssertUnwindSafe(consumer.run())
                            .catch_unwind()
                            .await
                            .is_err()
                        {
                            tracing::error!(
                                transport = name,
                                "the transport's consumer panicked; it stops listening"
                            );
                            let _ = state_tx
                                .send(TransportState::Failed("the consumer panicked".into()));
                        }
                    }
                    // Publishing goes on until the relay is gone: a draining engine's
                    // cascades still leave.
                    let _ = publishing.await;
                });
            })
            .map_err(|error| Error::Startup(error.to_string()))?;
        Ok(Host { name, stop, state })
    }
}

impl Host {
    /// This transport's name and where its listening stands.
    pub(crate) fn state(&self) -> (&'static str, TransportState) {
        (self.name, self.state.borrow().clone())
    }

    /// Waits until this transport listens; the error when it stopped for good first.
    pub(crate) async fn listening(&self) -> Result<(), Error> {
        let mut state = self.state.clone();
        let seen: TransportState = state
            .wait_for(|state| !matches!(state, TransportState::Connecting { .. }))
            .await
            .map(|state| state.clone())
            .unwrap_or(TransportState::Stopped);
        match seen {
            TransportState::Listening => Ok(()),
            TransportState::Failed(why) => {
                Err(Error::Configuration(format!("{}: {why}", self.name)))
            }
            _ => Err(Error::TransportStopped(self.name)),
        }
    }

    /// Stops consuming: what was received and not accepted goes back to the broker.
    pub(crate) async fn stop_listening(&self) {
        let _ = self.stop.send(true);
        let mut state = self.state.clone();
        let _ = state
            .wait_for(|state| matches!(state, TransportState::Stopped | TransportState::Failed(_)))
            .await;
    }
}

/// How long one publication may take before it counts as failed, besides a second per MiB
/// it carries ([`publish_timeout`]).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a publication of `envelopes` may take: [`PUBLISH_TIMEOUT`] and a second per MiB.
/// A timeout fails the whole batch (what the broker confirmed of it is sent again), so a fixed
/// one would fail a batch of large envelopes every round, the broker taking a copy each time,
/// and the relay never get past it.
fn publish_timeout(envelopes: &[Envelope]) -> Duration {
    let bytes: usize = envelopes.iter().map(Envelope::size).sum();
    let mib = u64::try_from(bytes).unwrap_or(u64::MAX) / (1024 * 1024);
    PUBLISH_TIMEOUT.saturating_add(Duration::from_secs(mib))
}

/// How long connecting and subscribing may take before they count as failed.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the relay's publications one at a time, in the order asked. After a failure the
/// broker is left alone for a backoff: the relay's next rounds fail at once meanwhile,
/// instead of each connecting again.
async fn publish(
    name: &'static str,
    mut publisher: Box<dyn Publish>,
    mut requests: mpsc::Receiver<Request>,
) {
    let mut failures = 0u32;
    let mut resume_at: Option<tokio::time::Instant> = None;
    while let Some(mut request) = requests.recv().await {
        // The relay gave up on it (its lease went): it sends these rows again in a later
        // round, if they are still its to send.
        if request.reply.is_closed() {
            continue;
        }
        if let Some(at) = resume_at.filter(|at| tokio::time::Instant::now() < *at) {
            let wait = at - tokio::time::Instant::now();
            let _ = request.reply.send(Err(Error::transport(
                name,
                format!("the broker failed {failures} time(s) in a row; trying again in {wait:?}"),
            )));
            continue;
        }
        let attempt =
            std::panic::AssertUnwindSafe(publisher.publish(&request.envelopes)).catch_unwind();
        let timeout = publish_timeout(&request.envelopes);
        let attempt = tokio::time::timeout(timeout, attempt);
        let attempt = tokio::select! {
            attempt = attempt => attempt,
            () = request.reply.closed() => {
                // Cut short, with the connection in an unknown state: what the broker took
                // of it is sent again, and the receiving inbox discards the copy. Counted as
                // a failure, so that a relay that keeps giving up does not resend at once.
                publisher.reset();
                failures = failures.saturating_add(1);
                resume_at = Some(tokio::time::Instant::now() + RECONNECT.pause(failures));
                continue;
            }
        };
        let sent = match attempt {
            Ok(Ok(sent)) => sent,
            Ok(Err(_)) => {
                publisher.reset();
                Err(Error::transport(name, "publishing panicked"))
            }
            Err(_) => {
                publisher.reset();
                Err(Error::transport(
                    name,
                    format!("the broker did not confirm within {timeout:?}"),
                ))
            }
        };
        match &sent {
            Ok(_) => {
                failures = 0;
                resume_at = None;
            }
            Err(_) => {
                failures = failures.saturating_add(1);
                resume_at = Some(tokio::time::Instant::now() + RECONNECT.pause(failures));
            }
        }
        let _ = request.reply.send(sent);
    }
}

/// How long the consumer waits before connecting again, by failures so far.
const RECONNECT: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// How long recording a received batch may take before the consumer warns that it is slow.
const SLOW_RECORD: Duration = Duration::from_secs(10);

/// How long a subscription stays up, bringing nothing, before it counts as one that worked:
/// the longest pause. One that drops sooner (a proxy cutting each connection right after it
/// is made, a listener whose connection goes at once) is one more failure in a row, not a
/// fresh start ten times a second.
const WORKED_WHEN_UP_FOR: Duration = Duration::from_secs(5);

struct Consumer {
    name: &'static str,
    subscriber: Box<dyn Subscribe>,
    listener: Listener,
    dead_letters: Arc<dyn DeadLetterStore>,
    clock: Arc<dyn Clock>,
    /// The runtime's envelope limit, applied as messages arrive.
    max_envelope_size: usize,
    stopping: watch::Receiver<bool>,
    state: Arc<watch::Sender<TransportState>>,
}

impl Consumer {
    async fn run(mut self) {
        let mut failures = 0u32;
        // Refused credentials or topology at the start are a configuration to mend; once this
        // consumer listened, the same refusal is passing (an authentication backend briefly
        // down, a virtual host recovering, a queue made again) and is waited out like an outage.
        let mut listened = false;
        loop {
            let subscribed = tokio::select! {
                biased;
                _ = self.stopping.wait_for(|stop| *stop) => break,
                subscribed = tokio::time::timeout(SUBSCRIBE_TIMEOUT, self.subscriber.subscribe()) => {
                    subscribed.unwrap_or_else(|_| Err(Error::transport(
                        self.name,
                        format!("connecting and subscribing took over {SUBSCRIBE_TIMEOUT:?}"),
                    )))
                }
            };
            match subscribed {
                Ok(()) => {
                    listened = true;
                    if failures > 0 {
                        tracing::info!(
                            transport = self.name,
                            failures,
                            "connected to the broker again; listening resumed"
                        );
                    }
                    let _ = self.state.send(TransportState::Listening);
                }
                Err(error) if !error.is_retryable() && !listened => {
                    tracing::error!(transport = self.name, %error, "the transport cannot listen; it stops");
                    let _ = self.state.send(TransportState::Failed(error.to_string()));
                    return;
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let pause = RECONNECT.pause(failures);
                    tracing::warn!(transport = self.name, %error, failures, ?pause, "cannot listen on the broker; connecting again after a pause");
                    let _ = self.state.send(TransportState::Connecting {
                        last_error: Some(error.to_string()),
                    });
                    tokio::select! {
                        biased;
                        _ = self.stopping.wait_for(|stop| *stop) => break,
                        () = tokio::time::sleep(pause) => continue,
                    }
                }
            }
            match self.consume().await {
                Consumed::Stopped => break,
                Consumed::Refused(error) => {
                    tracing::error!(transport = self.name, %error, "the broker refuses this consumer's acknowledgements; it stops listening");
                    self.subscriber.release().await;
                    let _ = self.state.send(TransportState::Failed(error.to_string()));
                    return;
                }
                Consumed::Lost { error, worked } => {
                    // A subscription that failed before it worked counts as one more failure
                    // in a row: one that keeps failing so is not made again ten times a
                    // second.
                    failures = if worked {
                        1
                    } else {
                        failures.saturating_add(1)
                    };
                    let pause = RECONNECT.pause(failures);
                    tracing::warn!(transport = self.name, %error, failures, ?pause, "lost the broker; connecting again after a pause");
                    let _ = self.state.send(TransportState::Connecting {
                        last_error: Some(error.to_string()),
                    });
                    tokio::select! {
                        biased;
                        _ = self.stopping.wait_for(|stop| *stop) => break,
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
        self.subscriber.release().await;
        let _ = self.state.send(TransportState::Stopped);
    }

    /// Consumes until the connection is lost or the runtime stops.
    async fn consume(&mut self) -> Consumed {
        let up_since = tokio::time::Instant::now();
        let mut brought = false;
        let worked = |brought: bool| brought || up_since.elapsed() >= WORKED_WHEN_UP_FOR;
        loop {
            let batch = tokio::select! {
                biased;
                _ = self.stopping.wait_for(|stop| *stop) => return Consumed::Stopped,
                batch = self.subscriber.next() => batch,
            };
            let batch = match batch {
                Ok(batch) if batch.is_empty() => continue,
                Ok(batch) => batch,
                Err(error) => {
                    return Consumed::Lost {
                        error,
                        worked: worked(brought),
                    };
                }
            };

            // Cut short by a shutdown, nothing of the batch is acknowledged: the broker
            // redelivers it, and the inbox discards what was recorded.
            let mut stopping = self.stopping.clone();
            let size = batch.len();
            let recorded = {
                let recording = self.record(batch);
                futures::pin_mut!(recording);
                let mut slow = std::pin::pin!(tokio::time::sleep(SLOW_RECORD));
                loop {
                    tokio::select! {
                        biased;
                        _ = stopping.wait_for(|stop| *stop) => break None,
                        recorded = &mut recording => break Some(recorded),
                        // Told once: a broker redelivers what stays unacknowledged past its
                        // own wait (JetStream's ack wait, 30 s by default), here or elsewhere.
                        () = &mut slow, if !slow.is_elapsed() => tracing::warn!(
                            transport = self.name,
                            batch = size,
                            waited = ?SLOW_RECORD,
                            "a received batch is still not recorded in the inbox; the broker may deliver it again meanwhile"
                        ),
                    }
                }
            };
            let persisted = match recorded {
                None => {
                    self.subscriber.release().await;
                    return Consumed::Stopped;
                }
                Some(Err(error)) => {
                    // Only a runtime that stops refuses what waiting would not cure.
                    tracing::info!(transport = self.name, %error, "the runtime refused received envelopes; handing them back to the broker");
                    self.subscriber.release().await;
                    return Consumed::Stopped;
                }
                Some(Ok(persisted)) => persisted,
            };
            // Acknowledged once persisted, before the deliveries wait for room: a broker's
            // hold on the batch (a PostgreSQL queue's open transaction) would otherwise last
            // as long as the engine stays full.
            let acked = self.subscriber.ack().await;
            // Started before the next batch is taken: the transport keeps the engine's pace.
            // A shutdown meanwhile leaves the rest in the inbox (durable wherever a transport
            // runs: the builder requires it) for the next node, their first attempt taken
            // back, so that it does not take them for attempts that failed.
            let mut persisted = persisted.into_iter();
            while let Some(mut batch) = persisted.next() {
                let started = tokio::select! {
                    biased;
                    _ = stopping.wait_for(|stop| *stop) => false,
                    () = batch.start() => true,
                };
                if !started {
                    batch.leave().await;
                    for rest in persisted {
                        rest.leave().await;
                    }
                    return Consumed::Stopped;
                }
            }
            if let Err(error) = acked {
                if matches!(error, Error::Configuration(_)) {
                    return Consumed::Refused(error);
                }
                // In the store already: the broker's redelivery is discarded by the inbox.
                return Consumed::Lost {
                    error,
                    worked: worked(brought),
                };
            }
            // Worked only once the broker took an acknowledgement: a subscription whose every
            // acknowledgement fails (a queue's table this role may read but not delete from)
            // backs off like one that fails at once, instead of taking the same batch again
            // ten times a second.
            brought = true;
        }
    }

    /// Dead-letters what is unreadable or over the envelope limit and persists the rest,
    /// whose deliveries are still to start.
    ///
    /// A message over the limit never reaches the inbox: a broker's burst of them in one inbox
    /// transaction could pass what the database takes in one statement (1 GiB on PostgreSQL),
    /// and be refused, and retried, for ever.
    async fn record(&self, batch: Vec<Received>) -> Result<Vec<Persisted>, Error> {
        let mut envelopes = Vec::with_capacity(batch.len());
        for received in batch {
            match received {
                Ok(envelope) if envelope.size() > self.max_envelope_size => {
                    self.too_large(envelope).await;
                }
                Ok(envelope) => envelopes.push(envelope),
                Err(unreadable) => self.dead_letter(unreadable).await,
            }
        }
        self.persist(envelopes).await
    }

    async fn too_large(&self, envelope: Envelope) {
        let reason = DeadLetterReason::TooLarge {
            size: envelope.size(),
            limit: self.max_envelope_size,
        };
        tracing::warn!(transport = self.name, messaging.message.id = %envelope.id, %reason, "a message from the broker goes to the dead letters");
        let letter = DeadLetter::rejected(envelope, reason, self.clock.now());
        self.put(letter).await;
    }

    /// Persists the batch in one store transaction; a batch the store refuses for one
    /// envelope's data is persisted one by one, and a refused envelope dead-lettered.
    async fn persist(&self, envelopes: Vec<Envelope>) -> Result<Vec<Persisted>, Error> {
        match self.listener.persist_batch(envelopes.clone()).await {
            Err(Error::Rejected(_)) => {}
            persisted => return Ok(persisted?.into_iter().collect()),
        }
        let mut persisted = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            match self.listener.persist_batch(vec![envelope.clone()]).await {
                Ok(one) => persisted.extend(one),
                Err(Error::Rejected(error)) => {
                    let letter = DeadLetter::rejected(
                        envelope,
                        DeadLetterReason::StoreRejected(error.to_string()),
                        self.clock.now(),
                    );
                    self.put(letter).await;
                }
                Err(error) => return Err(error),
            }
        }
        Ok(persisted)
    }

    async fn dead_letter(&self, unreadable: Unreadable) {
        let why = unreadable.why.clone();
        let envelope = unreadable.into_envelope(self.clock.now());
        tracing::warn!(transport = self.name, messaging.message.id = %envelope.id, %why, "an unreadable message from the broker goes to the dead letters");
        let letter = DeadLetter::rejected(
            envelope,
            DeadLetterReason::Unreadable(why),
            self.clock.now(),
        );
        self.put(letter).await;
    }

    /// Stores a dead letter, waiting out store failures: the message it keeps is
    /// acknowledged only once it is stored.
    async fn put(&self, letter: DeadLetter) {
        let mut failures = 0u32;
        loop {
            match self.dead_letters.put(letter.clone()).await {
                Ok(()) => return,
                Err(error) if error.is_retryable() => {
                    failures = failures.saturating_add(1);
                    let pause = RECONNECT.pause(failures);
                    tracing::warn!(transport = self.name, %error, ?pause, "the store cannot keep a dead letter; pausing");
                    tokio::time::sleep(pause).await;
                }
                Err(error) => {
                    // The store refuses even the dead letter (its bytes): nothing can keep it.
                    tracing::error!(transport = self.name, messaging.message.id = %letter.envelope.id, %error, "a message the store cannot hold is acknowledged without being kept");
                    return;
                }
            }
        }
    }
}

enum Consumed {
    Stopped,
    /// The subscription failed; `worked` tells whether it worked first: brought messages, or
    /// stayed up [`WORKED_WHEN_UP_FOR`].
    Lost {
        error: Error,
        worked: bool,
    },
    /// The broker refused an acknowledgement for a cause no retry cures (a privilege it lacks,
    /// rows a trigger keeps): consuming on would take the same messages again and again, and
    /// run them again once the inbox forgot them.
    Refused(Error),
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A broker's publishing side that confirms, or fails, each call after `takes`; counts
    /// its calls and resets.
    #[derive(Clone, Default)]
    struct Broker {
        fails: bool,
        takes: Duration,
        calls: Arc<AtomicUsize>,
        resets: Arc<AtomicUsize>,
    }

    #[async_trait]
    impl Publish for Broker {
        async fn publish(&mut self, _: &[Envelope]) -> Result<Sent, Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.takes).await;
            if self.fails {
                return Err(Error::transport("broker", "the broker is down"));
            }
            Ok(Sent::default())
        }

        fn reset(&mut self) {
            self.resets.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One transport per broker, each carrying one message type, each publishing on a task
    /// of its own.
    fn outbounds(brokers: &[(&'static str, &str, Broker)]) -> Outbounds {
        let transports = brokers
            .iter()
            .map(|(name, message_type, broker)| {
                let (requests_tx, requests) = mpsc::channel(16);
                tokio::spawn(publish(name, Box::new(broker.clone()), requests));
                let mut routes = Routes::default();
                routes.add(message_type, None);
                (routes, *name, requests_tx)
            })
            .collect();
        Outbounds { transports }
    }

    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    #[tokio::test]
    async fn a_batch_cut_short_by_an_error_keeps_the_messages_before_it() {
        let mut stream = futures::stream::iter([Ok(1), Ok(2), Err("cut"), Ok(3)]);
        let Ok(first) = gather(&mut stream, 10).await else {
            panic!("the messages before the error were dropped with it");
        };
        assert_eq!(first.taken, [1, 2]);
        assert_eq!(first.cut_short, Some("cut"));
        let Ok(second) = gather(&mut stream, 10).await else {
            panic!("the stream goes on after the error");
        };
        assert_eq!(second.taken, [3]);
        assert_eq!(second.cut_short, None);
        assert!(matches!(
            gather(&mut stream, 10).await,
            Err(GatherError::Ended)
        ));
        let mut failing = futures::stream::iter([Err::<u8, _>("down"), Ok(1)]);
        assert!(matches!(
            gather(&mut failing, 10).await,
            Err(GatherError::Failed("down"))
        ));
    }

    #[tokio::test]
    async fn a_transport_that_fails_holds_its_envelopes_and_the_others_confirmed_count_as_sent() {
        let up = Broker::default();
        let down = Broker {
            fails: true,
            ..Broker::default()
        };
        let outbound = outbounds(&[("up", "orders.placed", up), ("down", "mail.queued", down)]);
        let placed = Envelope::new("orders.placed", b"{}".to_vec());
        let queued = Envelope::new("mail.queued", b"{}".to_vec());
        let sent = outbound
            .send(&[placed.clone(), queued.clone()])
            .await
            .unwrap();
        let held: Vec<_> = sent.held.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            held,
            [queued.id],
            "only the failed transport's envelope waits"
        );
        assert!(sent.refused.is_empty());
        assert!(
            sent.held[0].1.contains("the broker is down"),
            "{:?}",
            sent.held
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_publication_has_a_second_per_mib_it_carries_besides_its_five() {
        // Ten seconds to confirm: past the five a small batch has, within the 5 + 16 of a
        // batch of sixteen envelopes of a MiB.
        let slow = Broker {
            takes: Duration::from_secs(10),
            ..Broker::default()
        };
        let outbound = outbounds(&[("slow", "mail.queued", slow.clone())]);
        let small = Envelope::new("mail.queued", b"{}".to_vec());
        let failed = outbound.send(&[small]).await.unwrap_err();
        assert!(failed.to_string().contains("within 5s"), "{failed}");
        let large: Vec<_> = (0..16)
            .map(|_| Envelope::new("mail.queued", vec![b'x'; 1024 * 1024]))
            .collect();
        // Past the backoff the failure left.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let sent = outbound.send(&large).await.unwrap();
        assert!(sent.held.is_empty(), "{:?}", sent.held);
        assert_eq!(slow.calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_batch_fails_when_every_transport_it_goes_to_fails() {
        let down = Broker {
            fails: true,
            ..Broker::default()
        };
        let outbound = outbounds(&[("down", "mail.queued", down)]);
        let queued = Envelope::new("mail.queued", b"{}".to_vec());
        let failed = outbound.send(&[queued]).await.unwrap_err();
        assert!(
            matches!(&failed, dacapo_actors::Error::Transport { source, .. }
                if source.to_string() == "the broker is down"),
            "{failed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_publication_the_relay_gave_up_on_is_cut_short_and_one_it_gave_up_on_before_is_not_sent()
     {
        let slow = Broker {
            takes: Duration::from_secs(3),
            ..Broker::default()
        };
        let (requests_tx, requests) = mpsc::channel(16);
        let publishing = tokio::spawn(publish("slow", Box::new(slow.clone()), requests));
        // Asks for one envelope to be published; the answer comes on the receiver.
        let ask = || {
            let (reply, answer) = oneshot::channel();
            let envelopes = vec![Envelope::new("mail.queued", b"{}".to_vec())];
            requests_tx.try_send(Request { envelopes, reply }).unwrap();
            answer
        };
        let answer = ask();
        // A request whose relay gave up while it waited behind the first.
        drop(ask());
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            slow.calls.load(Ordering::SeqCst),
            1,
            "the first is under way"
        );
        drop(answer);
        // The first is cut short when its relay gives up, and counts as a failure: the next
        // request waits out the publisher's backoff instead of going out at once.
        let answer = ask();
        let refused = answer.await.unwrap().unwrap_err();
        assert!(
            refused.to_string().contains("failed 1 time(s)"),
            "{refused}"
        );
        // The second was never sent.
        drop(requests_tx);
        tokio::time::timeout(Duration::from_secs(1), publishing)
            .await
            .expect("the publisher stopped without finishing the slow publication")
            .unwrap();
        assert_eq!(
            slow.calls.load(Ordering::SeqCst),
            1,
            "neither the abandoned one nor the one in the backoff was sent"
        );
        assert_eq!(
            slow.resets.load(Ordering::SeqCst),
            1,
            "the connection of the cut-short one is made again"
        );
    }

    /// Subscribes, then fails when asked for messages: at once (consumer limits a server
    /// refuses, a table it may not read), or, when `up_for` is given, after answering quiet
    /// polls for that long (a subscription whose connection drops); counts its subscriptions.
    struct Flapping {
        subscriptions: Arc<AtomicUsize>,
        up_for: Option<Duration>,
        answered: bool,
    }

    #[async_trait]
    impl Subscribe for Flapping {
        async fn subscribe(&mut self) -> Result<(), Error> {
            self.subscriptions.fetch_add(1, Ordering::SeqCst);
            self.answered = false;
            Ok(())
        }
        async fn next(&mut self) -> Result<Vec<Received>, Error> {
            if let Some(up_for) = self.up_for
                && !self.answered
            {
                self.answered = true;
                tokio::time::sleep(up_for).await;
                return Ok(Vec::new());
            }
            Err(Error::transport(
                "flapping",
                "the server refuses this consumer's limits",
            ))
        }
        async fn ack(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn release(&mut self) {}
    }

    /// A consumer on `subscriber` for `runtime`, stopped by `stopping`, telling `state`.
    fn consumer(
        runtime: &crate::Runtime,
        subscriber: impl Subscribe + 'static,
        stopping: watch::Receiver<bool>,
        state: watch::Sender<TransportState>,
    ) -> Consumer {
        Consumer {
            name: "test",
            subscriber: Box::new(subscriber),
            listener: runtime.listener(),
            dead_letters: Arc::new(crate::store::MemoryDeadLetters::default()),
            clock: Arc::new(dacapo_actors::ports::SystemClock),
            max_envelope_size: usize::MAX,
            stopping,
            state: Arc::new(state),
        }
    }

    /// How many subscriptions a consumer on `Flapping` makes in a minute.
    async fn subscriptions_in_a_minute(up_for: Option<Duration>) -> usize {
        let runtime = crate::Runtime::builder().build().unwrap();
        let subscriptions = Arc::new(AtomicUsize::new(0));
        let (stop, stopping) = watch::channel(false);
        let (state, _) = watch::channel(TransportState::Connecting { last_error: None });
        let flapping = Flapping {
            subscriptions: Arc::clone(&subscriptions),
            up_for,
            answered: false,
        };
        let consumer = consumer(&runtime, flapping, stopping, state);
        let watching = async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            let made = subscriptions.load(Ordering::SeqCst);
            stop.send(true).unwrap();
            made
        };
        let ((), made) = tokio::time::timeout(
            Duration::from_secs(70),
            futures::future::join(consumer.run(), watching),
        )
        .await
        .expect("the consumer stops while it pauses");
        runtime.shutdown().await;
        made
    }

    /// Brings the same envelope on every subscription, and fails every acknowledgement;
    /// tells when it was subscribed each time.
    struct NeverAcknowledged {
        subscribed: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
        envelope: Envelope,
    }

    #[async_trait]
    impl Subscribe for NeverAcknowledged {
        async fn subscribe(&mut self) -> Result<(), Error> {
            self.subscribed
                .lock()
                .unwrap()
                .push(std::time::Instant::now());
            Ok(())
        }
        async fn next(&mut self) -> Result<Vec<Received>, Error> {
            Ok(vec![Ok(self.envelope.clone())])
        }
        async fn ack(&mut self) -> Result<(), Error> {
            Err(Error::transport(
                "never",
                "permission denied to delete the taken rows",
            ))
        }
        async fn release(&mut self) {}
    }

    /// It brought a batch, but the broker took no acknowledgement: not a subscription that
    /// worked, whose pause starts again at 0.1 s, ten subscriptions a second for ever. On real
    /// time: the engine answers from its own thread, across which a paused clock would jump.
    #[tokio::test]
    async fn a_subscription_whose_acknowledgements_all_fail_backs_off() {
        let runtime = crate::Runtime::builder().build().unwrap();
        let subscribed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop, stopping) = watch::channel(false);
        let (state, _) = watch::channel(TransportState::Connecting { last_error: None });
        let never = NeverAcknowledged {
            subscribed: Arc::clone(&subscribed),
            envelope: Envelope::new("tests.unhandled", b"{}".to_vec()),
        };
        let consumer = consumer(&runtime, never, stopping, state);
        let watching = async {
            while subscribed.lock().unwrap().len() < 4 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            stop.send(true).unwrap();
        };
        tokio::time::timeout(
            Duration::from_secs(30),
            futures::future::join(consumer.run(), watching),
        )
        .await
        .expect("four subscriptions, then a stop");
        runtime.shutdown().await;
        let at = subscribed.lock().unwrap().clone();
        // Pauses of 0.1, 0.2 and 0.4 s between them.
        let third = at[3] - at[2];
        assert!(
            third >= Duration::from_millis(400),
            "the third pause was {third:?}"
        );
    }

    /// Subscribes, then loses its subscription, then is refused `refusals` times as a
    /// misconfigured broker refuses, then subscribes again for good.
    struct RefusedOnceItListened {
        subscriptions: Arc<AtomicUsize>,
        refusals: usize,
    }

    #[async_trait]
    impl Subscribe for RefusedOnceItListened {
        async fn subscribe(&mut self) -> Result<(), Error> {
            let made = self.subscriptions.fetch_add(1, Ordering::SeqCst);
            if (1..=self.refusals).contains(&made) {
                return Err(Error::Configuration(
                    "the broker refuses the connection".into(),
                ));
            }
            Ok(())
        }
        async fn next(&mut self) -> Result<Vec<Received>, Error> {
            if self.subscriptions.load(Ordering::SeqCst) == 1 {
                return Err(Error::transport("refusing", "connection lost"));
            }
            std::future::pending().await
        }
        async fn ack(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn release(&mut self) {}
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_after_the_consumer_listened_is_waited_out_not_final() {
        let runtime = crate::Runtime::builder().build().unwrap();
        let subscriptions = Arc::new(AtomicUsize::new(0));
        let (stop, stopping) = watch::channel(false);
        let (state, mut states) = watch::channel(TransportState::Connecting { last_error: None });
        let refusing = RefusedOnceItListened {
            subscriptions: Arc::clone(&subscriptions),
            refusals: 3,
        };
        let consumer = consumer(&runtime, refusing, stopping, state);
        let watching = async {
            let mut seen = Vec::new();
            loop {
                states.changed().await.unwrap();
                let now = states.borrow_and_update().clone();
                seen.push(now.clone());
                if subscriptions.load(Ordering::SeqCst) == 5 && now == TransportState::Listening {
                    break;
                }
                assert!(
                    !matches!(now, TransportState::Failed(_)),
                    "the consumer stopped for good: {seen:?}"
                );
            }
            stop.send(true).unwrap();
            seen
        };
        let ((), seen) = tokio::time::timeout(
            Duration::from_secs(60),
            futures::future::join(consumer.run(), watching),
        )
        .await
        .expect("the consumer listens again");
        assert!(
            seen.iter().any(|state| matches!(state,
                TransportState::Connecting { last_error: Some(error) }
                    if error.contains("refuses the connection"))),
            "{seen:?}"
        );
        runtime.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscription_that_keeps_failing_before_it_answers_backs_off() {
        // Pauses of 0.1, 0.2, 0.4, 0.8, 1.6 and 3.2 s, then 5 s each: 17 subscriptions in a
        // minute, where a pause that never grows makes 600.
        let made = subscriptions_in_a_minute(None).await;
        assert!((2..=18).contains(&made), "{made} subscriptions in a minute");
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscription_dropped_right_after_a_quiet_poll_backs_off() {
        // A listener whose connection goes as soon as it is made answers one poll with
        // nothing: it has not worked, and the pause grows as if it had failed at once.
        let made = subscriptions_in_a_minute(Some(Duration::ZERO)).await;
        assert!((2..=18).contains(&made), "{made} subscriptions in a minute");
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscription_that_stayed_up_before_it_dropped_is_made_again_after_the_first_pause() {
        // Up 5 s each time, then 0.1 s apart: twelve in a minute. Pauses growing from one
        // drop to the next (0.1, 0.2, 0.4 s…) would make nine.
        let made = subscriptions_in_a_minute(Some(WORKED_WHEN_UP_FOR)).await;
        assert!(made >= 11, "{made} subscriptions in a minute, 5.1 s apart");
    }

    /// A publishing side that takes every envelope but those of `mail.held`, which it holds
    /// (a queue that stays full), telling when it was asked for each held one and when it
    /// took each other one.
    #[derive(Clone, Default)]
    struct Holding {
        asked_for_held: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
        took: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
        asked: Arc<tokio::sync::Notify>,
    }

    #[async_trait]
    impl Publish for Holding {
        async fn publish(&mut self, envelopes: &[Envelope]) -> Result<Sent, Error> {
            let mut sent = Sent::default();
            for envelope in envelopes {
                if envelope.message_type == "mail.held" {
                    self.asked_for_held
                        .lock()
                        .unwrap()
                        .push(std::time::Instant::now());
                    sent.held
                        .push((envelope.id, "the queue is full".to_owned()));
                } else {
                    self.took.lock().unwrap().push(std::time::Instant::now());
                }
            }
            self.asked.notify_one();
            Ok(sent)
        }

        fn reset(&mut self) {}
    }

    /// A listening side that never brings anything.
    struct Quiet;

    #[async_trait]
    impl Subscribe for Quiet {
        async fn subscribe(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn next(&mut self) -> Result<Vec<Received>, Error> {
            std::future::pending().await
        }
        async fn ack(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn release(&mut self) {}
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Held;

    impl crate::Message for Held {
        const TYPE: &'static str = "mail.held";
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Taken;

    impl crate::Message for Taken {
        const TYPE: &'static str = "mail.taken";
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_envelope_the_broker_keeps_holding_is_sent_again_after_a_growing_pause() {
        let scratch = crate::testing::ScratchDatabase::sqlite();
        let store = scratch.sqlite_store().await.unwrap();
        let holding = Holding::default();
        let mut routes = Routes::default();
        routes.add("mail.held", None);
        routes.add("mail.taken", None);
        let transport = Transport {
            name: "holding",
            routes,
            home: "holding".to_owned(),
            open: Box::new({
                let holding = holding.clone();
                move |_| (Box::new(holding), Box::new(Quiet))
            }),
        };
        // Rounds every 20 ms: a row sent again each round would be asked for fifty times a
        // second.
        let runtime = crate::Runtime::builder()
            .store(store)
            .relay_interval(Duration::from_millis(20))
            .transport(transport)
            .build()
            .unwrap();
        runtime.publish(&Held).await.unwrap();
        // Others the broker takes keep coming, so that every round has rows to send.
        let traffic = async {
            loop {
                runtime.publish(&Taken).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let held_three_times = async {
            while holding.asked_for_held.lock().unwrap().len() < 3 {
                holding.asked.notified().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), async {
            tokio::select! {
                () = traffic => {}
                () = held_three_times => {}
            }
        })
        .await
        .expect("the held envelope is sent a third time");
        runtime.shutdown().await;
        let asked = holding.asked_for_held.lock().unwrap().clone();
        // Held once, it waits half a second; held twice, a second.
        let (first, second) = (asked[1] - asked[0], asked[2] - asked[1]);
        assert!(
            first >= Duration::from_millis(500),
            "{first:?} after the first"
        );
        assert!(
            second >= Duration::from_secs(1),
            "{second:?} after the second"
        );
        // Meanwhile the rows around it went out round after round.
        let took_meanwhile = holding
            .took
            .lock()
            .unwrap()
            .iter()
            .filter(|&&took| (asked[0]..asked[2]).contains(&took))
            .count();
        assert!(
            took_meanwhile >= 10,
            "{took_meanwhile} others sent while it waited"
        );
    }

    /// A listening side that never lets go of the broker as it stops.
    struct NeverLetsGo;

    #[async_trait]
    impl Subscribe for NeverLetsGo {
        async fn subscribe(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn next(&mut self) -> Result<Vec<Received>, Error> {
            std::future::pending().await
        }
        async fn ack(&mut self) -> Result<(), Error> {
            Ok(())
        }
        async fn release(&mut self) {
            std::future::pending().await
        }
    }

    /// Says it started, then never finishes.
    #[derive(Clone, Default)]
    struct Hangs(Arc<tokio::sync::Notify>);

    impl crate::Handler<Taken> for Hangs {
        async fn handle(
            &self,
            _: &Taken,
            _: &crate::MessageContext,
        ) -> Result<(), crate::HandlerError> {
            self.0.notify_one();
            std::future::pending().await
        }
    }

    /// One drain timeout bounds the whole shutdown: a transport that does not stop within it
    /// leaves the engine none of its own (both took one each before: twice the timeout).
    #[cfg(feature = "sqlite")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shutdown_takes_one_drain_timeout_however_long_a_transport_takes_to_stop() {
        let scratch = crate::testing::ScratchDatabase::sqlite();
        let store = scratch.sqlite_store().await.unwrap();
        let drain = Duration::from_secs(3);
        // It listens for what the module handles, which comes in through the runtime's own
        // `receive` here.
        let mut routes = Routes::default();
        routes.add("mail.taken", None);
        let transport = Transport {
            name: "never lets go",
            routes,
            home: "never lets go".to_owned(),
            open: Box::new(|_| (Box::new(Holding::default()), Box::new(NeverLetsGo))),
        };
        let hangs = Hangs::default();
        let runtime = crate::Runtime::builder()
            .store(store)
            .drain_timeout(drain)
            .transport(transport)
            .module(crate::Module::new("m").handle::<Taken, _>(hangs.clone()))
            .build()
            .unwrap();
        let started = hangs.0.notified();
        runtime
            .receive(
                runtime
                    .envelope(&Taken, crate::SendOptions::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        started.await;
        let began = std::time::Instant::now();
        let report = runtime.shutdown().await;
        let took = began.elapsed();
        assert_eq!(report.still_running.len(), 1);
        assert!(took >= drain, "{took:?}");
        // Twice the timeout before; the margin is for a loaded machine.
        assert!(took < drain + drain / 2, "{took:?}");
    }
}
