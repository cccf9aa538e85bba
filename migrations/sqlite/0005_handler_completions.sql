-- The handlers whose own transaction committed for an envelope: written in that transaction,
-- so a rerun of the handler (a retry, a crash, a redelivery within the retention) finds its
-- work already done.
CREATE TABLE dacapo_handler_completions (
    envelope_id  TEXT   NOT NULL,
    handler      TEXT   NOT NULL,
    completed_at BIGINT NOT NULL,
    PRIMARY KEY (envelope_id, handler)
);
CREATE INDEX dacapo_handler_completions_at ON dacapo_handler_completions (completed_at);
