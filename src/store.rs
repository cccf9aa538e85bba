//! Storage adapters behind the engine's ports.

mod memory;

pub use memory::{MemoryDeadLetters, MemoryInbox};
