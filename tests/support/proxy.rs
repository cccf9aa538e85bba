//! A TCP proxy to the PostgreSQL server that a test can cut (every connection dropped, new
//! ones refused) and restore, and which counts round trips: the `ReadyForQuery` messages the
//! server sends, one per statement, transaction command or ping the client waited for.
//!
//! A cut holds from the moment `cut` returns: a connection opened before it forwards no byte
//! read after it, and ends itself as soon as its task sees the cut.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    /// Counts cuts (and the ends of stalls); a connection lives only while the count is the
    /// one it opened under.
    epoch: Arc<watch::Sender<u64>>,
    /// The server's side held back, each connection left open: a server gone silent.
    stalled: Arc<AtomicBool>,
    /// What the next connection to send it has the server's side held back for (once).
    stall_on: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    /// How many connections `stall_on` held.
    stalled_on: Arc<AtomicU64>,
    /// What the next connection to send it has held back on its way to the server (once).
    hold_on: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    /// How many sends `hold_on` held.
    held_sends: Arc<AtomicU64>,
    /// Set to let held sends go on.
    let_go: Arc<watch::Sender<bool>>,
    round_trips: Arc<AtomicU64>,
}

impl Proxy {
    /// A proxy to the PostgreSQL server at `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let epoch = Arc::new(watch::Sender::new(0));
        let stalled = Arc::new(AtomicBool::new(false));
        let stall_on = Arc::new(std::sync::Mutex::new(None));
        let stalled_on = Arc::new(AtomicU64::new(0));
        let hold_on = Arc::new(std::sync::Mutex::new(None));
        let held_sends = Arc::new(AtomicU64::new(0));
        let let_go = Arc::new(watch::Sender::new(false));
        let round_trips = Arc::new(AtomicU64::new(0));
        let (up_, epoch_, stalled_, round_trips_) = (
            Arc::clone(&up),
            Arc::clone(&epoch),
            Arc::clone(&stalled),
            Arc::clone(&round_trips),
        );
        let (stall_on_, stalled_on_) = (Arc::clone(&stall_on), Arc::clone(&stalled_on));
        let (hold_on_, held_sends_, let_go_) = (
            Arc::clone(&hold_on),
            Arc::clone(&held_sends),
            Arc::clone(&let_go),
        );
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                // The epoch before `up`: a cut between the two leaves this connection with a
                // stale epoch, dead from its first byte.
                let epoch = epoch_.subscribe();
                let under = *epoch.borrow();
                if !up_.load(Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                let upstream = upstream.clone();
                let round_trips = Arc::clone(&round_trips_);
                let stalled = Arc::clone(&stalled_);
                let stall_on = StallOn {
                    needle: Arc::clone(&stall_on_),
                    held: Arc::clone(&stalled_on_),
                    this: Arc::new(AtomicBool::new(false)),
                };
                let hold_on = HoldOn {
                    needle: Arc::clone(&hold_on_),
                    held: Arc::clone(&held_sends_),
                    let_go: let_go_.subscribe(),
                };
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream.as_str()).await {
                        relay(
                            client,
                            server,
                            round_trips,
                            stalled,
                            stall_on,
                            hold_on,
                            Opened { epoch, under },
                        )
                        .await;
                    }
                });
            }
        });
        Self {
            port,
            up,
            epoch,
            stalled,
            stall_on,
            stalled_on,
            hold_on,
            held_sends,
            let_go,
            round_trips,
        }
    }

    /// A proxy to the server of `url` (`postgres://user@HOST:PORT/database`), and `url`
    /// rewritten to go through it, without TLS so the proxy can read the messages.
    pub async fn to(url: &str) -> (Self, String) {
        let authority = url
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .expect("a postgres://user@host:port/database url")
            .to_owned();
        let proxy = Self::start(authority.clone()).await;
        let through = url.replacen(&authority, &format!("127.0.0.1:{}", proxy.port), 1);
        let separator = if through.contains('?') { '&' } else { '?' };
        (proxy, format!("{through}{separator}sslmode=disable"))
    }

    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.epoch.send_modify(|epoch| *epoch += 1);
    }

    /// Holds back everything the server sends from now on, on every connection, new ones
    /// included, and closes none: a server host gone, or a network dropping its packets.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    /// Lets connections through again; those a stall held are closed, as TCP would once it
    /// noticed.
    pub fn restore(&self) {
        if self.stalled.load(Ordering::SeqCst) {
            // Ended before the stall is: none of them forwards what it held.
            self.epoch.send_modify(|epoch| *epoch += 1);
            self.stalled.store(false, Ordering::SeqCst);
        }
        self.up.store(true, Ordering::SeqCst);
    }

    /// Holds back, from then on, what the server sends on the next connection whose client
    /// sends `needle` (a statement's text: the proxy reads the messages without TLS), and
    /// closes it not: the server gone silent at that statement, for that connection only.
    pub fn stall_the_connection_that_sends(&self, needle: &'static [u8]) {
        *self.stall_on.lock().unwrap() = Some(needle);
    }

    /// How many connections [`stall_the_connection_that_sends`](Self::stall_the_connection_that_sends)
    /// held.
    pub fn stalled_connections(&self) -> u64 {
        self.stalled_on.load(Ordering::SeqCst)
    }

    /// Holds back the next send of a client that holds `needle` (a statement's text) on its
    /// way to the server, with what that client sends after it, until [`let_go`](Self::let_go):
    /// the statements before it ran, this one has not.
    pub fn hold_the_send_of(&self, needle: &'static [u8]) {
        *self.hold_on.lock().unwrap() = Some(needle);
    }

    /// How many sends [`hold_the_send_of`](Self::hold_the_send_of) held.
    pub fn held_sends(&self) -> u64 {
        self.held_sends.load(Ordering::SeqCst)
    }

    /// Lets the held sends reach the server.
    pub fn let_go(&self) {
        self.let_go.send_replace(true);
    }

    /// Round trips made through the proxy so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::SeqCst)
    }
}

