use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::{Decoded, Envelope, Message};

type KeyFn = Arc<dyn Fn(&Decoded) -> Option<String> + Send + Sync>;

#[derive(Clone)]
enum Source {
    Envelope,
    Header(String),
    Key(KeyFn),
}

/// What to do with a message whose deduplication id was claimed with a different payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Conflicts {
    /// Discard it like any duplicate, and log the conflict as a warning (the default).
    #[default]
    Log,
    /// Dead-letter it, so a person looks at it.
    DeadLetter,
}

/// A handler's opt-in to logical deduplication: one intent, one effect, within the window.
///
/// The handler claims the message's logical id before it runs; a message whose id it already
/// claimed within the window never reaches it. Claims are per handler: two modules
/// deduplicating the same message do not take each other's claim.
///
/// ```
/// use dacapo::Deduplication;
///
/// // The envelope's deduplication id, required (the default).
/// let strict = Deduplication::from_envelope();
/// // A header, and unkeyed messages are handled as if deduplication were off.
/// let lenient = Deduplication::from_header("idempotency-key").optional();
/// # let _ = (strict, lenient);
/// ```
#[derive(Clone)]
pub struct Deduplication {
    source: Source,
    required: bool,
    conflicts: Conflicts,
}

impl fmt::Debug for Deduplication {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Envelope => "envelope".to_owned(),
            Source::Header(name) => format!("header {name}"),
            Source::Key(_) => "key function".to_owned(),
        };
        f.debug_struct("Deduplication")
            .field("source", &source)
            .field("required", &self.required)
            .field("conflicts", &self.conflicts)
            .finish()
    }
}

impl Deduplication {
    fn new(source: Source) -> Self {
        Self {
            source,
            required: true,
            conflicts: Conflicts::default(),
        }
    }

    /// The id is the envelope's `deduplication_id` (the default source).
    pub fn from_envelope() -> Self {
        Self::new(Source::Envelope)
    }

    /// The id is the value of header `name`.
    pub fn from_header(name: impl Into<String>) -> Self {
        Self::new(Source::Header(name.into()))
    }

    /// The id is computed from the message itself; `None` or an empty string means "no id".
    pub fn by_key<M: Message>(key: impl Fn(&M) -> Option<String> + Send + Sync + 'static) -> Self {
        Self::new(Source::Key(Arc::new(move |decoded: &Decoded| {
            decoded.downcast_ref::<M>().and_then(&key)
        })))
    }

    /// Messages without an id are handled as if deduplication were off, at no store round
    /// trip, instead of being dead-lettered.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.required = false;
        self
    }

    /// Dead-letter a message whose id was claimed with a different payload, instead of
    /// discarding it with a warning.
    #[must_use]
    pub fn dead_letter_conflicts(mut self) -> Self {
        self.conflicts = Conflicts::DeadLetter;
        self
    }

    /// Whether a message without an id is dead-lettered.
    pub fn is_required(&self) -> bool {
        self.required
    }

    /// What happens to a conflicting payload.
    pub fn conflicts(&self) -> Conflicts {
        self.conflicts
    }

    /// The logical id of `envelope` for this handler, if it has one.
    #[doc(hidden)]
    pub fn key(&self, envelope: &Envelope, decoded: &Decoded) -> Option<String> {
        let key = match &self.source {
            Source::Envelope => envelope.deduplication_id.clone(),
            Source::Header(name) => envelope.headers.get(name).cloned(),
            Source::Key(key) => key(decoded),
        };
        key.filter(|k| !k.is_empty())
    }
}

/// A hex SHA-256, for claim keys (so collation never merges two ids) and payload fingerprints.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a publisher-side rule says of a message.
enum Verdict {
    /// Nothing: ask the next rule.
    Pass,
    /// This id (empty: the message opts out of having one).
    Id(String),
}

type Rule = Arc<dyn Fn(&str, &dyn std::any::Any, &[u8]) -> Verdict + Send + Sync>;

/// Publisher-side sources of logical ids, applied when a message is published.
///
/// Precedence: an id set explicitly on the send wins; then the configured rules, in
/// registration order; then the message type's own [`Message::deduplication_id`]. Nothing
/// overwrites an id already set, and a rule (or declaration) that gives an empty id leaves the
/// message without one — which is how a message opts out.
#[derive(Clone, Default)]
pub struct DeduplicationRules {
    rules: Vec<Rule>,
}

impl fmt::Debug for DeduplicationRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeduplicationRules")
            .field("rules", &self.rules.len())
            .finish()
    }
}

impl DeduplicationRules {
    /// Derives the id of messages of type `M` with `rule`; `None` or an empty string leaves
    /// such a message without one.
    pub fn by_message<M: Message>(
        &mut self,
        rule: impl Fn(&M) -> Option<String> + Send + Sync + 'static,
    ) {
        self.rules.push(Arc::new(move |_, message, _| {
            match message.downcast_ref::<M>() {
                Some(message) => Verdict::Id(rule(message).unwrap_or_default()),
                None => Verdict::Pass,
            }
        }));
    }

    /// Takes the id from the first top-level member of the message whose name is in `names`
    /// (in that order); other types are converted to text. Messages with none of them are left
    /// to the next rule.
    pub fn by_member_named(&mut self, names: &[&str]) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        self.rules.push(Arc::new(move |_, _, payload| {
            let Ok(serde_json::Value::Object(members)) = serde_json::from_slice(payload) else {
                return Verdict::Pass;
            };
            names
                .iter()
                .find_map(|name| members.get(name))
                .map_or(Verdict::Pass, |value| match value {
                    serde_json::Value::Null => Verdict::Id(String::new()),
                    serde_json::Value::String(text) => Verdict::Id(text.clone()),
                    other => Verdict::Id(other.to_string()),
                })
        }));
    }

    /// Gives `envelope` (of `message`) a logical id, unless it has one already.
    pub fn apply<M: Message>(&self, message: &M, envelope: &mut Envelope) {
        if envelope.deduplication_id.is_some() {
            return;
        }
        let decided =
            self.rules
                .iter()
                .find_map(|rule| match rule(M::TYPE, message, &envelope.payload) {
                    Verdict::Pass => None,
                    Verdict::Id(id) => Some(id),
                });
        let id = decided
            .or_else(|| message.deduplication_id())
            .unwrap_or_default();
        envelope.deduplication_id = (!id.is_empty()).then_some(id);
    }
}
