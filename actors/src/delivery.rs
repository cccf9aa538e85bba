//! One delivery as a pure state machine: `step(event) -> effect`, no actors, no store, no
//! clock of its own. The [`DeliverySupervisor`](crate::DeliverySupervisor) feeds it what
//! happened (an attempt ended, a store write answered, a timer fired) and runs the effect it
//! returns (record an attempt, run the handlers, record a retry, wait, settle). Every store
//! write it asks for is one transition that carries the whole new state, so a crash between
//! any two of them resumes from the last one written.

use chrono::{DateTime, Utc};

use crate::ports::{Fenced, Handled};
use crate::report::DiscardReason;
use crate::{
    AggregateError, DeadLetter, DeadLetterReason, Envelope, Error, FailureKind, HandlerFailure,
    HandlerId, Outcome, RetryDecision, RetryPolicy,
};

/// Where a delivery stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Not started: the supervisor has not checked the envelope yet.
    New,
    /// Waiting for the store to record that the next attempt starts.
    Beginning,
    /// Its handlers run.
    Running,
    /// Waiting for the store to record a failed attempt and the next one's time.
    RecordingRetry { due_at: DateTime<Utc> },
    /// Waiting for the next attempt's time.
    CoolingDown { due_at: DateTime<Utc> },
    /// Waiting for the store to settle it as handled.
    Handling,
    /// Waiting for the store to dead-letter it; `bare` once the letter without its failures
    /// is tried, after the store refused the whole one.
    DeadLettering {
        reason: DeadLetterReason,
        bare: bool,
    },
    /// Waiting for the store to settle it as discarded, for this reason.
    Discarding(DiscardReason),
    /// Over: reported, nothing more to do.
    Done,
}

/// How a delivery starts once its envelope was checked.
#[derive(Debug)]
pub(crate) enum Start {
    /// Run the first attempt now.
    Now,
    /// Wait until then first: a cooldown a restart resumes, or a scheduled time.
    At(DateTime<Utc>),
    /// A restart found an attempt started and never recorded as ended: it counts as failed.
    Interrupted,
    /// Bad input: dead-letter it without running anything.
    Reject(DeadLetterReason),
    /// A type nobody handles, configured to be discarded: settle it without running anything.
    Discard,
}

/// What happened to a delivery.
#[derive(Debug)]
pub(crate) enum Event {
    /// The envelope was checked; how it starts.
    Started(Start),
    /// The store answered the record of an attempt's start.
    AttemptRecorded(Result<Fenced, Error>),
    /// Every handler of the attempt ended: those that failed (by index), and what the handlers
    /// cascaded, with the handler that cascaded each.
    AttemptEnded {
        failed: Vec<(usize, HandlerFailure)>,
        cascaded: Vec<(HandlerId, Envelope)>,
    },
    /// The store answered the record of a failed attempt.
    RetryRecorded(Result<Fenced, Error>),
    /// The cooldown is over.
    Due,
    /// The store answered the settle of a handled (or discarded) delivery.
    HandledRecorded(Result<Handled, Error>),
    /// The store answered the dead letter.
    DeadLetterRecorded(Result<Fenced, Error>),
}

/// What the supervisor must do next.
#[derive(Debug, PartialEq)]
pub(crate) enum Effect {
    /// Record that attempt `n` starts (fenced), then report [`Event::AttemptRecorded`].
    RecordAttempt(u32),
    /// Run the handlers, but those that already succeeded (see [`Delivery::skips`]), as
    /// attempt `attempt`; report [`Event::AttemptEnded`].
    RunHandlers { attempt: u32 },
    /// Record the failed attempt, the state a resume needs, and `due_at` (fenced); report
    /// [`Event::RetryRecorded`].
    RecordRetry { due_at: DateTime<Utc> },
    /// Wait until `due_at`, then report [`Event::Due`].
    Wait { due_at: DateTime<Utc> },
    /// Settle the delivery as handled with its cascades (fenced); report
    /// [`Event::HandledRecorded`].
    RecordHandled,
    /// Dead-letter it (fenced); report [`Event::DeadLetterRecorded`].
    RecordDeadLetter(Box<DeadLetter>),
    /// Settle a discarded delivery (fenced); report [`Event::HandledRecorded`].
    RecordDiscard,
    /// Over: report the outcome and free the delivery's slot.
    Finish(Outcome),
}

