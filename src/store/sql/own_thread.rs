//! A thread with a tokio runtime of its own, for work that must go on whatever becomes of the
//! runtime that started it: a caller's runtime may stop, or stay idle after a `block_on`.

std::thread_local! {
    /// Whether this thread's runtime runs as long as the thread: one of [`spawn`]'s, or a
    /// transport's.
    static DRIVEN_FOR_ITS_LIFE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as one whose runtime runs as long as it does.
pub(crate) fn driven_for_its_life() {
    DRIVEN_FOR_ITS_LIFE.set(true);
}

/// Whether a task spawned here may stop being run before it ends: the caller runs on no tokio
/// runtime, or on a current-thread runtime of the application's, which runs only while one of
/// its `block_on`s does. A multi-thread runtime runs its tasks on its workers whatever its
/// `block_on`s do; the engine's threads (actix's) and dacapo's own run for their lives.
pub(crate) fn caller_may_stall() -> bool {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
                && !DRIVEN_FOR_ITS_LIFE.get()
                && actix::System::try_current().is_none()
        }
        Err(_) => true,
    }
}

/// A runtime that runs what is spawned on it to its end: the caller's, unless that one may
/// stall ([`caller_may_stall`]), then a thread of dacapo's own, started once for the process
/// and kept for its life. `None` with neither (no runtime, and no thread could start).
///
/// For work a caller must not leave halfway when it gives up: a transaction's end, which
/// SQLite's turn to write waits for.
pub(crate) fn lasting_runtime() -> Option<tokio::runtime::Handle> {
    static LASTING: std::sync::OnceLock<Option<OwnThread>> = std::sync::OnceLock::new();
    if !caller_may_stall() {
        return tokio::runtime::Handle::try_current().ok();
    }
    LASTING
        .get_or_init(|| OwnThread::start("dacapo-lasting").ok())
        .as_ref()
        .map(|thread| thread.runtime().clone())
        .or_else(|| tokio::runtime::Handle::try_current().ok())
}

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
            driven_for_its_life();
            run(tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build())
        })?;
    Ok(())
}

/// A thread of [`spawn`]'s whose runtime runs until the last handle to it is dropped: the
/// connections a task opens on it stay driven (their replies read, their wakers woken) for as
/// long as that, whichever runtime's tasks then use them.
#[derive(Debug)]
pub(crate) struct OwnThread {
    runtime: tokio::runtime::Handle,
    /// Dropped with the last handle, it ends the thread.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl OwnThread {
    /// Starts thread `name`.
    ///
    /// # Errors
    ///
    /// The operating system's, when the thread or its runtime cannot start.
    pub(crate) fn start(name: &str) -> std::io::Result<Self> {
        let (started, runtime) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        spawn(name, move |runtime| match runtime {
            Ok(runtime) => {
                if started.send(Ok(runtime.handle().clone())).is_ok() {
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                }
            }
            Err(error) => {
                let _ = started.send(Err(error));
            }
        })?;
        // The thread's first step: this waits for microseconds.
        let runtime = runtime
            .recv()
            .map_err(|_| std::io::Error::other("the thread ended as it started"))??;
        Ok(Self {
            runtime,
            _stop: stop,
        })
    }

    /// The thread's runtime.
    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Runs `work` on the thread and returns what it returns.
    ///
    /// # Panics
    ///
    /// If `work` panics.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, `work` still runs to its end on the thread — unless the cancelled caller held
    /// the last handle to it, whose drop ends the thread and drops `work` with it.
    #[cfg(feature = "postgres")]
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> T {
        match self.runtime.spawn(work).await {
            Ok(done) => done,
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            // The runtime runs as long as `self`, which the caller holds.
            Err(error) => unreachable!("the thread's runtime stopped under its owner: {error}"),
        }
    }
}
