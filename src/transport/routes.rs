use std::collections::BTreeMap;

/// Which message types leave through a transport, and where to.
///
/// A type routed to a transport is published to the broker (through the outbox, once the
/// broker confirmed it) instead of to this node's engine, and this node listens for it on the
/// broker if it handles it. Types not routed stay node-local, as without a transport.
#[derive(Clone, Debug, Default)]
pub(crate) struct Routes {
    all: bool,
    /// Routed types, each with its destination when not the transport's default.
    types: BTreeMap<String, Option<String>>,
}

#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "postgres")),
    allow(dead_code)
)]
impl Routes {
    pub(crate) fn all(&mut self) {
        self.all = true;
    }

    pub(crate) fn add(&mut self, message_type: &str, destination: Option<String>) {
        self.types.insert(message_type.to_owned(), destination);
    }

    /// Whether `message_type` leaves through the transport.
    pub(crate) fn carries(&self, message_type: &str) -> bool {
        self.all || self.types.contains_key(message_type)
    }

    /// Where `message_type` goes: its own destination, or `default`.
    pub(crate) fn destination<'a>(&'a self, message_type: &str, default: &'a str) -> &'a str {
        self.types
            .get(message_type)
            .and_then(Option::as_deref)
            .unwrap_or(default)
    }

    /// The types among `handled` that this node listens for at `default`: those routed there.
    pub(crate) fn listened<'a>(
        &self,
        handled: impl IntoIterator<Item = &'a str>,
        default: &str,
    ) -> Vec<String> {
        let mut listened: Vec<String> = handled
            .into_iter()
            .filter(|message_type| {
                self.carries(message_type) && self.destination(message_type, default) == default
            })
            .map(str::to_owned)
            .collect();
        listened.sort();
        listened.dedup();
        listened
    }
}

/// The routing methods every transport's configuration has.
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "postgres"))]
macro_rules! routing {
    () => {
        /// Routes messages of type `M` through this transport, to its default destination.
        #[must_use]
        pub fn route<M: $crate::Message>(mut self) -> Self {
            self.routes.add(M::TYPE, None);
            self
        }

        /// Routes messages of type `M` through this transport to `destination` (an exchange,
        /// a full subject or a queue, as the transport names them) instead of its default:
        /// another service's. A handler of `M` on this node then hears no `M` from RabbitMQ
        /// or NATS, which bind nothing for it at this node's own exchange or subjects; a
        /// PostgreSQL queue node takes every row of its own queue, `M` included, whoever put
        /// it there.
        #[must_use]
        pub fn route_to<M: $crate::Message>(mut self, destination: impl Into<String>) -> Self {
            self.routes.add(M::TYPE, Some(destination.into()));
            self
        }

        /// Routes every message type that `module` handles through this transport.
        #[must_use]
        pub fn route_module(mut self, module: &$crate::Module) -> Self {
            for message_type in module.message_types() {
                self.routes.add(message_type, None);
            }
            self
        }

        /// Routes every message type through this transport: nothing stays node-local.
        #[must_use]
        pub fn route_all(mut self) -> Self {
            self.routes.all();
            self
        }
    };
}
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "postgres"))]
pub(crate) use routing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_type_sent_elsewhere_is_carried_but_not_listened_for() {
        let mut routes = Routes::default();
        routes.add("orders.placed", None);
        routes.add("billing.charge", Some("billing".into()));
        assert!(routes.carries("orders.placed") && routes.carries("billing.charge"));
        assert!(!routes.carries("local.only"));
        assert_eq!(routes.destination("billing.charge", "orders"), "billing");
        assert_eq!(
            routes.listened(["billing.charge", "orders.placed", "local.only"], "orders"),
            vec!["orders.placed".to_owned()]
        );
        routes.all();
        assert!(routes.carries("local.only"));
    }
}
