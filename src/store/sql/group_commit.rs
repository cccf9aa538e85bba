//! Group commit: the accepts, attempt begins, scheduled retries and settles of many deliveries, written while a commit is under
//! way, commit together in the next transaction — one fsync (SQLite) or WAL flush
//! (PostgreSQL) for all of them. Each caller returns only once *its* write committed; a batch
//! that fails fails every caller in it (they retry), except that a batch the database refused
//! for its data runs again one write at a time, so one bad write does not fail the others.
//! SQLite commits one group at a time; PostgreSQL several (see [`Grouping`]).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dacapo_actors::Error;
use dacapo_actors::ports::{Fenced, Handled, Receipt};
use tokio::sync::oneshot;

use super::columns::EnvelopeColumns;
use super::database::{Database, Row, Tx, Value};
use super::own_thread::{OwnThread, caller_may_stall};
use super::statements::{
    BEGIN_ATTEMPT, BEGIN_ATTEMPT_ROWS, ENLIST_ONCE, MARK_HANDLED, MARK_HANDLED_ROWS, RECEIVE,
    RECEIVE_ROWS, RECEIVE_SCHEDULED, Rows, SCHEDULE_RETRY,
};

/// One delivery's write.
pub(crate) enum Write {
    /// Records a received envelope, its first attempt started (or scheduled for `due_at`).
    Receive {
        columns: EnvelopeColumns,
        attempts: i32,
        node: Arc<str>,
        now: i64,
        due_at: Option<i64>,
    },
    /// Records that an attempt after the first starts, fenced by its owner.
    BeginAttempt {
        id: String,
        attempt: i32,
        previous: i32,
        node: Arc<str>,
    },
    /// Records a failed attempt and when the next one is due, fenced by its owner.
    ScheduleRetry {
        id: String,
        attempts: i32,
        due_at: i64,
        /// The failures so far, the handlers that succeeded and the messages they cascaded,
        /// as JSON.
        failures: String,
        succeeded: String,
        cascaded: Option<String>,
        node: Arc<str>,
    },
    /// Marks a delivery handled, fenced by its owner and its count of attempts (at least 1),
    /// with the messages it cascaded.
    Settle {
        id: String,
        node: Arc<str>,
        now: i64,
        attempts: i32,
        cascaded: Vec<EnvelopeColumns>,
    },
}

/// What a write found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    Received(Receipt),
    Begun(Fenced),
    Scheduled(Fenced),
    Settled(Handled),
}

impl Write {
    /// The write's one statement — or, for a settle with cascades, its first — and its
    /// parameters.
    fn statement(&self) -> (&'static str, Vec<Value<'_>>) {
        match self {
            Self::Receive {
                columns,
                due_at: Some(due_at),
                now,
                ..
            } => (
                RECEIVE_SCHEDULED,
                columns.values_and(&[Value::Int64(*due_at), Value::Int64(*now)]),
            ),
            Self::Receive {
                columns,
                attempts,
                node,
                now,
                due_at: None,
            } => (
                RECEIVE,
                columns.values_and(&[
                    Value::Int32(*attempts),
                    Value::Text(node),
                    Value::Int64(*now),
                ]),
            ),
            Self::BeginAttempt {
                id,
                attempt,
                previous,
                node,
            } => (
                BEGIN_ATTEMPT,
                vec![
                    Value::Text(id),
                    Value::Int32(*attempt),
                    Value::Text(node),
                    Value::Int32(*previous),
                ],
            ),
            Self::ScheduleRetry {
                id,
                attempts,
                due_at,
                failures,
                succeeded,
                cascaded,
                node,
            } => (
                SCHEDULE_RETRY,
                vec![
                    Value::Text(id),
                    Value::Int32(*attempts),
                    Value::Int64(*due_at),
                    Value::Text(failures),
                    Value::Text(succeeded),
                    Value::Text(node),
                    Value::OptionalText(cascaded.as_deref()),
                    Value::Int32((*attempts).max(1)),
                ],
            ),
            Self::Settle {
                id,
                node,
                now,
                attempts,
                ..
            } => (
                MARK_HANDLED,
                vec![
                    Value::Text(id),
                    Value::Int64(*now),
                    Value::Text(node),
                    Value::Int32(*attempts),
                ],
            ),
        }
    }

