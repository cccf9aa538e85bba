//! The traits through which the actors reach storage and the clock.
//!
//! Adapters live in the `dacapo` crate; the actors only ever see these traits.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{AggregateError, DeadLetter, DeadLetterFilter, Envelope, Error};

/// What the inbox says of a received envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Receipt {
    /// First time seen: handle it.
    New,
    /// Already known (incoming, scheduled, or handled within the retention): discard it.
    Duplicate,
    /// Scheduled for later (its `scheduled_for` is ahead): recorded, unowned, and run by
    /// whichever node's recovery claims it when it is due.
    Scheduled,
}

/// An envelope waiting for the time it was scheduled for.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ScheduledEnvelope {
    /// The envelope.
    pub envelope: Envelope,
    /// When it is due.
    pub due_at: DateTime<Utc>,
}

impl ScheduledEnvelope {
    /// `envelope`, due at `due_at`.
    pub fn new(envelope: Envelope, due_at: DateTime<Utc>) -> Self {
        Self { envelope, due_at }
    }
}

/// A delivery a durable inbox hands back after a restart: resume it where it stopped.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Resumable {
    /// The envelope; `attempts` counts the attempts already started.
    pub envelope: Envelope,
    /// When its next attempt is due (`None`: now).
    pub due_at: Option<DateTime<Utc>>,
    /// The aggregate error of each failed attempt so far (the first and the latest 99).
    pub failures: Vec<AggregateError>,
    /// The handlers that already succeeded (`module/name`), which
    /// [`RetryScope::FailedHandlers`](crate::RetryScope::FailedHandlers) does not run again.
    pub succeeded: Vec<String>,
    /// What those handlers cascaded (outside a handler transaction), sent once the delivery
    /// is handled.
    pub cascaded: Vec<Envelope>,
}

impl Resumable {
    /// A delivery to resume.
    pub fn new(
        envelope: Envelope,
        due_at: Option<DateTime<Utc>>,
        failures: Vec<AggregateError>,
        succeeded: Vec<String>,
        cascaded: Vec<Envelope>,
    ) -> Self {
        Self {
            envelope,
            due_at,
            failures,
            succeeded,
            cascaded,
        }
    }
}

/// What a fenced write of a delivery's state found: its row was this node's, in the state the
/// write expected, and the new state is committed — or another node owns the delivery now (or
/// it was settled meanwhile), and nothing changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fenced {
    /// The new state is committed.
    Written,
    /// The row is no longer this node's to write: nothing changed.
    OwnedElsewhere,
}

impl Fenced {
    /// `Written` when `rows` rows (of one) were updated.
    pub fn from_rows(rows: u64) -> Self {
        if rows == 0 {
            Self::OwnedElsewhere
        } else {
            Self::Written
        }
    }
}

/// A failed attempt's record: the whole state a restart (or another node) resumes from.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RetryRecord<'a> {
    /// The envelope; `attempts` counts the attempts started so far.
    pub envelope: &'a Envelope,
    /// When the next attempt is due.
    pub due_at: DateTime<Utc>,
    /// Every failed attempt's aggregate error so far.
    pub failures: &'a [AggregateError],
    /// The handlers (`module/name`) that succeeded so far.
    pub succeeded: &'a [String],
    /// What they cascaded outside a handler transaction, sent once the delivery is handled.
    pub cascaded: &'a [Envelope],
}

impl<'a> RetryRecord<'a> {
    /// A failed attempt's record.
    pub fn new(
        envelope: &'a Envelope,
        due_at: DateTime<Utc>,
        failures: &'a [AggregateError],
        succeeded: &'a [String],
        cascaded: &'a [Envelope],
    ) -> Self {
        Self {
            envelope,
            due_at,
            failures,
            succeeded,
            cascaded,
        }
    }
}

/// Where a replayed dead letter goes back to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayTo {
    /// Owned by this node, which runs it at once.
    ThisNode,
    /// Unowned, for any running node's recovery to take (a tool's replay).
    AnyNode,
}

