//! Transports carry envelopes between publishers and the engine.

mod in_process;
mod listener;

pub use dacapo_actors::Backoff;
pub(crate) use in_process::InProcess;
pub use listener::Listener;