    /// Whether the write only ends an attempt — a settle that cascades no message, a retry
    /// scheduled — so that no work waits on its commit. A settle's cascaded messages are
    /// delivered once it committed: a chain of them would wait at each link for a write that
    /// cannot come before.
    fn only_ends_an_attempt(&self) -> bool {
        match self {
            Self::Settle { cascaded, .. } => cascaded.is_empty(),
            Self::ScheduleRetry { .. } => true,
            Self::Receive { .. } | Self::BeginAttempt { .. } => false,
        }
    }

    /// The bytes of envelope the write carries (a receive's payload and headers).
    fn bytes(&self) -> usize {
        match self {
            Self::Receive { columns, .. } => columns.payload.len() + columns.headers.len(),
            _ => 0,
        }
    }

    /// The id of the envelope the write is about.
    fn id(&self) -> &str {
        match self {
            Self::Receive { columns, .. } => &columns.id,
            Self::BeginAttempt { id, .. }
            | Self::ScheduleRetry { id, .. }
            | Self::Settle { id, .. } => id,
        }
    }

    /// What the write found, given the rows its statement changed.
    fn answer(&self, rows: u64) -> Written {
        match self {
            Self::Receive { due_at, .. } => received(rows, due_at.is_some()),
            Self::BeginAttempt { .. } => Written::Begun(Fenced::from_rows(rows)),
            Self::ScheduleRetry { .. } => Written::Scheduled(Fenced::from_rows(rows)),
            Self::Settle { .. } => settled(rows),
        }
    }

    /// Commits the write by itself: one statement that commits on its own where it is one
    /// (a round trip, not three), a transaction otherwise.
    async fn alone(&self, db: &Database) -> Result<Written, Error> {
        if let Self::Settle { cascaded, .. } = self
            && !cascaded.is_empty()
        {
            let mut tx = db.begin().await?;
            let written = self.run(&mut tx).await?;
            if written == Written::Settled(Handled::OwnedElsewhere) {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
            }
            return Ok(written);
        }
        let (sql, values) = self.statement();
        Ok(self.answer(db.execute(sql, &values).await?))
    }

    /// Runs the write in `tx`.
    async fn run(&self, tx: &mut Tx) -> Result<Written, Error> {
        let (sql, values) = self.statement();
        let written = self.answer(tx.execute(sql, &values).await?);
        if let Self::Settle { now, cascaded, .. } = self
            && written == Written::Settled(Handled::Written { in_outbox: true })
        {
            // Only a settle this node still owned writes its cascades: a fenced one leaves
            // them out of the outbox.
            for columns in cascaded {
                // A retry of this commit writes the same deterministic ids: keep the first.
                let values = columns.values_and(&[Value::Int64(*now)]);
                tx.execute(ENLIST_ONCE, &values).await?;
            }
        }
        Ok(written)
    }
}

/// What a receive that inserted `inserted` rows found.
fn received(inserted: u64, scheduled: bool) -> Written {
    Written::Received(match (inserted, scheduled) {
        (1, true) => Receipt::Scheduled,
        (1, false) => Receipt::New,
        _ => Receipt::Duplicate,
    })
}

/// What a settle that marked `marked` rows found.
fn settled(marked: u64) -> Written {
    Written::Settled(match marked {
        0 => Handled::OwnedElsewhere,
        _ => Handled::Written { in_outbox: true },
    })
}

type Reply = oneshot::Sender<Result<Written, Error>>;

/// How many writes must wait before a group lingers for more. Two may be a lone publisher's
/// accept and its last delivery's settle, each caller blocked on its own write: no one else
/// is coming, and a linger would only hold both (a live publisher ran 1 000/s with it instead
/// of 1 550–1 780/s).
const LINGER_FROM: usize = 3;

/// How long, at most, one or two writes that only end attempts wait for another write to join
/// them when the store lingers at all (SQLite), before the timer's rounding up to its next
/// millisecond tick. No work waits on them, and a lone publisher's next accept, which commits
/// (and fsyncs) anyway, is usually on its way: the settle of its last delivery rides in that
/// commit instead of taking one of its own before it.
const ENDINGS_WAIT_AT_MOST: Duration = Duration::from_millis(1);