/// What a replay found.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Replay {
    /// The dead letter moved back to the inbox, fresh attempt count: its envelope.
    Replayed(Envelope),
    /// The dead letter was one the broker refused on its way out
    /// ([`DeadLetterReason::Undeliverable`](crate::DeadLetterReason::Undeliverable)): it moved
    /// back to the outbox, with the same envelope id, for the relay to send again.
    Enlisted(Envelope),
    /// No dead letter has that id.
    NotFound,
    /// The envelope is being delivered right now (an earlier replay of it runs): refused.
    InProgress,
    /// The dead letter keeps a message from a broker that could not be read as an envelope
    /// ([`DeadLetterReason::Unreadable`](crate::DeadLetterReason::Unreadable)): refused, and
    /// the letter stays. Its bytes are kept for an operator as they arrived; run as an
    /// envelope, they would be dead-lettered again for a reason that hides the first, or
    /// discarded as an unknown type.
    Unreadable,
}

/// Remembers envelope ids so that a redelivered envelope is discarded, not handled again, and
/// records each transition of a delivery's state (fenced, where rows have owners). A durable
/// inbox shared by nodes also implements [`DurableInbox`], and says so with
/// [`durable`](Inbox::durable).
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// Records `envelope` as incoming, or reports that its id is already known.
    ///
    /// The engine starts the first attempt right after, so a durable inbox records that attempt
    /// as started (`attempts + 1`): a crash from here on counts it.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer; the envelope must then not be acked.
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, Error>;

    /// [`receive`](Inbox::receive) for every envelope of `envelopes`, all or nothing: a
    /// durable inbox records them in one transaction, and on an error none is recorded. The
    /// default receives them one by one, for an inbox that cannot fail part-way (in memory):
    /// an inbox that wraps a durable one must forward this method, or a batch may be recorded
    /// in part.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer; none of the envelopes may then be acked.
    async fn receive_batch(&self, envelopes: &[Envelope]) -> Result<Vec<Receipt>, Error> {
        let mut receipts = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            receipts.push(self.receive(envelope).await?);
        }
        Ok(receipts)
    }

    /// Takes back the first attempt [`receive`](Inbox::receive) recorded for envelopes this
    /// node persisted and never started (the runtime stopped while they waited for room), so
    /// that whoever resumes them starts their first attempt, instead of taking it for one that
    /// failed. Fenced: only deliveries this node still owns, unsettled, with that one attempt
    /// counted. The default does nothing: an inbox that keeps nothing past the process has
    /// nothing to resume.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be written: those deliveries then resume as attempts
    /// that were interrupted.
    async fn never_started(&self, ids: &[Uuid]) -> Result<(), Error> {
        let _ = ids;
        Ok(())
    }

    /// Records that attempt `attempt` of envelope `id` starts, so a crash during it counts it.
    /// Fenced: [`Fenced::OwnedElsewhere`] when this node no longer owns the delivery — another
    /// node recovered it after this node's heartbeat expired, or it was settled meanwhile — and
    /// the attempt must not run. The first attempt is recorded by [`receive`](Inbox::receive).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn begin_attempt(&self, id: Uuid, attempt: u32) -> Result<Fenced, Error>;

    /// Records a failed attempt — its failures, the handlers that succeeded and what they
    /// cascaded, when the next attempt is due — in one write, so a restart during the cooldown
    /// resumes at the right time with the right count and nothing cascaded is lost. Fenced
    /// like [`begin_attempt`](Inbox::begin_attempt), and on the record's count of attempts
    /// as [`settle_handled`](Inbox::settle_handled) is.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn schedule_retry(&self, record: RetryRecord<'_>) -> Result<Fenced, Error>;

    /// Marks the envelope handled and writes `cascaded` (the messages its handlers published)
    /// to the outbox, in one transaction: they leave exactly when the delivery is recorded as
    /// handled. Fenced like [`begin_attempt`](Inbox::begin_attempt), and on `attempts`, the
    /// attempts its runner started (0 for one that started none): a record that counts more
    /// was written by another runner since, and is not overwritten. Answers `Ok(Written)`
    /// with `in_outbox` false for a store without an outbox: the engine then sends the
    /// cascades itself.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the transaction fails; nothing of it took effect.
    async fn settle_handled(
        &self,
        id: Uuid,
        attempts: u32,
        cascaded: &[Envelope],
    ) -> Result<Handled, Error>;

    /// Dead-letters the delivery in one transaction: the dead letter, the inbox row settled
    /// (a redelivery within the retention is discarded), and — with `release_claims` — the
    /// envelope's uncompleted deduplication claims released, so the logical id is free for a
    /// message that will do the work. Fenced like [`begin_attempt`](Inbox::begin_attempt), and
    /// on the letter's count of attempts as [`settle_handled`](Inbox::settle_handled) is.
    ///
    /// The inbox keeps the runtime's dead letters: the runtime lists and replays them through
    /// the same store ([`DeadLetterStore`]).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the transaction fails; nothing of it took effect.
    async fn dead_letter(&self, letter: &DeadLetter, release_claims: bool)
    -> Result<Fenced, Error>;

    /// Moves the dead letter of envelope `id` back to the inbox in one transaction, fresh
    /// attempt count, same envelope id: the dead letter is removed only if it is unchanged
    /// and the envelope is not being delivered; the inbox row is rewritten, never deleted.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the transaction fails; nothing of it took effect.
    async fn replay(&self, id: Uuid, to: ReplayTo) -> Result<Replay, Error>;

    /// Up to `limit` envelopes scheduled for later and not started, soonest first.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer, or keeps no schedule it can list (an
    /// inbox in memory, where a scheduled envelope waits in its delivery's timer).
    async fn scheduled(&self, limit: usize) -> Result<Vec<ScheduledEnvelope>, Error>;

    /// Cancels the scheduled envelope `id` if it has not started: it is settled, never run,
    /// and a redelivery within the retention is discarded. `false` when there is no such
    /// envelope waiting (unknown, started, or settled).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer, or keeps no schedule (in memory).
    async fn cancel_scheduled(&self, id: Uuid) -> Result<bool, Error>;

    /// This inbox as a [`DurableInbox`], when it is one: the runtime then recovers its
    /// deliveries, heartbeats and cleans it up. `None` (the default) for an inbox whose
    /// deliveries live and die with the process.
    fn durable(self: std::sync::Arc<Self>) -> Option<std::sync::Arc<dyn DurableInbox>> {
        None
    }

    /// [`receive`](Inbox::receive) for stores that answer without waiting (in memory): `None`
    /// means "ask the async method". The engine tries it first to spare a future per envelope.
    fn receive_now(&self, envelope: &Envelope) -> Option<Result<Receipt, Error>> {
        let _ = envelope;
        None
    }

    /// [`settle_handled`](Inbox::settle_handled) with nothing cascaded, for stores that answer
    /// without waiting; `None` means "ask the async method".
    fn mark_handled_now(&self, id: Uuid) -> Option<Result<(), Error>> {
        let _ = id;
        None
    }
}