/// What the machine needs from outside to decide, read when an event arrives.
pub(crate) struct Rules<'a> {
    /// Reads the current time. Only failures and rejections need it, so it is read at most
    /// once per step, and only by a step that asks: a handled delivery's steps never do.
    pub(crate) clock: &'a dyn Fn() -> DateTime<Utc>,
    /// Whether the store recorded the first attempt with the envelope (a fresh receive), so
    /// that attempt starts without a write of its own.
    pub(crate) first_attempt_recorded: bool,
    /// The retry policy for a failed attempt.
    pub(crate) policy: &'a dyn Fn(&AggregateError) -> RetryPolicy,
    /// The time this step read, once it read it.
    pub(crate) read: std::cell::Cell<Option<DateTime<Utc>>>,
}

impl Rules<'_> {
    /// The current time, the same for the whole step.
    pub(crate) fn now(&self) -> DateTime<Utc> {
        match self.read.get() {
            Some(now) => now,
            None => {
                let now = (self.clock)();
                self.read.set(Some(now));
                now
            }
        }
    }
}

/// A delivery's whole state.
#[derive(Debug)]
pub(crate) struct Delivery {
    /// The envelope; `attempts` counts the attempts started.
    pub(crate) envelope: Envelope,
    /// The failed attempts' aggregate errors, oldest first: the first and the latest
    /// [`FAILURES_KEPT`] - 1.
    pub(crate) failures: Vec<AggregateError>,
    first_failure_at: Option<DateTime<Utc>>,
    /// Which handlers (by index) already succeeded, under `RetryScope::FailedHandlers`.
    pub(crate) succeeded: Vec<bool>,
    /// What handlers published in attempts where they succeeded, sent once it is handled.
    pub(crate) cascaded: Vec<Envelope>,
    phase: Phase,
}

impl Delivery {
    /// A delivery of `envelope`, with what an earlier run recorded of it.
    pub(crate) fn new(
        envelope: Envelope,
        failures: Vec<AggregateError>,
        succeeded: Vec<bool>,
        cascaded: Vec<Envelope>,
    ) -> Self {
        Self {
            first_failure_at: failures.first().map(|f| f.failed_at),
            envelope,
            failures,
            succeeded,
            cascaded,
            phase: Phase::New,
        }
    }

    pub(crate) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Whether handler `index` already succeeded and is not run again.
    pub(crate) fn skips(&self, index: usize) -> bool {
        self.succeeded.get(index).copied().unwrap_or(false)
    }

    /// The handlers that succeeded so far, by name (`module/name`).
    pub(crate) fn succeeded_handlers(&self, handlers: &[HandlerId]) -> Vec<String> {
        handlers
            .iter()
            .zip(&self.succeeded)
            .filter(|(_, done)| **done)
            .map(|(h, _)| h.to_string())
            .collect()
    }

