//! What a module author needs, in one import: `use dacapo::prelude::*;`.

pub use crate::{
    Deduplication, Envelope, Handler, HandlerError, Message, MessageContext, Module, RetryPolicy,
    Runtime, SendOptions, ids,
};
