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

-- Every transaction that enlists in the outbox tells the relays when it commits (a NOTIFY is
-- delivered at commit, and never for a rollback), so they publish without waiting for a poll.
CREATE FUNCTION dacapo_outbox_enlisted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('dacapo_outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER dacapo_outbox_enlisted AFTER INSERT ON dacapo_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION dacapo_outbox_enlisted();
