//! A webhook receiver: a payment provider redelivers an event until it gets a 2xx, and every
//! redelivery — one after another or at the same moment — makes one effect downstream.
//!
//! - The signature is checked first, over the raw body: HMAC-SHA256 of
//!   `{webhook-id}.{webhook-timestamp}.{body}` with the shared secret, sent as
//!   `webhook-signature: v1=<hex>`, and a timestamp at most five minutes away. A bad or stale
//!   signature gets 401 and the body is never parsed.
//! - The provider's event id (`webhook-id`) is the deduplication id: in one transaction the
//!   receiver records it as an idempotency key and enlists the event in the outbox, and
//!   answers 200 once that committed. A redelivery finds the key and enlists nothing.
//! - A module handles `payments.payment_succeeded` from the outbox: it credits the payment,
//!   one row per payment, in its handler transaction — so even the outbox's or the inbox's
//!   own redelivery after a crash credits once.
//!
//! `cargo run --features http --example webhooks_receiver` starts the receiver on an SQLite
//! file (`webhooks.db`, or `-- --database PATH`), plays the provider — ten redeliveries of one
//! event, five of them at once, and a forged one — and prints what happened.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use dacapo::prelude::*;
use dacapo::store::SqliteStore;
use dacapo::transaction::HandlerTransactions;
use dacapo::{idempotency, sqlx};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// How far a signature's timestamp may be from now.
const TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The event as the provider sends it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PaymentSucceeded {
    payment_id: String,
    amount_cents: i64,
}

impl Message for PaymentSucceeded {
    const TYPE: &'static str = "payments.payment_succeeded";
}

/// The downstream effect: each payment credited once, in the handler's transaction.
#[derive(Clone, Default)]
struct Credit;

impl Handler<PaymentSucceeded> for Credit {
    async fn handle(
        &self,
        event: &PaymentSucceeded,
        ctx: &MessageContext,
    ) -> Result<(), HandlerError> {
        let Some(mut tx) = ctx.transaction::<sqlx::Sqlite>().await? else {
            return Ok(()); // an earlier attempt committed the credit
        };
        sqlx::query("INSERT INTO credits (payment_id, amount_cents) VALUES ($1, $2)")
            .bind(&event.payment_id)
            .bind(event.amount_cents)
            .execute(&mut **tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Payments credited so far.
async fn credited(pool: &sqlx::SqlitePool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM credits")
        .fetch_one(pool)
        .await
}

/// What the receiver needs.
#[derive(Clone)]
struct Receiver {
    runtime: Arc<Runtime>,
    pool: sqlx::SqlitePool,
    secret: Arc<[u8]>,
}

/// Why a delivery was refused before its body was read.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    MissingHeader(&'static str),
    Stale,
    BadSignature,
}

fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, Refused> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .ok_or(Refused::MissingHeader(name))
}

/// Checks the signature over the raw body; returns the event id.
fn verify<'a>(
    headers: &'a HeaderMap,
    body: &[u8],
    secret: &[u8],
    now: i64,
) -> Result<&'a str, Refused> {
    let id = header(headers, "webhook-id")?;
    let timestamp = header(headers, "webhook-timestamp")?;
    let signature = header(headers, "webhook-signature")?;
    let sent: i64 = timestamp.parse().map_err(|_| Refused::Stale)?;
    if now.abs_diff(sent) > TOLERANCE.as_secs() {
        return Err(Refused::Stale);
    }
    let given = signature
        .strip_prefix("v1=")
        .and_then(decode_hex)
        .ok_or(Refused::BadSignature)?;
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| Refused::BadSignature)?;
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    // `verify_slice` compares in constant time.
    mac.verify_slice(&given)
        .map_err(|_| Refused::BadSignature)?;
    Ok(id)
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The provider's side: the headers of a signed delivery.
fn sign(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("v1={hex}")
}

async fn receive(
    State(receiver): State<Receiver>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, &'static str) {
    let now = chrono::Utc::now().timestamp();
    let id = match verify(&headers, &body, &receiver.secret, now) {
        Ok(id) => id,
        Err(refused) => {
            tracing::warn!(?refused, "webhook refused before reading its body");
            return (StatusCode::UNAUTHORIZED, "bad or stale signature");
        }
    };
    let Ok(event) = serde_json::from_slice::<PaymentSucceeded>(&body) else {
        // Signed by the provider but not an event this receiver knows: a non-2xx would make
        // the provider redeliver it for days, and no redelivery can help.
        tracing::warn!(
            webhook.id = id,
            "a signed event of a kind this receiver ignores"
        );
        return (StatusCode::OK, "ignored");
    };
    match record(&receiver, id, &event).await {
        Ok(true) => (StatusCode::OK, "accepted"),
        Ok(false) => (StatusCode::OK, "accepted before"),
        // Nothing committed: the provider's redelivery tries again.
        Err(error) => {
            tracing::warn!(%error, "webhook not recorded");
            (StatusCode::SERVICE_UNAVAILABLE, "try again")
        }
    }
}

