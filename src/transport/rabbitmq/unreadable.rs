//! Messages at the head of the queue that lapin cannot read.
//!
//! lapin reads a delivery's frames as they arrive, and one it cannot parse (a short string that
//! is not UTF-8: a property, a header's name, the routing key) ends its connection before the
//! message reaches the transport. RabbitMQ puts the message back at the head of the queue, and
//! delivers it first to the next consumer, whose connection ends too: the queue would never
//! move again. Before each subscription, the head of the queue is read here with a reader of
//! AMQP 0-9-1 frames of its own, which parses nothing it does not need, and each message is
//! checked with lapin's own parsers.

use std::collections::BTreeMap;

use lapin::uri::{AMQPScheme, AMQPUri};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::transport::wire::Unreadable;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;
/// The one channel this reader opens.
const CHANNEL: u16 = 1;
/// The arguments of a channel's or the connection's close: reply code 200, reply text
/// `done`, no failed method.
const CLOSE: [u8; 11] = [0, 200, 4, b'd', b'o', b'n', b'e', 0, 0, 0, 0];

/// Messages lapin cannot read, taken from the head of a queue and held unacknowledged on a
/// connection of this reader's own: acknowledged once their dead letters are kept, or put back
/// when the connection closes.
pub(super) struct Held {
    socket: TcpStream,
    /// Each message's delivery tag on the reader's channel, and its dead letter.
    pub(super) found: Vec<(u64, Unreadable)>,
}

impl Held {
    /// Acknowledges the messages found, whose dead letters are kept, and closes the reader's
    /// connection.
    pub(super) async fn acknowledge(mut self) -> Result<(), String> {
        for (tag, _) in &self.found {
            let mut arguments = tag.to_be_bytes().to_vec();
            arguments.push(0);
            send_method(&mut self.socket, CHANNEL, 60, 80, &arguments).await?;
        }
        // The channel's close is answered after the acknowledgements before it: its answer
        // says they were taken (a channel the server had closed answers otherwise).
        send_method(&mut self.socket, CHANNEL, 20, 40, &CLOSE).await?;
        let closed = expect_method(&mut self.socket).await?;
        if (closed.class, closed.method) != (20, 41) {
            return Err(format!(
                "the acknowledgements were answered {:?}",
                (closed.class, closed.method)
            ));
        }
        close(&mut self.socket).await;
        Ok(())
    }
}

/// Reads up to `count` messages at the head of `queue` and keeps the ones lapin cannot read,
/// held unacknowledged on the reader's connection; the others go back to the head of the queue
/// at once, in their order. `None` when none was found (the connection is closed), or when the
/// URL asks for TLS, which this reader does not speak.
///
/// # Errors
///
/// The server's refusal or failure, as text.
pub(super) async fn at_head(url: &str, queue: &str, count: usize) -> Result<Option<Held>, String> {
    let uri: AMQPUri = url.parse()?;
    if uri.scheme == AMQPScheme::AMQPS {
        return Ok(None);
    }
    let address = format!("{}:{}", uri.authority.host, uri.authority.port);
    let mut socket = TcpStream::connect(address)
        .await
        .map_err(|error| error.to_string())?;
    open(&mut socket, &uri).await?;
    let mut found = Vec::new();
    let mut readable = Vec::new();
    for _ in 0..count {
        let mut arguments = vec![0, 0];
        push_short(&mut arguments, queue)?;
        arguments.push(0);
        send_method(&mut socket, CHANNEL, 60, 70, &arguments).await?;
        let method = expect_method(&mut socket).await?;
        match (method.class, method.method) {
            (60, 72) => break,
            (60, 71) => {}
            other => return Err(format!("basic.get answered {other:?}")),
        }
        let tag = u64::from_be_bytes(
            method.payload[4..12]
                .try_into()
                .map_err(|_| "a short get-ok".to_owned())?,
        );
        let header = read_frame(&mut socket).await?;
        if header.kind != FRAME_HEADER || header.payload.len() < 14 {
            return Err("no content header after get-ok".into());
        }
        let size = u64::from_be_bytes(header.payload[4..12].try_into().unwrap_or_default());
        let mut body = Vec::new();
        while (body.len() as u64) < size {
            let frame = read_frame(&mut socket).await?;
            if frame.kind != FRAME_BODY {
                return Err("a content body cut short".into());
            }
            body.extend_from_slice(&frame.payload);
        }
        // Whole, as lapin parses a frame: a part left over fails it too.
        let method_read = matches!(
            lapin::protocol::parse_class(&method.payload[..]),
            Ok((rest, _)) if rest.is_empty()
        );
        let properties_read = matches!(
            lapin::protocol::basic::parse_properties(&header.payload[12..]),
            Ok((rest, _)) if rest.is_empty()
        );
        if method_read && properties_read {
            readable.push(tag);
        } else {
            let why = if method_read {
                "its properties"
            } else {
                "its exchange or routing key"
            };
            found.push((
                tag,
                unreadable(&method.payload, &header.payload[12..], body, why),
            ));
        }
    }
    // Back to the head of the queue, before anything else of it is consumed: a negative
    // acknowledgement, which a quorum queue too returns to its place (a rejection it may
    // send to the back).
    for tag in readable {
        let mut arguments = tag.to_be_bytes().to_vec();
        // Not `multiple`; `requeue`.
        arguments.push(0b10);
        send_method(&mut socket, CHANNEL, 60, 120, &arguments).await?;
    }
    if found.is_empty() {
        close(&mut socket).await;
        return Ok(None);
    }
    Ok(Some(Held { socket, found }))
}