    /// Moves the delivery on by one event; the effect is what the supervisor runs next.
    /// An event that does not fit the phase (a late answer) changes nothing.
    pub(crate) fn step(&mut self, event: Event, rules: &Rules<'_>) -> Option<Effect> {
        use Phase as P;
        let effect = match (&self.phase, event) {
            (P::New, Event::Started(start)) => self.start(start, rules),
            (P::CoolingDown { .. }, Event::Due) => self.next_attempt(rules),
            (P::Beginning, Event::AttemptRecorded(answer)) => match answer {
                Ok(Fenced::Written) => self.run(),
                Ok(_) => self.owned_elsewhere(),
                Err(error) => self.store_rejected(&error, rules),
            },
            (P::Running, Event::AttemptEnded { failed, cascaded }) => {
                self.attempt_ended(failed, cascaded, rules)
            }
            (&P::RecordingRetry { due_at }, Event::RetryRecorded(answer)) => match answer {
                Ok(Fenced::Written) => {
                    self.phase = P::CoolingDown { due_at };
                    Effect::Wait { due_at }
                }
                Ok(_) => self.owned_elsewhere(),
                Err(error) => self.store_rejected(&error, rules),
            },
            (P::Handling, Event::HandledRecorded(answer)) => match answer {
                Ok(Handled::Written { .. }) => self.finish(Outcome::Handled),
                Ok(_) => self.owned_elsewhere(),
                Err(error) => self.store_rejected(&error, rules),
            },
            (P::Discarding(reason), Event::HandledRecorded(answer)) => {
                let reason = reason.clone();
                match answer {
                    Ok(Handled::Written { .. }) => self.finish(Outcome::Discarded(reason)),
                    Ok(_) => self.owned_elsewhere(),
                    // Not even settled: its row stays for an operator (and for this node's
                    // sweep of rows nothing runs, which tries again).
                    Err(_) if reason == DiscardReason::StoreRejected => {
                        self.finish(Outcome::Discarded(reason))
                    }
                    Err(error) => self.store_rejected(&error, rules),
                }
            }
            (P::DeadLettering { reason, bare }, Event::DeadLetterRecorded(answer)) => {
                let (reason, bare) = (reason.clone(), *bare);
                match answer {
                    Ok(Fenced::Written) => self.finish(Outcome::DeadLettered(reason)),
                    Ok(_) => self.owned_elsewhere(),
                    // The letter with its failures was refused: try the bare envelope once.
                    Err(error) if !bare => {
                        let reason = DeadLetterReason::StoreRejected(error.to_string());
                        let mut letter = DeadLetter::rejected(
                            self.envelope.clone(),
                            reason.clone(),
                            rules.now(),
                        );
                        letter.attempts = self.envelope.attempts;
                        self.phase = P::DeadLettering { reason, bare: true };
                        Effect::RecordDeadLetter(Box::new(letter))
                    }
                    // Nothing of it can be stored: settle it without a letter rather than hold
                    // its slot forever, or run it again at every sweep (the supervisor logs
                    // it loudly, with the envelope's id and type).
                    Err(_) => {
                        self.phase = P::Discarding(DiscardReason::StoreRejected);
                        Effect::RecordDiscard
                    }
                }
            }
            _ => return None,
        };
        Some(effect)
    }

    fn start(&mut self, start: Start, rules: &Rules<'_>) -> Effect {
        match start {
            Start::Now => self.next_attempt(rules),
            Start::At(due_at) => {
                self.phase = Phase::CoolingDown { due_at };
                Effect::Wait { due_at }
            }
            Start::Interrupted => {
                let failure = AggregateError {
                    message_type: self.envelope.message_type.to_string(),
                    message_id: self.envelope.id,
                    attempt: self.envelope.attempts,
                    failures: vec![HandlerFailure {
                        module: "dacapo".into(),
                        handler: "runtime".into(),
                        error: "the runtime stopped while this attempt ran".into(),
                        kind: FailureKind::Error,
                    }],
                    failed_at: rules.now(),
                };
                self.attempt_failed(failure, rules)
            }
            Start::Reject(reason) => {
                let letter = DeadLetter::rejected(self.envelope.clone(), reason, rules.now());
                self.dead_letter(letter)
            }
            Start::Discard => {
                self.phase = Phase::Discarding(DiscardReason::NoHandler);
                Effect::RecordDiscard
            }
        }
    }

    fn next_attempt(&mut self, rules: &Rules<'_>) -> Effect {
        self.envelope.attempts += 1;
        // A fresh receive recorded the first attempt with the envelope; every other attempt
        // is recorded as started before it runs, so a crash while it runs counts it.
        if self.envelope.attempts == 1 && rules.first_attempt_recorded {
            return self.run();
        }
        self.phase = Phase::Beginning;
        Effect::RecordAttempt(self.envelope.attempts)
    }

    fn run(&mut self) -> Effect {
        self.phase = Phase::Running;
        Effect::RunHandlers {
            attempt: self.envelope.attempts,
        }
    }