/// What settling a handled delivery wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// Settled; `in_outbox` says whether the cascaded messages were written to the store's
    /// outbox (for the relay), or must be sent by the engine.
    Written {
        /// Whether the cascades went to the outbox.
        in_outbox: bool,
    },
    /// The row is no longer this node's: nothing changed.
    OwnedElsewhere,
}

/// What a durable inbox adds to an [`Inbox`]: each row has an owner (this node), nodes
/// heartbeat, the deliveries a stopped node left are recovered, and settled rows are removed
/// after their retention. Every method is required: a durable store that forgets one does not
/// compile, and the engine never takes a silent default for a guarantee.
#[async_trait]
pub trait DurableInbox: Inbox {
    /// Claims for this node up to `limit` deliveries left unsettled by a runtime that stopped —
    /// released at a graceful shutdown, or owned by a node whose heartbeat expired — or
    /// scheduled for later, so they resume here; only those due before `due_before` (a
    /// delivery cooling down, or scheduled, further ahead stays for a later round). Without
    /// `lapsed`, only rows no node owns (released, or scheduled): a node whose own heartbeat
    /// was interrupted claims none of another's until theirs have had time to catch up.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn recover(
        &self,
        limit: usize,
        due_before: DateTime<Utc>,
        lapsed: bool,
    ) -> Result<Vec<Resumable>, Error>;

    /// This node's own unsettled deliveries, received before `before`, that nothing in this
    /// process runs (`running` lists what does) — at most `limit`: an accept whose commit
    /// succeeded although its caller saw an error, a cancelled publish. They resume here.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn orphaned(
        &self,
        before: DateTime<Utc>,
        running: &std::collections::HashSet<Uuid>,
        limit: usize,
    ) -> Result<Vec<Resumable>, Error>;

    /// Gives up this node's deliveries received before `started_at`: a previous run under
    /// the same node name left them, and [`recover`](DurableInbox::recover) then resumes them at
    /// once. Deliveries this run received are not touched.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn release_before(&self, started_at: DateTime<Utc>) -> Result<(), Error>;

    /// Records that this node is alive; other nodes recover the deliveries of a node that
    /// stops doing so.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn heartbeat(&self) -> Result<(), Error>;

    /// How long this node may go without a heartbeat before other nodes take its deliveries
    /// over. The engine heartbeats well within it, however long its recovery interval.
    fn node_timeout(&self) -> std::time::Duration;

    /// The clock this store stamps its rows on (received, handled, heartbeats, keys): the
    /// runtime's cutoffs read it too unless the runtime is given a clock of its own.
    fn stamping_clock(&self) -> std::sync::Arc<dyn Clock>;

    /// Gives up this node's unsettled deliveries (at a graceful shutdown), so the next runtime
    /// on the store resumes them at once instead of waiting for the heartbeat to expire — all
    /// but `still_running`, whose handlers may still run: those stay this node's until its
    /// heartbeat expires, as after a crash (and the node is forgotten only when there are none).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn release(&self, still_running: &[uuid::Uuid]) -> Result<(), Error>;

    /// Deletes at most `limit` envelopes handled before `before`, and as many of the records
    /// the store keeps for settled envelopes (handler completions); returns how many rows it
    /// deleted.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn delete_handled_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error>;

    /// Forgets the nodes whose last heartbeat came before `before`: to whoever asks, a node
    /// with no heartbeat is as stopped as one whose heartbeat expired, and nodes named at
    /// random (the default), killed rather than shut down, would otherwise pile up for good.
    /// Returns how many it forgot; the default forgets none.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn forget_nodes_before(&self, before: DateTime<Utc>) -> Result<u64, Error> {
        let _ = before;
        Ok(0)
    }

    /// Deletes at most `limit` idempotency keys recorded before `before` (see
    /// `dacapo::idempotency`); returns how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn delete_idempotency_keys_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error>;
}

