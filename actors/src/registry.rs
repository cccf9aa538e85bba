use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::module::Decode;
use crate::{
    AggregateError, Decoded, Deduplication, HandlerEntry, HandlerId, Invoke, Module, RetryPolicy,
};

/// Every handler of one message type, and how to decode its payload.
#[derive(Clone, Debug)]
pub struct Route {
    message_type: &'static str,
    decode: Decode,
    handlers: Vec<HandlerEntry>,
    policy: Option<RetryPolicy>,
}

impl Route {
    /// The message type this route serves.
    pub fn message_type(&self) -> &'static str {
        self.message_type
    }

    /// Its handlers, in registration order.
    pub fn handlers(&self) -> &[HandlerEntry] {
        &self.handlers
    }

    /// Decodes a payload once for all handlers.
    ///
    /// # Errors
    ///
    /// The deserializer's error when the payload is not a valid message of this type.
    pub fn decode(&self, payload: &[u8]) -> Result<Decoded, serde_json::Error> {
        (self.decode)(payload)
    }
}

/// Which handlers run for which message type, and with which retry policy and timeout.
#[derive(Debug)]
pub struct Registry {
    routes: HashMap<&'static str, Arc<Route>>,
    default_policy: RetryPolicy,
    handler_timeout: Duration,
}

/// A registration that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two handlers of one module share a name for the same message type.
    #[error("handler {0} is registered twice for {1}")]
    DuplicateHandler(HandlerId, &'static str),
    /// Two handlers of one message type name expect different Rust types: one payload cannot
    /// decode into both.
    #[error(
        "{message_type} is handled as {first} and as {second}; one type name needs one Rust type"
    )]
    ConflictingTypes {
        /// The message type name.
        message_type: &'static str,
        /// The Rust type of the first handler registered.
        first: &'static str,
        /// The Rust type of the conflicting handler.
        second: &'static str,
    },
    /// `Module::deduplicate` named a handler the module does not have.
    #[error("module {module} has no handler {name} to deduplicate")]
    UnknownDeduplicatedHandler {
        /// The module.
        module: String,
        /// The name given.
        name: String,
    },
    /// A retry policy was set for a message type no handler handles.
    #[error("a retry policy was set for {0}, which no handler handles")]
    PolicyWithoutHandler(String),
    /// A message type's `TYPE` is empty, longer than [`MAX_MESSAGE_TYPE_LEN`] bytes, or holds
    /// whitespace or control characters: it names the message in stores and on the wire.
    #[error(
        "message type {rust_type} has TYPE {shown:?}: a type name is 1 to {MAX_MESSAGE_TYPE_LEN} bytes without whitespace or control characters"
    )]
    InvalidMessageType {
        /// The Rust type whose `TYPE` it is.
        rust_type: &'static str,
        /// The start of the `TYPE` given (at most 64 characters of it).
        shown: String,
    },
    /// A handler's timeout (the module's, or the runtime's default) is zero: every handler
    /// that awaits anything would time out, and every message be dead-lettered.
    #[error("handler {0} has a timeout of zero: it would time out at its first await")]
    ZeroTimeout(HandlerId),
}

/// The longest `Message::TYPE` a module may register, in bytes.
pub const MAX_MESSAGE_TYPE_LEN: usize = 255;

/// Whether `name` may be a message type name.
fn valid_message_type(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MESSAGE_TYPE_LEN
        && !name.chars().any(|c| c.is_whitespace() || c.is_control())
}

impl Registry {
    /// Builds the routes from `modules`, with per message type policies.
    ///
    /// # Errors
    ///
    /// [`RegistryError`] for a duplicate handler name or a policy without a handler.
    pub fn new(
        modules: Vec<Module>,
        default_policy: RetryPolicy,
        type_policies: HashMap<String, RetryPolicy>,
        handler_timeout: Duration,
    ) -> Result<Self, RegistryError> {
        if let Some((module, name)) = modules.iter().find_map(|m| {
            m.unknown_deduplications()
                .first()
                .map(|n| (m.name().to_owned(), n.clone()))
        }) {
            return Err(RegistryError::UnknownDeduplicatedHandler { module, name });
        }
        let mut routes: HashMap<&'static str, Route> = HashMap::new();
        for entry in modules.into_iter().flat_map(Module::into_handlers) {
            if !valid_message_type(entry.message_type) {
                return Err(RegistryError::InvalidMessageType {
                    rust_type: entry.rust_type.1,
                    shown: entry.message_type.chars().take(64).collect(),
                });
            }
            let route = routes.entry(entry.message_type).or_insert_with(|| Route {
                message_type: entry.message_type,
                decode: entry.decode,
                handlers: Vec::new(),
                policy: None,
            });
            if let Some(first) = route.handlers.first()
                && first.rust_type.0 != entry.rust_type.0
            {
                return Err(RegistryError::ConflictingTypes {
                    message_type: entry.message_type,
                    first: first.rust_type.1,
                    second: entry.rust_type.1,
                });
            }
            if entry.module_timeout.unwrap_or(handler_timeout).is_zero() {
                return Err(RegistryError::ZeroTimeout(entry.id));
            }
            if route.handlers.iter().any(|h| h.id == entry.id) {
                return Err(RegistryError::DuplicateHandler(
                    entry.id,
                    entry.message_type,
                ));
            }
            route.handlers.push(entry);
        }
        for (message_type, policy) in type_policies {
            let route = routes
                .get_mut(message_type.as_str())
                .ok_or(RegistryError::PolicyWithoutHandler(message_type))?;
            route.policy = Some(policy);
        }
        let routes = routes.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
        Ok(Self {
            routes,
            default_policy,
            handler_timeout,
        })
    }

