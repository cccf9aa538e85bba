//! What a module author needs, in one import: `use dacapo::prelude::*;`.

pub use crate::{
    DeadLetterReason, Deduplication, DiscardReason, Envelope, FailureKind, Handler, HandlerError,
    Message, MessageContext, Module, Outcome, RetryPolicy, Runtime, SendOptions, ids,
};
