//! The tower layer: what it does with each request.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use super::backend::{Backend, Row};
use super::key::{self, Key, constant_time_eq};
use super::problem::Problem;
use super::record::Record;
use super::request::{RequestTransaction, hex};
use crate::store::sql::{SqlStore, millis};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Scope = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type Fingerprint = Arc<dyn Fn(&Parts, &[u8]) -> String + Send + Sync>;

/// The layer's settings, shared by every clone of its service.
#[derive(Clone)]
struct Settings {
    required: bool,
    methods: Vec<Method>,
    retention: Duration,
    max_key_len: usize,
    max_request_body: usize,
    max_stored_body: usize,
    keep_server_errors: bool,
    keep_sensitive_headers: bool,
    scope: Scope,
    fingerprint: Fingerprint,
}

/// Idempotency-Key for the routes it wraps: a request retried with the same key gets the
/// first response again instead of running the endpoint twice. See the [module](super).
pub struct IdempotencyLayer<DB: Backend> {
    store: SqlStore<DB>,
    settings: Settings,
    /// Keys of this process's requests in progress, shared by every route the layer wraps
    /// (a scope other than the route may span several).
    in_flight: Arc<Mutex<HashSet<String>>>,
}

impl<DB: Backend> std::fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("required", &self.settings.required)
            .field("methods", &self.settings.methods)
            .field("retention", &self.settings.retention)
            .finish_non_exhaustive()
    }
}

/// The route, as the default scope: the same key on two routes is two keys.
fn route(parts: &Parts) -> String {
    format!("{} {}", parts.method, parts.uri.path())
}

/// SHA-256 of the method, the path with its query, and the body.
fn request_digest(parts: &Parts, body: &[u8]) -> String {
    let mut digest = Sha256::new();
    digest.update(parts.method.as_str().as_bytes());
    digest.update(b"\n");
    digest.update(
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .as_bytes(),
    );
    digest.update(b"\n");
    digest.update(body);
    hex(&digest.finalize())
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// A layer keeping responses in `store`, with the defaults: the key required on `POST`
    /// and `PATCH` (other methods pass through untouched), scoped to the route, responses
    /// kept 24 hours, keys of at most 255 characters, request and kept response bodies of at
    /// most 1 MiB, 5xx answers not kept, `Set-Cookie` and authorization headers not kept.
    pub fn new(store: SqlStore<DB>) -> Self {
        Self {
            store,
            settings: Settings {
                required: true,
                methods: vec![Method::POST, Method::PATCH],
                retention: Duration::from_secs(24 * 60 * 60),
                max_key_len: 255,
                max_request_body: 1024 * 1024,
                max_stored_body: 1024 * 1024,
                keep_server_errors: false,
                keep_sensitive_headers: false,
                scope: Arc::new(route),
                fingerprint: Arc::new(request_digest),
            },
            in_flight: Arc::default(),
        }
    }

    /// Whether a request without a key is refused with 400 (default) or passed through
    /// without any of the layer's work.
    #[must_use]
    pub fn required(mut self, required: bool) -> Self {
        self.settings.required = required;
        self
    }

    /// The methods the layer covers (default `POST`, `PATCH`); others pass through.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings.methods = methods.into_iter().collect();
        self
    }

    /// How long a response is kept for replay (default 24 h). The runtime's cleanup removes
    /// expired ones when a runtime runs on the same store.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// The longest key accepted (default 255 characters); longer ones get 400.
    #[must_use]
    pub fn max_key_len(mut self, characters: usize) -> Self {
        self.settings.max_key_len = characters;
        self
    }

    /// The largest request body read to fingerprint it (default 1 MiB); larger ones get 413.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.settings.max_request_body = bytes;
        self
    }

    /// The largest response body kept (default 1 MiB). A larger one is answered but not kept:
    /// its status and headers are, the first answer carries `Idempotency-Body-Not-Stored:
    /// true`, and a replay carries them with an empty body and the same header.
    #[must_use]
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.settings.max_stored_body = bytes;
        self
    }

    /// Whether a 5xx answer is kept like any other (default no: it rolls the request's
    /// transaction back and leaves the key free for the client's retry).
    #[must_use]
    pub fn keep_server_errors(mut self, keep: bool) -> Self {
        self.settings.keep_server_errors = keep;
        self
    }

    /// Whether `Set-Cookie`, `Authorization` and `Proxy-Authenticate` response headers are
    /// kept and replayed (default no: a replay goes to whoever sends the key).
    #[must_use]
    pub fn keep_sensitive_headers(mut self, keep: bool) -> Self {
        self.settings.keep_sensitive_headers = keep;
        self
    }

    /// Who the key belongs to (default: the route, `METHOD /path`). Give the caller's
    /// principal — a tenant or user id from an authenticated header or extension — so one
    /// caller's key never replays another's response.
    #[must_use]
    pub fn scope(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.settings.scope = Arc::new(scope);
        self
    }

    /// What makes two requests with one key the same request (default: SHA-256 of the
    /// method, the path and query, and the body). A key reused for another fingerprint
    /// gets 422.
    #[must_use]
    pub fn fingerprint(
        mut self,
        fingerprint: impl Fn(&Parts, &[u8]) -> String + Send + Sync + 'static,
    ) -> Self {
        self.settings.fingerprint = Arc::new(fingerprint);
        self
    }
}

