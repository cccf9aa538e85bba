//! B7: what the Idempotency-Key layer adds to a request. One axum server on 127.0.0.1 serves
//! the same endpoint bare and under the layer (a SQLite file store, WAL, `synchronous =
//! FULL`); one client sends requests one after another, each with a new key, and the same
//! number to the bare route, interleaved in rounds so a slow spell falls on both. The layer
//! reads the key, fingerprints the body, looks the key up, and commits the kept answer (one
//! fsync) before answering. Replays of a kept answer are timed too.
//!
//! Run with `cargo bench --bench b7_http --features http`. Goal: under 1 ms added at p50.

use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use dacapo::http::IdempotencyLayer;
use dacapo::store::SqliteStore;
use scratch::ScratchSqlite;

#[path = "support/scratch.rs"]
mod scratch;

const ROUNDS: usize = 5;
const PER_ROUND: usize = 400;

async fn created(body: String) -> (StatusCode, String) {
    (
        StatusCode::CREATED,
        format!("{{\"received\":{}}}", body.len()),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at]
}

async fn time(client: &reqwest::Client, url: &str, key: Option<&str>, samples: &mut Vec<Duration>) {
    let mut request = client.post(url).body("{\"order\":\"A-1\"}");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let start = Instant::now();
    let response = request.send().await.unwrap();
    let status = response.status();
    let _ = response.bytes().await.unwrap();
    samples.push(start.elapsed());
    assert_eq!(status, 201);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let file = ScratchSqlite::new("b7");
    let store = SqliteStore::open(file.path()).await.unwrap();
    let app = Router::new().route("/bare", post(created)).merge(
        Router::new()
            .route("/guarded", post(created))
            .route_layer(IdempotencyLayer::new(store)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let (bare_url, guarded_url) = (format!("{base}/bare"), format!("{base}/guarded"));

    // Warm up connections and statements.
    let mut discard = Vec::new();
    for n in 0..100 {
        time(&client, &bare_url, None, &mut discard).await;
        time(
            &client,
            &guarded_url,
            Some(&format!("warm-{n}")),
            &mut discard,
        )
        .await;
    }
    let (mut bare, mut guarded, mut replayed) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        for n in 0..PER_ROUND {
            time(&client, &bare_url, None, &mut bare).await;
            time(
                &client,
                &guarded_url,
                Some(&format!("k-{round}-{n}")),
                &mut guarded,
            )
            .await;
            time(&client, &guarded_url, Some("warm-0"), &mut replayed).await;
        }
    }
    for samples in [&mut bare, &mut guarded, &mut replayed] {
        samples.sort();
    }
    let row = |name: &str, samples: &[Duration]| {
        println!(
            "  {name:<28} p50 {:>8.3} ms   p99 {:>8.3} ms",
            percentile(samples, 0.5).as_secs_f64() * 1e3,
            percentile(samples, 0.99).as_secs_f64() * 1e3
        );
    };
    println!(
        "B7: the Idempotency-Key layer on a SQLite file (WAL, synchronous = FULL), {} requests each",
        ROUNDS * PER_ROUND
    );
    row("bare endpoint", &bare);
    row("new key (kept, one commit)", &guarded);
    row("replay of a kept answer", &replayed);
    let added = percentile(&guarded, 0.5).saturating_sub(percentile(&bare, 0.5));
    println!(
        "  added at p50: {:.3} ms (goal < 1 ms)",
        added.as_secs_f64() * 1e3
    );
}
