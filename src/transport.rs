//! Transports carry envelopes between publishers and the engine.

mod in_process;

pub use in_process::InProcess;
