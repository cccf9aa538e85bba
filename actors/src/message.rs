use serde::Serialize;
use serde::de::DeserializeOwned;

/// An integration event or command that modules exchange.
///
/// The type name is the contract between publisher and consumer: it travels in every
/// envelope and selects the handlers, so it must stay stable across releases even when the
/// Rust type is renamed or moved.
///
/// ```
/// use dacapo::Message;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct MemberRemoved {
///     organization_id: u64,
///     member_id: u64,
/// }
///
/// impl Message for MemberRemoved {
///     const TYPE: &'static str = "organization.member_removed";
/// }
/// ```
pub trait Message: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The stable type name, e.g. `organization.member_removed`.
    const TYPE: &'static str;

    /// The logical identity of this message's intent, declared once by the type so that every
    /// publisher sets it. An id given at publish time (`SendOptions::deduplication_id`) wins
    /// over a rule set on the runtime's builder (`deduplicate_by`), and that rule over this
    /// one. `None` or an empty string: no id.
    fn deduplication_id(&self) -> Option<String> {
        None
    }
}
