//! Handler panics, kept quiet on request.
//!
//! A handler's panic is caught and becomes its failure ([`FailureKind::Panicked`] with the
//! panic's message), reported and retried like any other. Rust's panic hook runs before the
//! catch, though, and prints every panic to standard error (with a backtrace under
//! `RUST_BACKTRACE`). [`quiet_handler_panics`] replaces that output, for panics raised while
//! a handler runs only, with a `debug` event.
//!
//! [`FailureKind::Panicked`]: crate::FailureKind::Panicked

use std::cell::Cell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Once;
use std::task::{Context, Poll};

thread_local! {
    /// Whether this thread is running handler code right now.
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as running handler code until dropped, unwinding included.
struct Marked {
    was: bool,
}

impl Marked {
    fn enter() -> Self {
        Self {
            was: IN_HANDLER.replace(true),
        }
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        IN_HANDLER.set(self.was);
    }
}

/// A handler's future, polled and dropped as handler code.
///
/// Dropping it runs the handler's own destructors (a timed-out or never-started handler's
/// locals): a panic there is caught like a panic in `poll`, since on an actix arbiter it would
/// take the arbiter's thread, and every actor on it, down with it.
pub(crate) struct HandlerCode<F>(Option<F>);

impl<F> HandlerCode<F> {
    pub(crate) fn new(future: F) -> Self {
        Self(Some(future))
    }
}

impl<F: Future + Unpin> Future for HandlerCode<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let _marked = Marked::enter();
        match self.0.as_mut() {
            Some(future) => Pin::new(future).poll(cx),
            // Only `drop` takes the future out.
            None => Poll::Pending,
        }
    }
}

impl<F> Drop for HandlerCode<F> {
    fn drop(&mut self) {
        let future = self.0.take();
        let _marked = Marked::enter();
        if std::panic::catch_unwind(AssertUnwindSafe(move || drop(future))).is_err() {
            tracing::warn!(
                target: "dacapo::panics",
                "a handler's future panicked while it was dropped; the panic is ignored"
            );
        }
    }
}

/// Keeps the panics of handlers off standard error: each becomes a `debug` event (target
/// `dacapo::panics`) instead, while the failure it causes is reported as always (a `warn`
/// event for the failed attempt, the dead letter, the delivery report). Panics anywhere else
/// go to the hook that was installed before, unchanged.
///
/// Call it once at start, after installing any panic hook of your own; later calls do
/// nothing. Meant for handlers that panic on purpose (a test of panic handling) or for
/// services whose logs go through `tracing` only.
pub fn quiet_handler_panics() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_HANDLER.get() {
                tracing::debug!(target: "dacapo::panics", panic = %info, "a handler panicked");
            } else {
                previous(info);
            }
        }));
    });
}
