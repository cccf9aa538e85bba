//! The `Idempotency-Key` request header: where it is read and what a valid one is.

use http::HeaderMap;

/// The header's name (IETF draft "The Idempotency-Key HTTP Header Field").
pub(crate) const HEADER: &str = "idempotency-key";

/// What a request says about its key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Key {
    /// No `Idempotency-Key` header.
    Missing,
    /// A header that cannot be a key; the reason, for the client.
    Invalid(String),
    /// The key, without the quotes of its structured-field form.
    Valid(String),
}

/// Reads the key: one header, 1 to `max_len` visible ASCII characters, given bare or as a
/// structured-field string (`"…"`), as the draft writes it.
pub(crate) fn read(headers: &HeaderMap, max_len: usize) -> Key {
    let mut values = headers.get_all(HEADER).iter();
    let Some(value) = values.next() else {
        return Key::Missing;
    };
    if values.next().is_some() {
        return Key::Invalid("more than one Idempotency-Key header".to_owned());
    }
    let Ok(text) = value.to_str() else {
        return Key::Invalid("the Idempotency-Key holds characters that are not ASCII".to_owned());
    };
    let text = text.trim();
    let key = match text.strip_prefix('"') {
        Some(quoted) => match unquote(quoted) {
            Some(key) => key,
            None => {
                return Key::Invalid(
                    "the Idempotency-Key is not a structured-field string: a quote or \\ \
                     inside it is not escaped, or it does not end with its quote"
                        .to_owned(),
                );
            }
        },
        // A proxy joins repeated headers with commas: `a, b` is two keys, not one.
        None if text.contains([',', '"']) => {
            return Key::Invalid(
                "the Idempotency-Key holds a comma or a quote: send one key, quoted as a \
                 structured-field string if it must hold them"
                    .to_owned(),
            );
        }
        None => text.to_owned(),
    };
    if key.is_empty() {
        return Key::Invalid("the Idempotency-Key is empty".to_owned());
    }
    if key.len() > max_len {
        return Key::Invalid(format!(
            "the Idempotency-Key is {} characters long; at most {max_len} are accepted",
            key.len()
        ));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Key::Invalid(
            "the Idempotency-Key holds characters that are not visible ASCII".to_owned(),
        );
    }
    Key::Valid(key)
}

/// The text of a structured-field string whose opening quote is gone: `\"` and `\\` stand
/// for themselves, another quote must be the last character.
fn unquote(quoted: &str) -> Option<String> {
    let mut key = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                escaped @ ('"' | '\\') => key.push(escaped),
                _ => return None,
            },
            '"' => return chars.next().is_none().then_some(key),
            c => key.push(c),
        }
    }
    None
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only: a stored
/// fingerprint is compared without telling an attacker how much of it matched.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in values {
            map.append(HEADER, http::HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn a_key_is_read_bare_or_quoted() {
        assert_eq!(read(&headers(&[b"abc-1"]), 255), Key::Valid("abc-1".into()));
        assert_eq!(
            read(&headers(&[b"\"abc-1\""]), 255),
            Key::Valid("abc-1".into())
        );
        assert_eq!(read(&headers(&[]), 255), Key::Missing);
        assert_eq!(
            read(&headers(&[br#""a\"b\\c, d""#]), 255),
            Key::Valid(r#"a"b\c, d"#.into())
        );
    }

    #[test]
    fn a_list_or_a_broken_string_is_no_key() {
        for bad in [
            // Two headers a proxy joined.
            headers(&[b"a, b"]),
            headers(&[b"a,b"]),
            headers(&[b"\"a\", \"b\""]),
            headers(&[b"ab\"c"]),
            headers(&[b"\"abc"]),
            headers(&[b"\"a\\qb\""]),
        ] {
            assert!(matches!(read(&bad, 255), Key::Invalid(_)), "{bad:?}");
        }
    }

    #[test]
    fn empty_long_repeated_and_non_ascii_keys_are_invalid() {
        for bad in [
            headers(&[b"\"\""]),
            headers(&[b"a", b"b"]),
            headers(&["clé".as_bytes()]),
            headers(&[b"abc\tdef"]),
            headers(&[&[b'k'; 256]]),
        ] {
            assert!(matches!(read(&bad, 255), Key::Invalid(_)), "{bad:?}");
        }
        assert!(matches!(
            read(&headers(&[&[b'k'; 255]]), 255),
            Key::Valid(_)
        ));
    }

    #[test]
    fn equal_fingerprints_compare_equal_and_others_do_not() {
        assert!(constant_time_eq(b"abcd", b"abcd"));
        assert!(!constant_time_eq(b"abcd", b"abce"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
    }
}
