-- The outbox: envelopes enlisted in the application's own transactions, published by the relay
-- in order, then marked published.
CREATE TABLE dacapo_outbox (
    seq              BIGSERIAL PRIMARY KEY,
    id               TEXT    NOT NULL UNIQUE,
    message_type     TEXT    NOT NULL,
    payload          BYTEA   NOT NULL,
    headers          TEXT    NOT NULL,
    deduplication_id TEXT,
    correlation_id   TEXT,
    causation_id     TEXT,
    sent_at          BIGINT  NOT NULL,
    scheduled_for    BIGINT,
    enlisted_at      BIGINT  NOT NULL,
    published_at     BIGINT
);
CREATE INDEX dacapo_outbox_unpublished ON dacapo_outbox (seq) WHERE published_at IS NULL;

-- One relay at a time publishes, so the order of the outbox is the order of publication.
CREATE TABLE dacapo_outbox_lease (
    id         INTEGER PRIMARY KEY,
    owner      TEXT    NOT NULL,
    expires_at BIGINT  NOT NULL
);
