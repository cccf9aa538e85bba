//! The layer's own answers, as RFC 9457 problem details (`application/problem+json`).

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// A problem the layer answers for, with its status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    KeyMissing,
    /// 400: the `Idempotency-Key` is empty, too long, repeated or not visible ASCII.
    KeyInvalid,
    /// 409: a request with the same key is still running; retry later.
    InFlight,
    /// 422: the key was used before, in the same scope, for a different request (another
    /// fingerprint: by default another body or query; with the default scope, the route,
    /// another method or path is another key).
    KeyReused,
    /// 413: the request body is over the layer's limit.
    RequestTooLarge,
    /// 400: the request body could not be read to its end.
    RequestUnreadable,
    /// 502: the endpoint's answer failed before its end; nothing was kept, the key is free.
    ResponseUnreadable,
    /// 409: the intent was carried out already (its deduplication id was claimed by an
    /// earlier request); the client should not retry it.
    DuplicateIntent,
    /// 503: the store could not be reached; nothing was kept, retry with the same key. The
    /// endpoint ran if the store failed as its answer was kept: its database work was rolled
    /// back — unless the commit itself failed on its way, when it may have landed, and the
    /// retry is replayed its answer.
    StoreUnavailable,
    /// 500: an answer is kept for the key but cannot be read back (its row was damaged); the
    /// request is not run again, and retrying gets the same answer until an operator acts or
    /// the kept answer expires.
    KeptAnswerUnreadable,
    /// 500: the endpoint answered, but its transaction cannot commit: one of its statements
    /// failed, and PostgreSQL refuses every statement after a failed one until the
    /// transaction ends. Its work is rolled back and nothing is kept; the key is free. An
    /// endpoint that means to go on after a statement may fail runs that statement under a
    /// savepoint of its own.
    TransactionAborted,
    /// 500: the endpoint answered, but the database refused its work as it committed (a
    /// constraint checked at commit, such as a deferred foreign key). Its work is rolled back
    /// and nothing is kept; the key is free. A retry runs the endpoint again and meets the
    /// same refusal until the data changes, so the answer does not ask for one.
    CommitRefused,
}

impl Problem {
    /// Its status code.
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyInvalid | Self::RequestUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Self::ResponseUnreadable => StatusCode::BAD_GATEWAY,
            Self::InFlight | Self::DuplicateIntent => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::KeptAnswerUnreadable | Self::TransactionAborted | Self::CommitRefused => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// Its `type` URI.
    pub fn type_uri(self) -> &'static str {
        match self {
            Self::KeyMissing => "urn:dacapo:problem:idempotency-key-missing",
            Self::KeyInvalid => "urn:dacapo:problem:idempotency-key-invalid",
            Self::InFlight => "urn:dacapo:problem:idempotency-key-in-flight",
            Self::KeyReused => "urn:dacapo:problem:idempotency-key-reused",
            Self::RequestTooLarge => "urn:dacapo:problem:request-too-large",
            Self::RequestUnreadable => "urn:dacapo:problem:request-unreadable",
            Self::ResponseUnreadable => "urn:dacapo:problem:response-unreadable",
            Self::DuplicateIntent => "urn:dacapo:problem:duplicate-intent",
            Self::StoreUnavailable => "urn:dacapo:problem:idempotency-store-unavailable",
            Self::KeptAnswerUnreadable => "urn:dacapo:problem:kept-answer-unreadable",
            Self::TransactionAborted => "urn:dacapo:problem:endpoint-transaction-aborted",
            Self::CommitRefused => "urn:dacapo:problem:endpoint-commit-refused",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key missing",
            Self::KeyInvalid => "Idempotency-Key invalid",
            Self::InFlight => "A request with this Idempotency-Key is in progress",
            Self::KeyReused => "Idempotency-Key reused for a different request",
            Self::RequestTooLarge => "Request body too large",
            Self::RequestUnreadable => "Request body unreadable",
            Self::ResponseUnreadable => "The endpoint's answer failed",
            Self::DuplicateIntent => "Duplicate intent",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::KeptAnswerUnreadable => "The answer kept for this Idempotency-Key is unreadable",
            Self::TransactionAborted => "The endpoint's transaction failed",
            Self::CommitRefused => "The database refused the endpoint's work as it committed",
        }
    }

    /// The response, with `detail` for the client.
    pub fn response<B: From<Bytes>>(self, detail: &str) -> Response<B> {
        let body = serde_json::json!({
            "type": self.type_uri(),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(B::from(Bytes::from(body.to_string())));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if matches!(self, Self::InFlight | Self::StoreUnavailable) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