/// How many times such writes do not wait after a wait no write came to end: the next write
/// may be waiting for them (a publisher held back by the engine's capacity, which a settle
/// frees), and they would wait in vain each time.
const SKIPS_AFTER_A_WAIT_IN_VAIN: usize = 16;

/// How writes are grouped: at most `max_batch` in one transaction, and — when
/// [`LINGER_FROM`] or more wait — `linger` (rounded up to the timer's millisecond tick) for
/// others to join before committing (one or two that only end attempts wait for the next
/// write, as long, at most [`ENDINGS_WAIT_AT_MOST`], unless such a wait lately ended with no
/// write: [`EndingsWaits`]); up to `commits`
/// transactions at once. SQLite takes one: it has one writer, so a second transaction would
/// only wait for the first. PostgreSQL takes several: it flushes the WAL of concurrent commits
/// together, so a write that arrives while a group commits starts the next group at once
/// instead of waiting for the first to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grouping {
    pub(crate) max_batch: usize,
    pub(crate) linger: Duration,
    pub(crate) commits: usize,
}

/// What a leader waits for before it takes what waits into a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Nothing: it commits at once.
    None,
    /// This long, for as many as come.
    Linger(Duration),
    /// Another write to join, at most this long.
    ForAnother(Duration),
}

impl Grouping {
    /// What a leader waits for with `waiting` writes in its queue, `only_endings` when they
    /// all end attempts: many wait for more; one or two whose callers go on once they
    /// committed (an accept, an attempt's begin) never wait; one or two that only end
    /// attempts wait for the next write, briefly. Nothing waits without a linger, or with a
    /// full batch.
    fn wait_before_commit(&self, waiting: usize, only_endings: bool) -> Wait {
        if self.linger.is_zero() || waiting == 0 || waiting >= self.max_batch {
            Wait::None
        } else if waiting >= LINGER_FROM {
            Wait::Linger(self.linger)
        } else if only_endings {
            Wait::ForAnother(self.linger.min(ENDINGS_WAIT_AT_MOST))
        } else {
            Wait::None
        }
    }
}

/// A store starts from its database's own linger and number of commits
/// ([`Dialect`](super::Dialect)); these are the rest.
impl Default for Grouping {
    fn default() -> Self {
        Self {
            max_batch: 128,
            linger: Duration::ZERO,
            commits: 1,
        }
    }
}

/// The writes waiting for the next commit, and how many leaders are committing.
#[derive(Default)]
struct Queue {
    waiting: VecDeque<(Write, Reply)>,
    leaders: usize,
    endings_waits: EndingsWaits,
}

impl Queue {
    /// Whether everything waiting only ends an attempt.
    fn only_endings(&self) -> bool {
        self.waiting
            .iter()
            .all(|(write, _)| write.only_ends_an_attempt())
    }
}

/// Whether writes that only end attempts wait for another write: not for the next
/// [`SKIPS_AFTER_A_WAIT_IN_VAIN`] times after one such wait ended with no write.
#[derive(Debug, Default)]
struct EndingsWaits {
    to_skip: usize,
}

impl EndingsWaits {
    /// Whether this one waits; counts a skip.
    fn take(&mut self) -> bool {
        if self.to_skip == 0 {
            return true;
        }
        self.to_skip -= 1;
        false
    }

    fn in_vain(&mut self) {
        self.to_skip = SKIPS_AFTER_A_WAIT_IN_VAIN;
    }
}

/// Groups the writes of one store's runtime pool into shared commits.
pub(crate) struct GroupCommit {
    grouping: Grouping,
    queue: Mutex<Queue>,
    /// Told each time a write joins the queue, for a leader waiting for company.
    joined: tokio::sync::Notify,
    /// Where a lead goes on after its first batch (see [`lead`]), and where the whole lead of
    /// a write whose caller may stall runs (see [`caller_may_stall`]): a thread of the
    /// group's own, started by the first lead that goes there, which ends with the group (no
    /// leader runs then: each holds the group); `None` if it could not start.
    committer: std::sync::OnceLock<Option<OwnThread>>,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit")
            .field("grouping", &self.grouping)
            .field("waiting", &self.queue().waiting.len())
            .finish()
    }
}