    fn attempt_ended(
        &mut self,
        mut failed: Vec<(usize, HandlerFailure)>,
        cascaded: Vec<(HandlerId, Envelope)>,
        rules: &Rules<'_>,
    ) -> Effect {
        failed.sort_by_key(|(index, _)| *index);
        // Every handler that ran this attempt and is not among the failures succeeded (tracked
        // only where the supervisor sized `succeeded`: under `RetryScope::FailedHandlers`).
        for (index, done) in self.succeeded.iter_mut().enumerate() {
            *done = *done || !failed.iter().any(|(f, _)| *f == index);
        }
        let failures: Vec<HandlerFailure> = failed.into_iter().map(|(_, f)| f).collect();
        for (handler, envelope) in cascaded {
            // What a handler published in an attempt where it failed is dropped with it.
            if failures
                .iter()
                .any(|f| *f.module == *handler.module && *f.handler == *handler.name)
            {
                continue;
            }
            // The same id published again on a retry is the same message: keep the latest.
            match self.cascaded.iter_mut().find(|kept| kept.id == envelope.id) {
                Some(kept) => *kept = envelope,
                None => self.cascaded.push(envelope),
            }
        }
        if failures.is_empty() {
            self.phase = Phase::Handling;
            return Effect::RecordHandled;
        }
        let failure = AggregateError {
            message_type: self.envelope.message_type.to_string(),
            message_id: self.envelope.id,
            attempt: self.envelope.attempts,
            failures,
            failed_at: rules.now(),
        };
        self.attempt_failed(failure, rules)
    }

    fn attempt_failed(&mut self, failure: AggregateError, rules: &Rules<'_>) -> Effect {
        let now = failure.failed_at;
        self.first_failure_at.get_or_insert(now);
        let decision = (rules.policy)(&failure).decide(failure.attempt, &failure);
        self.failures.push(failure);
        if self.failures.len() > FAILURES_KEPT {
            // The first stays: a resumed delivery reads when it first failed from it.
            let dropped = self.failures.len() - FAILURES_KEPT;
            self.failures.drain(1..=dropped);
        }
        match decision {
            RetryDecision::RetryIn(delay) => {
                let due_at = chrono::Duration::from_std(delay)
                    .ok()
                    .and_then(|delay| now.checked_add_signed(delay))
                    .unwrap_or(DateTime::<Utc>::MAX_UTC);
                self.phase = Phase::RecordingRetry { due_at };
                Effect::RecordRetry { due_at }
            }
            RetryDecision::DeadLetter { exhausted } => {
                let reason = if exhausted {
                    DeadLetterReason::RetriesExhausted
                } else {
                    DeadLetterReason::Permanent
                };
                let letter = DeadLetter::failed(
                    self.envelope.clone(),
                    reason,
                    self.failures.clone(),
                    self.first_failure_at.unwrap_or(now),
                    now,
                );
                self.dead_letter(letter)
            }
        }
    }

    fn dead_letter(&mut self, mut letter: DeadLetter) -> Effect {
        // The attempts it started, also where the letter's failures end before the last one:
        // an attempt that succeeded but whose settle the store refused.
        letter.attempts = self.envelope.attempts;
        self.phase = Phase::DeadLettering {
            reason: letter.reason.clone(),
            bare: false,
        };
        Effect::RecordDeadLetter(Box::new(letter))
    }

    /// The store refused to record the next state: dead-letter the delivery with the store's
    /// reason (what it published goes with it), the only state left that can settle it.
    fn store_rejected(&mut self, error: &Error, rules: &Rules<'_>) -> Effect {
        let letter = DeadLetter::failed(
            self.envelope.clone(),
            DeadLetterReason::StoreRejected(error.to_string()),
            self.failures.clone(),
            self.first_failure_at.unwrap_or(rules.now()),
            rules.now(),
        );
        self.cascaded.clear();
        self.dead_letter(letter)
    }

    fn owned_elsewhere(&mut self) -> Effect {
        self.finish(Outcome::Discarded(DiscardReason::OwnedElsewhere))
    }

    fn finish(&mut self, outcome: Outcome) -> Effect {
        self.phase = Phase::Done;
        Effect::Finish(outcome)
    }
}

