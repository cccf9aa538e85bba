use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use dacapo_actors::ports::{
    Claim, ClaimOutcome, Claims, Clock, DeadLetterStore, Fenced, Handled, Inbox, Receipt, Replay,
    ReplayTo, RetryRecord, ScheduledEnvelope,
};
use dacapo_actors::{DeadLetter, DeadLetterFilter, DeadLetterReason, Envelope, Error};
use uuid::Uuid;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section below leaves the data consistent, so a panic elsewhere while
    // holding the lock does not make it unusable.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Envelope ids are spread over shards so that publishers and workers rarely wait for the
/// same lock.
const SHARDS: usize = 16;

/// An inbox in memory: deduplicates envelope ids within one process, handled ones for its
/// `keep_after_handling`, and keeps the dead letters of the deliveries it settles.
pub struct MemoryInbox {
    keep_after_handling: chrono::Duration,
    clock: Arc<dyn Clock>,
    shards: [Mutex<InboxState>; SHARDS],
    dead_letters: Arc<MemoryDeadLetters>,
}

impl std::fmt::Debug for MemoryInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryInbox")
            .field("keep_after_handling", &self.keep_after_handling)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct InboxState {
    /// `None` while incoming; the handling time once settled.
    known: HashMap<Uuid, Option<DateTime<Utc>>, foldhash::fast::RandomState>,
    /// Settled ids in the order they settled, so expiry never scans the whole map.
    settled: VecDeque<(DateTime<Utc>, Uuid)>,
    /// Settled ids that were dead-lettered: known for as long as their letter is kept, so that
    /// a redelivery past the retention is not handled beside a letter that may be replayed.
    dead_lettered: HashSet<Uuid, foldhash::fast::RandomState>,
}

impl MemoryInbox {
    /// An inbox that remembers handled envelopes for `keep_after_handling`.
    pub fn new(keep_after_handling: Duration, clock: Arc<dyn Clock>) -> Self {
        Self {
            keep_after_handling: chrono::Duration::from_std(keep_after_handling)
                .unwrap_or(chrono::TimeDelta::MAX),
            clock,
            shards: std::array::from_fn(|_| Mutex::default()),
            dead_letters: Arc::default(),
        }
    }

    /// The dead letters this inbox settled deliveries into.
    pub fn dead_letters(&self) -> Arc<MemoryDeadLetters> {
        Arc::clone(&self.dead_letters)
    }

    fn shard(&self, id: Uuid) -> MutexGuard<'_, InboxState> {
        lock(&self.shards[id.as_u128() as usize % SHARDS])
    }

    fn record(&self, id: Uuid) -> Receipt {
        let mut state = self.shard(id);
        self.expire(&mut state);
        match state.known.entry(id) {
            Entry::Occupied(_) => Receipt::Duplicate,
            Entry::Vacant(vacant) => {
                vacant.insert(None);
                Receipt::New
            }
        }
    }

    fn settle(&self, id: Uuid, dead_lettered: bool) {
        let now = self.clock.now();
        let mut state = self.shard(id);
        state.known.insert(id, Some(now));
        state.settled.push_back((now, id));
        if dead_lettered {
            state.dead_lettered.insert(id);
        }
    }

    fn expire(&self, state: &mut InboxState) {
        if state.settled.is_empty() {
            return;
        }
        let now = self.clock.now();
        // Each at most once: a dead-lettered id goes to the back again.
        for _ in 0..state.settled.len() {
            let Some(&(at, id)) = state.settled.front() else {
                break;
            };
            // Kept past the end of time: kept.
            if at
                .checked_add_signed(self.keep_after_handling)
                .is_none_or(|until| until > now)
            {
                break;
            }
            state.settled.pop_front();
            // Only forget it if it was not received again and re-settled since.
            if state.known.get(&id) != Some(&Some(at)) {
                continue;
            }
            if !state.dead_lettered.is_empty() && state.dead_lettered.contains(&id) {
                if self.dead_letters.holds(id) {
                    state.known.insert(id, Some(now));
                    state.settled.push_back((now, id));
                    continue;
                }
                state.dead_lettered.remove(&id);
            }
            state.known.remove(&id);
        }
    }
}

