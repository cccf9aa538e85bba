use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};
use futures::StreamExt;

use crate::batches::delete_in_batches;
use crate::ports::{DeadLetterStore, Outbound, OutboxRow, OutboxStore, Sent};
use crate::{DeadLetter, DeadLetterReason, Dispatcher, Durability, Envelope};

/// Publishes what the application enlisted in its outbox: in outbox order, in bounded batches,
/// marking each batch published once it is accepted. A crash between publishing and marking
/// publishes the same envelopes again; the receiving inbox discards them by envelope id.
pub struct RelayActor {
    outbox: Arc<dyn OutboxStore>,
    /// The broker that message types routed away from this node leave through.
    outbound: Option<Arc<dyn Outbound>>,
    /// Where an envelope the broker can never take is kept instead.
    dead_letters: Option<Arc<dyn DeadLetterStore>>,
    /// Whether `outbox` is the dead-letter store too, and keeps a letter in the transaction
    /// that marks its row.
    letters_with_outbox: bool,
    dispatcher: Dispatcher,
    interval: Duration,
    batch: usize,
    retention: Duration,
    warn_after: Duration,
    busy: bool,
    /// Another node held the lease at the last round: wakes are its business until then, and
    /// only this relay's own polls try for the lease (so a burst of enlists elsewhere does not
    /// make every node contend for the lease row).
    leased_elsewhere_until: Option<tokio::time::Instant>,
    /// When this relay last took the lease: a round within the first half of it publishes
    /// without writing the lease again (on SQLite a write is an fsync).
    lease_taken_at: Option<TakenAt>,
    /// A wake came during a round, which may have read the outbox before the enlist
    /// committed: run another round right after.
    again: bool,
    /// Wakes that came during the current round: left to the lease holder if the round finds
    /// that another node holds the lease.
    wakes_during_round: u64,
    /// Positions of rows that could not be read: told once, and no reason to take the lease.
    unreadable: Arc<Mutex<HashSet<i64>>>,
    /// Rows the broker could not take lately, waiting out a backoff before they are sent again.
    held_back: Arc<Mutex<HeldBack>>,
    /// Where a round whose local rows wait for room goes on looking for the broker's rows:
    /// after the batches the last such round read (each reads a bounded number); none once one
    /// read to the end.
    broker_scan_from: Arc<Mutex<Option<i64>>>,
}

/// How often the relay measures its backlog and removes old published rows.
const HOUSEKEEPING: Duration = Duration::from_secs(5);

/// A deadline that never comes in practice.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

