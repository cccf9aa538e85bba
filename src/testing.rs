//! The test harness: a runtime on virtual time, faults injected into handlers, duplicate
//! deliveries, and publishing that waits for the delivery to settle and reports what happened.
//!
//! The engine under the harness runs its own timers (cooldowns, handler timeouts, background
//! rounds) on a virtual clock that moves to a delivery's next timer as soon as nothing in the
//! engine is working — no handler running, no store write under way — or as far as
//! [`TestHarness::advance`] says, so a 60 s cooldown passes at once and the report's
//! [`attempt_offsets`](crate::DeliveryReport::attempt_offsets) show exact virtual times. It
//! never moves a pool's, a driver's or a handler's own tokio timers: a handler doing real I/O
//! runs in real time. The test itself runs on an ordinary tokio runtime: the harness's waits are
//! bounded in real time.
//!
//! ```
//! use std::time::Duration;
//! use dacapo::prelude::*;
//! use dacapo::testing::{Fault, Recorder, TestHarness};
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Clone, Serialize, Deserialize)] struct MemberRemoved { member_id: u64 }
//! # impl Message for MemberRemoved { const TYPE: &'static str = "organization.member_removed"; }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dacapo::Error> {
//! let calls = Recorder::<MemberRemoved>::new();
//! let harness = TestHarness::builder()
//!     .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", calls.clone()))
//!     .fault("webhooks", "queue", Fault::fail_times(2))
//!     .build()?;
//!
//! let report = harness.publish(&MemberRemoved { member_id: 7 }).await?;
//! assert!(report.is_handled());
//! assert_eq!(report.attempts, 3);
//! assert_eq!(report.cooldowns(), [Duration::from_secs(1), Duration::from_secs(6)]);
//! assert_eq!(calls.count(), 1); // the faults ran before the handler on the failed attempts
//! # Ok(())
//! # }
//! ```

mod fault;
mod harness;
mod recorder;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod scratch;
// Without a SQL store there are no statements to hook: the faults' API stays, striking nothing.
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
mod store_fault;

pub use dacapo_actors::Failpoint;
pub use fault::Fault;
pub use harness::{SEED_VARIABLE, TestHarness, TestHarnessBuilder};
pub use recorder::{Call, Recorder};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use scratch::ScratchDatabase;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use store_fault::{Committing, StoreHooks};
pub use store_fault::{StoreFault, StoreFaults};
