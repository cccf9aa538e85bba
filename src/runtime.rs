//! The runtime: handlers registered by modules, the engine that runs them, and the ways in.

mod builder;
mod dead_letters;

use std::sync::Arc;
use std::time::Duration;

pub use builder::RuntimeBuilder;
use dacapo_actors::ports::{DeadLetterStore, Inbox, OutboxBacklog, OutboxStore, ScheduledEnvelope};
use dacapo_actors::{
    DeliveryReport, Engine, Envelope, Message, SendOptions, ShutdownReport, StatsSnapshot,
};
pub use dead_letters::DeadLetters;
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::Error;
use crate::transport::{Host, InProcess, Routes};

/// A running dacapo runtime.
///
/// Built with [`Runtime::builder`]; it owns the engine's threads until [`Runtime::shutdown`]
/// (or drop, which stops them without draining).
///
/// ```
/// use dacapo::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct MemberRemoved { member_id: u64 }
/// # impl Message for MemberRemoved { const TYPE: &'static str = "organization.member_removed"; }
/// struct RevokeAccess;
///
/// impl Handler<MemberRemoved> for RevokeAccess {
///     async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dacapo::Error> {
/// let runtime = Runtime::builder()
///     .module(Module::new("workspaces").handle::<MemberRemoved, _>(RevokeAccess))
///     .build()?;
/// runtime.publish(&MemberRemoved { member_id: 7 }).await?;
/// let report = runtime.shutdown().await;
/// assert!(report.is_clean());
/// # Ok(())
/// # }
/// ```
pub struct Runtime {
    engine: Engine,
    transport: InProcess,
    /// What each transport carries, in the order given.
    routes: Vec<Routes>,
    /// The running transports.
    hosts: Vec<Host>,
    inbox: Arc<dyn Inbox>,
    dead_letters: Arc<dyn DeadLetterStore>,
    clock: Arc<dyn dacapo_actors::ports::Clock>,
    outbox: Option<Arc<dyn OutboxStore>>,
    max_envelope_size: usize,
    drain_timeout: Duration,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Starts configuring a runtime.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// Publishes `message` to every handler of its type. Returns the envelope id once the
    /// message is accepted (not handled).
    ///
    /// Waits while the runtime's bound of deliveries in flight is reached.
    ///
    /// # Errors
    ///
    /// A serialization failure, an envelope over the size limit (handed back), or a runtime
    /// that is shutting down; [`Error::Configuration`] for a type routed to a transport on a
    /// runtime without an outbox; and the store's errors ([`Error::Store`], retryable;
    /// [`Error::Rejected`] for a value the database refuses; [`Error::NodeHeld`]), with
    /// nothing recorded.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: cancelled while accepting, the message may or may not be delivered.
    pub async fn publish<M: Message>(&self, message: &M) -> Result<Uuid, Error> {
        self.publish_with(message, SendOptions::default()).await
    }

