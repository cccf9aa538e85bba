//! A node's orphan sweep resumes its own rows that nothing in the process runs, once they are
//! older than the node timeout. A receive whose commit waited that long (SQLite's write lock
//! held by another process) writes a row that is old as it lands: the sweep must not take it
//! for an orphan while its receiver is about to start it.
#![cfg(all(feature = "sqlite", feature = "testing"))]

#[path = "support/manual_clock.rs"]
mod manual_clock;

use std::sync::Arc;
use std::time::Duration;

use dacapo::prelude::*;
use dacapo::store::SqliteStore;
use dacapo::testing::{Recorder, ScratchDatabase};
use manual_clock::ManualClock;
use serde::{Deserialize, Serialize};
use sqlx::Connection as _;
use uuid::Uuid;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct TicketIssued {
    number: u64,
}

impl Message for TicketIssued {
    const TYPE: &'static str = "orphan_sweep.ticket_issued";
}

const NODE: &str = "sweeper";
const NODE_TIMEOUT: Duration = Duration::from_millis(300);
const WAIT: Duration = Duration::from_secs(20);

async fn store(db: &ScratchDatabase, clock: &ManualClock) -> SqliteStore {
    db.sqlite_store()
        .await
        .unwrap()
        .node_id(NODE)
        .node_timeout(NODE_TIMEOUT)
        .clock(Arc::new(clock.clone()))
}

/// How many times the recorder ran the message `id`.
fn runs(recorder: &Recorder<TicketIssued>, id: Uuid) -> usize {
    recorder
        .calls()
        .iter()
        .filter(|call| call.message_id == Some(id))
        .count()
}

async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {WAIT:?}"));
}

/// A runtime on a SQLite file of its own, whose node stamps its rows on `clock` and sweeps
/// every 20 ms, with the recorder its handler is.
struct Node {
    db: ScratchDatabase,
    clock: ManualClock,
    recorder: Recorder<TicketIssued>,
    runtime: Arc<Runtime>,
}

impl Node {
    async fn start() -> Self {
        let (db, clock, recorder) = (
            ScratchDatabase::sqlite(),
            ManualClock::default(),
            Recorder::new(),
        );
        let runtime = Runtime::builder()
            .store(store(&db, &clock).await)
            .recovery_interval(Duration::from_millis(20))
            // An orphan resumes as an interrupted attempt: retried at once, on no clock.
            .retry_policy(RetryPolicy {
                min_retry_interval: Duration::ZERO,
                retry_interval_delta: Duration::ZERO,
                ..RetryPolicy::default()
            })
            .module(
                Module::new("box_office")
                    .handle_named::<TicketIssued, _>("print", recorder.clone()),
            )
            .build()
            .unwrap();
        runtime.first_recovery().await;
        Self {
            db,
            clock,
            recorder,
            runtime: Arc::new(runtime),
        }
    }

    /// Waits for every delivery to settle, checks that `id` ran once, and stops.
    async fn ran_once(self, id: Uuid) {
        tokio::time::timeout(WAIT, self.runtime.idle())
            .await
            .expect("every delivery settles");
        assert_eq!(runs(&self.recorder, id), 1, "the ticket ran once");
        self.runtime.shutdown().await;
    }
}

/// A receive of `envelope` on a thread of its own, blocked between the commit of its row and
/// the start of its delivery.
struct Stalled {
    go: std::sync::mpsc::Sender<()>,
    receiver: std::thread::JoinHandle<Result<(), dacapo::Error>>,
}

