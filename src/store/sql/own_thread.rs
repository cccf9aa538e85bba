//! A thread with a tokio runtime of its own, for work that must go on whatever becomes of the
//! runtime that started it: a caller's runtime may stop, or stay idle after a `block_on`.

/// Starts thread `name`, which runs `run` with a current-thread runtime of its own — or with
/// the error that kept that runtime from being built, for `run` to report.
///
/// # Errors
///
/// The operating system's, when the thread cannot start.
pub(crate) fn spawn(
    name: &str,
    run: impl FnOnce(std::io::Result<tokio::runtime::Runtime>) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            run(tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build())
        })?;
    Ok(())
}
