//! Deterministic ids: the same message and key give the same id on every retry and redelivery,
//! so a handler that keys its rows on them finds its earlier writes instead of duplicating them.
//!
//! The id is SHA-256 over the UTF-8 text `"{message_id as 32 lowercase hex digits}:{key}"`,
//! whose first 16 bytes are read as .NET's `new Guid(bytes)` reads them (the first three
//! fields little-endian) and printed as 32 lowercase hex digits: byte for byte the id a .NET
//! service computes with `new Guid(hash.AsSpan(0, 16)).ToString("N")`, so a mixed fleet agrees.
//!
//! ```
//! use dacapo::ids;
//! use dacapo::uuid::Uuid;
//!
//! let message_id = Uuid::parse_str("0f8fad5b-d9cb-469f-a165-70867728950e").unwrap();
//! assert_eq!(ids::derive(message_id, "42"), "7b17695fedeb468ac621b60044fac70d");
//! assert_eq!(ids::derive(message_id, "42"), ids::derive(message_id, "42"));
//! ```

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// The deterministic id of `key` within the message `message_id` (32 lowercase hex digits).
pub fn derive(message_id: Uuid, key: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(message_id.simple().to_string().as_bytes());
    hasher.update(b":");
    hasher.update(key.as_bytes());
    let hash = hasher.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&hash[..16]);
    // .NET's Guid(byte[]) stores its first three fields little-endian, which is exactly how
    // `from_bytes_le` reads them.
    Uuid::from_bytes_le(first).simple().to_string()
}

/// [`derive`](fn@derive) inside a consumer; a random id when there is no message (a controller, a job),
/// since there is then nothing a retry could repeat.
pub fn derive_or_random(message_id: Option<Uuid>, key: &str) -> String {
    match message_id {
        Some(id) => derive(id, key),
        None => Uuid::new_v4().simple().to_string(),
    }
}
