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
        drop_as_handler_code(self.0.take());
    }
}

/// The text of a handler's error, read and then dropped as handler code.
///
/// Its `Display` and its destructor are the handler's own: a `Display` that panics, or that
/// returns `Err` (which `to_string` turns into a panic), would otherwise end the handler's
/// actor before it reports, and leave its delivery waiting for a result that never comes.
pub(crate) fn error_text<E: std::fmt::Display>(error: E) -> String {
    let _marked = Marked::enter();
    let mut text = String::new();
    let written = std::panic::catch_unwind(AssertUnwindSafe(|| {
        std::fmt::write(&mut text, format_args!("{error}"))
    }));
    let text = match written {
        Ok(Ok(())) => text,
        Ok(Err(std::fmt::Error)) => format!("{text} (the error's Display failed)"),
        Err(panic) => {
            drop_as_handler_code(panic);
            "(the error's Display panicked)".to_owned()
        }
    };
    drop_as_handler_code(error);
    text
}

/// Drops what handler code made, catching a panic of its destructor. The panic's own payload
/// is leaked rather than dropped, since its destructor could panic in turn.
pub(crate) fn drop_as_handler_code<T>(value: T) {
    let _marked = Marked::enter();
    if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(move || drop(value))) {
        std::mem::forget(panic);
        tracing::warn!(
            target: "dacapo::panics",
            "a handler's value panicked while it was dropped; the panic is ignored"
        );
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
