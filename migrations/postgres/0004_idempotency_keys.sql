-- Idempotency keys recorded by handlers in their own transactions: the primary key, not a
-- prior read, decides whether the work is new.
CREATE TABLE dacapo_idempotency_keys (
    key         TEXT   PRIMARY KEY NOT NULL,
    recorded_at BIGINT NOT NULL
);