#[async_trait]
impl Inbox for MemoryInbox {
    async fn receive(&self, envelope: &Envelope) -> Result<Receipt, Error> {
        Ok(self.record(envelope.id))
    }

    // One process owns every delivery in memory: nothing to fence against.
    async fn begin_attempt(&self, _: Uuid, _: u32) -> Result<Fenced, Error> {
        Ok(Fenced::Written)
    }

    async fn schedule_retry(&self, _: RetryRecord<'_>) -> Result<Fenced, Error> {
        Ok(Fenced::Written)
    }

    async fn settle_handled(&self, id: Uuid, _: u32, _: &[Envelope]) -> Result<Handled, Error> {
        self.settle(id, false);
        Ok(Handled::Written { in_outbox: false })
    }

    async fn dead_letter(&self, letter: &DeadLetter, _: bool) -> Result<Fenced, Error> {
        self.dead_letters.insert(letter.clone());
        self.settle(letter.envelope.id, true);
        Ok(Fenced::Written)
    }

    async fn replay(&self, id: Uuid, _: ReplayTo) -> Result<Replay, Error> {
        let mut state = self.shard(id);
        if state.known.get(&id) == Some(&None) {
            return Ok(Replay::InProgress);
        }
        let replay = self.dead_letters.take_for_replay(id);
        if let Replay::Replayed(_) = replay {
            // Known again as incoming, under the same lock: the engine runs it next.
            state.known.insert(id, None);
            state.dead_lettered.remove(&id);
        }
        Ok(replay)
    }

    async fn scheduled(&self, _: usize) -> Result<Vec<ScheduledEnvelope>, Error> {
        Err(no_schedule())
    }

    async fn cancel_scheduled(&self, _: Uuid) -> Result<bool, Error> {
        Err(no_schedule())
    }

    fn receive_now(&self, envelope: &Envelope) -> Option<Result<Receipt, Error>> {
        Some(Ok(self.record(envelope.id)))
    }

    fn mark_handled_now(&self, id: Uuid) -> Option<Result<(), Error>> {
        self.settle(id, false);
        Some(Ok(()))
    }
}

/// Refused for good: no retry makes an inbox in memory keep a schedule.
fn no_schedule() -> Error {
    Error::rejected(
        "an inbox in memory keeps no schedule: a scheduled envelope waits in its delivery's \
         timer; use a durable store to list or cancel scheduled envelopes",
    )
}

/// The dead letters this inbox settled deliveries into.
#[async_trait]
impl DeadLetterStore for MemoryInbox {
    async fn put(&self, dead_letter: DeadLetter) -> Result<(), Error> {
        self.dead_letters.put(dead_letter).await
    }

    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, Error> {
        self.dead_letters.list(filter).await
    }

    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        self.dead_letters.get(id).await
    }

    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        self.dead_letters.remove(id).await
    }

    async fn remove_if_unchanged(
        &self,
        id: Uuid,
        last_failure_at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        self.dead_letters
            .remove_if_unchanged(id, last_failure_at)
            .await
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        self.dead_letters.purge(filter).await
    }
}

/// Dead letters in memory, lost with the process; the durable stores keep them.
#[derive(Debug, Default)]
pub struct MemoryDeadLetters {
    letters: Mutex<Vec<DeadLetter>>,
}

impl MemoryDeadLetters {
    fn insert(&self, dead_letter: DeadLetter) {
        let mut letters = lock(&self.letters);
        letters.retain(|l| l.envelope.id != dead_letter.envelope.id);
        letters.push(dead_letter);
    }

    fn holds(&self, id: Uuid) -> bool {
        lock(&self.letters).iter().any(|l| l.envelope.id == id)
    }

    /// Takes letter `id` out to replay it, its attempt count reset; leaves an unreadable one
    /// where it is.
    fn take_for_replay(&self, id: Uuid) -> Replay {
        let mut letters = lock(&self.letters);
        let Some(index) = letters.iter().position(|l| l.envelope.id == id) else {
            return Replay::NotFound;
        };
        if matches!(letters[index].reason, DeadLetterReason::Unreadable(_)) {
            return Replay::Unreadable;
        }
        let mut envelope = letters.remove(index).envelope;
        envelope.attempts = 0;
        Replay::Replayed(envelope)
    }