/// Records the event id and enlists the event, in one transaction; whether it was new.
async fn record(
    receiver: &Receiver,
    id: &str,
    event: &PaymentSucceeded,
) -> Result<bool, dacapo::Error> {
    let mut tx = receiver.pool.begin_with("BEGIN IMMEDIATE").await?;
    if !idempotency::record_key(&mut tx, &format!("webhook:{id}")).await? {
        return Ok(false);
    }
    let outbox = receiver.runtime.outbox();
    outbox
        .enlist_with(&mut tx, event, SendOptions::new().deduplication_id(id))
        .await?;
    outbox.commit(tx).await?;
    Ok(true)
}

/// A receiver on `database`, with the module that credits payments; the pool, to count them.
async fn start(
    database: &str,
    secret: &[u8],
) -> Result<(Router, Arc<Runtime>, sqlx::SqlitePool), dacapo::Error> {
    let store = SqliteStore::open(database).await?;
    let pool = store.pool().clone();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS credits (payment_id TEXT PRIMARY KEY, amount_cents INTEGER)",
    )
    .execute(&pool)
    .await?;
    let runtime = Arc::new(
        Runtime::builder()
            .store(store)
            .module(Module::new("payments").handle_named::<PaymentSucceeded, _>("credit", Credit))
            .build()?,
    );
    let router = Router::new()
        .route("/webhooks/payments", post(receive))
        .with_state(Receiver {
            runtime: Arc::clone(&runtime),
            pool: pool.clone(),
            secret: Arc::from(secret),
        });
    Ok((router, runtime, pool))
}

