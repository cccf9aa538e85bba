-- The inbox: every received envelope, its delivery state, and which node owns it.
CREATE TABLE reprise_inbox (
    id               TEXT    PRIMARY KEY NOT NULL,
    message_type     TEXT    NOT NULL,
    payload          BYTEA   NOT NULL,
    headers          TEXT    NOT NULL,
    deduplication_id TEXT,
    correlation_id   TEXT,
    causation_id     TEXT,
    sent_at          BIGINT  NOT NULL,
    scheduled_for    BIGINT,
    status           TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    execute_at       BIGINT,
    failures         TEXT,
    owner            TEXT,
    received_at      BIGINT  NOT NULL,
    handled_at       BIGINT
);
CREATE INDEX reprise_inbox_unsettled ON reprise_inbox (status, owner);
CREATE INDEX reprise_inbox_handled ON reprise_inbox (handled_at) WHERE status = 'handled';

CREATE TABLE reprise_dead_letters (
    id               TEXT    PRIMARY KEY NOT NULL,
    message_type     TEXT    NOT NULL,
    payload          BYTEA   NOT NULL,
    headers          TEXT    NOT NULL,
    deduplication_id TEXT,
    correlation_id   TEXT,
    causation_id     TEXT,
    sent_at          BIGINT  NOT NULL,
    scheduled_for    BIGINT,
    reason           TEXT    NOT NULL,
    failures         TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    first_failure_at BIGINT  NOT NULL,
    last_failure_at  BIGINT  NOT NULL
);

CREATE TABLE reprise_nodes (
    id           TEXT   PRIMARY KEY NOT NULL,
    heartbeat_at BIGINT NOT NULL
);