/// What every clone of the service shares.
struct Shared<DB: Backend> {
    store: SqlStore<DB>,
    settings: Settings,
    in_flight: Arc<Mutex<HashSet<String>>>,
}

impl<DB: Backend, S> Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotency<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            shared: Arc::new(Shared {
                store: self.store.clone(),
                settings: self.settings.clone(),
                in_flight: Arc::clone(&self.in_flight),
            }),
        }
    }
}

impl<DB: Backend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
            in_flight: Arc::clone(&self.in_flight),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an endpoint.
pub struct Idempotency<S, DB: Backend> {
    inner: S,
    shared: Arc<Shared<DB>>,
}

impl<S: Clone, DB: Backend> Clone for Idempotency<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, DB: Backend> std::fmt::Debug for Idempotency<S, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

/// A key of this process in progress, until dropped (the request's future included).
struct InFlight<DB: Backend> {
    shared: Arc<Shared<DB>>,
    id: String,
}

impl<DB: Backend> InFlight<DB> {
    fn enter(shared: &Arc<Shared<DB>>, id: &str) -> Option<Self> {
        let mut keys = shared
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        keys.insert(id.to_owned()).then(|| Self {
            shared: Arc::clone(shared),
            id: id.to_owned(),
        })
    }
}

impl<DB: Backend> Drop for InFlight<DB> {
    fn drop(&mut self) {
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl<S, DB, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, DB>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    DB: Backend,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + From<Bytes> + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was polled ready serves this request; a fresh one waits for the next.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let shared = Arc::clone(&self.shared);
        Box::pin(handle(shared, inner, request))
    }
}