    /// [`publish`](Self::publish) with a deduplication id, headers or correlation id.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_with<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Uuid, Error> {
        let envelope = self.envelope(message, options)?;
        let id = envelope.id;
        self.send_envelope(envelope).await?;
        Ok(id)
    }

    /// Whether envelopes of `message_type` leave through a transport.
    fn routed(&self, message_type: &str) -> bool {
        self.routes
            .iter()
            .any(|routes| routes.carries(message_type))
    }

    /// Sends `envelope` to this node's engine, or — routed to a broker — to the outbox, for
    /// the relay to send once committed.
    async fn send_envelope(&self, envelope: Envelope) -> Result<(), Error> {
        if self.routed(&envelope.message_type) {
            return self.enlist(std::slice::from_ref(&envelope)).await;
        }
        self.transport.send(envelope, None).await
    }

    /// Writes `envelopes` to the outbox in one transaction and wakes the relay.
    async fn enlist(&self, envelopes: &[Envelope]) -> Result<(), Error> {
        let Some(outbox) = &self.outbox else {
            return Err(Error::Configuration(
                "a routed message needs the store's outbox".into(),
            ));
        };
        if let (true, Some(first)) = (self.engine.dispatcher().is_closing(), envelopes.first()) {
            return Err(Error::ShuttingDown(Box::new(first.clone())));
        }
        outbox.enlist(envelopes).await?;
        self.engine.dispatcher().wake_outbox();
        Ok(())
    }

    /// Publishes every message of `messages` in one store transaction, all or nothing — one
    /// commit (one fsync on SQLite) for the lot — and starts their deliveries; returns their
    /// envelope ids, in order, once every one is persisted and on its way: started, or, with
    /// the engine full until a shutdown's drain ended, handed back in the shutdown's report
    /// (and left to the next node in a durable store). On an error none of them is recorded.
    /// Without a durable store they are accepted one by one.
    ///
    /// # Errors
    ///
    /// A serialization failure or an envelope over the size limit (nothing is sent then), a
    /// runtime that is shutting down, or the store's failure (none recorded).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: cancelled once the batch is persisted, the deliveries not started yet
    /// are resumed by this node's orphan sweep.
    pub async fn publish_batch<M: Message>(&self, messages: &[M]) -> Result<Vec<Uuid>, Error> {
        let envelopes = messages
            .iter()
            .map(|message| self.envelope(message, SendOptions::default()))
            .collect::<Result<Vec<_>, _>>()?;
        let ids = envelopes.iter().map(|envelope| envelope.id).collect();
        if envelopes.is_empty() {
            return Ok(ids);
        }
        if self.routed(M::TYPE) {
            self.enlist(&envelopes).await?;
        } else {
            self.engine.dispatcher().dispatch_batch(envelopes).await?;
        }
        Ok(ids)
    }

    /// Publishes `message` to be handled at `at`, not at once. With a durable store it waits in
    /// the inbox, unowned, across restarts, and whichever node's recovery claims it runs it
    /// when due; it can be listed and cancelled with [`scheduled`](Self::scheduled). In memory
    /// it waits on its delivery's timer (holding a slot of
    /// [`max_in_flight`](RuntimeBuilder::max_in_flight)). A time already past runs it at once.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_at<M: Message>(
        &self,
        message: &M,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Uuid, Error> {
        self.publish_with(message, SendOptions::new().deliver_at(at))
            .await
    }

    /// [`publish_at`](Self::publish_at) `delay` from now, on the runtime's clock.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_after<M: Message>(
        &self,
        message: &M,
        delay: Duration,
    ) -> Result<Uuid, Error> {
        let at = chrono::Duration::from_std(delay)
            .ok()
            .and_then(|delay| self.clock.now().checked_add_signed(delay))
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
        self.publish_at(message, at).await
    }

    /// Envelopes scheduled for later: list them, cancel one.
    pub fn scheduled(&self) -> Scheduled<'_> {
        Scheduled { runtime: self }
    }

    /// Like [`publish`](Self::publish), but fails at the call site when no handler is
    /// registered for the type, instead of dead-lettering at receive.
    ///
    /// # Errors
    ///
    /// [`Error::NoRoute`] with the envelope, and the errors
    /// of [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn send<M: Message>(&self, message: &M) -> Result<Uuid, Error> {
        let envelope = self.envelope(message, SendOptions::default())?;
        if !self.routed(M::TYPE) && !self.engine.dispatcher().registry().handles(M::TYPE) {
            return Err(dacapo_actors::Error::NoRoute(Box::new(envelope)).into());
        }
        let id = envelope.id;
        self.send_envelope(envelope).await?;
        Ok(id)
    }

    /// Hands a received envelope to the engine, as a transport's listener does: the inbox
    /// discards it if its id is already known, otherwise every handler of its type runs.
    ///
    /// # Errors
    ///
    /// The runtime is shutting down or the inbox cannot record the envelope: it was not
    /// accepted, and a transport must not acknowledge it.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`publish`](Self::publish).
    pub async fn receive(&self, envelope: Envelope) -> Result<(), Error> {
        self.transport.send(envelope, None).await
    }

    /// [`receive`](Self::receive), returning a channel that yields the report once the
    /// delivery settles (handled, dead-lettered or discarded).
    ///
    /// # Errors
    ///
    /// As [`receive`](Self::receive).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`publish`](Self::publish).
    pub async fn receive_tracked(
        &self,
        envelope: Envelope,
    ) -> Result<oneshot::Receiver<DeliveryReport>, Error> {
        let (reply, report) = oneshot::channel();
        self.transport.send(envelope, Some(reply)).await?;
        Ok(report)
    }

    /// The envelope `message` would travel in.
    ///
    /// # Errors
    ///
    /// A serialization failure, or an envelope over the size limit (handed back).
    pub fn envelope<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<Envelope, Error> {
        envelope_under(
            self.engine.dispatcher().deduplication_rules(),
            self.max_envelope_size,
            message,
            options,
        )
    }

    /// How this runtime makes the envelopes its outbox takes, for code that enlists outside
    /// it: the HTTP layer's request transactions
    /// ([`IdempotencyLayer::runtime`](crate::http::IdempotencyLayer::runtime)).
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
    pub fn enlisting(&self) -> crate::outbox::Enlisting {
        crate::outbox::Enlisting {
            dispatcher: self.engine.dispatcher().clone(),
            max_envelope_size: self.max_envelope_size,
        }
    }

    /// The outbox as this runtime sees it: enlisting applies the runtime's deduplication
    /// rules, and committing through it wakes the relay at once instead of at its next poll.
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
    pub fn outbox(&self) -> crate::outbox::RuntimeOutbox<'_> {
        crate::outbox::RuntimeOutbox::new(self)
    }

    /// Wakes the outbox relay: envelopes were just committed to the outbox.
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub(crate) fn wake_outbox(&self) {
        self.engine.dispatcher().wake_outbox();
    }

    /// A listener for a transport to hand received envelopes to: it acknowledges nothing the
    /// store has not recorded, and waits out store failures with backoff.
    pub fn listener(&self) -> crate::transport::Listener {
        crate::transport::Listener::new(
            self.transport.clone(),
            Arc::clone(&self.dead_letters),
            Arc::clone(&self.clock),
        )
    }

    /// Waits until every transport listens on its broker (connected, topology declared or
    /// checked, consuming); at once without transports. A transport that cannot reach its
    /// broker keeps trying with backoff, and this keeps waiting: bound it with a timeout.
    ///
    /// # Errors
    ///
    /// [`Error::Configuration`] when a transport stopped for good first: a topology it was
    /// asked only to check is missing, or declared otherwise; [`Error::TransportStopped`] once
    /// the runtime shut down. Neither is retryable.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn listening(&self) -> Result<(), Error> {
        for host in &self.hosts {
            host.listening().await?;
        }
        Ok(())
    }

    /// Each transport's name (`rabbitmq`, `nats`, `postgres-queue`) and where its listening
    /// stands: for a health check, or to see a broker outage.
    pub fn transports(&self) -> Vec<(&'static str, crate::transport::TransportState)> {
        self.hosts.iter().map(Host::state).collect()
    }

    /// The dead letters: list, inspect, replay, purge.
    pub fn dead_letters(&self) -> DeadLetters<'_> {
        DeadLetters::new(self)
    }

    /// Waits until every accepted delivery has settled (handled, dead-lettered or discarded),
    /// retries included, and — with a durable store — until the outbox is empty, so the
    /// messages deliveries cascaded through it have been published and settled too. A message
    /// routed to a broker counts as done here once the broker confirmed it: its handling,
    /// wherever it is consumed, is not waited for. An envelope that stays in the outbox — one
    /// no broker queue takes yet, or a row that cannot be read — keeps it waiting, and so does
    /// a store that cannot say what waits there (an outage): bound it with a timeout where
    /// that can happen.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn idle(&self) {
        let mut unknown = false;
        loop {
            self.engine.dispatcher().idle().await;
            let Some(outbox) = &self.outbox else { return };
            // The relay publishes before it marks, so once the outbox is empty whatever it
            // published is already counted as in flight: wait for that, then look again.
            match outbox.backlog().await {
                Ok(backlog) if backlog.depth == 0 => {
                    self.engine.dispatcher().idle().await;
                    if matches!(outbox.backlog().await, Ok(b) if b.depth == 0) {
                        return;
                    }
                }
                // Rows another writer enlisted (`Outbox::enlist` in the application's own
                // transaction) wake no relay on SQLite, which has no notifications: woken here,
                // it does not wait for its next poll (which a virtual clock may never reach).
                Ok(_) => {
                    self.engine.dispatcher().wake_outbox();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                // Not idle as far as known: what waits there is still to be published.
                Err(error) => {
                    if !std::mem::replace(&mut unknown, true) {
                        tracing::warn!(%error, "idle: the outbox backlog is unknown; waiting for the store");
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// What waits in the outbox (`None` without a durable store): its depth and the age of
    /// its oldest envelope. The relay also logs it, and warns when it is too old.
    ///
    /// # Errors
    ///
    /// The store's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn outbox_backlog(&self) -> Result<Option<OutboxBacklog>, Error> {
        match &self.outbox {
            Some(outbox) => Ok(Some(outbox.backlog().await?)),
            None => Ok(None),
        }
    }

    /// What the engine did so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.engine.dispatcher().stats().snapshot()
    }

    /// Stops accepting messages, lets deliveries in flight finish (up to the drain timeout),
    /// and stops the engine. Retries still waiting for their cooldown are not dropped: they
    /// are logged and handed back in the report, envelopes included, as are messages cascaded
    /// by handled deliveries that had not started. A durable store hands this node's unsettled
    /// deliveries to whichever node claims them next — but not those still running at the
    /// drain's end: named in the report and stopped where they stand, as a crash would stop
    /// them (a handler that holds its thread, synchronous work, holds the shutdown until it
    /// returns), they stay this node's until its heartbeat expires, so none runs on two nodes
    /// at once.
    ///
    /// Once it returned, calling it again does nothing and reports nothing.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: once polled, the runtime refuses new messages.
    pub async fn shutdown(&self) -> ShutdownReport {
        // Brokers first: what they delivered and the inbox did not record goes back to them.
        // One drain timeout for all: the engine's drain gets what the transports left of it.
        let now = tokio::time::Instant::now();
        // A timeout too long to add (`Duration::MAX`, "wait for ever") is a century.
        let deadline = now
            .checked_add(self.drain_timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600));
        // All told at once, and waited for together: one slow to stop takes none of the
        // others' time.
        let stopped = futures::future::join_all(self.hosts.iter().map(Host::stop_listening));
        if tokio::time::timeout_at(deadline, stopped).await.is_err() {
            tracing::warn!("a transport did not stop listening within the drain timeout");
        }
        let drain = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.engine.shutdown(drain).await
    }

    /// Returns once the node's first recovery round is over — with the rounds that go on
    /// where the engine's capacity cut it short: what an earlier run under this node's id left
    /// unsettled (a crash, a `kill -9`) is resumed by then, so [`idle`](Self::idle) waits for
    /// it too. A service that reports on its own work starts with both, as the main job does.
    /// Not included: a retry due later than one recovery interval (a long cooldown) is resumed
    /// when it falls due. Returns at once without a durable store. A round the store refused
    /// (down, or the node id held by another process) does not count: it is logged and tried
    /// again, after 100 ms and then twice as long each time up to the recovery interval, so
    /// this waits for as long as the store does (or until a shutdown begins): bound it with a
    /// timeout if the store may stay down.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn first_recovery(&self) {
        self.engine.first_recovery().await;
    }
}

