//! Idempotency-Key for HTTP endpoints: a client that retries a `POST` after a timeout, or a
//! provider that redelivers a webhook, gets the first response again instead of a second
//! effect.
//!
//! [`IdempotencyLayer`] is a tower layer (axum, hyper) that keeps responses in the
//! same SQLite or PostgreSQL store as the runtime. On the routes it wraps, for `POST` and
//! `PATCH` by default:
//!
//! | the request | the answer |
//! | --- | --- |
//! | no `Idempotency-Key` where one is required | 400, problem `idempotency-key-missing` |
//! | an empty, repeated, non-ASCII or over-long key, or a list (`a, b`) | 400, problem `idempotency-key-invalid` |
//! | a body over the limit | 413, problem `request-too-large` |
//! | a new key | the endpoint runs; its answer is kept with a fingerprint of the request |
//! | the same key and fingerprint, answered before | the kept answer, byte for byte, with `Idempotent-Replayed: true`; the endpoint does not run |
//! | the same key while its first request runs | 409, problem `idempotency-key-in-flight`, `Retry-After: 1` |
//! | the same key, another fingerprint | 422, problem `idempotency-key-reused` |
//! | the store unreachable | 503, problem `idempotency-store-unavailable`, `Retry-After: 1`; nothing was kept (the endpoint ran if the store failed as its answer was kept: its database work was rolled back, unless the commit itself failed on its way, when it may have landed — the retry then replays it or runs) |
//! | a request body that cannot be read | 400, problem `request-unreadable` |
//! | an endpoint answer that fails midway | 502, problem `response-unreadable`; nothing kept |
//! | an answer after a failed statement, on PostgreSQL (the transaction is aborted) | 500, problem `endpoint-transaction-aborted`; nothing kept, the work rolled back |
//! | an answer whose work the database refuses as it commits (a deferred constraint) | 500, problem `endpoint-commit-refused`, no `Retry-After`; nothing kept, the work rolled back |
//! | an intent already carried out ([`RequestTransaction::enlist_once`]) | 409, problem `duplicate-intent`, answered by the endpoint |
//! | the same key, its kept answer damaged in the store (a status or headers no response has) | 500, problem `kept-answer-unreadable`, until it expires; the endpoint does not run |
//!
//! Problems are RFC 9457 `application/problem+json` bodies whose `type` is
//! `urn:dacapo:problem:<name>`. Keys are scoped to the route by default, and the default
//! fingerprint holds the request's `Authorization` and `Cookie` headers, so another caller's
//! request with the same key is answered 422, never replayed the first caller's answer; give
//! [`scope`](IdempotencyLayer::scope) the caller's principal and
//! [`fingerprint`](IdempotencyLayer::fingerprint) [`request_fingerprint`], and a retry whose
//! token was refreshed meanwhile is replayed too. Which answers are kept is [`keep`](IdempotencyLayer::keep)'s:
//! by default every one but a 5xx and the client errors a retry may pass (401, 403, 408,
//! 409, 425, 429), which roll the request back and leave the key free. A kept 4xx is kept
//! without the endpoint's database work, which is undone.
//!
//! An endpoint that takes the request's [`RequestTransaction`] from its extensions writes its
//! rows and outbox messages in the transaction that keeps the answer: they commit together
//! after the endpoint answered, or not at all (a crash, a dropped connection, a 5xx), and
//! the client's retry then runs it again. Work done outside that transaction is not covered.
//!
//! ```no_run
//! use axum::{Extension, Router, http::StatusCode, routing::post};
//! use dacapo::http::{IdempotencyLayer, RequestTransaction};
//! use dacapo::sqlx::{self, Sqlite};
//! use dacapo::store::SqliteStore;
//!
//! async fn place_order(Extension(tx): Extension<RequestTransaction<Sqlite>>) -> StatusCode {
//!     let Ok(mut tx) = tx.get().await else {
//!         return StatusCode::SERVICE_UNAVAILABLE;
//!     };
//!     match sqlx::query("INSERT INTO orders (id) VALUES ('A-1')").execute(&mut **tx).await {
//!         Ok(_) => StatusCode::CREATED, // committed with the kept answer, after this returns
//!         Err(_) => StatusCode::INTERNAL_SERVER_ERROR, // rolled back, key left free
//!     }
//! }
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::open("app.db").await?;
//! let app: Router = Router::new()
//!     .route("/orders", post(place_order))
//!     .route_layer(IdempotencyLayer::new(store));
//! # Ok(())
//! # }
//! ```
//!
//! On SQLite, requests with one key are kept apart within the process, by every layer on the
//! store (one process per database file); on PostgreSQL the request's transaction also holds
//! a lock on the key, so nodes sharing the database answer 409 to each other's requests in
//! progress. Each covered request in progress holds one connection of the store's pool on
//! PostgreSQL (its transaction), and on SQLite the database's write lock from the moment the
//! endpoint first takes its transaction: size the pool for the requests you serve at once,
//! and take the transaction late. An answer is read up to the kept-body limit before it is
//! kept and sent; a longer one is streamed after its head is kept. With
//! [`required(false)`](IdempotencyLayer::required), a request without a key carries no
//! `RequestTransaction`: take it as `Option<Extension<…>>`.

mod backend;
mod key;
mod layer;
mod problem;
mod record;
mod request;

pub use backend::Backend;
pub use layer::{
    Idempotency, IdempotencyLayer, ResponseBody, keeps_by_default, request_fingerprint,
};
pub use problem::Problem;
pub use request::{Intent, RequestTransaction, RequestTx};

/// Marks a replayed answer.
pub const REPLAYED: &str = "idempotent-replayed";

/// Marks an answer whose body was over the size limit and is not kept (a replay has an
/// empty body).
pub const BODY_NOT_STORED: &str = "idempotency-body-not-stored";
