//! The Idempotency-Key layer through a real HTTP client, against an axum server on 127.0.0.1
//! and a real store (a SQLite file, a PostgreSQL database): one test per answer of the
//! status-code table, the request's transaction, concurrency, scoping and what is never kept.
#![cfg(all(
    feature = "http",
    feature = "sqlite",
    feature = "postgres",
    feature = "testing"
))]

#[path = "support/proxy.rs"]
mod support_proxy;
#[path = "support/stores.rs"]
mod support_stores;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Router};
use dacapo::http::{IdempotencyLayer, Intent, Problem, RequestTransaction};
use dacapo::store::SqlStore;
use dacapo::{Message, sqlx};
use serde::{Deserialize, Serialize};
use support_stores::{Backend as Which, TestDatabase};
use tokio::sync::Notify;

#[derive(Serialize, Deserialize)]
struct OrderPlaced {
    reference: String,
}

impl Message for OrderPlaced {
    const TYPE: &'static str = "orders.placed";
}

/// An order whose type declares its deduplication id: its reference.
#[derive(Serialize, Deserialize)]
struct OrderKeyed {
    reference: String,
}

impl Message for OrderKeyed {
    const TYPE: &'static str = "orders.keyed";

    fn deduplication_id(&self) -> Option<String> {
        Some(self.reference.clone())
    }
}

/// What the endpoints count and wait on.
#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
    release: Arc<Notify>,
    entered: Arc<Notify>,
    /// The task an endpoint left behind, with what its write after the release came to.
    left_behind: Arc<std::sync::Mutex<Option<LeftBehind>>>,
}

/// A task an endpoint left running, and what its last write came to.
type LeftBehind = tokio::task::JoinHandle<Result<(), String>>;

/// Waits until released, then answers.
async fn slow(State(app): State<App>) -> StatusCode {
    app.runs.fetch_add(1, Ordering::SeqCst);
    app.entered.notify_one();
    app.release.notified().await;
    StatusCode::OK
}

/// 500 on its first run, 201 after; writes nothing.
async fn flaky(State(app): State<App>) -> StatusCode {
    if app.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::CREATED
    }
}

/// 401 on its first run (an expired token, say), 201 after.
async fn unauthorized_first(State(app): State<App>) -> StatusCode {
    if app.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        StatusCode::UNAUTHORIZED
    } else {
        StatusCode::CREATED
    }
}

async fn not_found(State(app): State<App>) -> (StatusCode, String) {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::NOT_FOUND, format!("no such thing (run {run})"))
}

/// An answer over the layer's limit, with a digest of its body and a header about the rest.
async fn big(State(app): State<App>) -> impl axum::response::IntoResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (
        [
            ("content-digest", "sha-256=:not-checked-here:"),
            ("x-order", "kept"),
        ],
        "x".repeat(64 * 1024),
    )
}

/// An order read with axum's JSON extractor, which refuses a request without a JSON media type
/// (415) or with a body that is not JSON (400) before this runs.
async fn json_order(State(app): State<App>, _: axum::Json<serde_json::Value>) -> StatusCode {
    app.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

async fn listing(State(app): State<App>) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    "[]".to_owned()
}

