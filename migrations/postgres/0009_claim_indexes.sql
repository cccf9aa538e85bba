-- Recovery claims ready rows oldest first and due rows soonest first, each from an index of
-- its own: a backlog of envelopes scheduled far ahead (reminders for next month) is no longer
-- walked by every claim, under SQLite's write lock, to find that none of it is due. Each
-- pending row is in exactly one of the two, as it was in the index they replace.
CREATE INDEX dacapo_inbox_ready ON dacapo_inbox (received_at)
    WHERE status IN ('incoming', 'scheduled') AND execute_at IS NULL;
-- The id after the time: the schedule's listing (soonest first, ties by id) reads it in order.
CREATE INDEX dacapo_inbox_due ON dacapo_inbox (execute_at, id)
    WHERE status IN ('incoming', 'scheduled') AND execute_at IS NOT NULL;
-- Dropped last: on PostgreSQL the drop locks the table against reads too, until the migration
-- commits; after the builds, that is a moment, not their whole time.
DROP INDEX dacapo_inbox_pending;