    /// The route of `message_type`, if any handler handles it.
    pub fn route(&self, message_type: &str) -> Option<&Arc<Route>> {
        self.routes.get(message_type)
    }

    /// Whether any handler handles `message_type`.
    pub fn handles(&self, message_type: &str) -> bool {
        self.routes.contains_key(message_type)
    }

    /// How long `entry` may run before it counts as timed out.
    pub fn timeout_of(&self, entry: &HandlerEntry) -> Duration {
        entry.module_timeout.unwrap_or(self.handler_timeout)
    }

    /// The policy that decides what follows `failure` on `route`.
    ///
    /// The message type's own policy wins. Otherwise the modules whose handlers failed decide,
    /// and when they disagree the most patient one (highest retry limit) applies, so no module
    /// gets fewer attempts than it asked for. A failure that names none of the route's
    /// handlers — an attempt the runtime's stop cut short, in whichever handler it was — is
    /// every handler's: all their modules decide.
    pub fn policy_for(&self, route: &Route, failure: &AggregateError) -> RetryPolicy {
        if let Some(policy) = route.policy {
            return policy;
        }
        let most_patient = |handlers: &mut dyn Iterator<Item = &HandlerEntry>| {
            handlers
                .map(|h| h.module_policy.unwrap_or(self.default_policy))
                .max_by_key(|p| p.retry_limit)
        };
        let mut failed = failure.failures.iter().filter_map(|f| {
            route
                .handlers
                .iter()
                .find(|h| *h.id.module == *f.module && *h.id.name == *f.handler)
        });
        most_patient(&mut failed)
            .or_else(|| most_patient(&mut route.handlers.iter()))
            .unwrap_or(self.default_policy)
    }

    /// Replaces the invocation of one handler (the test harness injects faults this way).
    ///
    /// Returns false when no such handler is registered.
    pub fn wrap_handler(&mut self, id: &HandlerId, wrap: impl Fn(Invoke) -> Invoke) -> bool {
        let mut found = false;
        for route in self.routes.values_mut() {
            let Some(route) = Arc::get_mut(route) else {
                continue;
            };
            for entry in route.handlers.iter_mut().filter(|h| h.id == *id) {
                entry.invoke = wrap(Arc::clone(&entry.invoke));
                found = true;
            }
        }
        found
    }

    /// A copy for one worker thread: the same handlers behind routes of its own, so that the
    /// reference counts a delivery touches are not shared with other workers.
    pub fn replicate(&self) -> Self {
        Self {
            routes: self
                .routes
                .iter()
                .map(|(k, v)| (*k, Arc::new(Route::clone(v))))
                .collect(),
            default_policy: self.default_policy,
            handler_timeout: self.handler_timeout,
        }
    }

    /// Opts every handler `filter` accepts in to `deduplication`, unless it chose its own.
    pub fn require_deduplication(
        &mut self,
        filter: impl Fn(&HandlerEntry) -> bool,
        deduplication: &Deduplication,
    ) {
        for route in self.routes.values_mut() {
            let Some(route) = Arc::get_mut(route) else {
                continue;
            };
            for entry in route.handlers.iter_mut() {
                if entry.deduplication.is_none() && filter(entry) {
                    entry.deduplication = Some(deduplication.clone());
                }
            }
        }
    }

    /// Every registered handler.
    pub fn entries(&self) -> impl Iterator<Item = &HandlerEntry> {
        self.routes.values().flat_map(|r| r.handlers.iter())
    }

    /// The runtime-wide retry policy.
    pub fn default_policy(&self) -> RetryPolicy {
        self.default_policy
    }
}