impl std::fmt::Debug for RelayActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayActor")
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl RelayActor {
    pub(crate) fn new(
        outbox: Arc<dyn OutboxStore>,
        outbound: Option<Arc<dyn Outbound>>,
        dead_letters: Option<Arc<dyn DeadLetterStore>>,
        dispatcher: Dispatcher,
        settings: Durability,
    ) -> Self {
        let letters_with_outbox = dead_letters
            .as_ref()
            .is_some_and(|letters| std::ptr::addr_eq(Arc::as_ptr(letters), Arc::as_ptr(&outbox)));
        Self {
            outbox,
            outbound,
            dead_letters,
            letters_with_outbox,
            dispatcher,
            interval: settings.relay_interval,
            batch: settings.relay_batch.max(1),
            retention: settings.outbox_retention,
            warn_after: settings.outbox_warn_after,
            busy: false,
            leased_elsewhere_until: None,
            lease_taken_at: None,
            again: false,
            wakes_during_round: 0,
            unreadable: Arc::default(),
            held_back: Arc::default(),
            broker_scan_from: Arc::default(),
        }
    }

    /// Reports the backlog (a warning when its oldest envelope waits too long) and removes
    /// published rows past their retention, in bounded batches.
    fn housekeeping(&mut self, ctx: &mut Context<Self>) {
        let (outbox, clock) = (
            Arc::clone(&self.outbox),
            Arc::clone(&self.dispatcher.shared.clock),
        );
        let (retention, warn_after) = (self.retention, self.warn_after);
        let work = async move {
            let now = clock.now();
            match outbox.backlog().await {
                Ok(backlog) => {
                    let age = backlog
                        .oldest_enlisted_at
                        .map(|at| (now - at).to_std().unwrap_or_default());
                    tracing::debug!(
                        outbox.depth = backlog.depth,
                        outbox.oldest_age_ms = age.map(|a| a.as_millis() as u64),
                        "outbox backlog"
                    );
                    if let Some(age) = age.filter(|age| *age > warn_after) {
                        tracing::warn!(
                            outbox.depth = backlog.depth,
                            outbox.oldest_age_ms = age.as_millis() as u64,
                            "the outbox backlog is older than it should be: is the relay stuck?"
                        );
                    }
                }
                Err(error) => tracing::warn!(%error, "measuring the outbox backlog failed"),
            }
            let keep = chrono::Duration::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
            let before = now
                .checked_sub_signed(keep)
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
            let (removed, error) =
                delete_in_batches(1000, |limit| outbox.delete_published_before(before, limit))
                    .await;
            if let Some(error) = error {
                tracing::warn!(%error, "removing published outbox rows failed");
            }
            if removed > 0 {
                tracing::info!(
                    removed,
                    "removed published outbox rows past their retention"
                );
            }
        };
        ctx.spawn(work.into_actor(self));
    }

    /// Counts `wakes` left to the node holding the lease.
    fn deferred(&self, wakes: u64) {
        self.dispatcher
            .shared
            .stats
            .dispatching()
            .add(crate::stats::Counter::RelayWakeDeferred, wakes);
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            self.again = true;
            return;
        }
        self.busy = true;
        self.again = false;
        let (outbox, dispatcher) = (Arc::clone(&self.outbox), self.dispatcher.clone());
        let outbound = self.outbound.clone();
        let dead_letters = self.dead_letters.clone();
        let letters_with_outbox = self.letters_with_outbox;
        let lease_taken_at = self.lease_taken_at;
        let (batch, interval) = (self.batch, self.interval);
        let unreadable = Arc::clone(&self.unreadable);
        let held_back = Arc::clone(&self.held_back);
        let broker_scan_from = Arc::clone(&self.broker_scan_from);
        // The round holds a virtual clock until it is done (the token goes with the round's
        // future, in the same poll as the map below marks it over): an `advance` past its tick
        // returns with what it published sent and marked. It gives the token up while an
        // envelope waits for the engine's room.
        let busy = self.dispatcher.shared.timers.busy();
        let round = async move {
            let mut busy = Some(busy);
            // An idle node writes nothing: a read finds the outbox empty — but for rows known
            // to be unreadable — before any lease is taken (on SQLite a lease is a commit, so
            // an fsync, every poll).
            let known = lock(&unreadable).len() + {
                let mut held_back = held_back.lock().unwrap_or_else(PoisonError::into_inner);
                // Once a round, not once a batch: a pass over every row held.
                held_back.forget_stale(tokio::time::Instant::now());
                held_back.len()
            };
            match outbox.unpublished(i64::MIN, known + 1).await {
                Ok(rows)
                    if rows.iter().all(|(at, envelope)| {
                        (envelope.is_err() && lock(&unreadable).contains(at))
                            || held_back
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .waiting(*at, tokio::time::Instant::now())
                    }) =>
                {
                    return (None, lease_taken_at);
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "reading the outbox failed; retrying on the next round");
                    return (None, lease_taken_at);
                }
            }
            // Once a shutdown's drain is over the lease is given up, and not taken again.
            if dispatcher
                .shared
                .drain_over
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                return (None, None);
            }
            let mut lease = Lease::new(
                Arc::clone(&outbox),
                &dispatcher,
                interval.saturating_mul(10),
            );
            lease.taken_at = lease_taken_at;
            if lease.half_gone() {
                match lease.take().await {
                    Ok(true) => {}
                    Ok(false) => return (Some(lease.length), None),
                    Err(error) => {
                        tracing::warn!(%error, "outbox lease failed; retrying on the next round");
                        return (None, None);
                    }
                }
            }
            // Nothing was read before it: the round's rows are read under this lease.
            lease.rows_may_be_stale();
            let mut published = 0usize;
            let mut lost = false;
            // The broker failed this round: its rows wait for the next, the local ones go on.
            let mut broker_failed = false;
            // The engine had no room for a local row within a poll: the round's later batches
            // send only their broker rows, and the local ones wait for the next round.
            let mut local_blocked = false;
            // Batches read on since, for the broker's rows alone.
            let mut blocked_batches = 0usize;
            // The last batch's positions, marked while the next batch is published and the
            // one after it read: the broker's confirms, the mark's commit and the read overlap.
            let mut unmarked: Vec<i64> = Vec::new();
            let mut next = outbox.unpublished(i64::MIN, batch).await;
            loop {
                let rows = match std::mem::replace(&mut next, Ok(Vec::new())) {
                    Ok(rows) => rows,
                    Err(error) => {
                        tracing::warn!(%error, "reading the outbox failed; retrying on the next round");
                        break;
                    }
                };
                let count = rows.len();
                // A full batch may have more behind it: the next read starts after everything
                // this one read (the broker's rows and unreadable ones included, sent or not).
                let read_after = rows
                    .iter()
                    .map(|(position, _)| *position)
                    .max()
                    .filter(|_| count == batch);
                let rows = readable(rows, &unreadable);
                // What leaves for a broker goes in one confirmed send, before the local rows.
                // A failed send marks none of it; the round goes on with the local rows, and
                // reads on past the broker's rows without sending them again until the next.
                let (away, rows) = split_by_route(rows, outbound.as_deref());
                let away: Rows = {
                    let held_back = held_back.lock().unwrap_or_else(PoisonError::into_inner);
                    let now = tokio::time::Instant::now();
                    away.into_iter()
                        .filter(|(at, _)| !held_back.waiting(*at, now))
                        .collect()
                };
                let broker = match outbound.as_deref() {
                    Some(outbound) if !away.is_empty() && !broker_failed => Some(outbound),
                    _ => None,
                };
                if broker.is_some() && lease.half_gone() && !renewed(&mut lease, &mut lost).await {
                    break;
                }
                // This batch was read before the lease ran out (the node paused, say): read
                // again on the next round, under the lease taken now, what is still to send.
                if lease.rows_may_be_stale() {
                    break;
                }
                let this_batch = async {
                    let mut positions = Vec::with_capacity(count);
                    let mut sent_all = true;
                    if let Some(outbound) = broker {
                        let sending = send_away(
                            outbox.as_ref(),
                            outbound,
                            away,
                            Letters {
                                store: dead_letters.as_deref(),
                                with_outbox: letters_with_outbox,
                            },
                            dispatcher.shared.clock.as_ref(),
                        );
                        match lease.kept_while(sending).await {
                            Ok(Some((sent, held))) => {
                                let mut held_back =
                                    held_back.lock().unwrap_or_else(PoisonError::into_inner);
                                held_back.held(&held, tokio::time::Instant::now());
                                held_back.sent(&sent);
                                positions.extend(sent);
                            }
                            Ok(None) => broker_failed = true,
                            Err(kept) => {
                                // Given up: the copies that did arrive are discarded by the
                                // receiving inbox.
                                tracing::warn!(
                                    "the outbox lease could not be kept while the broker confirmed; retrying on the next round"
                                );
                                broker_failed = true;
                                lost |= kept == Kept::Lost;
                            }
                        }
                    }
                    for (position, envelope) in rows {
                        if local_blocked {
                            break;
                        }
                        // Room first, then the lease: a wait for room can outlast the lease,
                        // and rows read under a lease that ran out may have been published
                        // (and handled, and forgotten past the inbox's retention) by the node
                        // that took it next; they are read again on the next round.
                        let room = if let Some(room) = dispatcher.shared.capacity.try_acquire() {
                            Some(room)
                        } else if outbound.is_some() && !broker_failed {
                            // Rows for a broker may come in later batches: an engine that
                            // stays full (its deliveries cooling down through an outage) holds
                            // them back no longer than a poll — on the engine's clock, whose
                            // wake hands the round a token of its own under a harness.
                            let poll = dispatcher.shared.timers.sleep_for(interval, None);
                            let mut woke = None;
                            let room = tokio::select! {
                                biased;
                                room = dispatcher.room(&mut busy) => room,
                                token = poll => {
                                    woke = Some(token);
                                    None
                                }
                            };
                            if let Some(token) = woke {
                                local_blocked = true;
                                busy.get_or_insert(token);
                                break;
                            }
                            room
                        } else {
                            dispatcher.room(&mut busy).await
                        };
                        let Some(room) = room else {
                            sent_all = false;
                            break;
                        };
                        // Given up while the envelope waited for room, which only the clock
                        // moving on (a cooldown ending) may free: held again from here.
                        if busy.is_none() {
                            busy = Some(dispatcher.shared.timers.busy());
                        }
                        // Renewed once half of it has passed, checked before each publication:
                        // a long round keeps the lease, a relay paused past it learns it lost
                        // it before publishing more, and two nodes never publish the same rows
                        // side by side.
                        if lease.half_gone() && !renewed(&mut lease, &mut lost).await {
                            sent_all = false;
                            break;
                        }
                        // A lease that ran out (while the engine had no room, while the broker
                        // confirmed, while the node was paused) and was taken again: this row
                        // is published only if no other node published it meanwhile, and the
                        // rest of the batch is read again on the next round. Not dropped with
                        // its room: an engine full for longer than a lease would otherwise
                        // keep every row of the outbox waiting.
                        let mut last_of_round = false;
                        if lease.rows_may_be_stale() {
                            match outbox.unpublished(position.saturating_sub(1), 1).await {
                                Ok(next) if next.first().is_some_and(|(at, _)| *at == position) => {
                                    last_of_round = true;
                                }
                                Ok(_) => {
                                    sent_all = false;
                                    break;
                                }
                                Err(error) => {
                                    tracing::warn!(%error, "reading the outbox failed; retrying on the next round");
                                    sent_all = false;
                                    break;
                                }
                            }
                        }
                        let id = envelope.id;
                        // Not cut short: a publication cancelled inside the inbox's write could
                        // leave its row recorded with nothing running it.
                        let dispatched = dispatcher.dispatch_in(envelope, room, &mut busy).await;
                        if let Err(error) = dispatched {
                            tracing::warn!(messaging.message.id = %id, %error, "publishing from the outbox failed; retrying on the next round");
                            sent_all = false;
                            break;
                        }
                        positions.push(position);
                        if last_of_round {
                            sent_all = false;
                            break;
                        }
                    }
                    positions.sort_unstable();
                    (positions, sent_all)
                };
                let read_ahead = async {
                    match read_after {
                        Some(after) => Some(outbox.unpublished(after, batch).await),
                        None => None,
                    }
                };
                // The crash point between publishing a batch and marking it comes before the
                // next batch goes out, as it would without the overlap.
                before_mark(&dispatcher, &unmarked).await;
                // The mark and the read hold the clock on their own: the batch beside them
                // gives the round's token up while an envelope waits for room.
                let beside = dispatcher.shared.timers.busy();
                let ((positions, sent_all), (marked, read)) = futures::join!(this_batch, async {
                    let beside = beside;
                    let done = futures::join!(
                        mark(outbox.as_ref(), &dispatcher, std::mem::take(&mut unmarked)),
                        read_ahead,
                    );
                    drop(beside);
                    done
                });
                unmarked = positions;
                match marked {
                    Ok(count) => published += count,
                    Err(error) => {
                        // Published but not marked: the next round publishes them again, and
                        // the inbox discards them. This batch's mark is still tried below.
                        tracing::warn!(%error, "marking outbox envelopes published failed");
                        break;
                    }
                }
                // A full batch whose local rows all went out, or were left for the next round
                // while a broker may take the rows after them: read on.
                match read {
                    Some(read) if sent_all && !(local_blocked && broker_failed) => {
                        next = read;
                        if local_blocked {
                            blocked_batches += 1;
                            // Where the last such round stopped, past what this one read; or,
                            // past the bound, where the next one goes on from.
                            let ahead = {
                                let mut scan_from = broker_scan_from
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner);
                                if blocked_batches > BLOCKED_SCAN_BATCHES {
                                    *scan_from = read_after;
                                    None
                                } else {
                                    scan_from.filter(|from| {
                                        read_after.is_some_and(|after| *from > after)
                                    })
                                }
                            };
                            if blocked_batches > BLOCKED_SCAN_BATCHES {
                                break;
                            }
                            if blocked_batches == 1
                                && let Some(from) = ahead
                            {
                                next = outbox.unpublished(from, batch).await;
                            }
                        }
                    }
                    _ => {
                        if local_blocked {
                            // Read to the end (or stopped): the next such round reads from
                            // the start.
                            *broker_scan_from
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner) = None;
                        }
                        break;
                    }
                }
            }
            if !local_blocked {
                *broker_scan_from
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = None;
            }
            // What was published is marked even after the lease was lost: the new holder then
            // does not publish it again.
            before_mark(&dispatcher, &unmarked).await;
            match mark(outbox.as_ref(), &dispatcher, unmarked).await {
                Ok(count) => published += count,
                // Published but not marked: the next round publishes them again, and the
                // inbox discards them.
                Err(error) => tracing::warn!(%error, "marking outbox envelopes published failed"),
            }
            if published > 0 {
                tracing::debug!(published, "outbox envelopes published");
            }
            if lost {
                tracing::info!(
                    published,
                    "outbox lease taken by another node; this relay stops"
                );
                return (Some(lease.length), None);
            }
            (None, lease.taken_at)
        };
        ctx.spawn(
            round
                .into_actor(self)
                .map(move |(elsewhere, taken_at), actor, ctx| {
                    actor.busy = false;
                    actor.lease_taken_at = taken_at;
                    // A lease too long to add to the clock is waited out as if for ever.
                    actor.leased_elsewhere_until = elsewhere.map(|lease| {
                        let now = tokio::time::Instant::now();
                        now.checked_add(lease).unwrap_or(now + FAR_FUTURE)
                    });
                    let wakes = std::mem::take(&mut actor.wakes_during_round);
                    if elsewhere.is_some() {
                        actor.deferred(wakes);
                    } else if actor.again {
                        actor.tick(ctx);
                    }
                }),
        );
    }
}