/// The endpoints and router for one backend (axum handlers are concrete functions).
macro_rules! endpoints {
    ($module:ident, $db:ty) => {
        mod $module {
            use super::*;

            /// An order: a row of its own (an idempotency key stands in for the application's table)
            /// and an outbox message, in the request's transaction; a body that differs on every run.
            async fn place(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
                body: String,
            ) -> axum::response::Response {
                let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
                let effect = format!("order:{}", uuid::Uuid::new_v4());
                let written = match request.get().await {
                    Ok(mut tx) => sqlx::query(
                        "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ($1, 0)",
                    )
                    .bind(effect)
                    .execute(&mut **tx)
                    .await
                    .is_ok(),
                    Err(_) => false,
                };
                if !written
                    || request
                        .enlist(&OrderPlaced { reference: body })
                        .await
                        .is_err()
                {
                    return StatusCode::INTERNAL_SERVER_ERROR.into_response();
                }
                // Long enough for concurrent requests with the same key to meet this one.
                tokio::time::sleep(Duration::from_millis(20)).await;
                (
                    StatusCode::CREATED,
                    [
                        ("location", format!("/orders/{run}")),
                        ("set-cookie", "session=secret".to_owned()),
                        ("x-run", run.to_string()),
                    ],
                    format!("{{\"order\":{run}}}"),
                )
                    .into_response()
            }

            /// Writes in the request's transaction, then never answers (the client gives up).
            async fn hang(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                let run = app.runs.fetch_add(1, Ordering::SeqCst);
                let _ = request
                    .enlist(&OrderPlaced {
                        reference: "hang".into(),
                    })
                    .await;
                if run == 0 {
                    app.entered.notify_one();
                    std::future::pending::<()>().await;
                }
                StatusCode::CREATED
            }

            /// On its first run, hands the request's transaction to a task of its own that
            /// enlists a message, waits for the release and enlists another, and hangs; later
            /// runs enlist a message and answer.
            async fn hangs_in_a_task(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                let placed = |reference: &str| OrderPlaced {
                    reference: reference.into(),
                };
                if app.runs.fetch_add(1, Ordering::SeqCst) > 0 {
                    return match request.enlist(&placed("retried")).await {
                        Ok(_) => StatusCode::CREATED,
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                    };
                }
                let task = tokio::spawn({
                    let app = app.clone();
                    async move {
                        request
                            .enlist(&placed("first"))
                            .await
                            .map_err(|e| e.to_string())?;
                        app.entered.notify_one();
                        app.release.notified().await;
                        request
                            .enlist(&placed("late"))
                            .await
                            .map(drop)
                            .map_err(|e| e.to_string())
                    }
                });
                *app.left_behind.lock().unwrap() = Some(task);
                std::future::pending().await
            }

            /// Enlists a message, then fails with a 500 on its first run: the message must go
            /// with the rollback.
            async fn fails_after_writing(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                let run = app.runs.fetch_add(1, Ordering::SeqCst);
                if request
                    .enlist(&OrderPlaced {
                        reference: format!("run {run}"),
                    })
                    .await
                    .is_err()
                {
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                if run == 0 {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::CREATED
                }
            }

            /// Enlists, then a statement fails (a duplicate key): answers 410. On PostgreSQL
            /// the failed statement aborts the transaction the answer is kept in.
            async fn rejects_after_a_failed_statement(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                app.runs.fetch_add(1, Ordering::SeqCst);
                if request
                    .enlist(&OrderPlaced {
                        reference: "before the failure".into(),
                    })
                    .await
                    .is_err()
                {
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                let Ok(mut tx) = request.get().await else {
                    return StatusCode::SERVICE_UNAVAILABLE;
                };
                for _ in 0..2 {
                    let inserted = sqlx::query(
                        "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ('dup', 0)",
                    )
                    .execute(&mut **tx)
                    .await;
                    if inserted.is_err() {
                        return StatusCode::GONE;
                    }
                }
                StatusCode::CREATED
            }

            /// A statement fails (a duplicate key), and the endpoint takes that for "already
            /// there" and answers 201 all the same.
            async fn carries_on_after_a_failed_statement(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                app.runs.fetch_add(1, Ordering::SeqCst);
                let Ok(mut tx) = request.get().await else {
                    return StatusCode::SERVICE_UNAVAILABLE;
                };
                for _ in 0..2 {
                    let _already_there = sqlx::query(
                        "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ('dup', 0)",
                    )
                    .execute(&mut **tx)
                    .await;
                }
                StatusCode::CREATED
            }

            /// Writes a row that breaks a foreign key checked only at commit (deferred), in
            /// tables it creates in the request's transaction: the database refuses the work
            /// as the layer commits it, after the endpoint answered 201.
            async fn refused_at_commit(
                State(app): State<App>,
                Extension(request): Extension<RequestTransaction<$db>>,
            ) -> StatusCode {
                app.runs.fetch_add(1, Ordering::SeqCst);
                let Ok(mut tx) = request.get().await else {
                    return StatusCode::SERVICE_UNAVAILABLE;
                };
                for statement in [
                    "CREATE TABLE IF NOT EXISTS parents (id BIGINT PRIMARY KEY)",
                    "CREATE TABLE IF NOT EXISTS children (parent BIGINT REFERENCES parents (id) \
                     DEFERRABLE INITIALLY DEFERRED)",
                    "INSERT INTO children (parent) VALUES (1)",
                ] {
                    if sqlx::query(statement).execute(&mut **tx).await.is_err() {
                        return StatusCode::INTERNAL_SERVER_ERROR;
                    }
                }
                StatusCode::CREATED
            }

            /// Enlists a message whose type declares its deduplication id.
            async fn enlists_keyed(
                Extension(request): Extension<RequestTransaction<$db>>,
                body: String,
            ) -> StatusCode {
                match request.enlist(&OrderKeyed { reference: body }).await {
                    Ok(_) => StatusCode::CREATED,
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }

            /// Takes the transaction, writes, lets it go, then claims an intent; and shows a
            /// second borrow while one is held is refused instead of waiting forever.
            async fn writes_then_claims(
                Extension(request): Extension<RequestTransaction<$db>>,
                body: String,
            ) -> StatusCode {
                {
                    let Ok(mut tx) = request.get().await else {
                        return StatusCode::SERVICE_UNAVAILABLE;
                    };
                    if sqlx::query(
                        "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ('w', 0)",
                    )
                    .execute(&mut **tx)
                    .await
                    .is_err()
                    {
                        return StatusCode::INTERNAL_SERVER_ERROR;
                    }
                    match request
                        .enlist(&OrderPlaced {
                            reference: "x".into(),
                        })
                        .await
                    {
                        Err(dacapo::Error::RequestTransaction(_)) => {}
                        _ => return StatusCode::INTERNAL_SERVER_ERROR,
                    }
                }
                match request
                    .enlist_once(
                        &OrderPlaced {
                            reference: body.clone(),
                        },
                        body,
                    )
                    .await
                {
                    Ok(Intent::New(_)) => StatusCode::CREATED,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }

            /// Publishes with the body as its deduplication id: 201 once per id, 409 after.
            async fn intent(
                Extension(request): Extension<RequestTransaction<$db>>,
                body: String,
            ) -> axum::response::Response {
                match request
                    .enlist_once(
                        &OrderPlaced {
                            reference: body.clone(),
                        },
                        body,
                    )
                    .await
                {
                    Ok(Intent::New(_)) => StatusCode::CREATED.into_response(),
                    Ok(Intent::Duplicate) => Problem::DuplicateIntent
                        .response::<axum::body::Body>("this order was placed already")
                        .into_response(),
                    Ok(_) | Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                }
            }

            pub(super) fn router(store: SqlStore<$db>, app: App) -> Router {
                let layer = IdempotencyLayer::new(store.clone()).max_stored_body(16 * 1024);
                let forever = IdempotencyLayer::new(store.clone()).retention(Duration::MAX);
                let by_tenant = IdempotencyLayer::new(store.clone())
                    .fingerprint(dacapo::http::request_fingerprint)
                    .scope(|parts| {
                        let tenant = parts
                            .headers
                            .get("x-tenant")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("anonymous");
                        format!("tenant {tenant}")
                    });
                // A scope from a decoded claim, which may hold any character, NUL included.
                let by_decoded_tenant = IdempotencyLayer::new(store).scope(|parts| {
                    let tenant = parts
                        .headers
                        .get("x-tenant")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("anonymous");
                    format!("tenant {}", tenant.replace("%00", "\0"))
                });
                Router::new()
                    .route("/orders", post(place).get(listing))
                    .route("/slow", post(slow))
                    .route("/flaky", post(flaky))
                    .route("/missing", post(not_found))
                    .route("/big", post(big))
                    .route("/hang", post(hang))
                    .route("/hangs-in-a-task", post(hangs_in_a_task))
                    .route("/intent", post(intent))
                    .route("/fails-after-writing", post(fails_after_writing))
                    .route("/rejects", post(rejects_after_a_failed_statement))
                    .route("/carries-on", post(carries_on_after_a_failed_statement))
                    .route("/refused-at-commit", post(refused_at_commit))
                    .route("/keyed", post(enlists_keyed))
                    .route("/writes-then-claims", post(writes_then_claims))
                    .route("/unauthorized-first", post(unauthorized_first))
                    .route("/json", post(json_order))
                    .route_layer(layer)
                    .merge(
                        Router::new()
                            .route("/tenant", post(place))
                            .route_layer(by_tenant),
                    )
                    .merge(
                        Router::new()
                            .route("/decoded-tenant", post(place))
                            .route_layer(by_decoded_tenant),
                    )
                    .merge(
                        Router::new()
                            .route("/intent-kept-forever", post(intent))
                            .route_layer(forever),
                    )
                    .route("/open", post(listing))
                    .with_state(app)
            }
        }
    };
}

endpoints!(on_sqlite, sqlx::Sqlite);
endpoints!(on_postgres, sqlx::Postgres);

/// Serves `router` on 127.0.0.1; its base URL.
async fn serve_router(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// A server on 127.0.0.1 for `db`'s store; its base URL and its endpoints' counters.
async fn serve(db: &TestDatabase) -> (String, App) {
    let app = App::default();
    let router = match db.backend {
        Which::Sqlite => on_sqlite::router(db.sqlite().await, app.clone()),
        Which::Postgres => on_postgres::router(db.postgres().await, app.clone()),
    };
    (serve_router(router).await, app)
}

async fn post_with(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = client.post(url).body(body.to_owned());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

async fn problem(response: reqwest::Response) -> (StatusCode, String, serde_json::Value) {
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    (
        status,
        content_type,
        serde_json::from_slice(&response.bytes().await.unwrap()).unwrap(),
    )
}

fn replayed(headers: &reqwest::header::HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = super::TestDatabase::new(super::Which::Sqlite).await;
                    super::$name(&db).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = super::TestDatabase::new(super::Which::Postgres).await;
                    super::$name(&db).await;
                }
            )*
        }
    };
}

/// A retention too long to add to the clock keeps the intent's claim as long as there is
/// time: a second request for it is refused, not a panic.
async fn an_intent_kept_longer_than_the_clock_goes_is_still_refused_once_repeated(
    db: &TestDatabase,
) {
    let (base, _) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/intent-kept-forever");
    assert_eq!(
        post_with(&client, &url, Some("k-1"), "order-1", &[])
            .await
            .status(),
        201
    );
    let (status, _, body) =
        problem(post_with(&client, &url, Some("k-2"), "order-1", &[]).await).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["type"], "urn:dacapo:problem:duplicate-intent");
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
}

on_both!(
    an_intent_kept_longer_than_the_clock_goes_is_still_refused_once_repeated,
    a_missing_key_is_400_with_a_problem,
    a_retry_gets_the_first_answer_byte_for_byte_without_running_again,
    the_same_key_while_the_first_runs_is_409,
    the_same_key_for_another_body_is_422,
    one_tenants_key_never_replays_anothers_answer,
    under_the_default_scope_a_key_another_caller_sent_first_is_422,
    a_scope_of_your_own_replays_a_retry_whose_token_was_refreshed,
    a_scope_of_your_own_keeps_the_credentials_in_the_default_fingerprint,
    a_scope_with_a_nul_keeps_and_replays_its_answer,
    retries_arriving_together_after_the_answer_all_get_it,
    a_5xx_leaves_the_key_free_and_a_4xx_is_kept,
    an_answer_over_the_size_limit_is_given_but_not_kept,
    a_request_dropped_before_its_commit_leaves_the_key_free_and_its_work_undone,
    a_request_dropped_while_a_task_of_its_endpoint_holds_its_transaction_is_rolled_back,
    fifty_concurrent_requests_with_one_key_make_one_effect,
    bad_keys_are_400_and_routes_that_do_not_opt_in_keep_nothing,
    a_repeated_intent_is_409_from_the_claims_table,
    a_5xx_rolls_the_endpoints_writes_back,
    a_kept_4xx_is_kept_without_the_endpoints_work_even_after_a_failed_statement,
    an_endpoint_writes_then_claims_and_a_second_borrow_is_refused,
    a_401_is_not_kept,
    a_request_refused_as_sent_is_not_kept_and_its_mended_retry_runs,
    a_kept_answer_damaged_in_the_store_is_500_and_the_endpoint_does_not_run_again,
    an_endpoint_that_answers_after_a_failed_statement_is_never_told_to_retry_the_store,
    a_message_enlisted_by_an_endpoint_carries_its_types_deduplication_id,
    work_the_database_refuses_at_commit_is_a_500_that_asks_for_no_retry,
);

/// An endpoint that answers 201 after one of its statements failed. SQLite goes on after a
/// failed statement: the answer and the work are kept. PostgreSQL aborts the transaction:
/// nothing can commit, so the answer is a 500 of its own, the key stays free and no work is
/// kept — never a 503 telling the client to retry a store that is up, which would run the
/// endpoint again and again.
async fn an_endpoint_that_answers_after_a_failed_statement_is_never_told_to_retry_the_store(
    db: &TestDatabase,
) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/carries-on");
    match db.backend {
        Which::Sqlite => {
            let first = post_with(&client, &url, Some("k-40"), "", &[]).await;
            assert_eq!(first.status(), 201);
            let again = post_with(&client, &url, Some("k-40"), "", &[]).await;
            assert_eq!(again.status(), 201);
            assert!(replayed(again.headers()));
            assert_eq!(app.runs.load(Ordering::SeqCst), 1);
            assert_eq!(
                db.scalar("SELECT count(*) FROM dacapo_idempotency_keys WHERE key = 'dup'")
                    .await,
                1
            );
        }
        Which::Postgres => {
            for run in 1..=2 {
                let response = post_with(&client, &url, Some("k-40"), "", &[]).await;
                assert!(response.headers().get("retry-after").is_none());
                let (status, content_type, body) = problem(response).await;
                assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
                assert_eq!(content_type, "application/problem+json");
                assert_eq!(
                    body["type"],
                    "urn:dacapo:problem:endpoint-transaction-aborted"
                );
                // Nothing kept: the retry runs the endpoint again.
                assert_eq!(app.runs.load(Ordering::SeqCst), run);
            }
            assert_eq!(
                db.scalar("SELECT count(*) FROM dacapo_idempotency_keys WHERE key = 'dup'")
                    .await,
                0,
                "its work rolled back"
            );
        }
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_http_keys").await,
        i64::from(matches!(db.backend, Which::Sqlite))
    );
}