    fn take(&self, id: Uuid) -> Option<DeadLetter> {
        let mut letters = lock(&self.letters);
        let index = letters.iter().position(|l| l.envelope.id == id);
        index.map(|i| letters.remove(i))
    }
}

#[async_trait]
impl DeadLetterStore for MemoryDeadLetters {
    async fn put(&self, dead_letter: DeadLetter) -> Result<(), Error> {
        self.insert(dead_letter);
        Ok(())
    }

    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, Error> {
        let mut letters: Vec<_> = lock(&self.letters)
            .iter()
            .filter(|l| filter.matches(l))
            .cloned()
            .collect();
        letters.sort_by_key(|l| (l.first_failure_at, l.envelope.id.simple().to_string()));
        letters.truncate(filter.limit.unwrap_or(usize::MAX));
        Ok(letters)
    }

    async fn get(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        Ok(lock(&self.letters)
            .iter()
            .find(|l| l.envelope.id == id)
            .cloned())
    }

    async fn remove(&self, id: Uuid) -> Result<Option<DeadLetter>, Error> {
        Ok(self.take(id))
    }

    async fn remove_if_unchanged(
        &self,
        id: Uuid,
        last_failure_at: DateTime<Utc>,
    ) -> Result<bool, Error> {
        let mut letters = lock(&self.letters);
        let before = letters.len();
        letters.retain(|l| !(l.envelope.id == id && l.last_failure_at == last_failure_at));
        Ok(letters.len() < before)
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        let taken = self.list(filter).await?;
        let mut letters = lock(&self.letters);
        letters.retain(|l| !taken.iter().any(|t| t.envelope.id == l.envelope.id));
        Ok(taken.len() as u64)
    }
}

/// A claim's holder (handler, key hash) and what it holds.
type HeldClaims = HashMap<(String, String), Held>;

#[derive(Debug)]
struct Held {
    fingerprint: String,
    envelope_id: String,
    expires_at: DateTime<Utc>,
    completed: bool,
}

/// Deduplication claims in memory: enforced within one process, lost with it.
#[derive(Debug, Default)]
pub struct MemoryClaims {
    claims: Mutex<HeldClaims>,
}

#[async_trait]
impl Claims for MemoryClaims {
    async fn provision(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, Error> {
        let mut claims = lock(&self.claims);
        let key = (claim.handler.clone(), claim.key_hash.clone());
        match claims.get(&key) {
            Some(held)
                if held.expires_at > claim.claimed_at
                    && (held.completed || held.envelope_id != claim.envelope_id) =>
            {
                if held.envelope_id == claim.envelope_id {
                    return Ok(ClaimOutcome::Completed);
                }
                Ok(ClaimOutcome::Held {
                    same_payload: held.fingerprint == claim.fingerprint,
                })
            }
            _ => {
                let held = Held {
                    fingerprint: claim.fingerprint.clone(),
                    envelope_id: claim.envelope_id.clone(),
                    expires_at: claim.expires_at,
                    completed: false,
                };
                claims.insert(key, held);
                Ok(ClaimOutcome::Claimed)
            }
        }
    }

    async fn release(&self, claim: &Claim) -> Result<(), Error> {
        let mut claims = lock(&self.claims);
        let key = (claim.handler.clone(), claim.key_hash.clone());
        if claims
            .get(&key)
            .is_some_and(|held| held.envelope_id == claim.envelope_id && !held.completed)
        {
            claims.remove(&key);
        }
        Ok(())
    }

    async fn complete(&self, claim: &Claim, _cascaded: &[Envelope]) -> Result<bool, Error> {
        let mut claims = lock(&self.claims);
        if let Some(held) = claims.get_mut(&(claim.handler.clone(), claim.key_hash.clone()))
            && held.envelope_id == claim.envelope_id
        {
            held.completed = true;
        }
        // Nothing here outlives the process: the cascades settle with the attempt.
        Ok(false)
    }

    async fn reap(&self, now: DateTime<Utc>, limit: usize) -> Result<u64, Error> {
        let mut claims = lock(&self.claims);
        let expired: Vec<_> = claims
            .iter()
            .filter(|(_, held)| held.expires_at <= now)
            .map(|(k, _)| k.clone())
            .take(limit)
            .collect();
        for key in &expired {
            claims.remove(key);
        }
        Ok(expired.len() as u64)
    }
}