impl GroupCommit {
    pub(crate) fn new(grouping: Grouping) -> Arc<Self> {
        Arc::new(Self {
            grouping: Grouping {
                max_batch: grouping.max_batch.max(1),
                commits: grouping.commits.max(1),
                ..grouping
            },
            queue: Mutex::default(),
            joined: tokio::sync::Notify::new(),
            committer: std::sync::OnceLock::new(),
        })
    }

    /// The runtime of the committer's thread, started on first use; `None` if it could not
    /// start (leaders then stay on the runtimes of the writes that start them).
    fn committer(&self) -> Option<&tokio::runtime::Handle> {
        self.committer
            .get_or_init(|| {
                OwnThread::start("dacapo-commit")
                    .inspect_err(|error| {
                        tracing::warn!(%error, "no thread for the group commit; its leaders stay on the runtimes of the writes that start them");
                    })
                    .ok()
            })
            .as_ref()
            .map(OwnThread::runtime)
    }

    pub(crate) fn grouping(&self) -> Grouping {
        self.grouping
    }

    /// How many writes wait for a leader to take them, and how many leaders run.
    #[cfg(test)]
    pub(crate) fn waiting_and_leaders(&self) -> (usize, usize) {
        let queue = self.queue();
        (queue.waiting.len(), queue.leaders)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes `write` in the next commit on `db`, and returns once that committed.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait does not cancel the write: it commits with its batch, or fails
    /// with it.
    pub(crate) async fn write(
        self: &Arc<Self>,
        db: &Database,
        write: Write,
    ) -> Result<Written, Error> {
        let (reply, answer) = oneshot::channel();
        let leads = {
            let mut queue = self.queue();
            queue.waiting.push_back((write, reply));
            let leads = queue.leaders < self.grouping.commits;
            queue.leaders += usize::from(leads);
            leads
        };
        self.joined.notify_waiters();
        if leads {
            // Committed on a task of its own: a caller that stops waiting must not take the
            // others' commit with it. Its first batch commits on the caller's runtime, which
            // its caller drives while it waits, so that the writes of one poll (a `join_all`)
            // are all queued first; the rest on the committer's thread (see `lead`). All of
            // it goes there when the caller's runtime may stall (below).
            // The guard exists before the task: dropped unpolled (its runtime stopping), the
            // task still hands the lead back.
            let leading = Leading {
                group: Arc::clone(self),
                handed_back: false,
            };
            let db = db.clone();
            let committer = if caller_may_stall() {
                self.committer()
            } else {
                None
            };
            match committer {
                // A caller whose runtime runs only while it waits: given up (a timeout
                // around a `block_on`), it would leave the batch unrun, or halfway, with
                // every later write of the store behind it. The lead waits for the caller's
                // runtime to have ended the poll that queued this write, so that the writes
                // of that poll share the first commit as they do on the caller's runtime —
                // for a while only: that runtime may run nothing more.
                Some(committer) => {
                    let poll_ended = after_this_poll();
                    drop(committer.spawn(async move {
                        let _ = tokio::time::timeout(POLL_ENDS_WITHIN, poll_ended).await;
                        commit_batches(leading, &db, false).await;
                    }));
                }
                None => drop(tokio::spawn(lead(leading, db))),
            }
        }
        answer.await.unwrap_or_else(|_| {
            Err(Error::store(
                "the commit this write waited for was abandoned",
            ))
        })
    }
}

/// How long a lead taken off a caller's runtime that may stall waits for that runtime to end
/// the poll that queued its first write.
const POLL_ENDS_WITHIN: Duration = Duration::from_millis(10);

/// Answers once the caller's runtime runs its next task: after the current poll, on a
/// current-thread runtime. At once without a runtime; never, if the runtime is not run again.
fn after_this_poll() -> oneshot::Receiver<()> {
    let (ended, poll_ended) = oneshot::channel();
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        drop(runtime.spawn(async move {
            let _ = ended.send(());
        }));
    }
    poll_ended
}

