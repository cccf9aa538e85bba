use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use dacapo_actors::{Error, Failpoint, Failpoints};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Unavailable,
    FailingCommits,
    SlowCommits(Duration),
}

/// A fault of the runtime's store, injected by [`StoreFaults::inject`]: every statement the
/// runtime sends fails as if the database were down, or every commit takes longer.
///
/// It strikes the runtime's own statements (accepts, attempt records, settles, dead letters,
/// recovery, the relay, cleanup) — what the engine retries with its backoff and what a
/// listener answers with its pauses. Handler transactions run on the application's pool and
/// are not struck.
///
/// ```
/// use std::time::Duration;
/// use dacapo::testing::StoreFault;
///
/// // The next three statements fail; then the store answers again.
/// let outage = StoreFault::unavailable().times(3);
/// // Every commit waits 50 ms, for two seconds of real time.
/// let slow = StoreFault::slow_commits(Duration::from_millis(50)).lasting(Duration::from_secs(2));
/// # let _ = (outage, slow);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreFault {
    kind: Kind,
    times: Option<u64>,
    lasting: Option<Duration>,
}

impl StoreFault {
    /// Every statement fails with a retryable [`Error::Store`], as when the database is down.
    pub fn unavailable() -> Self {
        Self {
            kind: Kind::Unavailable,
            times: None,
            lasting: None,
        }
    }

    /// Every transaction's commit fails with a retryable [`Error::Store`] after the
    /// statements in it ran: what it wrote is rolled back. (Writes that commit on their own
    /// are not struck: [`unavailable`](Self::unavailable) fails those.)
    pub fn failing_commits() -> Self {
        Self {
            kind: Kind::FailingCommits,
            times: None,
            lasting: None,
        }
    }

    /// Every commit — of a transaction, or of a write that commits on its own — waits `by`
    /// (real time) before it runs.
    pub fn slow_commits(by: Duration) -> Self {
        Self {
            kind: Kind::SlowCommits(by),
            times: None,
            lasting: None,
        }
    }

    /// Strikes `n` statements (commits, for slow commits), then ends.
    #[must_use]
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }

    /// Ends after `span` of real time. The engine's retried writes pause in real time (a store
    /// outage is I/O, not one of the runtime's timers), so an outage is measured in it too.
    #[must_use]
    pub fn lasting(mut self, span: Duration) -> Self {
        self.lasting = Some(span);
        self
    }
}

#[derive(Debug)]
struct Active {
    fault: StoreFault,
    left: Option<u64>,
    until: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    active: Mutex<Option<Active>>,
    struck: AtomicU64,
}

/// The faults of a harness's store: inject one, end it, count what it struck. Cloned handles
/// act on the same store, so a handler can start an outage in the middle of its delivery.
#[derive(Clone, Debug, Default)]
pub struct StoreFaults(Arc<Inner>);

impl StoreFaults {
    /// Starts `fault`, in place of any other.
    pub fn inject(&self, fault: StoreFault) {
        if fault.times == Some(0) {
            self.end();
            return;
        }
        let active = Active {
            fault,
            left: fault.times,
            until: fault.lasting.map(|span| Instant::now() + span),
        };
        *self.active() = Some(active);
    }

    /// Ends the fault: the store answers again.
    pub fn end(&self) {
        *self.active() = None;
    }

    /// Whether a fault is on: injected, not ended, not past its `lasting` span and with
    /// statements left to strike of its `times`.
    pub fn is_on(&self) -> bool {
        let mut active = self.active();
        if active
            .as_ref()
            .and_then(|active| active.until)
            .is_some_and(|until| Instant::now() >= until)
        {
            *active = None;
        }
        active.is_some()
    }

    /// How many statements the faults struck so far.
    pub fn struck(&self) -> u64 {
        self.0.struck.load(Ordering::Acquire)
    }