/// An endpoint whose work breaks a constraint checked at commit (a deferred foreign key):
/// the commit fails for a reason no retry cures, so the answer is a 500 of its own, without
/// `Retry-After` — never the 503 of a store that is away, which asks the client to run the
/// endpoint again and again — and nothing is kept: the key stays free, the work rolled back.
async fn work_the_database_refuses_at_commit_is_a_500_that_asks_for_no_retry(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/refused-at-commit");
    for run in 1..=2 {
        let response = post_with(&client, &url, Some("k-41"), "", &[]).await;
        let retry_after = response.headers().get("retry-after").cloned();
        let (status, content_type, body) = problem(response).await;
        assert!(retry_after.is_none(), "run {run}: {status} {body}");
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
        assert_eq!(content_type, "application/problem+json");
        assert_eq!(body["type"], "urn:dacapo:problem:endpoint-commit-refused");
        // Nothing kept: the retry runs the endpoint again.
        assert_eq!(app.runs.load(Ordering::SeqCst), run);
    }
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_http_keys").await, 0);
    // The tables the endpoint created went with its transaction; on a store that kept its
    // work they would be there.
    assert!(!db.has_table("children").await, "its work rolled back");
    // The store is fine: another request on another route is served and kept.
    let placed = post_with(&client, &format!("{base}/orders"), Some("k-42"), "o", &[]).await;
    assert_eq!(placed.status(), 201);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_http_keys").await, 1);
}

/// `RequestTransaction::enlist` gives the message its type's deduplication id, as the
/// application's outbox does: a receiver that requires one finds it.
async fn a_message_enlisted_by_an_endpoint_carries_its_types_deduplication_id(db: &TestDatabase) {
    let (base, _) = serve(db).await;
    let client = reqwest::Client::new();
    let response = post_with(&client, &format!("{base}/keyed"), Some("k-41"), "A-41", &[]).await;
    assert_eq!(response.status(), 201);
    let id: Option<String> = db
        .value_for(
            "SELECT deduplication_id FROM dacapo_outbox WHERE message_type = $1",
            "orders.keyed".to_owned(),
        )
        .await;
    assert_eq!(id.as_deref(), Some("A-41"));
}

/// A kept answer whose status or headers were damaged by hand is refused with a problem of
/// its own, each time: not replayed as something the endpoint never answered, not retried as
/// a store outage, and the endpoint never runs twice.
async fn a_kept_answer_damaged_in_the_store_is_500_and_the_endpoint_does_not_run_again(
    db: &TestDatabase,
) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    for (key, damage) in [
        ("k-status", "UPDATE dacapo_http_keys SET status = 0"),
        (
            "k-headers",
            "UPDATE dacapo_http_keys SET headers = 'not json'",
        ),
    ] {
        assert_eq!(
            post_with(&client, &url, Some(key), "A-1", &[])
                .await
                .status(),
            201
        );
        db.execute(damage).await;
        for _ in 0..2 {
            let (status, _, body) =
                problem(post_with(&client, &url, Some(key), "A-1", &[]).await).await;
            assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(body["type"], "urn:dacapo:problem:kept-answer-unreadable");
        }
        let (status, _, body) =
            problem(post_with(&client, &url, Some(key), "B-2", &[]).await).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "a reused key is still told"
        );
        assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-reused");
        db.execute("DELETE FROM dacapo_http_keys").await;
    }
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        2,
        "once per key, never again"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 2);
}

async fn a_5xx_rolls_the_endpoints_writes_back(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/fails-after-writing");
    assert_eq!(
        post_with(&client, &url, Some("k-20"), "", &[])
            .await
            .status(),
        500
    );
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 0);
    assert_eq!(
        post_with(&client, &url, Some("k-20"), "", &[])
            .await
            .status(),
        201
    );
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