/// What a store that cannot enforce claims answers: for good, not to be tried again.
fn cannot_enforce() -> Error {
    Error::rejected("this store cannot enforce deduplication claims")
}

/// Keeps messages the runtime gave up on.
#[async_trait]
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Stores a dead letter, replacing one with the same envelope id.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be stored.
    async fn put(&self, dead_letter: DeadLetter) -> Result<(), Error>;

    /// The dead letters `filter` takes, oldest failure first.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, Error>;

    /// The dead letter of envelope `id`, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, Error>;

    /// Removes and returns the dead letter of envelope `id`.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, Error>;

    /// Removes the dead letter of envelope `id` if its last failure is still
    /// `last_failure_at` — the letter someone looked at, not one written since under the same
    /// id (replayed, and failed again) — and says whether it did.
    ///
    /// The default looks, removes, and puts back a letter that changed in between: a crash
    /// between the last two loses that letter. The durable stores remove it in one statement.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn remove_if_unchanged(
        &self,
        id: Uuid,
        last_failure_at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        let unchanged = |letter: &Option<DeadLetter>| {
            letter
                .as_ref()
                .is_some_and(|letter| letter.last_failure_at == last_failure_at)
        };
        if !unchanged(&self.get(id).await?) {
            return Ok(false);
        }
        let letter = self.remove(id).await?;
        if unchanged(&letter) {
            return Ok(true);
        }
        if let Some(letter) = letter {
            self.put(letter).await?;
        }
        Ok(false)
    }

    /// Removes the dead letters `filter` takes and says how many there were.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, Error>;
}