#[cfg(feature = "testing")]
impl Runtime {
    /// Stops the engine at once, as a killed process: no drain, no release.
    pub(crate) async fn kill(&self) {
        self.engine.kill().await;
    }

    /// [`receive_tracked`](Self::receive_tracked) while the harness holds `held` on the
    /// virtual clock, given up if the envelope must wait for capacity.
    pub(crate) async fn receive_tracked_holding(
        &self,
        envelope: Envelope,
        held: &mut Option<dacapo_actors::Busy>,
    ) -> Result<oneshot::Receiver<DeliveryReport>, Error> {
        let (reply, report) = oneshot::channel();
        self.transport
            .send_holding(envelope, Some(reply), held)
            .await?;
        Ok(report)
    }
}

/// The runtime's scheduled envelopes: those published for a later time and not started.
#[derive(Debug)]
pub struct Scheduled<'a> {
    runtime: &'a Runtime,
}

impl Scheduled<'_> {
    /// Up to `limit` scheduled envelopes, soonest first.
    ///
    /// # Errors
    ///
    /// The store's failure, or an inbox that keeps no schedule (in memory; not retryable).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn list(&self, limit: usize) -> Result<Vec<ScheduledEnvelope>, Error> {
        Ok(self.runtime.inbox.scheduled(limit).await?)
    }

    /// Cancels the scheduled envelope `id` if it has not started; `false` when no such
    /// envelope waits (unknown, already started, or settled). A cancelled envelope is settled
    /// without running, and a redelivery of it within the retention is discarded.
    ///
    /// # Errors
    ///
    /// The store's failure, or an inbox that keeps no schedule (in memory; not retryable).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, it may or may not have cancelled; ask [`list`](Self::list).
    pub async fn cancel(&self, id: Uuid) -> Result<bool, Error> {
        Ok(self.runtime.inbox.cancel_scheduled(id).await?)
    }
}

/// The envelope `message` travels in under a runtime's deduplication `rules` and size limit.
pub(crate) fn envelope_under<M: Message>(
    rules: &dacapo_actors::DeduplicationRules,
    max_envelope_size: usize,
    message: &M,
    options: SendOptions,
) -> Result<Envelope, Error> {
    let mut envelope = Envelope::for_message(message).map_err(dacapo_actors::Error::from)?;
    options.apply(&mut envelope);
    rules.apply(message, &mut envelope);
    let size = envelope.size();
    if size > max_envelope_size {
        return Err(dacapo_actors::Error::TooLarge {
            envelope: Box::new(envelope),
            size,
            limit: max_envelope_size,
        }
        .into());
    }
    Ok(envelope)
}