async fn a_kept_4xx_is_kept_without_the_endpoints_work_even_after_a_failed_statement(
    db: &TestDatabase,
) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/rejects");
    let first = post_with(&client, &url, Some("k-21"), "", &[]).await;
    assert_eq!(first.status(), 410, "kept, not a 503");
    assert!(!replayed(first.headers()));
    let again = post_with(&client, &url, Some("k-21"), "", &[]).await;
    assert_eq!(again.status(), 410);
    assert!(replayed(again.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_outbox").await,
        0,
        "the message enlisted before the failure is undone"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_idempotency_keys")
            .await,
        0
    );
}

async fn an_endpoint_writes_then_claims_and_a_second_borrow_is_refused(db: &TestDatabase) {
    let (base, _app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/writes-then-claims");
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        post_with(&client, &url, Some("k-22"), "order-77", &[]),
    )
    .await
    .expect("no wait on the request's own lock");
    assert_eq!(answer.status(), 201);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_idempotency_keys")
            .await,
        1
    );
}

async fn a_401_is_not_kept(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/unauthorized-first");
    assert_eq!(
        post_with(&client, &url, Some("k-23"), "", &[])
            .await
            .status(),
        401
    );
    let retried = post_with(&client, &url, Some("k-23"), "", &[]).await;
    assert_eq!(retried.status(), 201);
    assert!(!replayed(retried.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// Refused as sent before the endpoint ran, a request is not kept: the retry that mends its
/// header, or its body, under the same key runs.
async fn a_request_refused_as_sent_is_not_kept_and_its_mended_retry_runs(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/json");
    let json = [("content-type", "application/json")];
    let unlabelled = post_with(&client, &url, Some("k-50"), r#"{"n":1}"#, &[]).await;
    assert_eq!(unlabelled.status(), 415);
    let labelled = post_with(&client, &url, Some("k-50"), r#"{"n":1}"#, &json).await;
    assert_eq!(labelled.status(), 201, "the 415 was not replayed");
    assert!(!replayed(labelled.headers()));

    let broken = post_with(&client, &url, Some("k-51"), r#"{"n":"#, &json).await;
    assert_eq!(broken.status(), 400);
    let mended = post_with(&client, &url, Some("k-51"), r#"{"n":2}"#, &json).await;
    assert_eq!(mended.status(), 201, "not a 422 for the mended body");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    let again = post_with(&client, &url, Some("k-51"), r#"{"n":2}"#, &json).await;
    assert!(replayed(again.headers()), "the 201 is kept");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

async fn a_missing_key_is_400_with_a_problem(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let response = post_with(&client, &format!("{base}/orders"), None, "A-1", &[]).await;
    let (status, content_type, body) = problem(response).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(content_type, "application/problem+json");
    assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-missing");
    assert_eq!(body["status"], 400);
    assert!(body["detail"].as_str().unwrap().contains("Idempotency-Key"));
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
}

async fn a_retry_gets_the_first_answer_byte_for_byte_without_running_again(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    let first = post_with(&client, &url, Some("k-1"), "A-1", &[]).await;
    assert_eq!(first.status(), 201);
    assert!(!replayed(first.headers()));
    assert!(first.headers().contains_key("set-cookie"));
    let first_location = first.headers()["location"].clone();
    let first_body = first.bytes().await.unwrap();

    for _ in 0..3 {
        let again = post_with(&client, &url, Some("k-1"), "A-1", &[]).await;
        assert_eq!(again.status(), 201);
        assert!(replayed(again.headers()));
        assert_eq!(again.headers()["location"], first_location);
        assert!(
            !again.headers().contains_key("set-cookie"),
            "a session cookie is never replayed by default"
        );
        assert_eq!(again.bytes().await.unwrap(), first_body);
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_idempotency_keys")
            .await,
        1
    );
}

async fn the_same_key_while_the_first_runs_is_409(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/slow");
    let entered = app.entered.notified();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some("k-slow"), "", &[]).await }
    });
    entered.await;
    let (status, _, body) = problem(post_with(&client, &url, Some("k-slow"), "", &[]).await).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-in-flight");
    app.release.notify_one();
    assert_eq!(first.await.unwrap().status(), 200);
    let after = post_with(&client, &url, Some("k-slow"), "", &[]).await;
    assert_eq!(after.status(), 200);
    assert!(replayed(after.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

async fn the_same_key_for_another_body_is_422(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    assert_eq!(
        post_with(&client, &url, Some("k-2"), "A-1", &[])
            .await
            .status(),
        201
    );
    let (status, content_type, body) =
        problem(post_with(&client, &url, Some("k-2"), "B-2", &[]).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(content_type, "application/problem+json");
    assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-reused");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

async fn one_tenants_key_never_replays_anothers_answer(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/tenant");
    let acme = post_with(&client, &url, Some("k-3"), "A-1", &[("x-tenant", "acme")]).await;
    let globex = post_with(&client, &url, Some("k-3"), "A-1", &[("x-tenant", "globex")]).await;
    assert!(!replayed(acme.headers()) && !replayed(globex.headers()));
    assert_ne!(acme.headers()["x-run"], globex.headers()["x-run"]);
    let acme_again = post_with(&client, &url, Some("k-3"), "A-1", &[("x-tenant", "acme")]).await;
    assert!(replayed(acme_again.headers()));
    assert_eq!(acme_again.headers()["x-run"], acme.headers()["x-run"]);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// The default scope names no caller, so the default fingerprint holds the credentials: a
/// caller who sends another's key and body (without credentials, or with their own) is
/// answered 422 and never sees the other's answer (which it was replayed before: a check in
/// the endpoint does not run for a replay).
async fn under_the_default_scope_a_key_another_caller_sent_first_is_422(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    let alice = [("authorization", "Bearer alice"), ("cookie", "session=a")];
    let first = post_with(&client, &url, Some("k-cred"), "A-1", &alice).await;
    assert_eq!(first.status(), 201);
    for others in [
        &[][..],
        &[("authorization", "Bearer mallory"), ("cookie", "session=a")][..],
        &[("authorization", "Bearer alice"), ("cookie", "session=m")][..],
        &[("authorization", "Bearer alice")][..],
    ] {
        let (status, _, body) =
            problem(post_with(&client, &url, Some("k-cred"), "A-1", others).await).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{others:?}");
        assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-reused");
    }
    let again = post_with(&client, &url, Some("k-cred"), "A-1", &alice).await;
    assert!(
        replayed(again.headers()),
        "the caller's own retry is replayed"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A scope of its own does not take the credentials out of the default fingerprint (a scope
/// naming a router's prefix names no caller): another caller's request with the key is 422.
async fn a_scope_of_your_own_keeps_the_credentials_in_the_default_fingerprint(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/decoded-tenant");
    let alice = [("x-tenant", "acme"), ("authorization", "Bearer alice")];
    let mallory = [("x-tenant", "acme"), ("authorization", "Bearer mallory")];
    let first = post_with(&client, &url, Some("k-prefix"), "A-1", &alice).await;
    assert_eq!(first.status(), 201);
    let (status, _, body) =
        problem(post_with(&client, &url, Some("k-prefix"), "A-1", &mallory).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-reused");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// With a scope naming the caller and the fingerprint without credentials, a retry whose
/// token was refreshed meanwhile is the same request, replayed.
async fn a_scope_of_your_own_replays_a_retry_whose_token_was_refreshed(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/tenant");
    let before = [("x-tenant", "acme"), ("authorization", "Bearer old")];
    let after = [("x-tenant", "acme"), ("authorization", "Bearer refreshed")];
    let first = post_with(&client, &url, Some("k-refresh"), "A-1", &before).await;
    assert_eq!(first.status(), 201);
    let retry = post_with(&client, &url, Some("k-refresh"), "A-1", &after).await;
    assert_eq!(retry.status(), 201);
    assert!(replayed(retry.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A scope PostgreSQL cannot hold as text (a NUL) is still a scope: the answer is kept and
/// replayed. Its failure to store the answer was the endpoint's 500 on every retry, each
/// running the endpoint again.
async fn a_scope_with_a_nul_keeps_and_replays_its_answer(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/decoded-tenant");
    let tenant = [("x-tenant", "ac%00me")];
    let first = post_with(&client, &url, Some("k-nul"), "A-1", &tenant).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = post_with(&client, &url, Some("k-nul"), "A-1", &tenant).await;
    assert!(replayed(again.headers()));
    assert_eq!(again.headers()["x-run"], first.headers()["x-run"]);
    let other = post_with(
        &client,
        &url,
        Some("k-nul"),
        "A-1",
        &[("x-tenant", "ac me")],
    )
    .await;
    assert!(!replayed(other.headers()), "another scope, another key");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// Retries that arrive together after the first request answered all get its answer: none
/// is told that a request is in progress (those that met another retry holding the key were).
async fn retries_arriving_together_after_the_answer_all_get_it(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    let first = post_with(&client, &url, Some("k-together"), "A-1", &[]).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let retries = futures::future::join_all(
        (0..20).map(|_| post_with(&client, &url, Some("k-together"), "A-1", &[])),
    )
    .await;
    for retry in &retries {
        assert_eq!(retry.status(), StatusCode::CREATED);
        assert!(replayed(retry.headers()));
        assert_eq!(retry.headers()["x-run"], first.headers()["x-run"]);
    }
    let other = post_with(&client, &url, Some("k-together"), "B-2", &[]).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

async fn a_5xx_leaves_the_key_free_and_a_4xx_is_kept(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/flaky");
    assert_eq!(
        post_with(&client, &url, Some("k-4"), "", &[])
            .await
            .status(),
        500
    );
    let retried = post_with(&client, &url, Some("k-4"), "", &[]).await;
    assert_eq!(retried.status(), 201);
    assert!(!replayed(retried.headers()), "the 500 was not kept");
    let again = post_with(&client, &url, Some("k-4"), "", &[]).await;
    assert!(replayed(again.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);

    let url = format!("{base}/missing");
    let first = post_with(&client, &url, Some("k-5"), "", &[]).await;
    assert_eq!(first.status(), 404);
    let first_body = first.text().await.unwrap();
    let again = post_with(&client, &url, Some("k-5"), "", &[]).await;
    assert_eq!(again.status(), 404);
    assert!(replayed(again.headers()));
    assert_eq!(again.text().await.unwrap(), first_body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 3);
}

async fn an_answer_over_the_size_limit_is_given_but_not_kept(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/big");
    let first = post_with(&client, &url, Some("k-6"), "", &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["idempotency-body-not-stored"], "true");
    assert!(first.headers().contains_key("content-digest"));
    assert_eq!(first.bytes().await.unwrap().len(), 64 * 1024);
    let again = post_with(&client, &url, Some("k-6"), "", &[]).await;
    assert_eq!(again.status(), 200);
    assert!(replayed(again.headers()));
    assert_eq!(again.headers()["idempotency-body-not-stored"], "true");
    // The headers that describe the body go with it; the others stay.
    assert!(!again.headers().contains_key("content-digest"));
    assert!(!again.headers().contains_key("content-type"));
    assert_eq!(again.headers()["x-order"], "kept");
    assert!(again.bytes().await.unwrap().is_empty());
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        1,
        "the work is not repeated"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_http_keys WHERE body IS NULL")
            .await,
        1
    );
}

/// Posts to `url` under `key` until the endpoint tells `app.entered`, goes away, then posts
/// again until the answer is not 409 (the key in flight): that answer. The server drops the
/// request when its client goes, and its transaction rolls back.
async fn abandoned_then_retried(app: &App, url: &str, key: &str) -> reqwest::Response {
    let entered = app.entered.notified();
    let first = tokio::spawn({
        let (url, key) = (url.to_owned(), key.to_owned());
        async move {
            let client = reqwest::Client::new();
            post_with(&client, &url, Some(&key), "", &[]).await
        }
    });
    entered.await;
    first.abort();
    let _ = first.await;
    let client = reqwest::Client::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let response = post_with(&client, url, Some(key), "", &[]).await;
            if response.status() != 409 {
                return response;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the key is freed within 20s")
}

async fn a_request_dropped_before_its_commit_leaves_the_key_free_and_its_work_undone(
    db: &TestDatabase,
) {
    let (base, app) = serve(db).await;
    // The endpoint wrote in the request's transaction and hangs: the client goes away.
    let retried = abandoned_then_retried(&app, &format!("{base}/hang"), "k-7").await;
    assert_eq!(retried.status(), 201);
    assert!(!replayed(retried.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_outbox").await,
        1,
        "the dropped request's row was rolled back"
    );
}

/// An endpoint that moved the request's transaction into a task of its own, which outlives
/// the request: once the client goes, the request is rolled back and its key freed without
/// waiting for that task, and the task's later write is refused, not kept.
async fn a_request_dropped_while_a_task_of_its_endpoint_holds_its_transaction_is_rolled_back(
    db: &TestDatabase,
) {
    let (base, app) = serve(db).await;
    let url = format!("{base}/hangs-in-a-task");
    let retried = abandoned_then_retried(&app, &url, "k-8").await;
    assert_eq!(retried.status(), 201);
    assert!(!replayed(retried.headers()));
    app.release.notify_one();
    let task = app.left_behind.lock().unwrap().take().expect("the task");
    let late = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the task ends once released")
        .unwrap();
    let refused = late.expect_err("the task's write after the request ended is refused");
    assert!(refused.contains("has ended"), "{refused}");
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_outbox").await,
        1,
        "only the retry's message is kept"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

async fn fifty_concurrent_requests_with_one_key_make_one_effect(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    let requests = (0..50).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            let response = post_with(&client, &url, Some("k-many"), "A-1", &[]).await;
            (response.status().as_u16(), replayed(response.headers()))
        })
    });
    let answers: Vec<(u16, bool)> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let fresh = answers.iter().filter(|(s, r)| *s == 201 && !r).count();
    let replays = answers.iter().filter(|(s, r)| *s == 201 && *r).count();
    let conflicts = answers.iter().filter(|(s, _)| *s == 409).count();
    assert_eq!(fresh, 1, "{answers:?}");
    assert_eq!(replays + conflicts, 49, "{answers:?}");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
}

async fn bad_keys_are_400_and_routes_that_do_not_opt_in_keep_nothing(db: &TestDatabase) {
    let (base, app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    let long = "k".repeat(256);
    for key in [long.as_str(), "\"\""] {
        let (status, _, body) =
            problem(post_with(&client, &url, Some(key), "A-1", &[]).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-invalid");
    }
    let non_ascii = client
        .post(&url)
        .header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
        )
        .body("A-1")
        .send()
        .await
        .unwrap();
    assert_eq!(non_ascii.status(), 400);
    // GET is not covered, and /open has no layer: the key is ignored and nothing is kept.
    for _ in 0..2 {
        let listed = client
            .get(&url)
            .header("idempotency-key", "k-8")
            .send()
            .await
            .unwrap();
        assert!(!replayed(listed.headers()));
        let open = post_with(&client, &format!("{base}/open"), Some("k-8"), "", &[]).await;
        assert!(!replayed(open.headers()));
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 4);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_http_keys").await, 0);
}

async fn a_repeated_intent_is_409_from_the_claims_table(db: &TestDatabase) {
    let (base, _app) = serve(db).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/intent");
    // Two different keys (a double click) carrying one intent: one effect.
    let first = post_with(&client, &url, Some("k-9"), "order-42", &[]).await;
    assert_eq!(first.status(), 201);
    let (status, _, body) =
        problem(post_with(&client, &url, Some("k-10"), "order-42", &[]).await).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["type"], "urn:dacapo:problem:duplicate-intent");
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_deduplication WHERE handler = 'http:orders.placed'")
            .await,
        1
    );
    // Another intent is its own.
    let other = post_with(&client, &url, Some("k-11"), "order-43", &[]).await;
    assert_eq!(other.status(), 201);
}

/// Two nodes on one PostgreSQL database: each keeps its own requests apart in its process, and
/// the key's lock in the database keeps them apart from each other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_answer_409_to_each_others_request_in_progress_and_make_one_effect() {
    let db = TestDatabase::new(Which::Postgres).await;
    let (node_a, app_a) = serve(&db).await;
    let (node_b, app_b) = serve(&db).await;
    let client = reqwest::Client::new();

    let entered = app_a.entered.notified();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), format!("{node_a}/slow"));
        async move { post_with(&client, &url, Some("k-nodes"), "", &[]).await }
    });
    entered.await;
    let (status, _, body) =
        problem(post_with(&client, &format!("{node_b}/slow"), Some("k-nodes"), "", &[]).await)
            .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["type"], "urn:dacapo:problem:idempotency-key-in-flight");
    app_a.release.notify_one();
    assert_eq!(first.await.unwrap().status(), 200);
    let replay = post_with(&client, &format!("{node_b}/slow"), Some("k-nodes"), "", &[]).await;
    assert!(replayed(replay.headers()));
    assert_eq!(app_b.runs.load(Ordering::SeqCst), 0);

    // Fifty requests with one key, spread over both nodes: one effect.
    let requests = (0..50).map(|n| {
        let client = client.clone();
        let url = format!("{}/orders", if n % 2 == 0 { &node_a } else { &node_b });
        tokio::spawn(async move {
            let response = post_with(&client, &url, Some("k-spread"), "A-1", &[]).await;
            (response.status().as_u16(), replayed(response.headers()))
        })
    });
    let answers: Vec<(u16, bool)> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let fresh = answers.iter().filter(|(s, r)| *s == 201 && !r).count();
    assert_eq!(fresh, 1, "{answers:?}");
    assert!(
        answers.iter().all(|(s, _)| *s == 409 || *s == 201),
        "{answers:?}"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
}

/// Two stores in two schemas of one PostgreSQL database keep their keys apart, as they keep
/// their tables: a request in progress in one schema does not hold its key in the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_progress_in_one_schema_is_free_in_another_postgres() {
    let db = TestDatabase::new(Which::Postgres).await;
    db.execute("CREATE SCHEMA other").await;
    let in_other = dacapo::store::PostgresStore::connect(&format!(
        "{}?options=-c%20search_path%3Dother",
        db.url
    ))
    .await
    .unwrap();
    let app_other = App::default();
    let node_other = serve_router(on_postgres::router(in_other, app_other.clone())).await;
    let (node, app) = serve(&db).await;
    let client = reqwest::Client::new();

    let entered_other = app_other.entered.notified();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), format!("{node_other}/slow"));
        async move { post_with(&client, &url, Some("k-schema"), "", &[]).await }
    });
    entered_other.await;
    let entered = app.entered.notified();
    let mut second = tokio::spawn({
        let (client, url) = (client.clone(), format!("{node}/slow"));
        async move { post_with(&client, &url, Some("k-schema"), "", &[]).await }
    });
    tokio::select! {
        () = entered => {}
        answer = &mut second => panic!(
            "answered before its endpoint ran: {}",
            answer.unwrap().status()
        ),
    }
    app.release.notify_one();
    app_other.release.notify_one();
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(second.await.unwrap().status(), 200);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(app_other.runs.load(Ordering::SeqCst), 1);
    // Each kept its own answer, which a retry on its node gets.
    for base in [&node, &node_other] {
        let retry = post_with(&client, &format!("{base}/slow"), Some("k-schema"), "", &[]).await;
        assert_eq!(retry.status(), 200);
        assert!(replayed(retry.headers()), "{base}");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(app_other.runs.load(Ordering::SeqCst), 1);
}

/// On a PostgreSQL database whose transactions default to REPEATABLE READ, the statement that
/// takes a request's key lock also fixes its transaction's snapshot: an answer kept between
/// that snapshot and the lock (by the request that held the lock just before) is not in it.
/// The layer looks the kept answer up outside that snapshot and replays it, rather than run
/// the endpoint a second time. The proxy holds the lookup back while the answer is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_kept_after_a_repeatable_read_snapshot_began_is_replayed() {
    let (db, mut admin) = repeatable_read_database().await;
    let (proxy, through) = support_proxy::Proxy::to(&db.url).await;
    // Every statement sent with its text, which the proxy looks for: none prepared before.
    let through = format!("{through}&statement-cache-capacity=0");
    let store = dacapo::store::PostgresStore::connect(&through)
        .await
        .unwrap();
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(isolation, "repeatable read");
    let app = App::default();
    let url = format!(
        "{}/orders",
        serve_router(on_postgres::router(store, app.clone())).await
    );
    let client = reqwest::Client::new();
    let first = post_with(&client, &url, Some("k-rr"), "A-1", &[]).await;
    assert_eq!(first.status(), 201);
    let first_body = first.text().await.unwrap();

    // The kept answer taken away, so that the next request's snapshot is without it …
    sqlx::raw_sql(
        "CREATE TABLE kept AS SELECT * FROM dacapo_http_keys; DELETE FROM dacapo_http_keys",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    proxy.hold_the_send_of(b"FROM dacapo_http_keys WHERE id");
    let second = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some("k-rr"), "A-1", &[]).await }
    });
    tokio::time::timeout(Duration::from_secs(10), async {
        while proxy.held_sends() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the second request looks its key up");
    // … and kept again once it holds the lock, before it looks.
    sqlx::query("INSERT INTO dacapo_http_keys SELECT * FROM kept")
        .execute(&mut admin)
        .await
        .unwrap();
    proxy.let_go();
    let second = second.await.unwrap();
    let status = second.status();
    let replay = replayed(second.headers());
    let body = second.text().await.unwrap();
    assert_eq!(
        (status.as_u16(), replay, body.as_str()),
        (201, true, first_body.as_str()),
        "the first answer, replayed"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the endpoint ran once");
}

/// A fresh PostgreSQL database whose transactions default to REPEATABLE READ, and a
/// connection to it.
async fn repeatable_read_database() -> (TestDatabase, sqlx::PgConnection) {
    let db = TestDatabase::new(Which::Postgres).await;
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    (db, admin)
}

/// Where transactions default to REPEATABLE READ, a request looks its key up outside its
/// transaction, and not on a second connection of the pool it holds one of: with a pool of
/// two, requests two at a time each holding one would wait for each other until the pool
/// gave up on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_repeatable_read_requests_as_many_as_the_pool_holds_do_not_wait_for_each_other() {
    let (db, _admin) = repeatable_read_database().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&db.url)
        .await
        .unwrap();
    let store = dacapo::store::PostgresStore::with_pool(pool).await.unwrap();
    let app = App::default();
    let url = format!(
        "{}/orders",
        serve_router(on_postgres::router(store, app.clone())).await
    );
    let client = reqwest::Client::new();
    let requests = (0..6).map(|n| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            post_with(&client, &url, Some(&format!("k-{n}")), "A-1", &[])
                .await
                .status()
                .as_u16()
        })
    });
    let statuses: Vec<u16> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(statuses, [201; 6]);
    assert_eq!(app.runs.load(Ordering::SeqCst), 6);
}

/// Where transactions default to REPEATABLE READ, the lookup outside the request's
/// transaction, on the runtime's pool (which takes its connections without a ping), runs again
/// on another connection when the one it took was ended by the server while idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_repeatable_read_a_lookup_on_a_session_the_server_ended_runs_again() {
    let (db, mut admin) = repeatable_read_database().await;
    let store = dacapo::store::PostgresStore::connect(&db.url)
        .await
        .unwrap();
    let app = App::default();
    let url = format!(
        "{}/orders",
        serve_router(on_postgres::router(store, app.clone())).await
    );
    let client = reqwest::Client::new();
    assert_eq!(
        post_with(&client, &url, Some("k-1"), "A-1", &[])
            .await
            .status(),
        201
    );
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert!(ended.len() >= 2, "the pools' sessions ended: {ended:?}");
    for n in 2..=4 {
        let response = post_with(&client, &url, Some(&format!("k-{n}")), "A-1", &[]).await;
        assert_eq!(response.status(), 201, "request {n}");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 4);
}

/// A kept answer expires after the layer's retention: the key is free again, and the
/// runtime's cleanup removes the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_answer_is_not_replayed_and_the_cleanup_removes_it() {
    let db = TestDatabase::new(Which::Sqlite).await;
    let store = db.sqlite().await;
    let app = App::default();
    let router = Router::new()
        .route("/flaky", post(flaky))
        .route_layer(IdempotencyLayer::new(store.clone()).retention(Duration::ZERO))
        .with_state(app.clone());
    let url = format!("{}/flaky", serve_router(router).await);
    let client = reqwest::Client::new();
    assert_eq!(
        post_with(&client, &url, Some("k-old"), "", &[])
            .await
            .status(),
        500
    );
    // The 500 was not kept; the 201 is, already expired.
    assert_eq!(
        post_with(&client, &url, Some("k-old"), "", &[])
            .await
            .status(),
        201
    );
    let again = post_with(&client, &url, Some("k-old"), "", &[]).await;
    assert!(
        !replayed(again.headers()),
        "an expired answer is not replayed"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 3);
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_http_keys").await, 1);

    let runtime = dacapo::Runtime::builder()
        .store(store)
        .cleanup_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        while db.scalar("SELECT count(*) FROM dacapo_http_keys").await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the cleanup removed the expired answer");
    runtime.shutdown().await;
}

/// 413 for a body over the limit, read no further; 503 when the store cannot be reached,
/// with nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_413_and_an_unreachable_store_is_503() {
    let db = TestDatabase::new(Which::Sqlite).await;
    let store = db.sqlite().await;
    let app = App::default();
    let router = Router::new()
        .route("/flaky", post(flaky))
        .route_layer(IdempotencyLayer::new(store.clone()).max_request_body(1024))
        .with_state(app.clone());
    let url = format!("{}/flaky", serve_router(router).await);
    let client = reqwest::Client::new();

    let (status, _, body) =
        problem(post_with(&client, &url, Some("k-big"), &"x".repeat(4096), &[]).await).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["type"], "urn:dacapo:problem:request-too-large");

    // The store's pool closed under the layer: nothing can be looked up or kept.
    store.pool().close().await;
    let response = post_with(&client, &url, Some("k-down"), "", &[]).await;
    assert_eq!(response.headers()["retry-after"], "1");
    let (status, _, body) = problem(response).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body["type"],
        "urn:dacapo:problem:idempotency-store-unavailable"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0, "nothing ran");
}

