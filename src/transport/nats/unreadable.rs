//! Stream messages the NATS client cannot read.
//!
//! The client reads a delivery's header block as it arrives, and a block it cannot read (not
//! UTF-8, a line without a colon, a name with a space) ends its connection before the message
//! reaches the transport; a value with a carriage return in it makes the client panic, and
//! a status on the first line makes it take the message for one of the server's own. JetStream then delivers the message again after its ack wait, with
//! the batch it came in, and the connection ends again: the consumer, and every message
//! delivered beside it, would wait for ever. Such a message is found here through the stream's
//! JSON API, which carries the headers as base64 and so never meets the client's reader.

use std::collections::BTreeMap;

use async_nats::jetstream::{self, stream::RawMessage};
use base64::Engine;
use serde::Deserialize;

use crate::transport::wire::Unreadable;

/// How many messages one search reads past a consumer's acknowledged floor, at most: the
/// unreadable one is among the first a consumer holds unacknowledged, since it stops
/// everything delivered with it, and each read brings a whole message.
const SEARCHED: usize = 128;

/// A stream message the client cannot read, as the dead letter that keeps it.
#[derive(Debug)]
pub(super) struct Found {
    /// Its stream sequence, deleted once its dead letter is kept.
    pub(super) sequence: u64,
    pub(super) unreadable: Unreadable,
}

/// The stream API's answer to a message request.
#[derive(Deserialize)]
struct MessageGot {
    #[serde(default)]
    message: Option<RawMessage>,
}

/// The messages `consumer` holds delivered and unacknowledged on `subject` that the client
/// cannot read, oldest first.
///
/// # Errors
///
/// The server's failure to answer, as the client's error text.
pub(super) async fn held_by(
    context: &jetstream::Context,
    stream: &str,
    consumer: &jetstream::consumer::PullConsumer,
    subject: &str,
) -> Result<Vec<Found>, String> {
    let info = consumer
        .get_info()
        .await
        .map_err(|error| error.to_string())?;
    let mut found = Vec::new();
    if info.num_ack_pending == 0 {
        return Ok(found);
    }
    let last = info.delivered.stream_sequence;
    let mut next = info.ack_floor.stream_sequence.saturating_add(1);
    for _ in 0..SEARCHED {
        if next > last {
            break;
        }
        let request = serde_json::json!({ "seq": next, "next_by_subj": subject });
        let got: MessageGot = context
            .request(format!("STREAM.MSG.GET.{stream}"), &request)
            .await
            .map_err(|error| error.to_string())?;
        // None: nothing left on the subject (the server's "no message found").
        let Some(message) = got.message else { break };
        if message.sequence > last {
            break;
        }
        next = message.sequence.saturating_add(1);
        // A server before 2.9 reads no `next_by_subj`, and answers the sequence whatever
        // its subject: another consumer's message, not this one's to take.
        if message.subject != subject {
            continue;
        }
        let headers = match &message.headers {
            Some(encoded) => base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|error| format!("the stream's base64 headers: {error}"))?,
            None => continue,
        };
        if let Err(why) = client_reads(&headers) {
            let body = base64::engine::general_purpose::STANDARD
                .decode(&message.payload)
                .map_err(|error| format!("the stream's base64 payload: {error}"))?;
            found.push(Found {
                sequence: message.sequence,
                unreadable: unreadable(&message, &headers, body, &why),
            });
        }
    }
    Ok(found)
}

/// Whether the NATS client reads `block` (a header block, `NATS/1.0` first) as it reads one
/// from the connection; why not, if it does not.
pub(super) fn client_reads(block: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(block).map_err(|_| "they are not UTF-8".to_owned())?;
    let mut lines = text.lines().peekable();
    let version = lines.next().unwrap_or_default();
    let Some(status) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Err("their first line is not NATS/1.0".into());
    };
    // A message published with one is taken for the server's own (a 408, a 503) and never
    // reaches the transport.
    if !status.is_empty() {
        return Err(format!("their first line holds a status, {status:?}"));
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("the line {line:?} has no colon"));
        };
        if name.contains(|c: char| !c.is_ascii_graphic()) {
            return Err(format!(
                "the name {name:?} is not printable ASCII without spaces"
            ));
        }
        let mut value = value.trim_start().to_owned();
        while let Some(more) = lines.next_if(|next| next.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        if value.trim_end().contains(['\r', '\n']) {
            return Err(format!("the value of {name:?} holds a carriage return"));
        }
    }
    Ok(())
}

/// The dead letter of `message`: its headers as far as they read (lossily), its payload, and
/// its whole header block beside them, as text and, exactly, in base64: the message is
/// deleted from the stream once its dead letter is kept.
fn unreadable(message: &RawMessage, block: &[u8], body: Vec<u8>, why: &str) -> Unreadable {
    let text = String::from_utf8_lossy(block);
    let headers: BTreeMap<String, String> = text
        .lines()
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
        .collect();
    Unreadable {
        headers,
        body,
        why: format!(
            "the NATS client cannot read its headers ({why}); it was taken from the stream by \
             its sequence, {}, and deleted there",
            message.sequence
        ),
        properties: vec![
            ("nats-subject".to_owned(), message.subject.clone()),
            ("nats-header-block".to_owned(), text.into_owned()),
            (
                "nats-header-block-base64".to_owned(),
                base64::engine::general_purpose::STANDARD.encode(block),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::client_reads;

    #[test]
    fn reads_what_the_client_reads_and_refuses_what_it_refuses() {
        for readable in [
            &b"NATS/1.0\r\nmessage-id: 1\r\nmessage-type: a.b\r\n\r\n"[..],
            b"NATS/1.0\r\n\r\n",
            b"NATS/1.0\r\nfolded: a\r\n  b\r\n\r\n",
            b"NATS/1.0\r\ntrailing: a \r\n\r\n",
        ] {
            assert_eq!(client_reads(readable), Ok(()), "{readable:?}");
        }
        for unreadable in [
            &b"NATS/1.0\r\nno colon here\r\n\r\n"[..],
            b"NATS/1.0\r\nbad name: x\r\n\r\n",
            b"NATS/1.0\r\nna\xffme: x\r\n\r\n",
            b"NATS/1.1\r\n\r\n",
            b"NATS/1.0 503\r\n\r\n",
            b"NATS/1.0 5x3\r\n\r\n",
            b"NATS/1.0\r\ncarriage: a\rb\r\n\r\n",
            b"NATS/1.0\r\nfolded: a\r\n b\rc\r\n\r\n",
        ] {
            assert!(client_reads(unreadable).is_err(), "{unreadable:?}");
        }
    }
}
