//! The tower layer: what it does with each request.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use chrono::{DateTime, Utc};
use dacapo_actors::ports::Claims;
use futures::StreamExt;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, Full, LengthLimitError, Limited, StreamBody};
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use super::backend::{Backend, Row, Slot};
use super::key::{self, Key, constant_time_eq};
use super::problem::Problem;
use super::record::Record;
use super::request::{RequestTransaction, hex};
use crate::store::sql::{SqlStore, millis};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Scope = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type Fingerprint = Arc<dyn Fn(&Parts, &[u8]) -> String + Send + Sync>;
type Keep = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The default of [`IdempotencyLayer::keep`]: every answer but a server error, the client
/// errors that say "not now" or "not you" rather than "never" (401, 403, 408, 409, 425, 429),
/// which a retry may pass, and those that refuse the request as it was sent before anything
/// was done (400, 406, 412, 413, 415, 422, 428: malformed, unacceptable, a failed
/// precondition, too large, an unsupported media type, unprocessable), which a corrected
/// retry under the same key must pass: kept, such an answer was replayed to a retry whose
/// headers were mended (none of them is in the fingerprint), and a retry whose body was
/// mended met a 422 for reusing its key.
pub fn keeps_by_default(status: StatusCode) -> bool {
    !status.is_server_error()
        && !matches!(
            status.as_u16(),
            400 | 401 | 403 | 406 | 408 | 409 | 412 | 413 | 415 | 422 | 425 | 428 | 429
        )
}

/// The layer's settings, shared by every clone of its service.
#[derive(Clone)]
struct Settings {
    required: bool,
    methods: Vec<Method>,
    retention: Duration,
    max_key_len: usize,
    max_request_body: usize,
    max_stored_body: usize,
    keep: Keep,
    keep_sensitive_headers: bool,
    scope: Scope,
    fingerprint: Fingerprint,
    /// The runtime whose rules, size limit and relay the request transactions' enlists use.
    enlisting: Option<crate::outbox::Enlisting>,
}