/// The crash point between publishing `positions` and marking them, when there are any.
async fn before_mark(dispatcher: &Dispatcher, positions: &[i64]) {
    if !positions.is_empty() {
        dispatcher
            .shared
            .pass(crate::Failpoint::BeforeOutboxMark, None)
            .await;
    }
}

/// Marks `positions` published; how many it marked.
async fn mark(
    outbox: &dyn OutboxStore,
    dispatcher: &Dispatcher,
    positions: Vec<i64>,
) -> Result<usize, crate::Error> {
    if positions.is_empty() {
        return Ok(0);
    }
    outbox
        .mark_published(&positions, dispatcher.shared.clock.now())
        .await?;
    Ok(positions.len())
}

/// Sends the rows routed to the broker, once the outbox made them durable (a broker acts on
/// what it receives: a row it sent on must never be taken back by a power cut); the positions
/// to mark — those the broker confirmed, and those it can never take once their dead letter is
/// kept — and those it held. `None` when the sync or the send failed: none is marked, and the
/// next round sends them again.
async fn send_away(
    outbox: &dyn OutboxStore,
    outbound: &dyn Outbound,
    away: Rows,
    letters: Letters<'_>,
    clock: &dyn crate::ports::Clock,
) -> Option<(Vec<i64>, Vec<i64>)> {
    if let Err(error) = outbox.sync().await {
        tracing::warn!(%error, "making the outbox durable before sending to the broker failed; retrying on the next round");
        return None;
    }
    let (positions, envelopes): (Vec<i64>, Vec<Envelope>) = away.into_iter().unzip();
    let Sent { refused, held, .. } = match outbound.send(&envelopes).await {
        Ok(sent) => sent,
        Err(error) => {
            tracing::warn!(%error, envelopes = envelopes.len(), "sending outbox envelopes to the broker failed; retrying on the next round");
            return None;
        }
    };
    if let Some((id, why)) = held.first() {
        // Told once a batch: a transport down for a while holds every row it carries, each
        // round.
        tracing::warn!(held = held.len(), first = %id, %why, "the broker could not take some envelopes now; they stay in the outbox for a later round");
    }
    let mut marked = Vec::with_capacity(positions.len());
    let mut kept_back = Vec::with_capacity(held.len());
    for (position, envelope) in positions.into_iter().zip(envelopes) {
        if held.iter().any(|(id, _)| *id == envelope.id) {
            // Left unmarked, so the rest of its batch is marked and never sent again.
            kept_back.push(position);
            continue;
        }
        let Some((_, why)) = refused.iter().find(|(id, _)| *id == envelope.id) else {
            marked.push(position);
            continue;
        };
        tracing::error!(messaging.message.id = %envelope.id, %why, "the broker can never take this envelope; it goes to the dead letters");
        let Some(dead_letters) = letters.store else {
            continue;
        };
        let now = clock.now();
        let letter =
            DeadLetter::rejected(envelope, DeadLetterReason::Undeliverable(why.clone()), now);
        let kept = if letters.with_outbox {
            outbox.dead_letter_unsent(position, &letter, now).await
        } else {
            Ok(false)
        };
        // Kept and marked together, or kept first and marked with the batch.
        let kept = match kept {
            Ok(true) => Ok(()),
            Ok(false) => dead_letters
                .put(letter)
                .await
                .map(|()| marked.push(position)),
            Err(error) => Err(error),
        };
        if let Err(error) = kept {
            tracing::warn!(%error, "keeping an undeliverable envelope failed; retrying on the next round");
        }
    }
    Some((marked, kept_back))
}