async fn handle<S, DB, ReqBody, ResBody>(
    shared: Arc<Shared<DB>>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    DB: Backend,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + From<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let settings = &shared.settings;
    if !settings.methods.contains(request.method()) {
        return inner.call(request).await;
    }
    let key = match key::read(request.headers(), settings.max_key_len) {
        Key::Valid(key) => key,
        Key::Missing if !settings.required => return inner.call(request).await,
        Key::Missing => {
            return Ok(Problem::KeyMissing.response(
                "this route requires an Idempotency-Key header: a unique value per operation, \
                 sent again unchanged with every retry",
            ));
        }
        Key::Invalid(reason) => return Ok(Problem::KeyInvalid.response(&reason)),
    };
    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, settings.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return Ok(Problem::RequestTooLarge.response(&format!(
                "the request body is over {} bytes",
                settings.max_request_body
            )));
        }
        Err(error) => {
            return Ok(Problem::KeyInvalid
                .response(&format!("the request body could not be read: {error}")));
        }
    };
    let scope = (settings.scope)(&parts);
    let fingerprint = (settings.fingerprint)(&parts, &body);
    let digest = Sha256::new()
        .chain_update(scope.as_bytes())
        .chain_update(b"\n")
        .chain_update(key.as_bytes())
        .finalize();
    let id = hex(&digest);
    let lock = i64::from_be_bytes(digest[..8].try_into().unwrap_or_default());

    let Some(_in_flight) = InFlight::enter(&shared, &id) else {
        return Ok(in_flight());
    };
    let store = &shared.store;
    let mut slot = match DB::open(store, lock).await {
        Ok(Some(slot)) => slot,
        Ok(None) => return Ok(in_flight()),
        Err(error) => return Ok(unavailable(&error)),
    };
    match DB::lookup(&mut slot, &id, millis(store.now())).await {
        Err(error) => return Ok(unavailable(&error)),
        Ok(Some(kept))
            if !constant_time_eq(kept.fingerprint.as_bytes(), fingerprint.as_bytes()) =>
        {
            return Ok(Problem::KeyReused.response(
                "this Idempotency-Key was used for a different request (method, path or \
                 body); use a new key for a new operation",
            ));
        }
        Ok(Some(kept)) => return Ok(kept.replay()),
        Ok(None) => {}
    }

    let transaction = RequestTransaction::new(slot, store.clone(), settings.retention);
    parts.extensions.insert(transaction.clone());
    let response = inner
        .call(Request::from_parts(parts, ReqBody::from(body)))
        .await?;
    let (mut response, body) = response.into_parts();
    let collected = body.collect().await.map_err(Into::<BoxError>::into);
    let body = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            tracing::warn!(%error, "an endpoint's response body failed; its request is rolled back");
            roll_back(&transaction).await;
            return Ok(Problem::StoreUnavailable
                .response("the endpoint's answer could not be read; nothing was kept"));
        }
    };
    if response.status.is_server_error() && !settings.keep_server_errors {
        roll_back(&transaction).await;
        return Ok(Response::from_parts(response, ResBody::from(body)));
    }
    let keep_body = body.len() <= settings.max_stored_body;
    let record = Record::of(
        fingerprint,
        response.status,
        &response.headers,
        keep_body.then_some(&body[..]),
        settings.keep_sensitive_headers,
    );
    let now = store.now();
    let expires =
        now + chrono::TimeDelta::from_std(settings.retention).unwrap_or(chrono::TimeDelta::MAX);
    let row = Row {
        id: &id,
        scope: &scope,
        key: &key,
        record: &record,
        now: millis(now),
        expires_at: millis(expires),
    };
    let mut slot = transaction.slot().lock().await;
    let kept = DB::record(&mut slot, row).await;
    let committed = match kept {
        Ok(true) => match slot.tx.take() {
            Some(tx) => tx.commit().await,
            None => Ok(()),
        },
        // Another process kept a response for this key meanwhile: this one's work is undone
        // (the transaction rolls back as it drops).
        Ok(false) => {
            slot.ended = true;
            slot.tx = None;
            return Ok(in_flight());
        }
        Err(error) => Err(error),
    };
    slot.ended = true;
    drop(slot);
    if let Err(error) = committed {
        return Ok(unavailable(&error));
    }
    if !keep_body {
        response
            .headers
            .insert(super::BODY_NOT_STORED, HeaderValue::from_static("true"));
    }
    Ok(Response::from_parts(response, ResBody::from(body)))
}

/// Rolls the request's transaction back: the endpoint's work is undone, the key left free.
async fn roll_back<DB: Backend>(transaction: &RequestTransaction<DB>) {
    let mut slot = transaction.slot().lock().await;
    slot.ended = true;
    if let Some(tx) = slot.tx.take()
        && let Err(error) = tx.rollback().await
    {
        tracing::warn!(%error, "a request's transaction could not be rolled back cleanly");
    }
}

fn in_flight<B: From<Bytes>>() -> Response<B> {
    Problem::InFlight
        .response("a request with this Idempotency-Key is in progress; retry once it has answered")
}

fn unavailable<B: From<Bytes>>(error: &dyn std::fmt::Display) -> Response<B> {
    tracing::warn!(%error, "the Idempotency-Key store failed; the request was not run or is rolled back");
    Problem::StoreUnavailable.response(
        "the idempotency store could not be reached; nothing was kept: retry with the same key",
    )
}