/// Two layers on one SQLite store keep one key's requests apart: the set of keys in progress
/// is the store's, not the layer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_layers_on_one_store_answer_409_to_each_others_request_in_progress() {
    let db = TestDatabase::new(Which::Sqlite).await;
    let store = db.sqlite().await;
    let app = App::default();
    let same_scope = |_: &axum::http::request::Parts| "account 1".to_owned();
    let router = Router::new()
        .route("/a", post(slow))
        .route_layer(IdempotencyLayer::new(store.clone()).scope(same_scope))
        .merge(
            Router::new()
                .route("/b", post(slow))
                .route_layer(IdempotencyLayer::new(store).scope(same_scope)),
        )
        .with_state(app.clone());
    let base = serve_router(router).await;
    let client = reqwest::Client::new();
    let entered = app.entered.notified();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), format!("{base}/a"));
        async move { post_with(&client, &url, Some("k-shared"), "", &[]).await }
    });
    entered.await;
    let second = post_with(&client, &format!("{base}/b"), Some("k-shared"), "", &[]).await;
    assert_eq!(second.status(), 409);
    app.release.notify_one();
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// `keep` decides what is kept: here 5xx answers too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_told_to_keep_server_errors_replays_them() {
    /// `flaky`, which enlists a message first.
    async fn flaky_after_writing(
        State(app): State<App>,
        Extension(request): Extension<RequestTransaction<sqlx::Sqlite>>,
    ) -> StatusCode {
        let run = app.runs.load(Ordering::SeqCst);
        let reference = format!("run {run}");
        if request.enlist(&OrderPlaced { reference }).await.is_err() {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        flaky(State(app)).await
    }
    let db = TestDatabase::new(Which::Sqlite).await;
    let app = App::default();
    let router = Router::new()
        .route("/flaky", post(flaky_after_writing))
        .route_layer(IdempotencyLayer::new(db.sqlite().await).keep(|_| true))
        .with_state(app.clone());
    let url = format!("{}/flaky", serve_router(router).await);
    let client = reqwest::Client::new();
    assert_eq!(
        post_with(&client, &url, Some("k-30"), "", &[])
            .await
            .status(),
        500
    );
    let again = post_with(&client, &url, Some("k-30"), "", &[]).await;
    assert_eq!(again.status(), 500);
    assert!(replayed(again.headers()));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    // Kept, a 5xx commits with the endpoint's work (only a kept 4xx's work is undone).
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
}