/// Commits batches until none waits: the first on the runtime of the write that started the
/// lead, the rest on the committer's thread. After the first batch that write has its answer,
/// and its runtime may no longer be driven (a `block_on` that returned): a next commit there
/// would stay suspended halfway, holding SQLite's turn, with every later write of the store
/// waiting behind it.
async fn lead(leading: Leading, db: Database) {
    let Some(leading) = commit_batches(leading, &db, true).await else {
        return;
    };
    match leading.group.committer().cloned() {
        Some(committer) => drop(committer.spawn(async move {
            commit_batches(leading, &db, false).await;
        })),
        None => {
            commit_batches(leading, &db, false).await;
        }
    }
}

/// Commits batches until none waits, and gives the lead back; or, `first_only`, one batch,
/// and answers the lead, still held, if more may wait.
async fn commit_batches(mut leading: Leading, db: &Database, first_only: bool) -> Option<Leading> {
    let group = Arc::clone(&leading.group);
    loop {
        let (wait, looked) = {
            let mut queue = group.queue();
            let waiting = queue.waiting.len();
            match group
                .grouping
                .wait_before_commit(waiting, queue.only_endings())
            {
                Wait::ForAnother(_) if !queue.endings_waits.take() => (Wait::None, waiting),
                wait => (wait, waiting),
            }
        };
        match wait {
            Wait::None => {}
            // Until the linger ends, or the group is full: no one else could join it.
            Wait::Linger(linger) => {
                let deadline = tokio::time::Instant::now().checked_add(linger);
                loop {
                    let joined = group.joined.notified();
                    futures::pin_mut!(joined);
                    joined.as_mut().enable();
                    if group.queue().waiting.len() >= group.grouping.max_batch {
                        break;
                    }
                    let lingered = match deadline {
                        Some(deadline) => tokio::time::timeout_at(deadline, joined).await,
                        None => {
                            joined.await;
                            Ok(())
                        }
                    };
                    if lingered.is_err() {
                        break;
                    }
                }
            }
            Wait::ForAnother(at_most) => {
                let joined = group.joined.notified();
                futures::pin_mut!(joined);
                joined.as_mut().enable();
                // Registered, then looked again: a write that joined since is company already,
                // and one that joins from now on wakes it.
                let alone = group.queue().waiting.len() == looked;
                if alone && tokio::time::timeout(at_most, joined).await.is_err() {
                    group.queue().endings_waits.in_vain();
                }
            }
        }
        let batch: Vec<(Write, Reply)> = {
            let mut queue = group.queue();
            if queue.waiting.is_empty() {
                // Handed back under the lock a new write takes to decide whether to lead.
                queue.leaders -= 1;
                leading.handed_back = true;
                return None;
            }
            let take = queue.waiting.len().min(group.grouping.max_batch);
            queue.waiting.drain(..take).collect()
        };
        let (writes, replies): (Vec<Write>, Vec<Reply>) = batch.into_iter().unzip();
        let answers = commit(db, &writes).await;
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
        if first_only {
            let mut queue = group.queue();
            if !queue.waiting.is_empty() {
                return Some(leading);
            }
            // Nothing more: handed back here, with no hop to the committer's thread.
            queue.leaders -= 1;
            leading.handed_back = true;
            return None;
        }
    }
}

/// The lead of a group: fails what still waits if the leader's task is dropped (its runtime
/// stopped), so that the next write leads again instead of waiting for a leader that is gone.
struct Leading {
    group: Arc<GroupCommit>,
    /// Whether the leader gave the lead back itself, with nothing waiting.
    handed_back: bool,
}

impl Drop for Leading {
    fn drop(&mut self) {
        if self.handed_back {
            return;
        }
        let waiting = {
            let mut queue = self.group.queue();
            queue.leaders -= 1;
            // Another leader still commits what waits.
            if queue.leaders > 0 {
                return;
            }
            std::mem::take(&mut queue.waiting)
        };
        for (_, reply) in waiting {
            let _ = reply.send(Err(Error::store(
                "the runtime committing this write stopped; try again",
            )));
        }
    }
}

/// Commits `writes` in one transaction; one answer per write, in order.
async fn commit(db: &Database, writes: &[Write]) -> Vec<Result<Written, Error>> {
    if let [write] = writes {
        return vec![write.alone(db).await];
    }
    match in_one_transaction(db, writes).await {
        Ok(written) => written.into_iter().map(Ok).collect(),
        // One write's data was refused: each alone, so the others still commit and the bad
        // one gets its own answer.
        Err(Error::Rejected(_)) if writes.len() > 1 => {
            let mut answers = Vec::with_capacity(writes.len());
            for write in writes {
                answers.push(write.alone(db).await);
            }
            answers
        }
        Err(error) => {
            let message = error.to_string();
            let mut answers = vec![Err(error)];
            answers.extend((1..writes.len()).map(|_| Err(Error::store(message.clone()))));
            answers
        }
    }
}

