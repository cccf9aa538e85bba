-- Responses to HTTP requests made with an Idempotency-Key, replayed to the client's retries.
-- The id is a digest of the caller's scope and the key, so both may be long; the body is NULL
-- when it was over the size limit and only the status and headers were kept.
CREATE TABLE dacapo_http_keys (
    id          TEXT    PRIMARY KEY NOT NULL,
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    status      INTEGER NOT NULL,
    headers     TEXT    NOT NULL,
    body        BYTEA,
    recorded_at BIGINT  NOT NULL,
    expires_at  BIGINT  NOT NULL
);

CREATE INDEX dacapo_http_keys_expires ON dacapo_http_keys (expires_at);