/// How many attempts' failures a delivery keeps, the first and the latest: each retry's
/// record writes them all, and a policy that retries without end (`retry_limit: u32::MAX`) would otherwise make
/// every write longer than the one before, for as long as the message keeps failing.
pub(crate) const FAILURES_KEPT: usize = 100;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn handler(name: &str) -> HandlerId {
        HandlerId {
            module: Arc::from("m"),
            name: Arc::from(name),
        }
    }

    fn failure(name: &str, kind: FailureKind) -> HandlerFailure {
        HandlerFailure {
            module: "m".into(),
            handler: name.into(),
            error: format!("{name} failed"),
            kind,
        }
    }

    fn published(id: u128) -> Envelope {
        let mut envelope = Envelope::new("m.published", b"{}".to_vec());
        envelope.id = uuid::Uuid::from_u128(id);
        envelope
    }

    /// Drives a delivery with a fixed clock and policy.
    struct Driver {
        delivery: Delivery,
        now: DateTime<Utc>,
        fresh: bool,
        policy: RetryPolicy,
    }

    impl Driver {
        fn fresh() -> Self {
            Self {
                delivery: Delivery::new(
                    Envelope::new("m.event", b"{}".to_vec()),
                    Vec::new(),
                    Vec::new(),
                    Vec::new(),
                ),
                now: at(0),
                fresh: true,
                policy: RetryPolicy::default(),
            }
        }

        fn step(&mut self, event: Event) -> Option<Effect> {
            let policy = self.policy;
            let decide = move |_: &AggregateError| policy;
            let now = self.now;
            let clock = move || now;
            let rules = Rules {
                clock: &clock,
                first_attempt_recorded: self.fresh,
                policy: &decide,
                read: std::cell::Cell::new(None),
            };
            self.delivery.step(event, &rules)
        }

        fn ended(&mut self, failed: Vec<(usize, HandlerFailure)>) -> Option<Effect> {
            self.step(Event::AttemptEnded {
                failed,
                cascaded: Vec::new(),
            })
        }
    }

    #[test]
    fn a_fresh_delivery_runs_at_once_and_settles_handled() {
        let mut d = Driver::fresh();
        assert_eq!(
            d.step(Event::Started(Start::Now)),
            Some(Effect::RunHandlers { attempt: 1 }),
            "its first attempt was recorded with the envelope"
        );
        assert_eq!(d.ended(Vec::new()), Some(Effect::RecordHandled));
        assert_eq!(
            d.step(Event::HandledRecorded(Ok(Handled::Written {
                in_outbox: true
            }))),
            Some(Effect::Finish(Outcome::Handled))
        );
        assert_eq!(d.delivery.phase(), &Phase::Done);
    }

    #[test]
    fn a_resumed_delivery_records_every_attempt_before_it_runs() {
        let mut d = Driver::fresh();
        d.fresh = false;
        assert_eq!(
            d.step(Event::Started(Start::Now)),
            Some(Effect::RecordAttempt(1))
        );
        assert_eq!(
            d.step(Event::AttemptRecorded(Ok(Fenced::Written))),
            Some(Effect::RunHandlers { attempt: 1 })
        );
    }

    #[test]
    fn a_failed_attempt_is_recorded_then_cooled_down_then_recorded_as_started_again() {
        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        let due_at = at(1);
        assert_eq!(
            d.ended(vec![(0, failure("a", FailureKind::Error))]),
            Some(Effect::RecordRetry { due_at }),
            "the first pause is 1 s"
        );
        assert_eq!(d.delivery.failures.len(), 1);
        assert_eq!(
            d.step(Event::RetryRecorded(Ok(Fenced::Written))),
            Some(Effect::Wait { due_at })
        );
        d.now = due_at;
        assert_eq!(d.step(Event::Due), Some(Effect::RecordAttempt(2)));
        assert_eq!(
            d.step(Event::AttemptRecorded(Ok(Fenced::Written))),
            Some(Effect::RunHandlers { attempt: 2 })
        );
        let due_at = at(7);
        assert_eq!(
            d.ended(vec![(0, failure("a", FailureKind::Error))]),
            Some(Effect::RecordRetry { due_at }),
            "the second pause is 6 s"
        );
    }

    #[test]
    fn a_delivery_retried_without_end_keeps_its_first_and_latest_failures_only() {
        let mut d = Driver::fresh();
        d.policy = RetryPolicy {
            retry_limit: u32::MAX,
            ..RetryPolicy::default()
        };
        d.step(Event::Started(Start::Now));
        for attempt in 1..=150u32 {
            assert!(matches!(
                d.ended(vec![(0, failure("a", FailureKind::Error))]),
                Some(Effect::RecordRetry { .. })
            ));
            d.step(Event::RetryRecorded(Ok(Fenced::Written)));
            d.step(Event::Due);
            assert_eq!(
                d.step(Event::AttemptRecorded(Ok(Fenced::Written))),
                Some(Effect::RunHandlers {
                    attempt: attempt + 1
                })
            );
        }
        let failures = &d.delivery.failures;
        assert_eq!(failures.len(), FAILURES_KEPT);
        let attempts: Vec<u32> = failures.iter().map(|f| f.attempt).collect();
        assert_eq!(attempts[..2], [1, 52], "the first, then the latest");
        assert_eq!(attempts.last(), Some(&150));
    }

    #[test]
    fn the_attempt_after_the_limit_dead_letters_with_every_failure() {
        let mut d = Driver::fresh();
        d.policy = RetryPolicy {
            retry_limit: 1,
            ..RetryPolicy::default()
        };
        d.step(Event::Started(Start::Now));
        d.ended(vec![(0, failure("a", FailureKind::Error))]);
        d.step(Event::RetryRecorded(Ok(Fenced::Written)));
        d.step(Event::Due);
        d.step(Event::AttemptRecorded(Ok(Fenced::Written)));
        let Some(Effect::RecordDeadLetter(letter)) =
            d.ended(vec![(0, failure("a", FailureKind::Error))])
        else {
            panic!("dead-lettered");
        };
        assert_eq!(letter.reason, DeadLetterReason::RetriesExhausted);
        assert_eq!(letter.failures.len(), 2);
        assert_eq!(letter.attempts, 2);
        assert_eq!(
            d.step(Event::DeadLetterRecorded(Ok(Fenced::Written))),
            Some(Effect::Finish(Outcome::DeadLettered(
                DeadLetterReason::RetriesExhausted
            )))
        );
    }

    #[test]
    fn a_permanent_failure_dead_letters_at_once() {
        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        let effect = d.ended(vec![
            (0, failure("a", FailureKind::Error)),
            (1, failure("b", FailureKind::Permanent)),
        ]);
        assert!(
            matches!(&effect, Some(Effect::RecordDeadLetter(l)) if l.reason == DeadLetterReason::Permanent),
            "{effect:?}"
        );
    }

    #[test]
    fn every_fenced_write_that_lost_its_row_stops_the_delivery_without_writing_more() {
        let owned_elsewhere = Some(Effect::Finish(Outcome::Discarded(
            DiscardReason::OwnedElsewhere,
        )));
        let mut d = Driver::fresh();
        d.fresh = false;
        d.step(Event::Started(Start::Now));
        assert_eq!(
            d.step(Event::AttemptRecorded(Ok(Fenced::OwnedElsewhere))),
            owned_elsewhere
        );

        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        d.ended(vec![(0, failure("a", FailureKind::Error))]);
        assert_eq!(
            d.step(Event::RetryRecorded(Ok(Fenced::OwnedElsewhere))),
            owned_elsewhere
        );

        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        d.ended(Vec::new());
        assert_eq!(
            d.step(Event::HandledRecorded(Ok(Handled::OwnedElsewhere))),
            owned_elsewhere
        );

        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Reject(DeadLetterReason::Permanent)));
        assert_eq!(
            d.step(Event::DeadLetterRecorded(Ok(Fenced::OwnedElsewhere))),
            owned_elsewhere
        );
    }

    #[test]
    fn a_state_the_store_rejects_dead_letters_with_its_reason_then_gives_up() {
        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        d.step(Event::AttemptEnded {
            failed: Vec::new(),
            cascaded: vec![(handler("a"), published(1))],
        });
        let refused = Error::rejected("a cascade the outbox cannot hold");
        let Some(Effect::RecordDeadLetter(letter)) = d.step(Event::HandledRecorded(Err(refused)))
        else {
            panic!("dead-lettered");
        };
        assert!(
            matches!(&letter.reason, DeadLetterReason::StoreRejected(t) if t.contains("cannot hold"))
        );
        assert!(
            d.delivery.cascaded.is_empty(),
            "what it published goes with it"
        );
        assert_eq!(letter.attempts, 1, "the attempt that succeeded counts");

        let refused = Error::rejected("the letter too");
        let Some(Effect::RecordDeadLetter(bare)) = d.step(Event::DeadLetterRecorded(Err(refused)))
        else {
            panic!("the bare letter is tried");
        };
        assert!(bare.failures.is_empty());
        assert_eq!(bare.attempts, 1, "the bare letter counts the attempts too");
        assert_eq!(
            d.step(Event::DeadLetterRecorded(Err(Error::rejected("still")))),
            Some(Effect::RecordDiscard),
            "settled without a letter rather than holding its slot"
        );
        assert_eq!(
            d.step(Event::HandledRecorded(Ok(Handled::Written {
                in_outbox: true
            }))),
            Some(Effect::Finish(Outcome::Discarded(
                DiscardReason::StoreRejected
            )))
        );
    }

    #[test]
    fn what_a_failed_handler_published_is_dropped_and_a_republished_id_kept_once() {
        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        d.step(Event::AttemptEnded {
            failed: vec![(1, failure("b", FailureKind::Error))],
            cascaded: vec![(handler("a"), published(1)), (handler("b"), published(2))],
        });
        let ids = |d: &Driver| {
            d.delivery
                .cascaded
                .iter()
                .map(|e| e.id.as_u128())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&d), [1]);
        d.step(Event::RetryRecorded(Ok(Fenced::Written)));
        d.step(Event::Due);
        d.step(Event::AttemptRecorded(Ok(Fenced::Written)));
        assert_eq!(
            d.step(Event::AttemptEnded {
                failed: Vec::new(),
                cascaded: vec![(handler("a"), published(1)), (handler("b"), published(2))],
            }),
            Some(Effect::RecordHandled)
        );
        assert_eq!(ids(&d), [1, 2]);
    }

    #[test]
    fn under_failed_handlers_scope_a_succeeded_handler_is_skipped_on_the_retry() {
        let mut d = Driver::fresh();
        d.delivery.succeeded = vec![false, false];
        d.step(Event::Started(Start::Now));
        d.ended(vec![(1, failure("b", FailureKind::Error))]);
        assert!(d.delivery.skips(0));
        assert!(!d.delivery.skips(1));
        assert_eq!(
            d.delivery.succeeded_handlers(&[handler("a"), handler("b")]),
            ["m/a"]
        );
    }

    #[test]
    fn an_interrupted_attempt_counts_as_failed() {
        let mut envelope = Envelope::new("m.event", b"{}".to_vec());
        envelope.attempts = 3;
        let mut d = Driver::fresh();
        d.fresh = false;
        d.delivery = Delivery::new(envelope, Vec::new(), Vec::new(), Vec::new());
        let effect = d.step(Event::Started(Start::Interrupted));
        assert!(
            matches!(effect, Some(Effect::RecordRetry { .. })),
            "{effect:?}"
        );
        let failure = &d.delivery.failures[0];
        assert_eq!(failure.attempt, 3);
        assert!(failure.failures[0].error.contains("runtime stopped"));
    }

    #[test]
    fn a_scheduled_or_resumed_start_waits_first() {
        let mut d = Driver::fresh();
        assert_eq!(
            d.step(Event::Started(Start::At(at(60)))),
            Some(Effect::Wait { due_at: at(60) })
        );
        assert_eq!(d.step(Event::Due), Some(Effect::RunHandlers { attempt: 1 }));
    }

    #[test]
    fn an_event_that_does_not_fit_the_phase_changes_nothing() {
        let mut d = Driver::fresh();
        d.step(Event::Started(Start::Now));
        assert_eq!(d.step(Event::Due), None);
        assert_eq!(d.step(Event::RetryRecorded(Ok(Fenced::Written))), None);
        assert_eq!(d.delivery.phase(), &Phase::Running);
        assert_eq!(d.delivery.envelope.attempts, 1);
    }

    #[test]
    fn a_discarded_type_settles_without_running() {
        let mut d = Driver::fresh();
        assert_eq!(
            d.step(Event::Started(Start::Discard)),
            Some(Effect::RecordDiscard)
        );
        assert_eq!(
            d.step(Event::HandledRecorded(Ok(Handled::Written {
                in_outbox: true
            }))),
            Some(Effect::Finish(Outcome::Discarded(DiscardReason::NoHandler)))
        );
    }
}