/// Where the relay keeps the dead letters of rows no broker takes.
#[derive(Clone, Copy)]
struct Letters<'a> {
    /// The runtime's dead-letter store; none keeps nothing (the row stays, and is sent again).
    store: Option<&'a dyn DeadLetterStore>,
    /// Whether that store is the outbox itself, which keeps a letter and marks its row in one
    /// transaction.
    with_outbox: bool,
}

/// Outbox rows: each envelope with its position.
type Rows = Vec<(i64, Envelope)>;

/// The rows that can be read; one that cannot is left unpublished for an operator rather
/// than holding back every row after it, told once as an error (the backlog's warning goes on
/// showing its age). Repaired, it goes out in a later round, after the rows behind it.
fn readable(rows: Vec<OutboxRow>, unreadable: &Mutex<HashSet<i64>>) -> Rows {
    rows.into_iter()
        .filter_map(|(position, envelope)| match envelope {
            Ok(envelope) => {
                let mut known = lock(unreadable);
                if !known.is_empty() {
                    known.remove(&position);
                }
                Some((position, envelope))
            }
            Err(error) => {
                if lock(unreadable).insert(position) {
                    tracing::error!(position, %error, "an outbox row cannot be read; it is left unpublished for an operator");
                }
                None
            }
        })
        .collect()
}

