-- The inbox: every received envelope, its delivery state, and which node owns it.
CREATE TABLE dacapo_inbox (
    id               TEXT    PRIMARY KEY NOT NULL,
    message_type     TEXT    NOT NULL,
    payload          BLOB    NOT NULL,
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
CREATE INDEX dacapo_inbox_unsettled ON dacapo_inbox (status, owner);
CREATE INDEX dacapo_inbox_handled ON dacapo_inbox (handled_at) WHERE status = 'handled';

CREATE TABLE dacapo_dead_letters (
    id               TEXT    PRIMARY KEY NOT NULL,
    message_type     TEXT    NOT NULL,
    payload          BLOB    NOT NULL,
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

CREATE TABLE dacapo_nodes (
    id           TEXT   PRIMARY KEY NOT NULL,
    heartbeat_at BIGINT NOT NULL
);