/// Commits `writes` in one transaction of their own, all or nothing.
pub(crate) async fn in_one_transaction(
    db: &Database,
    writes: &[Write],
) -> Result<Vec<Written>, Error> {
    let mut tx = db.begin().await?;
    let written = run_together(&mut tx, writes).await?;
    tx.commit().await?;
    Ok(written)
}

/// Runs `writes` in `tx`: the receives of envelopes due now in statements of many rows, the
/// settles without cascades likewise, and the begins of one owner's same attempt (a node
/// resuming a backlog begins many first attempts at once), the rest one by one. The writes of a group commit come
/// from callers that wait on none of the others, so any order of them is an order they could
/// have come in; each answer is what its write found in that order. (A `receive_batch` is one
/// caller's, in its order: its receives keep that order among themselves, so the first of two
/// copies of an envelope is the one recorded.)
async fn run_together(tx: &mut Tx, writes: &[Write]) -> Result<Vec<Written>, Error> {
    let mut answers: Vec<Option<Written>> = vec![None; writes.len()];
    let settling_node = writes.iter().find_map(|write| match write {
        Write::Settle { node, cascaded, .. } if cascaded.is_empty() => Some(Arc::clone(node)),
        _ => None,
    });
    let beginning = writes.iter().find_map(|write| match write {
        Write::BeginAttempt {
            attempt,
            previous,
            node,
            ..
        } => Some((*attempt, *previous, Arc::clone(node))),
        _ => None,
    });
    let mut receives = Vec::new();
    let mut settles = Vec::new();
    let mut begins = Vec::new();
    for (at, write) in writes.iter().enumerate() {
        match write {
            Write::Receive { due_at: None, .. } => receives.push(at),
            Write::Settle { node, cascaded, .. }
                if cascaded.is_empty() && Some(node) == settling_node.as_ref() =>
            {
                settles.push(at);
            }
            Write::BeginAttempt {
                attempt,
                previous,
                node,
                ..
            } if beginning.as_ref() == Some(&(*attempt, *previous, Arc::clone(node))) => {
                begins.push(at);
            }
            _ => {}
        }
    }
    // In key order across the statements too (a stable sort: of two copies of one id, the
    // first still first), so that two groups committing at once lock shared keys in one order.
    receives.sort_by(|a, b| writes[*a].id().cmp(writes[*b].id()));
    for chunk in by_bytes(&receives, |at| writes[at].bytes(), RUN_BYTES) {
        let mut start = 0;
        for size in Rows::sizes(chunk.len()) {
            let run = &chunk[start..start + size];
            start += size;
            receive_rows(tx, writes, run, &mut answers).await?;
        }
    }
    let mut start = 0;
    for size in Rows::sizes(settles.len()) {
        let run = &settles[start..start + size];
        start += size;
        settle_rows(tx, writes, run, &mut answers).await?;
    }
    let mut start = 0;
    for size in Rows::sizes(begins.len()) {
        let run = &begins[start..start + size];
        start += size;
        begin_rows(tx, writes, run, &mut answers).await?;
    }
    for (write, answer) in writes.iter().zip(answers.iter_mut()) {
        if answer.is_none() {
            *answer = Some(write.run(tx).await?);
        }
    }
    answers
        .into_iter()
        .map(|answer| answer.ok_or_else(|| Error::store("a write of the batch went unanswered")))
        .collect()
}

/// The most bytes of envelopes one multi-row receive carries: PostgreSQL refuses a statement
/// whose parameters pass 1 GiB, and 64 envelopes near a raised `max_envelope_size` would.
const RUN_BYTES: usize = 64 * 1024 * 1024;

