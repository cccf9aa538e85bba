//! Waiting on a [`Notify`] for a condition that the notifier changes.

use tokio::sync::Notify;

/// Returns once `holds()` is true, looked at again each time `changed` is told (with
/// `notify_waiters`, after the change).
///
/// # Cancel safety
///
/// Cancel safe: it only observes.
pub(crate) async fn until(changed: &Notify, holds: impl Fn() -> bool) {
    loop {
        let told = changed.notified();
        let mut told = std::pin::pin!(told);
        // Registered before the look: a change told in between is not missed.
        told.as_mut().enable();
        if holds() {
            return;
        }
        told.await;
    }
}
