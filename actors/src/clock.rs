//! The engine's own timers: cooldowns, handler timeouts and the attempt times in reports.
//!
//! In production they are tokio's. Under the test harness they are a [`VirtualClock`], which
//! moves only for the engine's timers: when the test advances it, or by itself to the next due
//! timer once no part of the engine is working — a handler running, a supervisor writing to
//! its store, a delivery being accepted. Each such piece of work holds a [`Busy`] token, handed
//! from one actor to the next with the message that passes the work on, so the count never
//! drops to zero between two steps of one delivery. Nothing else is virtual: a pool's, a
//! driver's and a handler's own tokio timers keep real time, so a handler doing real I/O under
//! the harness behaves as in production.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use crate::ports::Clock;

/// Real (tokio) or virtual timers.
#[derive(Clone, Debug, Default)]
pub enum Timers {
    /// Tokio's clock.
    #[default]
    Real,
    /// A virtual clock, under the test harness.
    Virtual(Arc<VirtualClock>),
}

/// A point in time on [`Timers`], to measure from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mark {
    Real(tokio::time::Instant),
    Virtual(Duration),
}

impl Timers {
    /// A token saying the engine is working: it moves to the next due timer once nothing in the engine is working, or when advanced.
    pub fn busy(&self) -> Busy {
        match self {
            Self::Real => Busy(None),
            Self::Virtual(clock) => clock.busy(),
        }
    }

    /// Puts `items`, which the engine would start together, in the virtual clock's seeded
    /// order; leaves them as they came otherwise.
    ///
    /// Seeded, they are first sorted by `key`: the order they came in (rows a store returns
    /// in no order it promises) must not change what the seed draws.
    pub(crate) fn shuffle<T, K: Ord>(&self, items: &mut [T], key: impl FnMut(&T) -> K) {
        if let Self::Virtual(clock) = self
            && clock.seed.is_some()
        {
            items.sort_by_key(key);
            clock.shuffle(items);
        }
    }

    pub(crate) fn mark(&self) -> Mark {
        match self {
            Self::Real => Mark::Real(tokio::time::Instant::now()),
            Self::Virtual(clock) => Mark::Virtual(clock.elapsed()),
        }
    }

    pub(crate) fn since(&self, mark: Mark) -> Duration {
        match (self, mark) {
            (Self::Virtual(clock), Mark::Virtual(at)) => clock.elapsed().saturating_sub(at),
            (_, Mark::Real(at)) => at.elapsed(),
            (Self::Real, Mark::Virtual(_)) => Duration::ZERO,
        }
    }

    /// Calls `tick` on the actor every `interval`: tokio's interval on real timers; on a virtual
    /// clock, a tick each time the clock passes the next one, which it never moves to by
    /// itself.
    pub(crate) fn every<A, F>(&self, interval: Duration, ctx: &mut actix::Context<A>, tick: F)
    where
        A: actix::Actor<Context = actix::Context<A>>,
        F: FnMut(&mut A, &mut actix::Context<A>) + 'static,
    {
        use actix::AsyncContext;
        match self {
            Self::Real => {
                ctx.run_interval(interval, tick);
            }
            Self::Virtual(clock) => {
                let tick = std::rc::Rc::new(std::cell::RefCell::new(tick));
                next_tick(Arc::clone(clock), interval, tick, ctx);
            }
        }
    }

    /// A handler's timeout of `timeout`, for the work `tie` names (as [`sleep_for`]'s);
    /// see [`Deadline`].
    ///
    /// [`sleep_for`]: Self::sleep_for
    pub(crate) fn deadline(&self, timeout: Duration, tie: u64) -> Deadline {
        match self {
            Self::Real => Deadline::Real(timeout),
            Self::Virtual(clock) => Deadline::Virtual(clock.sleep(timeout, Some(tie))),
        }
    }

    /// Waits `delay` for the work `tie` names (a delivery's attempt, say); yields the token
    /// of the work that resumes. The timer is set when this is called, not when the future is
    /// first polled, so the caller may drop its own token right after. Under a seeded virtual
    /// clock, timers due at one instant wake in an order drawn from the seed and their ties.
    pub(crate) fn sleep_for(&self, delay: Duration, tie: Option<u64>) -> Sleep {
        match self {
            Self::Real => Sleep::Real(Box::pin(tokio::time::sleep(delay))),
            Self::Virtual(clock) => clock.sleep(delay, tie),
        }
    }
}