/// Wall-clock time as the engine sees it, so a harness can make it virtual.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// One claim on a logical id, by one handler, until `expires_at`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Claim {
    /// The claiming handler (`module/name`).
    pub handler: String,
    /// The envelope whose handling holds the claim (32 hex digits): if its handler crashed
    /// before completing, the same envelope's next attempt takes the claim over.
    pub envelope_id: String,
    /// The logical id, in clear, for people reading the table.
    pub key: String,
    /// The logical id's SHA-256 (hex): what the store compares, so collation never merges ids.
    pub key_hash: String,
    /// The payload's SHA-256 (hex), to tell a true duplicate from a conflicting message.
    pub fingerprint: String,
    /// When it was claimed.
    pub claimed_at: DateTime<Utc>,
    /// When the window ends and the id may be claimed again.
    pub expires_at: DateTime<Utc>,
}

impl Claim {
    /// A claim by `handler` on `key` for a message with `payload`, for `window` from `now`.
    pub fn new(
        handler: String,
        key: String,
        envelope_id: Uuid,
        payload: &[u8],
        now: DateTime<Utc>,
        window: std::time::Duration,
    ) -> Self {
        let expires_at = chrono::Duration::from_std(window)
            .ok()
            .and_then(|w| now.checked_add_signed(w))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        Self {
            handler,
            envelope_id: envelope_id.simple().to_string(),
            key_hash: crate::deduplication::sha256_hex(key.as_bytes()),
            key,
            fingerprint: crate::deduplication::sha256_hex(payload),
            claimed_at: now,
            expires_at,
        }
    }
}

impl Claim {
    /// This claim made at `now`, holding for `window` from then: a claim tried again after an
    /// outage holds its whole window from when it lands, not from its first try.
    pub(crate) fn stamped(&self, now: DateTime<Utc>, window: std::time::Duration) -> Self {
        let mut stamped = self.clone();
        stamped.claimed_at = now;
        stamped.expires_at = chrono::Duration::from_std(window)
            .ok()
            .and_then(|w| now.checked_add_signed(w))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        stamped
    }
}

/// What a store says of a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// Claimed now (first time, or over a claim whose window ended): run the handler.
    Claimed,
    /// Held by an earlier message within the window: a duplicate. `same_payload` is false when
    /// the earlier message's payload differs (a conflict, not a plain duplicate).
    Held {
        /// Whether the earlier message had the same payload.
        same_payload: bool,
    },
    /// Held and completed by this very envelope: an earlier attempt's handler committed its
    /// work (in a handler transaction) and the attempt failed after. Not a duplicate intent:
    /// the work is done, so the handler does not run again.
    Completed,
    /// Held, not completed, by this very envelope's attempt on another node that is alive (a
    /// broker delivered it to both): that attempt may still run the handler. This attempt
    /// fails, and its retry finds the claim completed, released, or taken over once that node
    /// is taken for dead.
    RunningElsewhere,
}