fn lock(unreadable: &Mutex<HashSet<i64>>) -> std::sync::MutexGuard<'_, HashSet<i64>> {
    unreadable.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Splits a batch of outbox rows into those routed to `outbound` and those for this node.
fn split_by_route(rows: Rows, outbound: Option<&dyn Outbound>) -> (Rows, Rows) {
    match outbound {
        Some(outbound) => rows
            .into_iter()
            .partition(|(_, envelope)| outbound.carries(&envelope.message_type)),
        None => (Vec::new(), rows),
    }
}

/// Rows the broker held (a nack, a subject no stream captures, a transport down while
/// another is up), by position: each is sent again after a pause that grows with each hold,
/// instead of every round.
#[derive(Debug, Default)]
struct HeldBack {
    rows: HashMap<i64, (u32, tokio::time::Instant)>,
}

/// The pause before a held row is sent again, by how many times in a row it was held. At
/// most the longest pause of a transport reconnecting: rows a full queue held wait no longer
/// for a slot than rows of a broker that was down, though newer rows, sent at once, may still
/// take the slots before them.
const HELD_BACK: crate::Backoff =
    crate::Backoff::new(Duration::from_millis(500), Duration::from_secs(5));

impl HeldBack {
    /// Whether the row at `position` waits out its pause at `now`.
    fn waiting(&self, position: i64, now: tokio::time::Instant) -> bool {
        self.rows
            .get(&position)
            .is_some_and(|(_, until)| now < *until)
    }

    /// The rows at `positions` were held once more.
    fn held(&mut self, positions: &[i64], now: tokio::time::Instant) {
        for position in positions {
            let (times, until) = self.rows.entry(*position).or_insert((0, now));
            *times = times.saturating_add(1);
            *until = now + HELD_BACK.pause(*times);
        }
    }

    /// The rows at `positions` left.
    fn sent(&mut self, positions: &[i64]) {
        if !self.rows.is_empty() {
            for position in positions {
                self.rows.remove(position);
            }
        }
    }

    /// Forgets rows whose pause ended long ago: another node's relay sent them, or an
    /// operator removed them.
    fn forget_stale(&mut self, now: tokio::time::Instant) {
        self.rows
            .retain(|_, (_, until)| now.saturating_duration_since(*until) < STALE_HELD_BACK);
    }

    fn len(&self) -> usize {
        self.rows.len()
    }
}

/// How many batches a round whose local rows wait for room reads on for the broker's rows
/// alone; the next such round goes on from there.
const BLOCKED_SCAN_BATCHES: usize = 10;

/// How long after its pause ended a held row this relay has not seen again is forgotten.
const STALE_HELD_BACK: Duration = Duration::from_secs(300);

/// Why the lease could not be kept while the broker confirmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    /// Another node holds it.
    Lost,
    /// Renewing it failed.
    Failed,
}

/// The relay's hold on the outbox lease during one round, timed on the engine's clock for
/// what it writes and on a local instant for when to renew.
/// Takes `lease` again for the round under way; `false` when the round must stop: another
/// node holds it (`lost` is set) or the store failed (logged).
async fn renewed(lease: &mut Lease, lost: &mut bool) -> bool {
    match lease.take().await {
        Ok(true) => true,
        Ok(false) => {
            *lost = true;
            false
        }
        Err(error) => {
            tracing::warn!(%error, "renewing the outbox lease failed; retrying on the next round");
            false
        }
    }
}

struct Lease {
    outbox: Arc<dyn OutboxStore>,
    clock: Arc<dyn crate::ports::Clock>,
    length: Duration,
    taken_at: Option<TakenAt>,
    /// Taken again after it ran out, since [`rows_may_be_stale`](Self::rows_may_be_stale)
    /// last looked: another node may have held it meanwhile.
    retaken: bool,
}

/// When the lease was taken, on both clocks: the store expires it on the engine's (virtual
/// under a harness, or stepped), the relay times its round on a monotonic one.
#[derive(Clone, Copy, Debug)]
struct TakenAt {
    instant: tokio::time::Instant,
    wall: chrono::DateTime<chrono::Utc>,
}

impl Lease {
    fn new(outbox: Arc<dyn OutboxStore>, dispatcher: &Dispatcher, length: Duration) -> Self {
        Self {
            outbox,
            clock: Arc::clone(&dispatcher.shared.clock),
            length,
            taken_at: None,
            retaken: false,
        }
    }