/// A service under the layer that fails without an answer (a timeout layer inside it, say)
/// has its request's work undone and its key's lock let go before the error goes up: the
/// retry right after it runs, never answered 409, and nothing it wrote is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_fails_without_an_answer_leaves_the_key_free_and_its_work_undone() {
    use tower::{Layer, ServiceExt};
    let db = TestDatabase::new(Which::Postgres).await;
    let store = db.postgres().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let failing = {
        let runs = Arc::clone(&runs);
        tower::service_fn(move |request: axum::http::Request<axum::body::Body>| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let transaction = request
                    .extensions()
                    .get::<RequestTransaction<sqlx::Postgres>>()
                    .expect("the layer's transaction")
                    .clone();
                let mut tx = transaction.get().await.unwrap();
                sqlx::query(
                    "INSERT INTO dacapo_idempotency_keys (key, recorded_at) VALUES ('effect', 0)",
                )
                .execute(&mut **tx)
                .await
                .unwrap();
                drop(tx);
                Err::<axum::http::Response<axum::body::Body>, _>(std::io::Error::other(
                    "the service gave up",
                ))
            }
        })
    };
    let service = IdempotencyLayer::new(store).layer(failing);
    for attempt in 1..=5 {
        let request = axum::http::Request::post("/orders")
            .header("idempotency-key", "k-1")
            .body(axum::body::Body::from("A-1"))
            .unwrap();
        let failed = service.clone().oneshot(request).await;
        assert!(
            failed.is_err(),
            "attempt {attempt}: the service's error goes up"
        );
        assert_eq!(runs.load(Ordering::SeqCst), attempt, "never answered 409");
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM dacapo_idempotency_keys")
            .await,
        0,
        "its work undone each time"
    );
}