/// Waits (boundedly) until `count` payments are credited and the runtime is idle.
async fn until_credited(
    runtime: &Runtime,
    pool: &sqlx::SqlitePool,
    count: i64,
) -> Result<i64, Box<dyn std::error::Error>> {
    tokio::time::timeout(Duration::from_secs(10), async {
        while credited(pool).await? < count {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok::<_, sqlx::Error>(())
    })
    .await??;
    runtime.idle().await;
    Ok(credited(pool).await?)
}

/// Sends one delivery of `body` under event `id`, signed with `secret`.
async fn deliver(
    client: &reqwest::Client,
    url: &str,
    secret: &[u8],
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<u16, reqwest::Error> {
    let response = client
        .post(url)
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", sign(secret, id, timestamp, body))
        .body(body.to_vec())
        .send()
        .await?;
    Ok(response.status().as_u16())
}

fn database_arg() -> Result<String, String> {
    let mut args = std::env::args().skip(1);
    let mut database = "webhooks.db".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--database" => database = args.next().ok_or("--database needs a path")?,
            "-h" | "--help" => {
                return Err("usage: webhooks_receiver [--database PATH]".to_owned());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(database)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let database = database_arg()?;
    let secret = b"whsec_example_only";
    let (router, runtime, pool) = start(&database, secret).await?;
    let before = credited(&pool).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/webhooks/payments", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    println!("webhook receiver on {url}, store {database}");

    let client = reqwest::Client::new();
    let id = format!("evt_{}", uuid::Uuid::new_v4().simple());
    let body = serde_json::to_vec(&PaymentSucceeded {
        payment_id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
        amount_cents: 4_200,
    })?;
    let now = chrono::Utc::now().timestamp();
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(deliver(&client, &url, secret, &id, now, &body).await?);
    }
    let at_once = (0..5).map(|_| deliver(&client, &url, secret, &id, now, &body));
    for answer in futures::future::join_all(at_once).await {
        answers.push(answer?);
    }
    let forged = deliver(&client, &url, b"not the secret", &id, now, &body).await?;
    let stale = deliver(&client, &url, secret, &id, now - 3_600, &body).await?;
    let credited = until_credited(&runtime, &pool, before + 1).await? - before;
    println!("10 deliveries of {id} answered {answers:?}");
    println!("a forged signature answered {forged}, a stale one {stale}");
    println!("payments credited: {credited}");
    runtime.shutdown().await;
    if credited == 1 && answers.iter().all(|a| *a == 200) && forged == 401 && stale == 401 {
        println!("OK: ten redeliveries made one effect; forged and stale ones were refused");
        Ok(())
    } else {
        Err("the redeliveries did not make exactly one effect".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch(std::path::PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
            }
        }
    }

    /// Outbox rows enlisted for event `id`, read with a connection of the test's own.
    async fn enlisted(file: &Scratch, id: &str) -> i64 {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", file.0.display()))
            .await
            .unwrap();
        sqlx::query_scalar("SELECT count(*) FROM dacapo_outbox WHERE deduplication_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
    }

    async fn served() -> (String, Arc<Runtime>, sqlx::SqlitePool, Scratch) {
        let file = std::env::temp_dir().join(format!("webhooks-{}.db", uuid::Uuid::new_v4()));
        let (router, runtime, pool) = start(&file.display().to_string(), b"secret").await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/webhooks/payments",
            listener.local_addr().unwrap()
        );
        tokio::spawn(async move { axum::serve(listener, router).await });
        (url, runtime, pool, Scratch(file))
    }

    fn event() -> Vec<u8> {
        serde_json::to_vec(&PaymentSucceeded {
            payment_id: "pay_9".into(),
            amount_cents: 100,
        })
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_redeliveries_one_after_another_and_at_once_make_one_effect() {
        let (url, runtime, pool, file) = served().await;
        let client = reqwest::Client::new();
        let now = chrono::Utc::now().timestamp();
        let body = event();
        for _ in 0..5 {
            assert_eq!(
                deliver(&client, &url, b"secret", "evt_1", now, &body)
                    .await
                    .unwrap(),
                200
            );
        }
        let at_once = (0..5).map(|_| deliver(&client, &url, b"secret", "evt_1", now, &body));
        for answer in futures::future::join_all(at_once).await {
            assert_eq!(answer.unwrap(), 200);
        }
        assert_eq!(until_credited(&runtime, &pool, 1).await.unwrap(), 1);
        // Another event still goes through: the barrier that shows nothing else was pending.
        let other = serde_json::to_vec(&PaymentSucceeded {
            payment_id: "pay_10".into(),
            amount_cents: 200,
        })
        .unwrap();
        assert_eq!(
            deliver(&client, &url, b"secret", "evt_2", now, &other)
                .await
                .unwrap(),
            200
        );
        assert_eq!(until_credited(&runtime, &pool, 2).await.unwrap(), 2);
        assert_eq!(enlisted(&file, "evt_1").await, 1);
        runtime.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_or_stale_signature_is_401_and_the_body_is_never_parsed() {
        let (url, runtime, pool, file) = served().await;
        let client = reqwest::Client::new();
        let now = chrono::Utc::now().timestamp();
        // Not JSON at all: read, it would be ignored with a 200; a 401 shows it was not read.
        let garbage = b"not json".to_vec();
        let forged = deliver(&client, &url, b"wrong", "evt_3", now, &garbage)
            .await
            .unwrap();
        let stale = deliver(&client, &url, b"secret", "evt_3", now - 600, &garbage)
            .await
            .unwrap();
        let future = deliver(&client, &url, b"secret", "evt_3", now + 600, &garbage)
            .await
            .unwrap();
        let unsigned = client
            .post(&url)
            .body(garbage.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(
            (forged, stale, future, unsigned.status().as_u16()),
            (401, 401, 401, 401)
        );
        // Signed properly, the same bytes are read — and ignored with a 2xx, so the provider
        // stops redelivering what no redelivery can make pass.
        let signed = deliver(&client, &url, b"secret", "evt_3", now, &garbage)
            .await
            .unwrap();
        assert_eq!(signed, 200);
        runtime.idle().await;
        assert_eq!(credited(&pool).await.unwrap(), 0);
        assert_eq!(enlisted(&file, "evt_3").await, 0);
        runtime.shutdown().await;
    }

    #[test]
    fn a_signature_made_by_the_provider_verifies_and_a_changed_body_does_not() {
        let mut headers = HeaderMap::new();
        headers.insert("webhook-id", "evt_4".parse().unwrap());
        headers.insert("webhook-timestamp", "1000".parse().unwrap());
        headers.insert(
            "webhook-signature",
            sign(b"k", "evt_4", 1000, b"{}").parse().unwrap(),
        );
        assert_eq!(verify(&headers, b"{}", b"k", 1000), Ok("evt_4"));
        assert_eq!(
            verify(&headers, b"{ }", b"k", 1000),
            Err(Refused::BadSignature)
        );
        assert_eq!(
            verify(&headers, b"{}", b"k", 1000 + 301),
            Err(Refused::Stale)
        );
    }
}