    /// Takes or renews the lease; false while another node holds it.
    async fn take(&mut self) -> Result<bool, crate::Error> {
        let now = self.clock.now();
        let until = chrono::Duration::from_std(self.length)
            .ok()
            .and_then(|length| now.checked_add_signed(length))
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
        // Timed from before the write: a slow write must not look like more lease left.
        let asked_at = TakenAt {
            instant: tokio::time::Instant::now(),
            wall: now,
        };
        let ran_out = self.taken_at.is_some() && self.left().is_zero();
        let taken = self.outbox.lease(now, until).await?;
        if taken {
            self.taken_at = Some(asked_at);
            self.retaken |= ran_out;
        }
        Ok(taken)
    }

    /// Whether the lease ran out and was taken again since this was last asked: rows read
    /// before then may have been published meanwhile by the node that held it (and handled,
    /// and forgotten by their inbox past its retention), so they are read again before they
    /// are published.
    fn rows_may_be_stale(&mut self) -> bool {
        std::mem::take(&mut self.retaken)
    }

    /// How long the lease has been held, by whichever clock says longer.
    fn held(&self) -> Option<Duration> {
        self.taken_at.map(|taken_at| {
            let wall = (self.clock.now() - taken_at.wall)
                .to_std()
                .unwrap_or(Duration::MAX);
            taken_at.instant.elapsed().max(wall)
        })
    }

    /// Runs `work` — a broker's confirms, which may take longer than the lease has left —
    /// renewing the lease each time half of it has passed, so that a slow broker is waited
    /// for instead of sent the same rows again each round. `work` is dropped when the lease
    /// cannot be renewed, or its renewal does not answer before the lease ends: outliving it
    /// could overlap the next holder's sends.
    async fn kept_while<F: std::future::Future>(&mut self, work: F) -> Result<F::Output, Kept> {
        let mut work = std::pin::pin!(work);
        loop {
            let renew_in = self.left().saturating_sub(self.length / 2);
            tokio::select! {
                done = &mut work => return Ok(done),
                () = tokio::time::sleep(renew_in) => {}
            }
            // The confirms go on while the lease is renewed, for as long as it is still held
            // by this node's reckoning; past that only the store's answer lets them go on. The
            // renewal gets at least half a lease to answer: a clock that jumped (the test
            // harness's virtual one) or a thread that stalled can leave nothing, and a store
            // that never answers must not keep the confirms waiting past the lease, into the
            // next holder's round, for long.
            let left = self.left();
            let bound = left.max(self.length / 2);
            let renewal = tokio::time::timeout(bound, self.take());
            tokio::pin!(renewal);
            let lease_ends = tokio::time::sleep(left);
            tokio::pin!(lease_ends);
            let mut held = !left.is_zero();
            let renewed = loop {
                tokio::select! {
                    biased;
                    renewed = &mut renewal => break renewed,
                    () = &mut lease_ends, if held => held = false,
                    done = &mut work, if held => return Ok(done),
                }
            };
            match renewed {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => return Err(Kept::Lost),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "renewing the outbox lease failed");
                    return Err(Kept::Failed);
                }
                Err(_) => {
                    tracing::warn!(
                        waited = ?bound,
                        "renewing the outbox lease took longer than the lease had left"
                    );
                    return Err(Kept::Failed);
                }
            }
        }
    }

    /// Whether half of the lease has passed since it was last taken.
    fn half_gone(&self) -> bool {
        self.held().is_none_or(|held| held > self.length / 2)
    }

    /// How much of the lease is left (none when it is not held).
    fn left(&self) -> Duration {
        self.held()
            .map_or(Duration::ZERO, |held| self.length.saturating_sub(held))
    }
}

impl Actor for RelayActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.tick(ctx);
        let timers = self.dispatcher.shared.timers.clone();
        timers.every(self.interval, ctx, Self::tick);
        timers.every(
            HOUSEKEEPING.min(self.retention.max(self.interval)),
            ctx,
            Self::housekeeping,
        );
        // Polling is the fallback: a local enlist (a delivery, a handler transaction, a
        // committed application transaction) wakes the relay at once, and so does the store
        // when it can tell of enlists elsewhere.
        let dispatcher = self.dispatcher.clone();
        let me = ctx.address();
        ctx.spawn(
            async move {
                loop {
                    dispatcher.shared.outbox_enlisted.notified().await;
                    if !wake(&me) {
                        return;
                    }
                }
            }
            .into_actor(self),
        );
        let Some(mut enlisted) = self.outbox.enlisted() else {
            return;
        };
        let me = ctx.address();
        ctx.spawn(
            async move {
                while let Some(signal) = enlisted.next().await {
                    if let Err(error) = signal {
                        tracing::warn!(%error, "listening for outbox enlists failed; polling meanwhile");
                        tokio::time::sleep(LISTEN_PAUSE).await;
                    }
                    // After a failure too: what was enlisted while nobody listened is published
                    // now, not at the next poll.
                    if !wake(&me) {
                        return;
                    }
                }
            }
            .into_actor(self),
        );
    }
}

/// How long the relay waits before listening again after the store stopped telling it of
/// enlists (it polls meanwhile).
const LISTEN_PAUSE: Duration = Duration::from_secs(1);

/// Queues a wake; false once the relay has stopped. A full mailbox already holds wakes, so
/// the relay will look anyway.
fn wake(me: &actix::Addr<RelayActor>) -> bool {
    !matches!(me.try_send(Wake), Err(actix::prelude::SendError::Closed(_)))
}

/// Asks the relay to look at the outbox now.
struct Wake;

impl actix::Message for Wake {
    type Result = ();
}

impl actix::Handler<Wake> for RelayActor {
    type Result = ();