/// Idempotency-Key for the routes it wraps: a request retried with the same key gets the
/// first response again instead of running the endpoint twice. See the [module](super).
pub struct IdempotencyLayer<DB: Backend> {
    store: SqlStore<DB>,
    settings: Settings,
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

/// The route, as the default scope: the same key on two routes is two keys. Behind a router
/// that strips a prefix (axum's `nest`), give a scope of your own.
fn route(parts: &Parts) -> String {
    format!("{} {}", parts.method, parts.uri.path())
}

/// The credentials a request carries, which the default fingerprint takes in.
const CREDENTIALS: [header::HeaderName; 2] = [header::AUTHORIZATION, header::COOKIE];

/// The default fingerprint: [`request_fingerprint`] with the request's `Authorization` and
/// `Cookie` headers. A key another caller sent first answers this one 422 instead of replaying
/// the other's answer to it (a check in the endpoint itself, such as an axum extractor, does
/// not run for a replay), whatever the scope names — where callers are told apart by those
/// two headers only.
fn request_and_credentials_digest(parts: &Parts, body: &[u8]) -> String {
    let mut digest = Sha256::new();
    digest.update(request_fingerprint(parts, body).as_bytes());
    for name in &CREDENTIALS {
        let mut fields: Vec<&[u8]> = parts
            .headers
            .get_all(name)
            .iter()
            .map(|value| value.as_bytes())
            .collect();
        // Cookies sent as several fields (HTTP/2 lets a client or a proxy split them) are
        // the same cookies as one field joined by "; ": one retry may come either way.
        let joined;
        if name == header::COOKIE && fields.len() > 1 {
            joined = fields.join(&b"; "[..]);
            fields = vec![&joined];
        }
        for value in fields {
            digest.update(b"\n");
            digest.update(name.as_str().as_bytes());
            digest.update(b": ");
            digest.update(value);
        }
    }
    hex(&digest.finalize())
}

/// A fingerprint of the request without its credentials: SHA-256 of the method, the path
/// with its query, and the body. For [`IdempotencyLayer::fingerprint`] under a scope that names
/// the caller, so that a retry whose token was refreshed meanwhile is replayed.
pub fn request_fingerprint(parts: &Parts, body: &[u8]) -> String {
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
                keep: Arc::new(keeps_by_default),
                keep_sensitive_headers: false,
                scope: Arc::new(route),
                fingerprint: Arc::new(request_and_credentials_digest),
                enlisting: None,
            },
        }
    }

    /// The runtime the endpoints' messages are for: [`RequestTransaction::enlist`] then applies
    /// its deduplication rules and its envelope size limit (an envelope over it fails the
    /// enlist, instead of being dead-lettered by every receiver), and a committed request wakes
    /// its relay, which publishes what the request enlisted at once instead of at its next
    /// poll. Without it, enlists take the message types' own deduplication ids only, check no
    /// size, and wait for the poll (on SQLite; PostgreSQL's notification wakes the relay).
    #[must_use]
    pub fn runtime(mut self, runtime: &crate::Runtime) -> Self {
        self.settings.enlisting = Some(runtime.enlisting());
        self
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

    /// Which answers are kept and replayed (default [`keeps_by_default`]). An answer not kept
    /// rolls the request's transaction back and leaves the key free for the client's retry;
    /// a kept client error (4xx) is kept without the endpoint's database work, which is
    /// undone. Any other answer kept, a 5xx your `keep` keeps included, is kept with the
    /// endpoint's work, which commits.
    #[must_use]
    pub fn keep(mut self, keep: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.settings.keep = Arc::new(keep);
        self
    }

    /// Whether `Set-Cookie`, `Authorization` and `Proxy-Authenticate` response headers are
    /// kept and replayed (default no: a replay goes to whoever sends the key).
    #[must_use]
    pub fn keep_sensitive_headers(mut self, keep: bool) -> Self {
        self.settings.keep_sensitive_headers = keep;
        self
    }

    /// Who the key belongs to (default: the route, `METHOD /path`). **Give the caller's
    /// principal** — a tenant or account id from an authenticated extension — whenever
    /// several callers share a route. The default fingerprint takes in the request's
    /// `Authorization` and `Cookie` headers, whatever the scope: a key another caller sent
    /// first gets 422, not the other's answer — and so does a retry whose token was refreshed
    /// meanwhile, or whose cookies changed. Under a scope that names the caller, give
    /// [`fingerprint`](Self::fingerprint) [`request_fingerprint`], which leaves them out, and
    /// such a retry is replayed. A credential that changes is not a principal: under a scope
    /// made of one, the retry would run again.
    ///
    /// The default's path is the one the layer sees: under a router that strips a prefix
    /// (axum's `nest`), routes of two prefixes look alike, and one's answer would be replayed
    /// for the other's request. Give a scope that names the prefix there.
    #[must_use]
    pub fn scope(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.settings.scope = Arc::new(scope);
        self
    }

    /// What makes two requests with one key the same request (default: SHA-256 of the
    /// method, the path and query, the body, and the `Authorization` and `Cookie` headers;
    /// [`request_fingerprint`] is the same without the headers). A key reused for another
    /// fingerprint gets 422.
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
}

impl<DB: Backend, S> Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotency<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            shared: Arc::new(Shared {
                store: self.store.clone(),
                settings: self.settings.clone(),
            }),
        }
    }
}

impl<DB: Backend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
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
            .store
            .http_in_flight()
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
            .store
            .http_in_flight()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

/// The body of the layer's answers: the endpoint's, or the layer's own.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

impl<S, DB, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, DB>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    DB: Backend,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, S::Error>> + Send>>;

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

fn full(bytes: Bytes) -> ResponseBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn boxed<B>(response: Response<B>) -> Response<ResponseBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|body| body.map_err(Into::into).boxed_unsync())
}

fn problem(problem: Problem, detail: &str) -> Response<ResponseBody> {
    boxed(problem.response::<Full<Bytes>>(detail))
}

/// An endpoint's answer read up to a limit: what was read, and the rest if it went over.
struct Read<B> {
    head: Bytes,
    /// The trailers of an answer read to its end: passed on to the client, not kept.
    trailers: Option<http::HeaderMap>,
    rest: Option<B>,
}