/// An answer with trailers (gRPC's status travels in them) reaches the client with them: the
/// layer reads the answer to keep it, but does not drop what follows the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answers_trailers_reach_the_client() {
    use http_body_util::{BodyExt, StreamBody};
    use tower::{Layer, ServiceExt};
    let db = TestDatabase::new(Which::Sqlite).await;
    let with_trailers = tower::service_fn(|_: axum::http::Request<axum::body::Body>| async {
        let mut trailers = axum::http::HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let frames = [
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(axum::body::Bytes::from(
                "answer",
            ))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        Ok::<_, std::convert::Infallible>(axum::http::Response::new(StreamBody::new(
            futures::stream::iter(frames),
        )))
    });
    let service = IdempotencyLayer::new(db.sqlite().await).layer(with_trailers);
    let request = axum::http::Request::post("/calls")
        .header("idempotency-key", "k-1")
        .body(axum::body::Body::from("call"))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let collected = response.into_body().collect().await.unwrap();
    assert_eq!(
        collected
            .trailers()
            .and_then(|trailers| trailers.get("grpc-status")),
        Some(&axum::http::HeaderValue::from_static("0"))
    );
    assert_eq!(collected.to_bytes(), "answer");
}

/// A request dropped on a current-thread runtime that then stays idle, its endpoint's SQLite
/// transaction open (holding the write lock), is rolled back all the same: the rollback does
/// not wait for that runtime to run again, and the next request, served from another runtime,
/// gets its answer. It used to be spawned on the idle runtime, holding the lock for good.
#[test]
fn a_request_dropped_on_a_runtime_left_idle_leaves_the_write_lock_free() {
    use futures::FutureExt as _;
    use std::future::Future as _;
    use tower::ServiceExt as _;

    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let application = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = main.block_on(TestDatabase::new(Which::Sqlite));
    let app = App::default();
    let router = main.block_on(async { on_sqlite::router(db.sqlite().await, app.clone()) });
    {
        let _application = application.enter();
        let request = axum::http::Request::post("/hang")
            .header("idempotency-key", "k-dropped")
            .body(axum::body::Body::from(""))
            .unwrap();
        let mut answer = Box::pin(router.clone().oneshot(request));
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        let polled_for = std::time::Instant::now();
        // Polled, the application's runtime running no task, until the endpoint wrote.
        while app.entered.notified().now_or_never().is_none() {
            assert!(answer.as_mut().poll(&mut context).is_pending());
            assert!(
                polled_for.elapsed() < Duration::from_secs(10),
                "the endpoint wrote"
            );
        }
        drop(answer);
    }
    // From here on the application's runtime runs nothing.
    main.block_on(async {
        let url = serve_router(router).await;
        let response = tokio::time::timeout(
            Duration::from_secs(20),
            post_with(
                &reqwest::Client::new(),
                &format!("{url}/orders"),
                Some("k-next"),
                "A-1",
                &[],
            ),
        )
        .await
        .expect("answered");
        assert_eq!(response.status(), 201);
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox WHERE payload LIKE '%A-1%'")
                .await,
            1,
            "the next request's work committed"
        );
        assert_eq!(
            db.scalar("SELECT count(*) FROM dacapo_outbox WHERE payload LIKE '%hang%'")
                .await,
            0,
            "the dropped request's work rolled back"
        );
    });
    drop(application);
}