impl Stalled {
    /// Receives `envelope` while another process holds SQLite's write lock, so that its commit
    /// waits; blocks the receiver's thread once it waits, then lets the commit go through, and
    /// returns once the envelope's row is there (at once, if it was before).
    async fn receive(runtime: &Arc<Runtime>, db: &ScratchDatabase, envelope: Envelope) -> Self {
        let id = envelope.id;
        let mut holder = sqlx::SqliteConnection::connect(db.url()).await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .unwrap();
        let block = Arc::new(tokio::sync::Notify::new());
        let (blocked_tx, blocked_rx) = tokio::sync::oneshot::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let receiver = std::thread::spawn({
            let (runtime, block) = (Arc::clone(runtime), Arc::clone(&block));
            move || {
                let caller = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                caller.spawn(async move {
                    block.notified().await;
                    blocked_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                });
                caller.block_on(runtime.receive(envelope))
            }
        });
        let received = runtime.stats().received;
        until("the envelope is received", async || {
            runtime.stats().received > received
        })
        .await;
        // Runs once the receive waits for its commit (the way there does not yield).
        block.notify_one();
        tokio::time::timeout(WAIT, blocked_rx)
            .await
            .expect("the receiver's thread blocks")
            .unwrap();
        sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
        until("the envelope's row is there", async || {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dacapo_inbox WHERE id = $1")
                .bind(id.simple().to_string())
                .fetch_one(&mut holder)
                .await
                .unwrap()
                > 0
        })
        .await;
        Self { go, receiver }
    }

    /// Lets the receiver go on, and waits for its receive to return.
    fn go(self) {
        self.go.send(()).unwrap();
        self.receiver.join().unwrap().unwrap();
    }
}

/// Ages every row of the node past the node timeout, and waits for the node's sweep to run:
/// a real orphan of the node's — received by it, run by nothing — resumed by it shows it did.
async fn sweep(node: &Node) {
    let orphan = Envelope::for_message(&TicketIssued { number: 0 }).unwrap();
    dacapo::ports::Inbox::receive(&store(&node.db, &node.clock).await, &orphan)
        .await
        .unwrap();
    node.clock
        .advance(chrono::Duration::from_std(NODE_TIMEOUT * 2).unwrap());
    until("the sweep resumes the orphan", async || {
        runs(&node.recorder, orphan.id) == 1
    })
    .await;
}

/// The receiver's thread stops between the commit of its row and the start of its delivery,
/// the row already older than the node timeout; the node's sweep runs meanwhile and must leave
/// the row to the receiver, whose delivery then runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_whose_commit_waited_past_the_node_timeout_is_not_taken_for_an_orphan() {
    let node = Node::start().await;
    let envelope = Envelope::for_message(&TicketIssued { number: 1 }).unwrap();

    let stalled = Stalled::receive(&node.runtime, &node.db, envelope.clone()).await;
    sweep(&node).await;
    stalled.go();
    node.ran_once(envelope.id).await;
}

/// A second copy of the envelope, received and discarded as a duplicate while the first waits
/// to start, leaves the first listed as starting: the sweep leaves its row alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_received_meanwhile_leaves_the_first_receive_listed() {
    let node = Node::start().await;
    let envelope = Envelope::for_message(&TicketIssued { number: 1 }).unwrap();

    let stalled = Stalled::receive(&node.runtime, &node.db, envelope.clone()).await;
    let report = node
        .runtime
        .receive_tracked(envelope.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        report.outcome,
        Outcome::Discarded(DiscardReason::DuplicateEnvelope),
        "the second copy is a duplicate"
    );
    sweep(&node).await;
    stalled.go();
    node.ran_once(envelope.id).await;
}

/// A row recovery claims while an envelope of the same id is being received here — the
/// receive then finds the row there, a duplicate — is run by the claim: a receive keeps its
/// envelope off this node's orphan sweep, not off recovery, or nothing would run the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_recovery_claims_while_its_envelope_is_being_received_runs_once() {
    let node = Node::start().await;
    // Rows of another node's, released as its shutdown releases them: any node's to claim.
    let other = node
        .db
        .sqlite_store()
        .await
        .unwrap()
        .node_id("other")
        .clock(Arc::new(node.clock.clone()));
    let envelope = Envelope::for_message(&TicketIssued { number: 1 }).unwrap();
    let control = Envelope::for_message(&TicketIssued { number: 2 }).unwrap();
    for held in [&envelope, &control] {
        dacapo::ports::Inbox::receive(&other, held).await.unwrap();
    }

    let stalled = Stalled::receive(&node.runtime, &node.db, envelope.clone()).await;
    dacapo::ports::DurableInbox::release(&other, &[])
        .await
        .unwrap();
    // The claim that takes the control takes the envelope's row with it.
    until("recovery claims and runs the control", async || {
        runs(&node.recorder, control.id) == 1
    })
    .await;
    stalled.go();
    node.ran_once(envelope.id).await;
}
