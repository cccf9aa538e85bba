//! What a module author needs, in one import: `use reprise::prelude::*;`.

pub use crate::{
    Deduplication, Envelope, Handler, HandlerError, Message, MessageContext, Module, RetryPolicy,
    Runtime, SendOptions, ids,
};