/// Counts the orders it handles.
#[derive(Clone, Default)]
struct HandledOrders {
    count: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

impl dacapo::Handler<OrderPlaced> for HandledOrders {
    async fn handle(
        &self,
        _: &OrderPlaced,
        _: &dacapo::MessageContext,
    ) -> Result<(), dacapo::HandlerError> {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        Ok(())
    }
}

/// Enlists an order for its body; the enlist's error as a 500 whose body says why.
async fn order_for_the_runtime(
    Extension(request): Extension<RequestTransaction<sqlx::Sqlite>>,
    body: String,
) -> axum::response::Response {
    match request.enlist(&OrderPlaced { reference: body }).await {
        Ok(_) => StatusCode::CREATED.into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// A layer given the runtime enlists as the runtime's own outbox does: under its
/// deduplication rules and its envelope size limit (an envelope over it fails the endpoint's
/// enlist instead of being dead-lettered by every receiver), and a committed request wakes the
/// relay (a SQLite store tells it of no commit; it polls once an hour here). Before, the rules
/// and the limit were not applied, and the message waited for the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_given_the_runtime_enlists_under_its_rules_and_limit_and_wakes_its_relay() {
    let db = TestDatabase::new(Which::Sqlite).await;
    let store = db.sqlite().await;
    let handled = HandledOrders::default();
    let runtime = dacapo::Runtime::builder()
        .store(store.clone())
        .relay_interval(Duration::from_secs(3600))
        .max_envelope_size(512)
        .deduplicate_by::<OrderPlaced>(|order| Some(format!("rule:{}", order.reference)))
        .module(dacapo::Module::new("orders").handle::<OrderPlaced, _>(handled.clone()))
        .build()
        .unwrap();
    let router = Router::new()
        .route("/orders", post(order_for_the_runtime))
        .route_layer(IdempotencyLayer::new(store).runtime(&runtime));
    let url = format!("{}/orders", serve_router(router).await);
    let client = reqwest::Client::new();

    let handled_one = handled.changed.notified();
    let response = post_with(&client, &url, Some("k-1"), "A-1", &[]).await;
    assert_eq!(response.status(), 201);
    tokio::time::timeout(Duration::from_secs(20), handled_one)
        .await
        .expect("published at once, not at the relay's hourly poll");
    let id: Option<String> = db
        .value_for(
            "SELECT deduplication_id FROM dacapo_outbox WHERE message_type = $1",
            "orders.placed".to_owned(),
        )
        .await;
    assert_eq!(id.as_deref(), Some("rule:A-1"), "the runtime's rule");

    let response = post_with(&client, &url, Some("k-2"), &"x".repeat(1000), &[]).await;
    assert_eq!(response.status(), 500);
    let why = response.text().await.unwrap();
    assert!(why.contains("over the limit of 512"), "{why}");
    assert_eq!(db.scalar("SELECT count(*) FROM dacapo_outbox").await, 1);
    assert_eq!(handled.count.load(Ordering::SeqCst), 1);
    runtime.shutdown().await;
}