/// The engine is working while one is held (nothing, on real timers).
#[must_use = "the engine counts as idle once the token is dropped"]
pub struct Busy(Option<Arc<VirtualClock>>);

impl std::fmt::Debug for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Busy")
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(clock) = self.0.take() {
            clock.release();
        }
    }
}

/// A wait on [`Timers`].
pub(crate) enum Sleep {
    Real(Pin<Box<tokio::time::Sleep>>),
    Virtual {
        clock: Arc<VirtualClock>,
        id: (Duration, u64),
        woken: oneshot::Receiver<Busy>,
    },
}

impl Future for Sleep {
    type Output = Busy;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Busy> {
        match self.get_mut() {
            Self::Real(sleep) => sleep.as_mut().poll(cx).map(|()| Busy(None)),
            Self::Virtual { woken, .. } => match Pin::new(woken).poll(cx) {
                Poll::Ready(Ok(busy)) => Poll::Ready(busy),
                // The clock is gone with its engine: nothing will wake this.
                Poll::Ready(Err(_)) => Poll::Pending,
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        // A wait given up (a handler that finished before its timeout) is no timer to move to.
        if let Self::Virtual { clock, id, .. } = self {
            clock.cancel(*id);
        }
    }
}

/// Sets the next background tick on `clock`, and the one after when it comes.
fn next_tick<A, F>(
    clock: Arc<VirtualClock>,
    interval: Duration,
    tick: std::rc::Rc<std::cell::RefCell<F>>,
    ctx: &mut actix::Context<A>,
) where
    A: actix::Actor<Context = actix::Context<A>>,
    F: FnMut(&mut A, &mut actix::Context<A>) + 'static,
{
    use actix::{ActorFutureExt, AsyncContext};
    let due = clock.set(interval, false, None);
    ctx.spawn(
        actix::fut::wrap_future::<_, A>(due).map(move |busy, actor, ctx| {
            (tick.borrow_mut())(actor, ctx);
            drop(busy);
            next_tick(clock, interval, tick, ctx);
        }),
    );
}

/// A running handler's token, which it gives up while it waits on the clock alone (a hang the
/// harness injects), so that its timeout can come.
/// Nothing at all on real timers, whose tokens count nothing.
#[derive(Clone, Debug, Default)]
pub(crate) struct Running(Option<Arc<Mutex<Option<Busy>>>>);

impl Running {
    pub(crate) fn new(busy: Busy) -> Self {
        match busy.0 {
            Some(_) => Self(Some(Arc::new(Mutex::new(Some(busy))))),
            None => Self(None),
        }
    }

    /// Takes the token, to hand it on with the handler's report.
    pub(crate) fn take(&self) -> Option<Busy> {
        let slot = self.0.as_ref()?;
        slot.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Gives the token up: the handler waits on nothing but the clock.
    pub(crate) fn give_up(&self) {
        drop(self.take());
    }

    fn put(&self, busy: Busy) {
        if let Some(slot) = &self.0 {
            let previous = slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .replace(busy);
            drop(previous);
        }
    }
}

/// The handler's call timed out.
#[derive(Debug)]
pub(crate) struct TimedOut;

/// A handler's timeout: on real timers just its length, armed only if the handler has to
/// wait; on a virtual clock a timer set at once, before the handler is first polled (a handler
/// that gives its token up at once, an injected hang, must find it set).
pub(crate) enum Deadline {
    Real(Duration),
    Virtual(Sleep),
}

/// `work`, or [`TimedOut`] once `deadline` comes, told to `given_up` before `work` is
/// dropped; on a virtual clock the deadline's token then goes to `running`.
pub(crate) async fn within<F: Future>(
    deadline: Deadline,
    running: &Running,
    work: F,
    given_up: impl FnOnce(),
) -> Result<F::Output, TimedOut> {
    // Pinned here, so that `given_up` is told before the work is dropped, on return.
    let work = std::pin::pin!(work);
    match deadline {
        // Tokio's own timeout fires even when the work has used up the task's budget.
        Deadline::Real(timeout) => match tokio::time::timeout(timeout, work).await {
            Ok(done) => Ok(done),
            Err(_) => {
                given_up();
                Err(TimedOut)
            }
        },
        Deadline::Virtual(sleep) => {
            let sleep = tokio::task::unconstrained(sleep);
            match futures::future::select(work, sleep).await {
                futures::future::Either::Left((done, _)) => Ok(done),
                futures::future::Either::Right((busy, _)) => {
                    running.put(busy);
                    given_up();
                    Err(TimedOut)
                }
            }
        }
    }
}

/// Time that moves only for the engine's own timers: it moves to the next due timer once nothing in the engine is working, or when advanced.
#[derive(Debug)]
pub struct VirtualClock {
    /// The wall-clock time the virtual clock started at.
    epoch: DateTime<Utc>,
    /// Orders what the engine would otherwise run together (timers due at one instant, a
    /// batch of recovered deliveries): `None` keeps the order they came in.
    seed: Option<u64>,
    state: Mutex<State>,
    /// Told whenever the last token goes.
    idle: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    elapsed: Duration,
    busy: usize,
    next_id: u64,
    /// Draws of the seeded order so far.
    draws: u64,
    /// Waiting timers by deadline (then by order of setting), and whether each drives the
    /// clock: a delivery's timers do; the background rounds' ticks (recovery, relay, cleanup,
    /// reaping) only fire as the clock passes them, or an idle runtime would spin through
    /// virtual time.
    timers: BTreeMap<(Duration, u64), (oneshot::Sender<Busy>, bool)>,
}

impl VirtualClock {
    /// A clock at zero, whose wall time starts now.
    pub fn new() -> Arc<Self> {
        Self::seeded(0)
    }

    /// A clock at zero whose choices of order follow `seed`: timers due at one instant wake
    /// one at a time, each once the work of the one before is done, in an order drawn from
    /// the seed, and recovered batches are shuffled by it. Seed 0 keeps the order things
    /// came in, and wakes timers due together at once.
    pub fn seeded(seed: u64) -> Arc<Self> {
        Arc::new(Self {
            // On a whole millisecond, as stores keep times: a due time read back after a
            // restart is then the one written, and a seeded run's timings repeat exactly.
            epoch: DateTime::from_timestamp_millis(Utc::now().timestamp_millis())
                .unwrap_or_else(Utc::now),
            seed: (seed != 0).then_some(seed),
            state: Mutex::default(),
            idle: tokio::sync::Notify::new(),
        })
    }

    /// The next number of the seeded order (`None` without a seed).
    fn draw(&self, state: &mut State) -> Option<u64> {
        let seed = self.seed?;
        state.draws += 1;
        Some(mix(seed ^ mix(state.draws)))
    }

    /// Shuffles `items` in the seeded order; leaves them as they are without a seed.
    pub(crate) fn shuffle<T>(&self, items: &mut [T]) {
        let mut state = self.state();
        for last in (1..items.len()).rev() {
            let Some(draw) = self.draw(&mut state) else {
                return;
            };
            let pick = usize::try_from(draw % (last as u64 + 1)).unwrap_or(last);
            items.swap(last, pick);
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Time elapsed on this clock.
    pub fn elapsed(&self) -> Duration {
        self.state().elapsed
    }

    fn busy(self: &Arc<Self>) -> Busy {
        self.state().busy += 1;
        Busy(Some(Arc::clone(self)))
    }

    fn release(self: &Arc<Self>) {
        let mut state = self.state();
        state.busy = state.busy.saturating_sub(1);
        if state.busy == 0 {
            self.idle.notify_waiters();
        }
        self.run_idle(state);
    }

    /// Returns once nothing in the engine works.
    async fn until_idle(&self) {
        crate::told::until(&self.idle, || self.state().busy == 0).await;
    }

    fn sleep(self: &Arc<Self>, delay: Duration, tie: Option<u64>) -> Sleep {
        self.set(delay, true, tie)
    }

    fn set(self: &Arc<Self>, delay: Duration, drives: bool, tie: Option<u64>) -> Sleep {
        let (wake, woken) = oneshot::channel();
        let mut state = self.state();
        let at = state.elapsed.saturating_add(delay);
        let order = match self.seed {
            // Timers due together wake in an order drawn from the seed and from what the timer
            // is for (a delivery's attempt), or else from how many were set for that instant
            // before — never from everything set before, which the threads' timing reorders.
            Some(seed) => {
                let tie = tie
                    .unwrap_or_else(|| state.timers.range((at, 0)..=(at, u64::MAX)).count() as u64);
                // Not the instant itself: a test's own times (a schedule from the wall
                // clock) would make it differ from run to run.
                let mut order = mix(seed ^ mix(tie));
                while state.timers.contains_key(&(at, order)) {
                    order = order.wrapping_add(1);
                }
                order
            }
            None => state.next_id,
        };
        let id = (at, order);
        state.next_id += 1;
        state.timers.insert(id, (wake, drives));
        self.run_idle(state);
        Sleep::Virtual {
            clock: Arc::clone(self),
            id,
            woken,
        }
    }

    fn cancel(&self, id: (Duration, u64)) {
        self.state().timers.remove(&id);
    }

    /// Moves the clock forward by `by`, timer by timer: each timer due on the way is woken at
    /// its own deadline, once the engine is idle — a handler at work is waited for, never
    /// timed out by the jump — and what it sets within the span is woken in turn.
    pub async fn advance(self: &Arc<Self>, by: Duration) {
        let _ = self.advance_within(by, None).await;
    }

    /// [`advance`](Self::advance), giving up once the engine takes longer than `each_wait`
    /// to get idle for a timer (`None`: no bound). The bound is each wait's, not the span's:
    /// a long span of quick rounds is not cut short.
    ///
    /// # Errors
    ///
    /// [`Elapsed`](tokio::time::error::Elapsed) when a wait passed `each_wait`; the clock
    /// stays where the last woken timer put it.
    pub async fn advance_within(
        self: &Arc<Self>,
        by: Duration,
        each_wait: Option<Duration>,
    ) -> Result<(), tokio::time::error::Elapsed> {
        let until = self.elapsed().saturating_add(by);
        loop {
            match each_wait {
                Some(wait) => tokio::time::timeout(wait, self.until_idle()).await?,
                None => self.until_idle().await,
            }
            let mut state = self.state();
            if state.busy > 0 {
                continue;
            }
            let Some(&(at, _)) = state.timers.keys().next().filter(|(at, _)| *at <= until) else {
                state.elapsed = state.elapsed.max(until);
                return Ok(());
            };
            self.wake_at(&mut state, at);
        }
    }

    /// With nothing working, moves to the next timer and wakes every timer due then.
    fn run_idle(self: &Arc<Self>, mut state: std::sync::MutexGuard<'_, State>) {
        if state.busy > 0 {
            return;
        }
        let Some(&(at, _)) = state
            .timers
            .iter()
            .find(|(_, (_, drives))| *drives)
            .map(|(id, _)| id)
        else {
            return;
        };
        self.wake_at(&mut state, at);
    }

    /// Moves the clock to `at` and wakes every timer due by then, in order — or, seeded, the
    /// first one still waited for: the next wakes once its work is done.
    fn wake_at(self: &Arc<Self>, state: &mut State, at: Duration) {
        state.elapsed = state.elapsed.max(at);
        while let Some(entry) = state.timers.first_entry() {
            if entry.key().0 > at {
                break;
            }
            let (wake, _) = entry.remove();
            if self.wake(state, wake) && self.seed.is_some() {
                break;
            }
        }
    }

    /// Hands a token to the woken work, counted before the lock is let go; `false` when
    /// nobody waited any more.
    fn wake(self: &Arc<Self>, state: &mut State, wake: oneshot::Sender<Busy>) -> bool {
        state.busy += 1;
        let busy = Busy(Some(Arc::clone(self)));
        if let Err(mut busy) = wake.send(busy) {
            // Nobody waits any more: the token goes uncounted here, since dropping it would
            // take the lock held here.
            busy.0 = None;
            state.busy -= 1;
            return false;
        }
        true
    }
}

/// SplitMix64's finalizer: a well-spread number from any input.
fn mix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

impl Clock for VirtualClock {
    fn now(&self) -> DateTime<Utc> {
        // Saturates: a clock advanced "for ever" (`Duration::MAX`) reads the calendar's end
        // instead of panicking in whichever actor asks next.
        chrono::TimeDelta::from_std(self.elapsed())
            .ok()
            .and_then(|elapsed| self.epoch.checked_add_signed(elapsed))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn virtual_timers() -> (Arc<VirtualClock>, Timers) {
        let clock = VirtualClock::new();
        (Arc::clone(&clock), Timers::Virtual(clock))
    }

    #[test]
    fn a_seeded_shuffle_does_not_depend_on_the_order_items_came_in() {
        let shuffled = |mut items: Vec<u32>| {
            Timers::Virtual(VirtualClock::seeded(7)).shuffle(&mut items, |item| *item);
            items
        };
        let one = shuffled((0..20).collect());
        assert_eq!(one, shuffled((0..20).rev().collect()));
        assert_ne!(one, (0..20).collect::<Vec<_>>(), "the seed reorders them");
        // Unseeded, they keep the order they came in.
        let mut items: Vec<u32> = (0..20).rev().collect();
        Timers::Virtual(VirtualClock::new()).shuffle(&mut items, |item| *item);
        assert_eq!(items, (0..20).rev().collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_clock_advanced_past_the_calendar_reads_its_end() {
        let clock = VirtualClock::new();
        clock.advance(Duration::from_secs(60)).await;
        assert!(clock.now() < DateTime::<Utc>::MAX_UTC);
        clock.advance(Duration::MAX).await;
        assert_eq!(clock.now(), DateTime::<Utc>::MAX_UTC);
        // A span chrono can hold, but not add to the epoch.
        let clock = VirtualClock::new();
        clock
            .advance(Duration::from_secs(i64::MAX as u64 / 1_000))
            .await;
        assert_eq!(clock.now(), DateTime::<Utc>::MAX_UTC);
    }

    #[tokio::test]
    async fn an_idle_engine_moves_to_its_next_timer_at_once() {
        let (clock, timers) = virtual_timers();
        let busy = timers.sleep_for(Duration::from_secs(6), None).await;
        assert_eq!(clock.elapsed(), Duration::from_secs(6));
        drop(busy);
    }

    #[tokio::test]
    async fn the_clock_stays_while_work_is_under_way() {
        let (clock, timers) = virtual_timers();
        let working = timers.busy();
        let mut sleep = Box::pin(timers.sleep_for(Duration::from_secs(1), None));
        assert!(futures::poll!(sleep.as_mut()).is_pending());
        assert_eq!(clock.elapsed(), Duration::ZERO);
        drop(working);
        let _resumed = sleep.await;
        assert_eq!(clock.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_woken_timer_holds_the_clock_until_its_work_is_done() {
        let (clock, timers) = virtual_timers();
        let first = timers.sleep_for(Duration::from_secs(1), None);
        let second = timers.sleep_for(Duration::from_secs(16), None);
        let resumed = first.await;
        assert_eq!(clock.elapsed(), Duration::from_secs(1));
        // The first timer's work holds the clock: the second waits for it.
        let mut second = Box::pin(second);
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(resumed);
        let _ = second.await;
        // Set at 1 s, for 16 s.
        assert_eq!(clock.elapsed(), Duration::from_secs(17));
    }

    #[tokio::test]
    async fn a_wait_given_up_is_no_timer_to_move_to() {
        let (clock, timers) = virtual_timers();
        let working = timers.busy();
        drop(timers.sleep_for(Duration::from_secs(30), None));
        drop(working);
        assert_eq!(clock.elapsed(), Duration::ZERO);
    }

    #[tokio::test]
    async fn advancing_wakes_due_timers_in_order_at_their_own_times_and_leaves_later_ones() {
        let (clock, _) = virtual_timers();
        // Background ticks: the clock never moves to them by itself.
        let late = clock.set(Duration::from_secs(10), false, None);
        let early = clock.set(Duration::from_secs(2), false, None);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let watcher = {
            let (clock, seen) = (Arc::clone(&clock), Arc::clone(&seen));
            tokio::spawn(async move {
                let busy = early.await;
                seen.lock().unwrap().push(clock.elapsed());
                drop(busy);
            })
        };
        clock.advance(Duration::from_secs(5)).await;
        watcher.await.unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            [Duration::from_secs(2)],
            "woken at its own time"
        );
        assert_eq!(clock.elapsed(), Duration::from_secs(5));
        let mut late = Box::pin(late);
        assert!(futures::poll!(late.as_mut()).is_pending());
    }

    #[tokio::test]
    async fn advancing_waits_for_work_under_way_instead_of_timing_it_out() {
        let (clock, timers) = virtual_timers();
        let working = timers.busy();
        let deadline = clock.set(Duration::from_secs(1), true, None);
        let advance = tokio::spawn({
            let clock = Arc::clone(&clock);
            async move { clock.advance(Duration::from_secs(5)).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(clock.elapsed(), Duration::ZERO, "the work holds the clock");
        drop(working);
        let _ = deadline.await;
        advance.await.unwrap();
        assert_eq!(clock.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test]
    async fn wall_time_follows_the_virtual_clock() {
        let (clock, _) = virtual_timers();
        let start = clock.now();
        clock.advance(Duration::from_secs(60)).await;
        assert_eq!(clock.now() - start, chrono::TimeDelta::seconds(60));
    }
}