/// Reads `body` until it ends or passes `limit` bytes.
async fn read_up_to<B>(mut body: B, limit: usize) -> Result<Read<B>, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut head = BytesMut::new();
    let mut trailers: Option<http::HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame.map_err(Into::into)?.into_data() {
            Ok(data) => {
                head.extend_from_slice(&data);
                if head.len() > limit {
                    return Ok(Read {
                        head: head.freeze(),
                        trailers,
                        rest: Some(body),
                    });
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(more) = frame.into_trailers() {
            trailers
                .get_or_insert_with(http::HeaderMap::new)
                .extend(more);
        }
    }
    Ok(Read {
        head: head.freeze(),
        trailers,
        rest: None,
    })
}

/// What was read, followed by the rest of the endpoint's body, streamed.
fn rejoined<B>(read: Read<B>) -> ResponseBody
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    match (read.rest, read.trailers) {
        (None, None) => full(read.head),
        (None, Some(trailers)) => {
            let frames = [Ok(Frame::data(read.head)), Ok(Frame::trailers(trailers))];
            StreamBody::new(futures::stream::iter(frames)).boxed_unsync()
        }
        (Some(rest), _) => {
            let head = futures::stream::once(async move { Ok(Frame::data(read.head)) });
            let rest = BodyStream::new(rest.map_err(Into::into));
            StreamBody::new(head.chain(rest)).boxed_unsync()
        }
    }
}