/// `items` cut, in order, into chunks of at most `limit` bytes each (an item larger than that
/// alone).
fn by_bytes(items: &[usize], bytes: impl Fn(usize) -> usize, limit: usize) -> Vec<&[usize]> {
    let mut chunks = Vec::new();
    let (mut start, mut total) = (0, 0usize);
    for (at, &item) in items.iter().enumerate() {
        let size = bytes(item);
        if at > start && total.saturating_add(size) > limit {
            chunks.push(&items[start..at]);
            (start, total) = (at, 0);
        }
        total = total.saturating_add(size);
    }
    if start < items.len() {
        chunks.push(&items[start..]);
    }
    chunks
}

/// The receives at `run` (envelopes due now), in one statement. Of two receives of one id,
/// the first inserts and the second finds it, as they would one after the other.
async fn receive_rows(
    tx: &mut Tx,
    writes: &[Write],
    run: &[usize],
    answers: &mut [Option<Written>],
) -> Result<(), Error> {
    // In the order of their ids (the first of two copies still first): every group inserts,
    // and so locks, the keys it shares with a group committing at once (PostgreSQL) in the
    // same order, so two groups never wait on each other.
    let mut in_key_order = run.to_vec();
    in_key_order.sort_by(|a, b| writes[*a].id().cmp(writes[*b].id()));
    let mut values = Vec::with_capacity(run.len() * 12);
    for &at in &in_key_order {
        if let Write::Receive {
            columns,
            attempts,
            node,
            now,
            due_at: None,
        } = &writes[at]
        {
            values.extend(columns.values_and(&[
                Value::Int32(*attempts),
                Value::Text(node),
                Value::Int64(*now),
            ]));
        }
    }
    let inserted = returned_ids(
        tx.fetch_all_built(RECEIVE_ROWS.text(run.len()), &values)
            .await?,
    )?;
    answer_run(writes, run, inserted, answers, |found| {
        received(u64::from(found), false)
    });
    Ok(())
}

/// The settles at `run` (one owner's, without cascades), in one statement at the latest of
/// their times. Of two settles of one id, the first marks it and the second finds it marked.
async fn settle_rows(
    tx: &mut Tx,
    writes: &[Write],
    run: &[usize],
    answers: &mut [Option<Written>],
) -> Result<(), Error> {
    let mut latest = i64::MIN;
    let mut owner = None;
    let mut ids = Vec::with_capacity(2 * run.len());
    for &at in run {
        if let Write::Settle {
            id,
            node,
            now,
            attempts,
            ..
        } = &writes[at]
        {
            latest = latest.max(*now);
            owner = Some(node);
            ids.extend([Value::Text(id), Value::Int32(*attempts)]);
        }
    }
    let Some(owner) = owner else { return Ok(()) };
    let mut values = Vec::with_capacity(ids.len() + 2);
    values.extend([Value::Int64(latest), Value::Text(owner)]);
    values.extend(ids);
    let marked = returned_ids(
        tx.fetch_all_built(MARK_HANDLED_ROWS.text(run.len()), &values)
            .await?,
    )?;
    answer_run(writes, run, marked, answers, |found| {
        settled(u64::from(found))
    });
    Ok(())
}

/// The begins at `run` (one owner's, of the same attempt), in one statement. Of two begins of
/// one id, the first starts the attempt and the second finds it started, as they would one
/// after the other.
async fn begin_rows(
    tx: &mut Tx,
    writes: &[Write],
    run: &[usize],
    answers: &mut [Option<Written>],
) -> Result<(), Error> {
    let mut values = Vec::with_capacity(run.len() + 3);
    for &at in run {
        if let Write::BeginAttempt {
            id,
            attempt,
            previous,
            node,
        } = &writes[at]
        {
            if values.is_empty() {
                values.extend([
                    Value::Int32(*attempt),
                    Value::Text(node),
                    Value::Int32(*previous),
                ]);
            }
            values.push(Value::Text(id));
        }
    }
    if values.is_empty() {
        return Ok(());
    }
    let begun = returned_ids(
        tx.fetch_all_built(BEGIN_ATTEMPT_ROWS.text(run.len()), &values)
            .await?,
    )?;
    answer_run(writes, run, begun, answers, |found| {
        Written::Begun(Fenced::from_rows(u64::from(found)))
    });
    Ok(())
}

/// The `id` column of each row.
fn returned_ids(rows: Vec<Row>) -> Result<HashSet<String>, Error> {
    rows.iter().map(|row| row.get::<String>("id")).collect()
}