/// Logical deduplication claims: one per handler and logical id, within a window.
///
/// A claim is one insert that the store's primary key rejects when the id is held — never a
/// read followed by an insert — so two nodes claiming the same id at the same moment get one
/// `Claimed` between them. A store that cannot enforce claims keeps the default methods, which
/// fail loudly; none ever answers `Claimed` without enforcing it.
#[async_trait]
pub trait Claims: Send + Sync + 'static {
    /// Creates what the claims need (a table), once; called when a runtime enables
    /// deduplication.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot, [`Error::Rejected`] when this store cannot enforce
    /// claims.
    async fn provision(&self) -> Result<(), Error> {
        Err(cannot_enforce())
    }

    /// Claims `claim.key` for `claim.handler`, taking over a claim whose window ended, or one
    /// the same envelope made and never completed (its handler crashed).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer (tried again), [`Error::Rejected`] when
    /// it cannot enforce claims.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, Error> {
        let _ = claim;
        Err(cannot_enforce())
    }

    /// Releases this envelope's claim, so that a retry of a failed handler gets through; a
    /// claim another envelope took over since, or one already completed (in the handler's
    /// own transaction), is left alone.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be released.
    async fn release(&self, claim: &Claim) -> Result<(), Error> {
        let _ = claim;
        Err(cannot_enforce())
    }

    /// Records that the handler holding the claim succeeded: from now on only the window
    /// ending frees it, and a later attempt of the delivery skips the handler. What the
    /// handler cascaded in this attempt (`cascaded`) must therefore not wait for the delivery
    /// to settle: a store with an outbox enlists it there in the same write (once per
    /// envelope id) and returns `true`; `false` leaves it to the attempt, for a store that
    /// keeps nothing across a crash anyway.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded; nothing was then enlisted either.
    async fn complete(&self, claim: &Claim, cascaded: &[Envelope]) -> Result<bool, Error> {
        let _ = (claim, cascaded);
        Err(cannot_enforce())
    }

    /// Deletes at most `limit` claims whose window ended by `now`, in one transaction; returns
    /// how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn reap(&self, now: DateTime<Utc>, limit: usize) -> Result<u64, Error> {
        let _ = (now, limit);
        Ok(0)
    }

    /// How often [`keep_alive`](Claims::keep_alive) must be called, for a store that takes over
    /// the uncompleted claims of a node whose heartbeat expired; `None` (the default) for one
    /// that takes none over so.
    fn keep_alive_interval(&self) -> Option<std::time::Duration> {
        None
    }

    /// Tells the store that this node lives, so that its running claims are not taken over.
    /// The runtime calls it every [`keep_alive_interval`](Claims::keep_alive_interval) unless its
    /// recovery already beats the same store.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn keep_alive(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Forgets the nodes silent for a day (or twice the store's node timeout, if longer), on
    /// the store's own clock, as [`DurableInbox::forget_nodes_before`] does, for a store the
    /// runtime heartbeats as the claims' only. Returns how many it forgot; the default forgets
    /// none.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn forget_silent_nodes(&self) -> Result<u64, Error> {
        Ok(0)
    }
}

/// What waits in the outbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxBacklog {
    /// Envelopes enlisted and not yet published.
    pub depth: u64,
    /// When the oldest of them was enlisted.
    pub oldest_enlisted_at: Option<DateTime<Utc>>,
}

impl OutboxBacklog {
    /// A backlog of `depth` envelopes, the oldest enlisted at `oldest_enlisted_at`.
    pub fn new(depth: u64, oldest_enlisted_at: Option<DateTime<Utc>>) -> Self {
        Self {
            depth,
            oldest_enlisted_at,
        }
    }
}

/// An unpublished outbox row: its position, and its envelope or why it cannot be read.
pub type OutboxRow = (i64, Result<Envelope, Error>);

