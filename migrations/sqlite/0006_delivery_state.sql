-- What the handlers that succeeded cascaded outside a handler transaction (a JSON list of
-- envelopes), written with each failed attempt's record: a restart or another node sends them
-- when the delivery is handled, instead of losing them with the process.
ALTER TABLE dacapo_inbox ADD COLUMN cascaded TEXT;

-- Recovery claims pending rows oldest first: an index on exactly those rows, so a claim reads
-- what it takes instead of scanning and sorting the whole inbox. Releases and the orphan sweep
-- look for one node's pending rows: the owner index holds those rows only, so the handled
-- rows' sweep is left to its own index on the handling time.
CREATE INDEX dacapo_inbox_pending ON dacapo_inbox (received_at)
    WHERE status IN ('incoming', 'scheduled');
DROP INDEX dacapo_inbox_unsettled;
CREATE INDEX dacapo_inbox_unsettled ON dacapo_inbox (owner)
    WHERE status IN ('incoming', 'scheduled');

-- Retention sweeps: published outbox rows and idempotency keys, each by its time.
CREATE INDEX dacapo_outbox_published ON dacapo_outbox (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX dacapo_idempotency_keys_at ON dacapo_idempotency_keys (recorded_at);