async fn handle<S, DB, ReqBody, ResBody>(
    shared: Arc<Shared<DB>>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    DB: Backend,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let settings = &shared.settings;
    if !settings.methods.contains(request.method()) {
        return inner.call(request).await.map(boxed);
    }
    let key = match key::read(request.headers(), settings.max_key_len) {
        Key::Valid(key) => key,
        Key::Missing if !settings.required => return inner.call(request).await.map(boxed),
        Key::Missing => {
            return Ok(problem(
                Problem::KeyMissing,
                "this route requires an Idempotency-Key header: a unique value per operation, \
                 sent again unchanged with every retry",
            ));
        }
        Key::Invalid(reason) => return Ok(problem(Problem::KeyInvalid, &reason)),
    };
    let (mut parts, body) = request.into_parts();
    let collected = Limited::new(body, settings.max_request_body)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes);
    let body = match collected {
        Ok(body) => body,
        Err(error) if error.is::<LengthLimitError>() => {
            return Ok(problem(
                Problem::RequestTooLarge,
                &format!(
                    "the request body is over {} bytes",
                    settings.max_request_body
                ),
            ));
        }
        Err(_) => {
            return Ok(problem(
                Problem::RequestUnreadable,
                "the request body could not be read to its end",
            ));
        }
    };
    let scope = (settings.scope)(&parts);
    let fingerprint = storable((settings.fingerprint)(&parts, &body));
    let digest = Sha256::new()
        .chain_update(scope.as_bytes())
        .chain_update(b"\n")
        .chain_update(key.as_bytes())
        .finalize();
    let id = hex(&digest);
    let lock = i64::from_be_bytes(digest[..8].try_into().unwrap_or_default());

    let store = &shared.store;
    // The claims table exists before any request's transaction may need it (`enlist_once`):
    // creating it from inside one would wait for that transaction's own write lock.
    if let Err(error) = store.provision().await {
        return Ok(unavailable(&error));
    }
    // Taken by another request with this key: an answer it kept already is replayed (or
    // refused for another request) rather than told to be in progress, as for retries that
    // arrive together after the first one answered.
    let Some(entered) = InFlight::enter(&shared, &id) else {
        return Ok(answer_kept_since(store, &id, &fingerprint).await);
    };
    let mut slot = match DB::open(store, lock).await {
        Ok(Some(slot)) => slot,
        Ok(None) => return Ok(answer_kept_since(store, &id, &fingerprint).await),
        Err(error) => return Ok(unavailable(&error)),
    };
    match DB::lookup(&mut slot, &id, millis(store.now())).await {
        Err(error) => {
            release(&mut slot).await;
            return Ok(lookup_failed(&error));
        }
        Ok(Some(kept)) => {
            release(&mut slot).await;
            return Ok(answer_kept(kept, &fingerprint));
        }
        Ok(None) => {}
    }
    if let Err(error) = DB::mark(&mut slot).await {
        release(&mut slot).await;
        return Ok(unavailable(&error));
    }

    let transaction = RequestTransaction::new(
        slot,
        store.clone(),
        settings.retention,
        settings.enlisting.clone(),
    );
    let _unanswered = Unanswered {
        slot: Arc::clone(transaction.slot()),
        in_flight: Some(entered),
    };
    parts.extensions.insert(transaction.clone());
    let response = match inner
        .call(Request::from_parts(parts, ReqBody::from(body)))
        .await
    {
        Ok(response) => response,
        Err(error) => {
            // The service failed without an answer: its work is undone and the key left free
            // before the error goes up.
            roll_back(&transaction).await;
            return Err(error);
        }
    };
    let (mut head, body) = response.into_parts();
    let read = match read_up_to(Box::pin(body), settings.max_stored_body).await {
        Ok(read) => read,
        Err(error) => {
            tracing::warn!(%error, "an endpoint's answer failed; its request is rolled back");
            roll_back(&transaction).await;
            return Ok(problem(
                Problem::ResponseUnreadable,
                "the endpoint's answer failed before its end; nothing was kept",
            ));
        }
    };
    if !(settings.keep)(head.status) {
        roll_back(&transaction).await;
        return Ok(Response::from_parts(head, rejoined(read)));
    }
    let keep_body = read.rest.is_none();
    let record = Record::of(
        fingerprint.clone(),
        head.status,
        &head.headers,
        keep_body.then_some(&read.head[..]),
        settings.keep_sensitive_headers,
    );
    let now = store.now();
    let scope = storable(scope);
    let row = Row {
        id: &id,
        scope: &scope,
        key: &key,
        record: &record,
        now: millis(now),
        expires_at: millis(expiry(now, settings.retention)),
    };
    let mut slot = transaction.slot().lock().await;
    slot.ended = true;
    // A client error is kept, but not the work that led to it.
    let undone = if head.status.is_client_error() {
        DB::undo(&mut slot).await
    } else {
        Ok(())
    };
    let kept = match undone {
        Ok(()) => DB::record(&mut slot, row).await,
        Err(error) => Err(error),
    };
    let committed = match kept {
        Ok(true) => match slot.tx.take() {
            Some(tx) => tx.commit().await,
            None => Ok(()),
        },
        Ok(false) => {
            // Another process kept an answer for this key meanwhile: this one's work is
            // undone, and that answer given.
            release(&mut slot).await;
            drop(slot);
            return Ok(answer_kept_since(store, &id, &fingerprint).await);
        }
        Err(error) => Err(error),
    };
    let enlisted = slot.enlisted;
    release(&mut slot).await;
    drop(slot);
    if let (Ok(()), true, Some(enlisting)) = (&committed, enlisted, &settings.enlisting) {
        enlisting.wake_relay();
    }
    if let Err(error) = committed {
        if aborted(&error) {
            tracing::warn!(%error, status = %head.status, "the endpoint answered, but one of its statements had failed and its transaction cannot commit; it is rolled back and its answer not kept");
            return Ok(problem(
                Problem::TransactionAborted,
                "one of the endpoint's statements failed, so its transaction cannot commit: its \
                 work is rolled back and nothing was kept",
            ));
        }
        if refused_at_commit(&error) {
            DB::lock_let_go(store.pool(), lock).await;
            tracing::warn!(%error, status = %head.status, "the endpoint answered, but the database refused its work as it committed; it is rolled back and its answer not kept");
            return Ok(problem(
                Problem::CommitRefused,
                "the database refused the endpoint's work as it committed (a constraint checked \
                 at commit): its work is rolled back and nothing was kept",
            ));
        }
        return Ok(commit_unanswered(&error));
    }
    if !keep_body {
        head.headers
            .insert(super::BODY_NOT_STORED, HeaderValue::from_static("true"));
    }
    Ok(Response::from_parts(head, rejoined(read)))
}