/// Answers the writes at `run`: the first write of each id the statement returned found it
/// changed, every other found nothing to change.
fn answer_run(
    writes: &[Write],
    run: &[usize],
    mut changed: HashSet<String>,
    answers: &mut [Option<Written>],
    answer: impl Fn(bool) -> Written,
) {
    for &at in run {
        answers[at] = Some(answer(changed.remove(writes[at].id())));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{
        ENDINGS_WAIT_AT_MOST, EndingsWaits, Grouping, LINGER_FROM, SKIPS_AFTER_A_WAIT_IN_VAIN,
        Wait, by_bytes,
    };

    #[test]
    fn receives_are_cut_where_their_bytes_would_pass_the_limit() {
        let sizes = [40, 40, 30, 100, 0, 5, 60];
        let items: Vec<usize> = (0..sizes.len()).collect();
        let chunks = by_bytes(&items, |at| sizes[at], 100);
        assert_eq!(chunks, [&[0, 1][..], &[2][..], &[3, 4][..], &[5, 6][..]]);
        // One larger than the limit goes alone; none is lost or repeated.
        let chunks = by_bytes(&items, |at| sizes[at], 10);
        assert_eq!(chunks.concat(), items);
        assert!(by_bytes(&[], |_| 0, 10).is_empty());
    }

    fn grouping(linger: Duration) -> Grouping {
        Grouping {
            max_batch: 128,
            linger,
            commits: 1,
        }
    }

    #[test]
    fn a_write_its_caller_goes_on_from_never_waits_alone_or_in_two() {
        let grouping = grouping(Duration::from_secs(3600));
        for waiting in 1..LINGER_FROM {
            assert_eq!(grouping.wait_before_commit(waiting, false), Wait::None);
        }
    }

    #[test]
    fn writes_that_only_end_attempts_wait_briefly_for_the_next_write() {
        let quick = grouping(Duration::from_micros(150));
        assert_eq!(
            quick.wait_before_commit(1, true),
            Wait::ForAnother(Duration::from_micros(150))
        );
        let slow = grouping(Duration::from_secs(3600));
        for waiting in 1..LINGER_FROM {
            assert_eq!(
                slow.wait_before_commit(waiting, true),
                Wait::ForAnother(ENDINGS_WAIT_AT_MOST),
                "however long the linger"
            );
        }
    }

    #[test]
    fn many_waiting_linger_and_a_full_batch_or_no_linger_commits_at_once() {
        let linger = Duration::from_millis(2);
        let grouping = grouping(linger);
        for only_endings in [false, true] {
            assert_eq!(
                grouping.wait_before_commit(LINGER_FROM, only_endings),
                Wait::Linger(linger)
            );
            assert_eq!(grouping.wait_before_commit(128, only_endings), Wait::None);
            assert_eq!(
                super::Grouping {
                    linger: Duration::ZERO,
                    ..grouping
                }
                .wait_before_commit(1, only_endings),
                Wait::None
            );
        }
        assert_eq!(grouping.wait_before_commit(0, true), Wait::None);
    }

    #[test]
    fn after_a_wait_in_vain_the_next_endings_do_not_wait_for_a_while() {
        let mut waits = EndingsWaits::default();
        assert!(waits.take(), "they wait until one waited in vain");
        assert!(waits.take());
        waits.in_vain();
        for skip in 0..SKIPS_AFTER_A_WAIT_IN_VAIN {
            assert!(!waits.take(), "skip {skip}");
        }
        assert!(waits.take(), "then wait again");
    }

    #[test]
    fn a_settle_that_cascades_messages_is_waited_on() {
        let settle = |cascaded: Vec<super::EnvelopeColumns>| super::Write::Settle {
            id: "e".to_owned(),
            node: "n".into(),
            now: 0,
            attempts: 1,
            cascaded,
        };
        assert!(settle(Vec::new()).only_ends_an_attempt());
        let cascaded = dacapo_actors::Envelope::new("orders.placed", b"{}".to_vec());
        let columns = super::EnvelopeColumns::of(&cascaded).unwrap();
        assert!(
            !settle(vec![columns]).only_ends_an_attempt(),
            "its messages are delivered once it committed"
        );
    }
}