/// A connection's share of [`Proxy::stall_the_connection_that_sends`].
struct StallOn {
    needle: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    held: Arc<AtomicU64>,
    /// Whether this connection is the one held.
    this: Arc<AtomicBool>,
}

impl StallOn {
    /// Takes the needle, if `sent` holds it, and holds this connection from now on.
    fn sent(&self, sent: &[u8]) {
        let mut needle = self.needle.lock().unwrap();
        if needle.is_some_and(|needle| sent.windows(needle.len()).any(|window| window == needle)) {
            *needle = None;
            self.this.store(true, Ordering::SeqCst);
            self.held.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A connection's share of [`Proxy::hold_the_send_of`].
struct HoldOn {
    needle: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    held: Arc<AtomicU64>,
    let_go: watch::Receiver<bool>,
}

impl HoldOn {
    /// Returns once `sent` may go to the server: at once, unless it holds the needle.
    async fn sent(&mut self, sent: &[u8]) {
        let holds = {
            let mut needle = self.needle.lock().unwrap();
            let holds = needle
                .is_some_and(|needle| sent.windows(needle.len()).any(|window| window == needle));
            if holds {
                *needle = None;
            }
            holds
        };
        if holds {
            self.held.fetch_add(1, Ordering::SeqCst);
            let _ = self.let_go.wait_for(|go| *go).await;
        }
    }
}

/// The cut count a connection was opened under.
struct Opened {
    epoch: watch::Receiver<u64>,
    under: u64,
}

impl Opened {
    fn cut(&self) -> bool {
        *self.epoch.borrow() != self.under
    }
}

/// Copies both ways until either side closes or a cut, which drops both sockets; reads the
/// server's side as protocol messages (a type byte, then a big-endian length that counts
/// itself) to count `ReadyForQuery` (`Z`).
async fn relay(
    client: TcpStream,
    server: TcpStream,
    round_trips: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
    stall_on: StallOn,
    mut hold_on: HoldOn,
    mut opened: Opened,
) {
    let held = Arc::clone(&stall_on.this);
    let live = Opened {
        epoch: opened.epoch.clone(),
        under: opened.under,
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(read) = client_read.read(&mut buffer).await {
            if read == 0 || live.cut() {
                break;
            }
            stall_on.sent(&buffer[..read]);
            hold_on.sent(&buffer[..read]).await;
            if live.cut() {
                break;
            }
            if server_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async {
        let mut buffer = vec![0u8; 64 * 1024];
        // Bytes of the current message still to skip, and the header being read.
        let mut skip = 0usize;
        let mut header = Vec::with_capacity(5);
        while let Ok(read) = server_read.read(&mut buffer).await {
            if read == 0 || live.cut() {
                break;
            }
            if stalled.load(Ordering::SeqCst) || held.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            let mut at = 0;
            while at < read {
                if skip > 0 {
                    let taken = skip.min(read - at);
                    skip -= taken;
                    at += taken;
                    continue;
                }
                header.push(buffer[at]);
                at += 1;
                if header.len() == 5 {
                    if header[0] == b'Z' {
                        round_trips.fetch_add(1, Ordering::SeqCst);
                    }
                    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
                    skip = (length as usize).saturating_sub(4);
                    header.clear();
                }
            }
            if client_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    let under = opened.under;
    tokio::select! {
        _ = async { tokio::join!(upstream, downstream) } => {}
        _ = opened.epoch.wait_for(|epoch| *epoch != under) => {}
    }
}