/// When an answer kept now expires; the furthest time there is for a retention too long to
/// add.
pub(super) fn expiry(now: DateTime<Utc>, retention: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(retention)
        .ok()
        .and_then(|retention| now.checked_add_signed(retention))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `text` as PostgreSQL can keep it: a NUL, which PostgreSQL's text cannot hold (the key's
/// answer then failed to be kept, the endpoint's 500 on every retry, each running it again),
/// becomes U+FFFD. Applied to what the application's scope and fingerprint functions give;
/// the key's id is digested from the scope as given.
fn storable(text: String) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text
    }
}

/// The kept answer, or 422 when it was kept for another request.
fn answer_kept(kept: Record, fingerprint: &str) -> Response<ResponseBody> {
    if constant_time_eq(kept.fingerprint.as_bytes(), fingerprint.as_bytes()) {
        match kept.damaged {
            Some(why) => kept_answer_unreadable(&why),
            None => boxed(kept.replay::<Full<Bytes>>()),
        }
    } else {
        problem(
            Problem::KeyReused,
            "this Idempotency-Key was used for a different request (its method, path, query or \
             body, or, under the default fingerprint, its credentials); use a new key for a new \
             operation",
        )
    }
}

/// The answer another request kept for `id` (while this one ran, or before it came); in
/// progress when none is kept yet.
async fn answer_kept_since<DB: Backend>(
    store: &SqlStore<DB>,
    id: &str,
    fingerprint: &str,
) -> Response<ResponseBody> {
    let mut slot = Slot {
        pool: store.pool().clone(),
        tx: None,
        ended: true,
        fresh_reads: None,
        enlisted: false,
    };
    match DB::lookup(&mut slot, id, millis(store.now())).await {
        Ok(Some(kept)) => answer_kept(kept, fingerprint),
        Ok(None) => in_flight(),
        Err(error) => lookup_failed(&error),
    }
}

/// The store could not answer, or kept an answer whose columns cannot be read back: that
/// one is not retried as an outage (the request ran) and not run again.
fn lookup_failed(error: &sqlx::Error) -> Response<ResponseBody> {
    if matches!(
        error,
        sqlx::Error::Decode(_) | sqlx::Error::ColumnDecode { .. }
    ) {
        return kept_answer_unreadable(error);
    }
    unavailable(error)
}

/// 500 for an answer kept for this request that cannot be replayed, until it expires.
fn kept_answer_unreadable(why: &dyn std::fmt::Display) -> Response<ResponseBody> {
    tracing::error!(%why, "the answer kept for an Idempotency-Key cannot be read back; it is left for an operator");
    problem(
        Problem::KeptAnswerUnreadable,
        "the answer kept for this Idempotency-Key cannot be read back; the request was not run \
         again",
    )
}

/// Rolls the request's transaction back: the endpoint's work is undone, the key left free.
async fn roll_back<DB: Backend>(transaction: &RequestTransaction<DB>) {
    let mut slot = transaction.slot().lock().await;
    slot.ended = true;
    release(&mut slot).await;
}

/// Ends the request's transaction if the layer's future is dropped before it did (the client
/// went away, a timeout above the layer). A clone of the [`RequestTransaction`] the endpoint
/// moved into a task of its own would otherwise keep it open, and the key's lock with it (on
/// SQLite the database's write lock), until that task ends; that task's next borrow is
/// refused instead. The key stays in flight in this process until the rollback is done.
struct Unanswered<DB: Backend> {
    slot: Arc<tokio::sync::Mutex<Slot<DB>>>,
    in_flight: Option<InFlight<DB>>,
}