/// The dead letter of a message lapin cannot read: its body exactly, its headers as far as they
/// read (lossily), its exchange and routing key, and its properties exactly, in hexadecimal.
/// Nothing of the delivery itself (its tag, the queue's count): the message found again after
/// a crash keeps the dead letter it has.
fn unreadable(method: &[u8], properties: &[u8], body: Vec<u8>, why: &str) -> Unreadable {
    let mut headers = BTreeMap::new();
    // Names and text values of the headers table, lossily, where the table is laid out as
    // the protocol says (flags with bit 13 set: content type and encoding first, if present).
    for (name, value) in lossy_headers(properties) {
        headers.insert(name, value);
    }
    let (exchange, routing_key) = address(method);
    Unreadable {
        headers,
        body,
        why: format!(
            "lapin cannot read {why} (text that is not UTF-8); it was taken from the head of \
             the queue by a reader of the transport's own"
        ),
        properties: vec![
            ("amqp-exchange".to_owned(), exchange),
            ("amqp-routing-key".to_owned(), routing_key),
            ("amqp-properties-hex".to_owned(), hex(properties)),
        ],
    }
}

/// A `get-ok`'s exchange and routing key, read lossily.
fn address(method: &[u8]) -> (String, String) {
    // Class and method ids, the delivery tag and the redelivered flag come first.
    let mut at = 13usize;
    let mut short = || {
        let len = usize::from(*method.get(at)?);
        let text = method.get(at + 1..at + 1 + len)?;
        at += 1 + len;
        Some(String::from_utf8_lossy(text).into_owned())
    };
    let exchange = short().unwrap_or_default();
    let routing_key = short().unwrap_or_default();
    (exchange, routing_key)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The text entries of a properties block's headers table, names and values read lossily.
fn lossy_headers(properties: &[u8]) -> Vec<(String, String)> {
    let mut entries = Vec::new();
    let Some(flags) = properties
        .get(..2)
        .map(|f| u16::from_be_bytes([f[0], f[1]]))
    else {
        return entries;
    };
    let mut at = 2usize;
    let short = |at: &mut usize| -> Option<()> {
        let len = usize::from(*properties.get(*at)?);
        *at = at.checked_add(1 + len)?;
        Some(())
    };
    for bit in [15, 14] {
        if flags & (1 << bit) != 0 && short(&mut at).is_none() {
            return entries;
        }
    }
    if flags & (1 << 13) == 0 {
        return entries;
    }
    let Some(size) = properties.get(at..at + 4) else {
        return entries;
    };
    let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
    let Some(table) = properties.get(at + 4..at + 4 + size) else {
        return entries;
    };
    let mut at = 0usize;
    while at < table.len() {
        let Some(&len) = table.get(at) else { break };
        let Some(name) = table.get(at + 1..at + 1 + usize::from(len)) else {
            break;
        };
        at += 1 + usize::from(len);
        let Some(&kind) = table.get(at) else { break };
        at += 1;
        let long = |at: usize| {
            table
                .get(at..at + 4)
                .map(|len| u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize)
        };
        // Each value's length by its type, as RabbitMQ lays them out ('s' a short integer).
        let size = match kind {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'L' | b'l' | b'd' | b'T' => 8,
            b'S' | b'A' | b'F' | b'x' => match long(at) {
                Some(len) => 4 + len,
                None => break,
            },
            // A type no one lays out: the rest is kept in the hexadecimal properties only.
            _ => break,
        };
        let Some(value) = table.get(at..at + size) else {
            break;
        };
        at += size;
        let name = String::from_utf8_lossy(name).into_owned();
        // Text only, and none of the broker's own, which it rewrites at each return.
        if kind == b'S' && !super::is_the_brokers(&name) {
            entries.push((name, String::from_utf8_lossy(&value[4..]).into_owned()));
        }
    }
    entries
}

struct Frame {
    kind: u8,
    payload: Vec<u8>,
}

struct Method {
    class: u16,
    method: u16,
    /// The whole method payload, class and method ids first.
    payload: Vec<u8>,
}

async fn read_frame(socket: &mut TcpStream) -> Result<Frame, String> {
    let mut head = [0u8; 7];
    socket
        .read_exact(&mut head)
        .await
        .map_err(|error| error.to_string())?;
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    if size > 128 * 1024 * 1024 {
        return Err(format!("a frame of {size} bytes"));
    }
    let mut payload = vec![0; size + 1];
    socket
        .read_exact(&mut payload)
        .await
        .map_err(|error| error.to_string())?;
    if payload.pop() != Some(FRAME_END) {
        return Err("a frame without its end".into());
    }
    Ok(Frame {
        kind: head[0],
        payload,
    })
}

/// The next method frame, past heartbeats; the server's close, as an error.
async fn expect_method(socket: &mut TcpStream) -> Result<Method, String> {
    loop {
        let frame = read_frame(socket).await?;
        if frame.kind != FRAME_METHOD {
            continue;
        }
        if frame.payload.len() < 4 {
            return Err("a method frame too short".into());
        }
        let class = u16::from_be_bytes([frame.payload[0], frame.payload[1]]);
        let method = u16::from_be_bytes([frame.payload[2], frame.payload[3]]);
        if (class, method) == (10, 50) || (class, method) == (20, 40) {
            let text = frame
                .payload
                .get(7..)
                .map(|rest| {
                    let len = usize::from(frame.payload[6]);
                    String::from_utf8_lossy(&rest[..len.min(rest.len())]).into_owned()
                })
                .unwrap_or_default();
            return Err(format!("RabbitMQ closed the reader: {text}"));
        }
        return Ok(Method {
            class,
            method,
            payload: frame.payload,
        });
    }
}

async fn send_method(
    socket: &mut TcpStream,
    channel: u16,
    class: u16,
    method: u16,
    arguments: &[u8],
) -> Result<(), String> {
    let size = u32::try_from(4 + arguments.len()).map_err(|_| "a method too large".to_owned())?;
    let mut frame = vec![FRAME_METHOD];
    frame.extend_from_slice(&channel.to_be_bytes());
    frame.extend_from_slice(&size.to_be_bytes());
    frame.extend_from_slice(&class.to_be_bytes());
    frame.extend_from_slice(&method.to_be_bytes());
    frame.extend_from_slice(arguments);
    frame.push(FRAME_END);
    socket
        .write_all(&frame)
        .await
        .map_err(|error| error.to_string())
}

fn push_short(into: &mut Vec<u8>, text: &str) -> Result<(), String> {
    let len = u8::try_from(text.len()).map_err(|_| format!("{text:?} is over 255 bytes"))?;
    into.push(len);
    into.extend_from_slice(text.as_bytes());
    Ok(())
}

/// Opens the connection (PLAIN credentials, no heartbeats) and channel 1.
async fn open(socket: &mut TcpStream, uri: &AMQPUri) -> Result<(), String> {
    socket
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(|error| error.to_string())?;
    let start = expect_method(socket).await?;
    if (start.class, start.method) != (10, 10) {
        return Err("no connection.start".into());
    }
    let user = &uri.authority.userinfo;
    let response = format!("\0{}\0{}", user.username, user.password);
    let mut arguments = 0u32.to_be_bytes().to_vec();
    push_short(&mut arguments, "PLAIN")?;
    let len = u32::try_from(response.len()).map_err(|_| "credentials too long".to_owned())?;
    arguments.extend_from_slice(&len.to_be_bytes());
    arguments.extend_from_slice(response.as_bytes());
    push_short(&mut arguments, "en_US")?;
    send_method(socket, 0, 10, 11, &arguments).await?;
    let tune = expect_method(socket).await?;
    if (tune.class, tune.method) != (10, 30) || tune.payload.len() < 12 {
        return Err("no connection.tune".into());
    }
    let mut arguments = tune.payload[4..10].to_vec();
    arguments.extend_from_slice(&0u16.to_be_bytes());
    send_method(socket, 0, 10, 31, &arguments).await?;
    let mut arguments = Vec::new();
    push_short(&mut arguments, &uri.vhost)?;
    arguments.extend_from_slice(&[0, 0]);
    send_method(socket, 0, 10, 40, &arguments).await?;
    let opened = expect_method(socket).await?;
    if (opened.class, opened.method) != (10, 41) {
        return Err("no connection.open-ok".into());
    }
    send_method(socket, CHANNEL, 20, 10, &[0]).await?;
    let opened = expect_method(socket).await?;
    if (opened.class, opened.method) != (20, 11) {
        return Err("no channel.open-ok".into());
    }
    Ok(())
}

/// Closes the connection; what it held unacknowledged goes back to the queue.
async fn close(socket: &mut TcpStream) {
    if send_method(socket, 0, 10, 50, &CLOSE).await.is_ok() {
        // Close-ok, or the end of the connection: either way it is closed.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), read_frame(socket)).await;
    }
    let _ = socket.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::{lossy_headers, unreadable};

    #[test]
    fn the_same_message_fetched_twice_keeps_one_dead_letter() {
        // A get-ok: ids, delivery tag, redelivered, exchange, routing key, message count.
        let get_ok = |tag: u64, redelivered: u8, count: u32| {
            let mut method = vec![0, 60, 0, 71];
            method.extend_from_slice(&tag.to_be_bytes());
            method.push(redelivered);
            method.extend_from_slice(&[2, b'e', b'x', 5]);
            method.extend_from_slice(b"a.b\xffc");
            method.extend_from_slice(&count.to_be_bytes());
            method
        };
        // A content type of one byte that is not UTF-8.
        let mut properties = (1u16 << 15).to_be_bytes().to_vec();
        properties.extend_from_slice(&[1, 0xff]);
        let letter = |method: &[u8]| {
            unreadable(method, &properties, b"{}".to_vec(), "its properties")
                .into_envelope(chrono::Utc::now())
        };
        let first = letter(&get_ok(1, 0, 7));
        let again = letter(&get_ok(9, 1, 3));
        assert_eq!(first.id, again.id);
        assert_eq!(first.headers["amqp-routing-key"], "a.b\u{fffd}c");
        assert_eq!(first.headers["amqp-exchange"], "ex");
    }

    #[test]
    fn reads_the_text_headers_of_a_properties_block_lossily() {
        // Flags: headers only; a table of `ok` = "1" (long string) and a name not UTF-8.
        let mut table = vec![2, b'o', b'k', b'S', 0, 0, 0, 1, b'1'];
        // A short integer (RabbitMQ's 's'), skipped; the broker's count, left out.
        table.extend_from_slice(&[1, b'n', b's', 0, 7]);
        table.extend_from_slice(&[16]);
        table.extend_from_slice(b"x-delivery-count");
        table.extend_from_slice(&[b'l', 0, 0, 0, 0, 0, 0, 0, 2]);
        table.extend_from_slice(&[3, b'b', 0xff, b'd', b'S', 0, 0, 0, 1, b'x']);
        let mut properties = (1u16 << 13).to_be_bytes().to_vec();
        properties.extend_from_slice(&(table.len() as u32).to_be_bytes());
        properties.extend_from_slice(&table);
        let entries = lossy_headers(&properties);
        assert_eq!(
            entries,
            [
                ("ok".to_owned(), "1".to_owned()),
                ("b\u{fffd}d".to_owned(), "x".to_owned())
            ]
        );
        assert!(lapin::protocol::basic::parse_properties(&properties[..]).is_err());
    }
}