    fn handle(&mut self, _: Wake, ctx: &mut Context<Self>) {
        if self
            .leased_elsewhere_until
            .is_some_and(|until| tokio::time::Instant::now() < until)
        {
            self.deferred(1);
            return;
        }
        if self.busy {
            self.wakes_during_round += 1;
        }
        self.tick(ctx);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use chrono::{DateTime, Utc};

    use super::{HeldBack, Kept, Lease, send_away};
    use crate::ports::{Outbound, OutboxBacklog, OutboxRow, OutboxStore, Sent, SystemClock};
    use crate::{Envelope, Error};

    /// What happened, in order.
    type Log = Arc<Mutex<Vec<&'static str>>>;

    /// An outbox whose sync fails when `sync_fails`, and whose lease is this node's for its
    /// first `kept` asks, then another's — or, when `hangs`, never answered after those; each
    /// answer `answer_after` the ask.
    #[derive(Default)]
    struct Outbox {
        log: Log,
        sync_fails: bool,
        kept: usize,
        hangs: bool,
        answer_after: Duration,
        asked: Mutex<usize>,
    }

    #[async_trait]
    impl OutboxStore for Outbox {
        async fn lease(&self, _: DateTime<Utc>, _: DateTime<Utc>) -> Result<bool, Error> {
            // A store answers after a round trip, never on the first poll.
            tokio::task::yield_now().await;
            tokio::time::sleep(self.answer_after).await;
            let kept = {
                let mut asked = self.asked.lock().unwrap();
                *asked += 1;
                *asked <= self.kept
            };
            if !kept && self.hangs {
                std::future::pending::<()>().await;
            }
            Ok(kept)
        }
        async fn unpublished(&self, _: i64, _: usize) -> Result<Vec<OutboxRow>, Error> {
            Ok(Vec::new())
        }
        async fn backlog(&self) -> Result<OutboxBacklog, Error> {
            Ok(OutboxBacklog::new(0, None))
        }
        async fn delete_published_before(&self, _: DateTime<Utc>, _: usize) -> Result<u64, Error> {
            Ok(0)
        }
        async fn mark_published(&self, _: &[i64], _: DateTime<Utc>) -> Result<(), Error> {
            Ok(())
        }
        async fn sync(&self) -> Result<(), Error> {
            self.log.lock().unwrap().push("sync");
            if self.sync_fails {
                return Err(Error::store("the disk is gone"));
            }
            Ok(())
        }
    }

    struct Broker(Log);

    #[async_trait]
    impl Outbound for Broker {
        fn carries(&self, _: &str) -> bool {
            true
        }
        async fn send(&self, envelopes: &[Envelope]) -> Result<Sent, Error> {
            self.0.lock().unwrap().push("send");
            // The second envelope has no queue bound yet.
            Ok(Sent {
                refused: Vec::new(),
                held: vec![(envelopes[1].id, "no queue bound".to_owned())],
            })
        }
    }

    /// Three rows sent away through an outbox whose sync fails when `sync_fails`: the
    /// positions to mark, and what happened in order.
    async fn send_three(sync_fails: bool) -> (Option<(Vec<i64>, Vec<i64>)>, Vec<&'static str>) {
        let log = Log::default();
        let outbox = Outbox {
            log: Arc::clone(&log),
            sync_fails,
            ..Outbox::default()
        };
        let rows = (1..=3)
            .map(|position| (position, Envelope::new("orders.placed", b"{}".to_vec())))
            .collect();
        let letters = super::Letters {
            store: None,
            with_outbox: false,
        };
        let sent = send_away(
            &outbox,
            &Broker(Arc::clone(&log)),
            rows,
            letters,
            &SystemClock,
        )
        .await;
        let happened = log.lock().unwrap().clone();
        (sent, happened)
    }

    #[tokio::test]
    async fn rows_go_to_the_broker_only_once_the_outbox_synced_them() {
        let (sent, happened) = send_three(false).await;
        assert_eq!(
            sent,
            Some((vec![1, 3], vec![2])),
            "the held one is left unmarked"
        );
        assert_eq!(happened, ["sync", "send"]);
    }

    #[tokio::test]
    async fn rows_the_outbox_cannot_sync_are_not_sent() {
        let (sent, happened) = send_three(true).await;
        assert_eq!(sent, None, "nothing to mark: the next round sends them");
        assert_eq!(happened, ["sync"]);
    }

    /// A lease of two seconds on `outbox`, taken — then, when `jumped`, left behind by the
    /// engine's clock, a minute ahead (as the test harness's virtual clock can jump) — and a
    /// broker's confirms that take `confirming`, kept while the lease is renewed: what that
    /// gave, how many times the lease was asked for, and whether the confirms ended.
    async fn confirms_while_the_lease_is_renewed(
        outbox: Outbox,
        jumped: bool,
        confirming: Duration,
    ) -> (Result<(), Kept>, usize, Arc<AtomicBool>) {
        let outbox = Arc::new(outbox);
        let clock = Arc::new(Jumping::default());
        let mut lease = Lease {
            outbox: Arc::clone(&outbox) as Arc<dyn OutboxStore>,
            clock: Arc::clone(&clock) as Arc<dyn crate::ports::Clock>,
            length: Duration::from_secs(2),
            taken_at: None,
            retaken: false,
        };
        assert!(lease.take().await.unwrap());
        if jumped {
            *clock.ahead.lock().unwrap() = chrono::Duration::seconds(60);
        }
        let done = Arc::new(AtomicBool::new(false));
        let confirms = {
            let done = Arc::clone(&done);
            async move {
                tokio::time::sleep(confirming).await;
                done.store(true, Ordering::SeqCst);
            }
        };
        // Bounded: a renewal that hangs must not hang the test with it.
        let kept = tokio::time::timeout(Duration::from_secs(60), lease.kept_while(confirms))
            .await
            .expect("the confirms were neither kept nor given up within a minute");
        let asked = *outbox.asked.lock().unwrap();
        (kept, asked, done)
    }

    /// An outbox that keeps the lease for its first `kept` asks, then gives it to another —
    /// or, when `hangs`, never answers.
    fn keeping(kept: usize, hangs: bool) -> Outbox {
        Outbox {
            kept,
            hangs,
            ..Outbox::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_broker_slower_than_the_lease_is_waited_for_while_the_lease_is_renewed() {
        let (kept, asked, done) = confirms_while_the_lease_is_renewed(
            keeping(usize::MAX, false),
            false,
            Duration::from_secs(7),
        )
        .await;
        assert_eq!(kept, Ok(()));
        assert!(done.load(Ordering::SeqCst));
        // Renewed each time half of it passed: after 1, 2, … 6 seconds.
        assert!(
            (5..=8).contains(&asked),
            "the lease was asked for {asked} times"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn confirms_are_given_up_once_the_lease_is_lost() {
        let (kept, asked, done) =
            confirms_while_the_lease_is_renewed(keeping(1, false), false, Duration::from_secs(7))
                .await;
        assert_eq!(kept, Err(Kept::Lost));
        assert_eq!(asked, 2, "the first renewal found it another's");
        assert!(!done.load(Ordering::SeqCst), "the confirms were dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn confirms_are_given_up_when_a_renewal_does_not_answer_before_the_lease_ends() {
        let start = tokio::time::Instant::now();
        let (kept, asked, done) =
            confirms_while_the_lease_is_renewed(keeping(1, true), false, Duration::from_secs(7))
                .await;
        assert_eq!(kept, Err(Kept::Failed));
        assert_eq!(asked, 2, "one renewal, never answered");
        assert!(!done.load(Ordering::SeqCst), "the confirms were dropped");
        let waited = start.elapsed();
        assert!(
            waited <= Duration::from_secs(2),
            "given up within the two-second lease, not {waited:?} later"
        );
    }

    /// The system's clock, moved forward by `ahead`: the test harness's virtual clock jumps so.
    #[derive(Default)]
    struct Jumping {
        ahead: Mutex<chrono::Duration>,
    }

    impl crate::ports::Clock for Jumping {
        fn now(&self) -> DateTime<Utc> {
            Utc::now() + *self.ahead.lock().unwrap()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_the_engine_clock_jumped_past_is_renewed_when_the_store_still_gives_it() {
        // Nothing left by the engine's clock: the renewal is asked at once.
        let (kept, asked, done) = confirms_while_the_lease_is_renewed(
            keeping(usize::MAX, false),
            true,
            Duration::from_millis(500),
        )
        .await;
        assert_eq!(kept, Ok(()), "the store still gave this node the lease");
        assert_eq!(asked, 2);
        assert!(done.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn confirms_that_end_after_the_lease_are_given_up_when_the_renewal_finds_it_another_s() {
        // Nothing left by the engine's clock; the confirms would end before the store answers.
        let slow = Outbox {
            answer_after: Duration::from_millis(100),
            ..keeping(1, false)
        };
        let (kept, asked, done) =
            confirms_while_the_lease_is_renewed(slow, true, Duration::from_millis(50)).await;
        assert_eq!(kept, Err(Kept::Lost), "the store gave the lease to another");
        assert_eq!(asked, 2);
        assert!(!done.load(Ordering::SeqCst), "not run past the lease");
    }

    #[tokio::test(start_paused = true)]
    async fn confirms_that_end_while_a_renewal_hangs_are_kept() {
        let (kept, asked, done) = confirms_while_the_lease_is_renewed(
            keeping(1, true),
            false,
            Duration::from_millis(1500),
        )
        .await;
        assert_eq!(kept, Ok(()), "they ended under the lease still held");
        assert_eq!(asked, 2, "the renewal began after one second");
        assert!(done.load(Ordering::SeqCst));
    }

    #[test]
    fn a_row_held_again_and_again_waits_longer_each_time_and_is_forgotten_once_sent() {
        let mut held_back = HeldBack::default();
        let start = tokio::time::Instant::now();
        let at = |seconds: f64| start + Duration::from_secs_f64(seconds);
        held_back.held(&[7], at(0.0));
        assert!(held_back.waiting(7, at(0.4)));
        assert!(!held_back.waiting(7, at(0.5)), "due after half a second");
        assert!(
            !held_back.waiting(8, at(0.0)),
            "a row never held waits for nothing"
        );
        held_back.held(&[7], at(0.5));
        assert!(held_back.waiting(7, at(1.4)));
        assert!(!held_back.waiting(7, at(1.5)), "then after a second");
        for _ in 0..10 {
            held_back.held(&[7], at(2.0));
        }
        assert!(held_back.waiting(7, at(6.9)));
        assert!(
            !held_back.waiting(7, at(7.0)),
            "never longer than a transport reconnecting"
        );
        held_back.sent(&[7]);
        assert!(!held_back.waiting(7, at(1.0)));
        assert_eq!(held_back.len(), 0);
        held_back.held(&[9], at(0.0));
        held_back.forget_stale(at(100.0));
        assert_eq!(held_back.len(), 1, "recently due: kept");
        held_back.forget_stale(at(400.0));
        assert_eq!(held_back.len(), 0, "not seen for minutes: forgotten");
    }
}