impl<DB: Backend> Drop for Unanswered<DB> {
    fn drop(&mut self) {
        let in_flight = self.in_flight.take();
        let tx = match self.slot.try_lock() {
            // Ended by the layer, which may have been cut short before its commit or rollback
            // with the transaction still there.
            Ok(mut slot) => {
                slot.ended = true;
                slot.tx.take()
            }
            // The endpoint's task holds a `RequestTx` (or the layer's own end was cut short
            // holding the lock): the rollback waits for it.
            Err(_) => {
                let slot = Arc::clone(&self.slot);
                if let Some(runtime) = crate::store::sql::lasting_runtime() {
                    runtime.spawn(async move {
                        let mut slot = slot.lock().await;
                        if !slot.ended {
                            slot.ended = true;
                            tracing::warn!("a request dropped before it answered is rolled back");
                        }
                        release(&mut slot).await;
                        drop(in_flight);
                    });
                }
                return;
            }
        };
        let Some(tx) = tx else { return };
        tracing::warn!("a request dropped before it answered is rolled back");
        // Not on a runtime that may not run it again (nor without one): on SQLite the
        // transaction holds the write lock until its rollback. Where no runtime can run it,
        // the dropped transaction's rollback goes with its connection.
        if let Some(runtime) = crate::store::sql::lasting_runtime() {
            runtime.spawn(async move {
                if let Err(error) = tx.rollback().await {
                    tracing::warn!(%error, "a request's transaction could not be rolled back cleanly");
                }
                drop(in_flight);
            });
        }
    }
}

/// Rolls back what is left of the request's transaction before it answers. Dropped instead,
/// the rollback would wait for its connection's next use, and on PostgreSQL the key's lock
/// with it: a retry arriving meanwhile would be answered 409 for a request that is over.
async fn release<DB: Backend>(slot: &mut Slot<DB>) {
    if let Some(tx) = slot.tx.take()
        && let Err(error) = tx.rollback().await
    {
        tracing::warn!(%error, "a request's transaction could not be rolled back cleanly");
    }
}

/// Whether `error` is PostgreSQL refusing a statement in a transaction that an earlier failed
/// statement aborted: the endpoint's doing, which no retry of the store cures.
fn aborted(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.code())
        .is_some_and(|code| code == "25P02")
}

/// Whether `error` is the database refusing the transaction's data as it commits (a deferred
/// constraint): the endpoint's doing, which a retry meets again, not the store being away.
fn refused_at_commit(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.code())
        .is_some_and(|code| crate::store::sql::rejects_data(&code))
}

fn in_flight() -> Response<ResponseBody> {
    problem(
        Problem::InFlight,
        "a request with this Idempotency-Key is in progress; retry once it has answered",
    )
}

/// The commit of the answer and the endpoint's work failed without the database's word on
/// it (a connection lost as it committed): it may have been kept. A retry with the key finds
/// out: the kept answer is replayed, or the request runs again.
fn commit_unanswered(error: &dyn std::fmt::Display) -> Response<ResponseBody> {
    tracing::warn!(%error, "the Idempotency-Key store failed as the answer committed; whether it was kept is unknown");
    problem(
        Problem::StoreUnavailable,
        "the idempotency store failed as the answer was being kept, and whether it was is \
         unknown: retry with the same key, which replays the answer if it was kept and runs \
         the request again if not",
    )
}