/// The relay's side of the outbox: envelopes the application enlisted in its own transactions,
/// in order, until they are published.
#[async_trait]
pub trait OutboxStore: Send + Sync + 'static {
    /// Takes (or keeps) the relay lease for this node until `until`; false while another node
    /// holds an unexpired one. One relay at a time keeps publication in outbox order.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn lease(&self, now: DateTime<Utc>, until: DateTime<Utc>) -> Result<bool, Error>;

    /// Up to `limit` unpublished envelopes positioned after `after`, oldest first, with their
    /// position. A relay reads from `i64::MIN` at the start of each round, so an envelope whose
    /// transaction committed after later positions were published is found on the next round.
    ///
    /// A row that cannot be read as an envelope (a column written by hand, say) comes as its
    /// position with the error: the relay leaves it for an operator and publishes the others.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn unpublished(&self, after: i64, limit: usize) -> Result<Vec<OutboxRow>, Error>;

    /// How many envelopes wait to be published, and since when the oldest does.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn backlog(&self) -> Result<OutboxBacklog, Error>;

    /// Deletes at most `limit` envelopes published before `before`; returns how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer.
    async fn delete_published_before(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<u64, Error>;

    /// Writes `envelopes` to the outbox in one transaction of their own, all or nothing, for
    /// the relay to publish: how a message routed to a broker is published from outside any
    /// delivery or application transaction. An envelope whose id the outbox holds already is
    /// kept once: a handler's cascades, enlisted again by its rerun after a crash, carry the
    /// ids of the first run.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the transaction fails (none was written), and by default, for an
    /// outbox that only a delivery or an application's transaction writes to.
    async fn enlist(&self, envelopes: &[Envelope]) -> Result<(), Error> {
        let _ = envelopes;
        Err(Error::store(
            "this outbox takes envelopes only within a transaction",
        ))
    }

    /// Marks the envelopes at these positions published.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when it cannot be recorded.
    async fn mark_published(&self, positions: &[i64], at: DateTime<Utc>) -> Result<(), Error>;

    /// Gives up this node's relay lease, if it holds it: another node's relay takes it at its
    /// next poll instead of once it runs out (ten of this node's polls). A shutdown calls it
    /// once its relay takes the lease no more. The default does nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot answer; the lease then runs out by itself.
    async fn release_lease(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Keeps `letter`, the dead letter of the envelope at `position` that the broker can
    /// never take, and marks that envelope published, in one transaction: a crash between the
    /// two would leave the letter beside a row still to send, which a later round may send
    /// after all (the broker's limit raised) and a replay of the letter would send again. The
    /// relay asks only an outbox that is also the runtime's dead-letter store.
    ///
    /// `false` (the default) when this store keeps no dead letters with its outbox: the relay
    /// then keeps the letter in the dead-letter store, and marks the row once it is kept.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the transaction fails (neither was written), [`Error::Rejected`]
    /// for a letter the store cannot hold.
    async fn dead_letter_unsent(
        &self,
        position: i64,
        letter: &DeadLetter,
        at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        let _ = (position, letter, at);
        Ok(false)
    }

    /// Makes every commit so far durable. The relay calls it before it sends what it read to
    /// a broker, which acts on what it receives at once: a store whose commits can be read
    /// before they are durable (SQLite's handler connections commit without an fsync of their
    /// own) syncs them here, so a power cut never takes back a row the broker already sent
    /// on. The default does nothing, for a store whose every commit is durable when it returns;
    /// a store that wraps another forwards it.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot sync; the relay then sends nothing this round.
    async fn sync(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Signals that envelopes may have been enlisted by another process or node (PostgreSQL:
    /// a `NOTIFY` sent when their transaction commits), so the relay publishes them without
    /// waiting for its next poll; `None` (the default) for a store that can only be polled.
    ///
    /// The stream owns its connection: dropping it stops listening. An `Err` item says the
    /// listening failed; the stream listens again on its next poll, and the relay pauses first.
    fn enlisted(&self) -> Option<futures::stream::BoxStream<'static, Result<(), Error>>> {
        None
    }
}

/// Where the outbox relay sends the envelopes of message types routed to a broker (another
/// node or service), instead of this node's engine.
///
/// The relay marks an envelope published only once [`send`](Outbound::send) returned `Ok`
/// for it, so `Ok` must mean the broker confirmed it (publisher confirms, a stream's ack).
#[async_trait]
pub trait Outbound: Send + Sync + 'static {
    /// Whether envelopes of `message_type` leave through this transport.
    fn carries(&self, message_type: &str) -> bool;

    /// Sends `envelopes`, in order; `Ok` once the broker confirmed every one of them but those
    /// the answer names: [`Sent::refused`], which this broker can never take, and
    /// [`Sent::held`], which it could not place now. The relay marks the others sent.
    ///
    /// # Errors
    ///
    /// [`Error::Transport`] when the broker failed (unreachable, a publication not
    /// confirmed): none of them counts as sent, and the relay sends them all again on a later
    /// round (the receiving inbox discards the copies that did arrive).
    async fn send(&self, envelopes: &[Envelope]) -> Result<Sent, Error>;
}

/// What a broker made of a batch [`Outbound::send`] sent, beyond the envelopes it confirmed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// Envelopes (by id, with why) this broker can never take (a header it cannot carry, a
    /// body over its limit), which were not sent. The relay keeps them as dead letters instead
    /// of trying them forever.
    pub refused: Vec<(Uuid, String)>,
    /// Envelopes (by id, with why) the broker took but could not place now (RabbitMQ returns
    /// one for which no queue is bound yet). The relay leaves them in the outbox and sends
    /// them again on a later round; the rest of the batch counts as sent.
    pub held: Vec<(Uuid, String)>,
}

impl Sent {
    /// Every envelope confirmed but `refused`, none held.
    pub fn refusing(refused: Vec<(Uuid, String)>) -> Self {
        Self {
            refused,
            held: Vec::new(),
        }
    }
}