    fn active(&self) -> std::sync::MutexGuard<'_, Option<Active>> {
        self.0.active.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The kind of fault that strikes this statement, counted: `commit` for a commit (of a
    /// transaction, or of a write on its own), `transaction` for a transaction's.
    fn strike(&self, commit: bool, transaction: bool) -> Option<Kind> {
        let mut active = self.active();
        let current = active.as_mut()?;
        if current.until.is_some_and(|until| Instant::now() >= until) {
            *active = None;
            return None;
        }
        let kind = current.fault.kind;
        let spared = match kind {
            Kind::Unavailable => false,
            Kind::SlowCommits(_) => !commit,
            Kind::FailingCommits => !transaction,
        };
        if spared {
            return None;
        }
        if let Some(left) = &mut current.left {
            *left -= 1;
            if *left == 0 {
                *active = None;
            }
        }
        self.0.struck.fetch_add(1, Ordering::AcqRel);
        Some(kind)
    }
}

/// What the harness does to the runtime's statements: the crash fence of its failpoints, and
/// its store faults.
#[derive(Debug)]
pub(crate) struct StoreHooks {
    pub(crate) failpoints: Arc<Failpoints>,
    pub(crate) faults: StoreFaults,
    /// The runtime whose statements these are ([`Failpoints::run`]).
    run: u64,
    /// Its commits under way, which a restart lets end before the next runtime starts.
    committing: tokio::sync::watch::Sender<usize>,
}

/// A commit under way, counted until it returned or was dropped: a killed runtime's task
/// drops it as the runtime stops, while its database may still be ending the commit (SQLite's
/// connection thread, the PostgreSQL server).
#[derive(Debug)]
pub(crate) struct Committing(Arc<StoreHooks>);

impl Drop for Committing {
    fn drop(&mut self) {
        self.0.committing.send_modify(|n| *n -= 1);
    }
}

impl StoreHooks {
    /// The hooks of the runtime that runs now.
    pub(crate) fn of_the_live_run(failpoints: &Arc<Failpoints>, faults: &StoreFaults) -> Self {
        Self {
            failpoints: Arc::clone(failpoints),
            faults: faults.clone(),
            run: failpoints.run(),
            committing: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Returns once no commit of these hooks' runtime is under way. A killed runtime's
    /// commit that had begun on a thread the kill left running (the group commit's) still
    /// ends, as one the database had received from a process that died would: the next
    /// runtime's first recovery must find what it wrote, as it would have after a real crash.
    /// One whose task the kill dropped is not counted (see [`Committing`]): a restart waits
    /// for it through the database instead, where it can (SQLite's write lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub(crate) async fn commits_ended(&self) {
        let mut committing = self.committing.subscribe();
        let _ = committing.wait_for(|n| *n == 0).await;
    }

    /// Whether these hooks' runtime crashed, or was replaced by a restart. A crashed runtime's
    /// store can go on past its kill where a thread of its own (the group commit's) runs a
    /// batch: its statements must not reach the database once the next runtime started.
    fn gone(&self) -> bool {
        self.failpoints.crashed().is_some() || self.failpoints.run() != self.run
    }

    /// Stops a crashed runtime's statement — forever where it holds nothing, with an error
    /// inside a transaction, which then rolls back as a dead process's would rather than hold
    /// its locks — or fails it as a faulty store would.
    pub(crate) async fn before_statement(&self, in_transaction: bool) -> Result<(), Error> {
        self.stop_if_crashed(in_transaction).await?;
        match self.faults.strike(false, false) {
            Some(Kind::Unavailable) => Err(unavailable()),
            Some(Kind::SlowCommits(_) | Kind::FailingCommits) | None => Ok(()),
        }
    }

    /// Stops a crashed runtime's commit, fails it or slows it as a faulty store would; the
    /// commit, if it goes on, is counted until the guard returned is dropped.
    pub(crate) async fn before_commit(
        self: &Arc<Self>,
        transaction: bool,
    ) -> Result<Committing, Error> {
        self.stop_if_crashed(transaction).await?;
        match self.faults.strike(true, transaction) {
            Some(Kind::Unavailable) => return Err(unavailable()),
            Some(Kind::FailingCommits) => {
                return Err(Error::store(
                    "the commit failed (injected by the test harness: StoreFault::failing_commits)",
                ));
            }
            Some(Kind::SlowCommits(by)) => {
                tokio::time::sleep(by).await;
                // A crash while the commit waited: the commit never runs.
                self.stop_if_crashed(transaction).await?;
            }
            None => {}
        }
        // Counted before the last look at the run: a restart that counts a new run meanwhile
        // either finds this commit counted and waits for it, or is seen here.
        self.committing.send_modify(|n| *n += 1);
        let committing = Committing(Arc::clone(self));
        if self.gone() {
            drop(committing);
            return Err(self.stop(transaction).await);
        }
        Ok(committing)
    }

    async fn stop_if_crashed(&self, in_transaction: bool) -> Result<(), Error> {
        if self.gone() {
            return Err(self.stop(in_transaction).await);
        }
        Ok(())
    }

    /// What a statement of a runtime that is gone gets: an error inside a transaction, which
    /// then rolls back as a dead process's would rather than hold its locks; never an answer
    /// outside one.
    async fn stop(&self, in_transaction: bool) -> Error {
        if in_transaction {
            return Error::store("the runtime crashed (test harness): this transaction rolls back");
        }
        std::future::pending().await
    }

    pub(crate) async fn pass(&self, point: Failpoint, message_type: &str) {
        self.failpoints.pass(point, Some(message_type)).await;
    }
}

fn unavailable() -> Error {
    Error::store("the store is unavailable (injected by the test harness: StoreFault::unavailable)")
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    #[test]
    fn a_statement_of_a_run_a_restart_replaced_never_reaches_the_database() {
        let failpoints = Arc::new(Failpoints::default());
        let faults = StoreFaults::default();
        let killed = Arc::new(StoreHooks::of_the_live_run(&failpoints, &faults));
        assert!(killed.before_statement(false).now_or_never().is_some());
        // A commit that began before the crash is waited for, and only it.
        let begun = killed.before_commit(false).now_or_never().unwrap().unwrap();
        failpoints.arm(Failpoint::AfterSettle, None);
        assert!(failpoints.reached(Failpoint::AfterSettle, None));
        assert!(killed.commits_ended().now_or_never().is_none());
        drop(begun);
        assert!(killed.commits_ended().now_or_never().is_some());
        // The restart: a batch the killed run's committer thread takes up from now on is
        // still the killed run's, though nothing is crashed any more.
        failpoints.reset();
        assert!(
            killed.before_statement(false).now_or_never().is_none(),
            "held for good"
        );
        assert!(matches!(
            killed.before_statement(true).now_or_never(),
            Some(Err(Error::Store(_)))
        ));
        assert!(matches!(
            killed.before_commit(true).now_or_never(),
            Some(Err(Error::Store(_)))
        ));
        let restarted = Arc::new(StoreHooks::of_the_live_run(&failpoints, &faults));
        assert!(matches!(
            restarted.before_statement(true).now_or_never(),
            Some(Ok(()))
        ));
    }

    #[test]
    fn a_lasting_fault_is_off_once_its_span_passed_though_nothing_was_struck() {
        let faults = StoreFaults::default();
        faults.inject(StoreFault::unavailable().lasting(Duration::ZERO));
        assert!(!faults.is_on());
        faults.inject(StoreFault::unavailable().lasting(Duration::from_secs(3600)));
        assert!(faults.is_on());
        assert_eq!(faults.struck(), 0);
    }

    #[test]
    fn a_counted_fault_ends_by_itself_and_slow_commits_spare_other_statements() {
        let faults = StoreFaults::default();
        faults.inject(StoreFault::unavailable().times(2));
        assert_eq!(faults.strike(false, false), Some(Kind::Unavailable));
        assert_eq!(faults.strike(true, false), Some(Kind::Unavailable));
        assert_eq!(faults.strike(false, false), None);
        assert!(!faults.is_on());
        let by = Duration::from_millis(1);
        faults.inject(StoreFault::slow_commits(by));
        assert_eq!(faults.strike(false, false), None);
        assert_eq!(faults.strike(true, false), Some(Kind::SlowCommits(by)));
        faults.inject(StoreFault::failing_commits());
        assert_eq!(faults.strike(true, false), None);
        assert_eq!(faults.strike(true, true), Some(Kind::FailingCommits));
        assert_eq!(faults.struck(), 4);
        faults.end();
        assert_eq!(faults.strike(true, true), None);
    }

    #[test]
    fn a_fault_lasting_a_span_ends_once_it_passed() {
        let faults = StoreFaults::default();
        faults.inject(StoreFault::unavailable().lasting(Duration::ZERO));
        assert_eq!(faults.strike(false, false), None);
        assert!(!faults.is_on());
    }
}