fn unavailable(error: &dyn std::fmt::Display) -> Response<ResponseBody> {
    tracing::warn!(%error, "the Idempotency-Key store failed; the request was not run or is rolled back");
    problem(
        Problem::StoreUnavailable,
        "the idempotency store could not be reached; nothing was kept: retry with the same key",
    )
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    fn parts_with(headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::post("/orders");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn cookies_split_over_fields_fingerprint_as_one_field() {
        let digest =
            |headers: &[(&str, &str)]| request_and_credentials_digest(&parts_with(headers), b"{}");
        let one = digest(&[("cookie", "a=1; b=2")]);
        assert_eq!(one, digest(&[("cookie", "a=1"), ("cookie", "b=2")]));
        assert_ne!(one, digest(&[("cookie", "a=1; b=3")]));
        assert_ne!(one, digest(&[]));
        // As before for one cookie field and any Authorization fields: the fingerprints of
        // answers kept by an earlier build still match.
        let before = |lines: &str| {
            let mut digest = Sha256::new();
            digest.update(request_fingerprint(&parts_with(&[]), b"{}").as_bytes());
            digest.update(lines.as_bytes());
            hex(&digest.finalize())
        };
        assert_eq!(
            digest(&[
                ("authorization", "a"),
                ("authorization", "b"),
                ("cookie", "c=1")
            ]),
            before("\nauthorization: a\nauthorization: b\ncookie: c=1")
        );
    }

    /// A request under way on a fresh SQLite file with a `rows` table, its key not entered.
    struct Request {
        directory: std::path::PathBuf,
        store: SqliteStore,
        shared: Arc<Shared<sqlx::Sqlite>>,
        transaction: RequestTransaction<sqlx::Sqlite>,
    }

    impl Request {
        async fn new() -> Self {
            let directory = std::env::temp_dir().join(format!(
                "dacapo-unanswered-{}",
                uuid::Uuid::new_v4().simple()
            ));
            std::fs::create_dir_all(&directory).unwrap();
            let path = directory.join("db.sqlite");
            let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
            sqlx::query("CREATE TABLE rows (n INTEGER)")
                .execute(store.pool())
                .await
                .unwrap();
            let shared = Arc::new(Shared {
                store: store.clone(),
                settings: IdempotencyLayer::new(store.clone()).settings,
            });
            let slot = Slot {
                pool: store.pool().clone(),
                tx: None,
                ended: false,
                fresh_reads: None,
                enlisted: false,
            };
            let transaction =
                RequestTransaction::new(slot, store.clone(), Duration::from_secs(60), None);
            Self {
                directory,
                store,
                shared,
                transaction,
            }
        }
    }

    async fn rows(store: &SqliteStore) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM rows")
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    /// Waits until the key `k` can be entered again (its entry is let go at once).
    async fn freed(shared: &Arc<Shared<sqlx::Sqlite>>) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while InFlight::enter(shared, "k").is_none() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the key is freed within 10s");
    }

    /// The endpoint's task still borrows the request's transaction when the request is
    /// dropped: the rollback waits for the borrow, the key stays in flight until it is done,
    /// and the task's next borrow is refused.
    #[tokio::test]
    async fn a_request_dropped_while_its_transaction_is_borrowed_ends_once_the_borrow_goes() {
        let Request {
            directory,
            store,
            shared,
            transaction,
        } = Request::new().await;
        let unanswered = Unanswered {
            slot: Arc::clone(transaction.slot()),
            in_flight: InFlight::enter(&shared, "k"),
        };
        let mut tx = transaction.get().await.unwrap();
        sqlx::query("INSERT INTO rows VALUES (1)")
            .execute(&mut **tx)
            .await
            .unwrap();

        drop(unanswered);
        assert!(
            InFlight::enter(&shared, "k").is_none(),
            "the key stays in flight while the endpoint borrows the transaction"
        );
        sqlx::query("INSERT INTO rows VALUES (2)")
            .execute(&mut **tx)
            .await
            .unwrap();
        drop(tx);
        freed(&shared).await;

        let refused = transaction.get().await.expect_err("the request has ended");
        assert!(
            matches!(refused, crate::Error::RequestTransaction(_)),
            "{refused}"
        );
        assert_eq!(rows(&store).await, 0, "the request's rows are rolled back");
        std::fs::remove_dir_all(&directory).ok();
    }

    /// The layer was cut short while ending the request (it marked it ended, then was dropped
    /// before its commit or rollback), with a clone still held elsewhere: the transaction is
    /// rolled back all the same, not kept open by that clone.
    #[tokio::test]
    async fn a_request_dropped_while_the_layer_ends_it_is_rolled_back() {
        let Request {
            directory,
            store,
            shared,
            transaction,
        } = Request::new().await;
        let held_elsewhere = transaction.clone();
        let unanswered = Unanswered {
            slot: Arc::clone(transaction.slot()),
            in_flight: InFlight::enter(&shared, "k"),
        };
        let mut tx = transaction.get().await.unwrap();
        sqlx::query("INSERT INTO rows VALUES (1)")
            .execute(&mut **tx)
            .await
            .unwrap();
        drop(tx);
        transaction.slot().lock().await.ended = true;

        drop(unanswered);
        drop(transaction);
        freed(&shared).await;
        assert!(held_elsewhere.slot().lock().await.tx.is_none());
        assert_eq!(rows(&store).await, 0, "the request's rows are rolled back");
        std::fs::remove_dir_all(&directory).ok();
    }
}
