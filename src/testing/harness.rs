use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dacapo_actors::{
    DeliveryReport, Envelope, HandlerId, Message, Module, RetryPolicy, SendOptions, ShutdownReport,
};
use tokio::sync::oneshot;

use crate::testing::Fault;
use crate::{Error, Runtime, RuntimeBuilder};

/// Configures a [`TestHarness`].
#[derive(Debug)]
pub struct TestHarnessBuilder {
    runtime: RuntimeBuilder,
    faults: Vec<(HandlerId, Fault)>,
    settle_timeout: Duration,
}

impl TestHarnessBuilder {
    /// Registers a module.
    #[must_use]
    pub fn module(mut self, module: Module) -> Self {
        self.runtime = self.runtime.module(module);
        self
    }

    /// The runtime-wide retry policy.
    #[must_use]
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.runtime = self.runtime.retry_policy(policy);
        self
    }

    /// The per-handler timeout.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.runtime = self.runtime.handler_timeout(timeout);
        self
    }

    /// Any other runtime setting.
    #[must_use]
    pub fn configure(mut self, configure: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder) -> Self {
        self.runtime = configure(self.runtime);
        self
    }

    /// Injects `fault` in front of the handler `name` of `module`.
    #[must_use]
    pub fn fault(mut self, module: &str, name: &str, fault: Fault) -> Self {
        let id = HandlerId {
            module: module.into(),
            name: name.into(),
        };
        self.faults.push((id, fault));
        self
    }

    /// How long, in real time, tracked calls wait for a delivery to settle (default 10 s).
    /// Virtual time makes cooldowns instant, so this only bounds a stuck test.
    #[must_use]
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = timeout;
        self
    }

    /// Starts the runtime on virtual time.
    ///
    /// # Errors
    ///
    /// The runtime's build errors, and [`Error::UnknownHandler`] (which lists the registered
    /// handlers) when a fault names a handler that is not registered.
    pub fn build(self) -> Result<TestHarness, Error> {
        let clock = dacapo_actors::VirtualClock::new();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let reports = Arc::clone(&reports);
            dacapo_actors::ReportSink(Arc::new(move |report: &DeliveryReport| {
                reports
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(report.clone());
            }))
        };
        let (mut registry, runtime) = self
            .runtime
            .virtual_time(Arc::clone(&clock))
            .report_to(sink)
            .into_parts()?;
        for (id, fault) in self.faults {
            if !registry.wrap_handler(&id, |inner| fault.clone().wrap(inner)) {
                let mut registered: Vec<_> = registry.entries().map(|e| e.id.clone()).collect();
                registered.sort_by_key(ToString::to_string);
                registered.dedup();
                return Err(Error::UnknownHandler {
                    handler: id,
                    registered,
                });
            }
        }
        Ok(TestHarness {
            runtime: runtime.start(registry)?,
            settle_timeout: self.settle_timeout,
            clock,
            reports,
        })
    }
}

/// A runtime on virtual time with faults injected, and calls that wait for deliveries to
/// settle and report them.
#[derive(Debug)]
pub struct TestHarness {
    runtime: Runtime,
    settle_timeout: Duration,
    clock: Arc<dacapo_actors::VirtualClock>,
    /// Every settled delivery's report, in the order they settled.
    reports: Arc<Mutex<Vec<DeliveryReport>>>,
}

impl TestHarness {
    /// Starts configuring a harness.
    pub fn builder() -> TestHarnessBuilder {
        TestHarnessBuilder {
            runtime: Runtime::builder(),
            faults: Vec::new(),
            settle_timeout: Duration::from_secs(10),
        }
    }

    /// The runtime under test.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Moves the runtime's virtual clock forward by `by`, timer by timer: each cooldown,
    /// handler timeout and background round due on the way runs at its own time, once the
    /// runtime is idle (a handler at work is waited for, never timed out by the jump). The
    /// clock also moves by itself to a delivery's next timer whenever nothing in the runtime
    /// works; this moves it further, for what waits on time with the runtime idle (background
    /// rounds: recovery, the outbox relay, cleanup, reaping).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the clock stays where the last woken timer put it.
    pub async fn advance(&self, by: Duration) {
        self.clock.advance(by).await;
    }

    /// The report of every delivery that settled so far, in the order they settled — the
    /// messages handlers cascaded included, which no call of the test waited for. Call
    /// [`idle`](Self::idle) first to have every one.
    pub fn reports(&self) -> Vec<DeliveryReport> {
        self.reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Time elapsed on the runtime's virtual clock since the harness started.
    pub fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Publishes `message` and waits until its delivery settles.
    ///
    /// # Errors
    ///
    /// [`Error::NotSettled`] past the settle timeout, and the errors of
    /// [`Runtime::publish`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the message may be delivered without its report being awaited.
    pub async fn publish<M: Message>(&self, message: &M) -> Result<DeliveryReport, Error> {
        self.publish_with(message, SendOptions::default()).await
    }

    /// [`publish`](Self::publish) with send options.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn publish_with<M: Message>(
        &self,
        message: &M,
        options: SendOptions,
    ) -> Result<DeliveryReport, Error> {
        let envelope = self.runtime.envelope(message, options)?;
        self.deliver(envelope).await
    }

    /// Delivers a prepared envelope (malformed, oversized, a copy of an earlier one…) and
    /// waits until it settles.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn deliver(&self, envelope: Envelope) -> Result<DeliveryReport, Error> {
        let id = envelope.id;
        let report = self.runtime.receive_tracked(envelope).await?;
        self.settled(id, report).await
    }

    /// Delivers the same envelope `copies` times, each copy accepted before any settles — a
    /// broker redelivering while the first delivery still runs — and waits for every copy to
    /// settle.
    ///
    /// # Errors
    ///
    /// As [`publish`](Self::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Self::publish).
    pub async fn deliver_concurrently(
        &self,
        envelope: Envelope,
        copies: usize,
    ) -> Result<Vec<DeliveryReport>, Error> {
        let id = envelope.id;
        let accepted = futures::future::join_all(
            (0..copies).map(|_| self.runtime.receive_tracked(envelope.clone())),
        )
        .await;
        let mut reports = Vec::with_capacity(copies);
        for receiver in accepted {
            reports.push(self.settled(id, receiver?).await?);
        }
        Ok(reports)
    }

    async fn settled(
        &self,
        envelope_id: uuid::Uuid,
        report: oneshot::Receiver<DeliveryReport>,
    ) -> Result<DeliveryReport, Error> {
        match tokio::time::timeout(self.settle_timeout, report).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(_)) => Err(Error::Abandoned(envelope_id)),
            Err(_) => Err(Error::NotSettled {
                envelope_id,
                waited: self.settle_timeout,
            }),
        }
    }

    /// Waits until every accepted delivery (cascaded messages and retries included) has
    /// settled.
    ///
    /// # Errors
    ///
    /// [`Error::NotSettled`] (with a nil envelope id) past the settle timeout.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn idle(&self) -> Result<(), Error> {
        tokio::time::timeout(self.settle_timeout, self.runtime.idle())
            .await
            .map_err(|_| Error::NotSettled {
                envelope_id: uuid::Uuid::nil(),
                waited: self.settle_timeout,
            })
    }

    /// Shuts the runtime down; see [`Runtime::shutdown`].
    ///
    /// # Cancel safety
    ///
    /// As [`Runtime::shutdown`].
    pub async fn shutdown(&self) -> ShutdownReport {
        self.runtime.shutdown().await
    }
}
