//! The SQL the stores run, one text for both backends: `$N` parameters, which SQLite and
//! PostgreSQL both accept; ids as text, times as milliseconds, JSON as text. Where the two
//! must differ (how a claim of unsettled rows locks), each backend has its own statement.

/// A statement that writes many rows at once — one statement, not one per row, for a batch
/// that commits together: `head`, then `row` once per row, joined by commas, then `tail`.
/// The head takes parameters `$1` … `$fixed`; each row's `$1` … `$width` are renumbered after
/// them and after the rows before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    head: &'static str,
    fixed: usize,
    row: &'static str,
    width: usize,
    /// Between two rows.
    between: &'static str,
    tail: &'static str,
}

impl Rows {
    /// The most rows one statement takes: a run is cut into statements of this many, then of
    /// powers of two, so that a connection's statement cache holds at most seven texts of
    /// each.
    pub(crate) const MOST: usize = 64;

    /// The statement for `count` rows.
    pub(crate) fn text(&self, count: usize) -> String {
        let mut text = String::with_capacity(
            self.head.len()
                + count * (self.row.len() + 2 * self.width + self.between.len())
                + self.tail.len(),
        );
        text.push_str(self.head);
        for n in 0..count {
            if n > 0 {
                text.push_str(self.between);
            }
            let offset = self.fixed + n * self.width;
            let mut rest = self.row;
            while let Some(at) = rest.find('$') {
                text.push_str(&rest[..=at]);
                rest = &rest[at + 1..];
                let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
                let number: usize = rest[..digits].parse().unwrap_or(0);
                text.push_str(&(offset + number).to_string());
                rest = &rest[digits..];
            }
            text.push_str(rest);
        }
        text.push_str(self.tail);
        text
    }

    /// How many rows each statement of a run of `count` takes.
    pub(crate) fn sizes(count: usize) -> impl Iterator<Item = usize> {
        let full = count / Self::MOST;
        let rest = count % Self::MOST;
        std::iter::repeat_n(Self::MOST, full).chain(
            (0..usize::BITS)
                .rev()
                .map(|bit| 1usize << bit)
                .filter(move |size| rest & size != 0),
        )
    }
}

/// The columns of an inbox row a receive writes, and one row's values.
macro_rules! receive {
    (columns) => {
        "INSERT INTO dacapo_inbox (id, message_type, payload, headers, deduplication_id, \
         correlation_id, causation_id, sent_at, scheduled_for, status, attempts, owner, \
         received_at) VALUES "
    };
    (row) => {
        "($1, $2, $3, $4, $5, $6, $7, $8, $9, 'incoming', $10, $11, $12)"
    };
}

pub(crate) const RECEIVE: &str = concat!(
    receive!(columns),
    receive!(row),
    " ON CONFLICT (id) DO NOTHING"
);

/// Many receives in one statement; the ids it answers are those it inserted.
pub(crate) const RECEIVE_ROWS: Rows = Rows {
    head: receive!(columns),
    fixed: 0,
    row: receive!(row),
    width: 12,
    between: ", ",
    tail: " ON CONFLICT (id) DO NOTHING RETURNING id",
};

/// An envelope scheduled for later: unowned, no attempt started, due at `$10`.
pub(crate) const RECEIVE_SCHEDULED: &str = "INSERT INTO dacapo_inbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, status, attempts, execute_at, owner, received_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'scheduled', 0, $10, NULL, $11) \
    ON CONFLICT (id) DO NOTHING";

/// Envelopes scheduled for later and not started, soonest first. The index of due rows
/// holds them in that order; its condition is repeated for SQLite to see it applies.
pub(crate) const LIST_SCHEDULED: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, execute_at \
    FROM dacapo_inbox WHERE status IN ('incoming', 'scheduled') AND execute_at IS NOT NULL \
    AND status = 'scheduled' AND attempts = 0 \
    ORDER BY execute_at, id LIMIT $1";

/// Settles a scheduled envelope that has not started; its row stays for the retention, so a
/// redelivery is discarded, and a node waiting to run it finds it settled.
pub(crate) const CANCEL_SCHEDULED: &str = "UPDATE dacapo_inbox \
    SET status = 'handled', handled_at = $2, owner = NULL \
    WHERE id = $1 AND status = 'scheduled' AND attempts = 0";

// An attempt's start and its retry record never take an envelope back from handled, and only
// the owner writes them: a node that lost a delivery to recovery while it was cooling down or
// running late must neither start it again next to the new owner nor overwrite the new owner's
// state. Its late settlement (handled, or dead-lettered) is still recorded: the attempt ran,
// and the new owner's next attempt then finds the envelope settled and stops.
//
// It is also a compare-and-set on the attempt count: attempt N starts only over a row that
// counts N - 1 started, so two runners of one delivery (even on one node) never both start it.
pub(crate) const BEGIN_ATTEMPT: &str = "UPDATE dacapo_inbox \
    SET status = 'incoming', attempts = $2, execute_at = NULL \
    WHERE id = $1 AND status <> 'handled' AND owner = $3 AND attempts = $4";

/// Takes back the first attempt a receive counted, for a delivery its owner never started —
/// released by its owner's shutdown meanwhile, too (no owner then), but not once another node
/// claimed it or recorded a failure of it.
pub(crate) const NEVER_STARTED: &str = "UPDATE dacapo_inbox SET attempts = 0 \
    WHERE id = $1 AND status = 'incoming' AND (owner = $2 OR owner IS NULL) AND attempts = 1 \
    AND failures IS NULL";

/// Many deliveries of one owner begin the same attempt in one statement (`$1`, after `$3`);
/// the ids it answers are those it began.
pub(crate) const BEGIN_ATTEMPT_ROWS: Rows = Rows {
    head: "UPDATE dacapo_inbox SET status = 'incoming', attempts = $1, execute_at = NULL \
        WHERE status <> 'handled' AND owner = $2 AND attempts = $3 AND id IN (",
    fixed: 3,
    row: "$1",
    width: 1,
    between: ", ",
    tail: ") RETURNING id",
};

// A retry's record and a settle are fenced on the attempt count too: the owner's runner of
// attempt N writes over a row that counts no attempt after N. A node that paused past its
// heartbeat lost the delivery to another node, which ran later attempts; if that node died in
// turn and this one claimed the delivery back, the owner is this node again, and only the count
// tells its stale runner from the state the other node recorded (what its handlers cascaded,
// which succeeded). The bound is at least 1: a receive counts the first attempt before its
// delivery starts, and one that never ran (an unknown type) settles over that count.
pub(crate) const SCHEDULE_RETRY: &str = "UPDATE dacapo_inbox \
    SET status = 'scheduled', attempts = $2, execute_at = $3, failures = $4, succeeded = $5, \
    cascaded = $7 \
    WHERE id = $1 AND status <> 'handled' AND owner = $6 AND attempts <= $8";

/// Settles a delivery, handled or dead-lettered; only its owner does, and only once.
pub(crate) const MARK_HANDLED: &str = "UPDATE dacapo_inbox \
    SET status = 'handled', handled_at = $2, owner = NULL \
    WHERE id = $1 AND status <> 'handled' AND owner = $3 AND attempts <= $4";

/// Many deliveries of one owner settled in one statement, at `$1`, each fenced on its count
/// of attempts; the ids it answers are those it marked.
pub(crate) const MARK_HANDLED_ROWS: Rows = Rows {
    head: "UPDATE dacapo_inbox SET status = 'handled', handled_at = $1, owner = NULL \
        WHERE status <> 'handled' AND owner = $2 AND (",
    fixed: 2,
    row: "(id = $1 AND attempts <= $2)",
    width: 2,
    between: " OR ",
    tail: ") RETURNING id",
};

/// A replayed dead letter back in the inbox, fresh attempt count: a new row if the settled one
/// was cleaned up, the settled one rewritten otherwise — never a row still being delivered.
pub(crate) const REPLAY: &str = "INSERT INTO dacapo_inbox \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, status, attempts, owner, received_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'incoming', 0, $10, $11) \
    ON CONFLICT (id) DO UPDATE SET status = 'incoming', attempts = 0, execute_at = NULL, \
    failures = NULL, succeeded = NULL, cascaded = NULL, owner = excluded.owner, \
    received_at = excluded.received_at, handled_at = NULL \
    WHERE dacapo_inbox.status = 'handled'";

/// Releases the uncompleted claims of a dead-lettered envelope that this node or a dead one
/// made: the work never happened, so the logical id must be free for a message that will do
/// it. A live node's claim stays: its attempt of the same envelope (a broker delivered it to
/// both) may still run the handler, and completes or releases the claim as it ends.
pub(crate) const RELEASE_ENVELOPE_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE envelope_id = $1 AND completed = 0 AND (node = $2 OR node NOT IN \
    (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $3 OR alive_until >= $4))";

/// Moves a heartbeat back by no less than `$3`: two beats of one node (a round's and the
/// timer's) may commit in the other order than they were stamped, but a clock stepped back
/// (NTP, a restored snapshot) must not leave a stamp in the future, which would keep the node
/// alive to the others for as long after it stopped. `$4` is when the node is to be taken for
/// dead without another beat: the stamp plus its own node timeout, moved with the stamp.
pub(crate) const HEARTBEAT: &str = "INSERT INTO dacapo_nodes (id, heartbeat_at, alive_until) \
    VALUES ($1, $2, $4) \
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = CASE \
    WHEN excluded.heartbeat_at > dacapo_nodes.heartbeat_at \
        OR excluded.heartbeat_at < dacapo_nodes.heartbeat_at - $3 THEN excluded.heartbeat_at \
    ELSE dacapo_nodes.heartbeat_at END, \
    alive_until = CASE \
    WHEN excluded.heartbeat_at > dacapo_nodes.heartbeat_at \
        OR excluded.heartbeat_at < dacapo_nodes.heartbeat_at - $3 THEN excluded.alive_until \
    ELSE dacapo_nodes.alive_until END";

pub(crate) const RELEASE: &str = "UPDATE dacapo_inbox SET owner = NULL \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled')";

pub(crate) const RELEASE_BEFORE: &str = "UPDATE dacapo_inbox SET owner = NULL \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled') AND received_at < $2";

pub(crate) const FORGET_NODE: &str = "DELETE FROM dacapo_nodes WHERE id = $1";

/// Nodes silent since `$1`, whose own expiry (if they gave one) passed by then as well.
pub(crate) const FORGET_SILENT_NODES: &str = "DELETE FROM dacapo_nodes WHERE heartbeat_at < $1 \
    AND (alive_until IS NULL OR alive_until < $1)";

/// Takes back a row [`RELEASE`] gave up whose delivery still runs on this node.
pub(crate) const KEEP_RUNNING: &str = "UPDATE dacapo_inbox SET owner = $1 \
    WHERE id = $2 AND owner IS NULL AND status IN ('incoming', 'scheduled')";

/// The sweeps below repeat their condition on the row they delete: on PostgreSQL a row another
/// transaction changed while the sweep waited for its lock is checked again against the outer
/// condition only, not the subquery's. Without it a sweep deletes the row a replay just made
/// `incoming` again, or a claim just taken over, or a key just recorded again.
///
/// A dead-lettered envelope's row is kept while its letter is: a redelivery past the retention
/// would otherwise be handled, and the letter's replay would then run it a second time.
pub(crate) const DELETE_HANDLED: &str = "DELETE FROM dacapo_inbox \
    WHERE status = 'handled' AND handled_at < $1 \
    AND NOT EXISTS (SELECT 1 FROM dacapo_dead_letters d WHERE d.id = dacapo_inbox.id) \
    AND id IN (SELECT i.id FROM dacapo_inbox i WHERE i.status = 'handled' AND i.handled_at < $1 \
    AND NOT EXISTS (SELECT 1 FROM dacapo_dead_letters d WHERE d.id = i.id) LIMIT $2)";

pub(crate) const PUT_DEAD_LETTER: &str = "INSERT INTO dacapo_dead_letters \
    (id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, sent_at, \
     scheduled_for, reason, failures, attempts, first_failure_at, last_failure_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
    ON CONFLICT (id) DO UPDATE SET reason = excluded.reason, failures = excluded.failures, \
    attempts = excluded.attempts, first_failure_at = excluded.first_failure_at, \
    last_failure_at = excluded.last_failure_at";

pub(crate) const LIST_DEAD_LETTERS: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, reason, failures, \
    attempts, first_failure_at, last_failure_at \
    FROM dacapo_dead_letters \
    WHERE ($1 IS NULL OR message_type = $1) AND ($2 IS NULL OR last_failure_at >= $2) \
    ORDER BY first_failure_at, id LIMIT $3";

pub(crate) const GET_DEAD_LETTER: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, reason, failures, \
    attempts, first_failure_at, last_failure_at \
    FROM dacapo_dead_letters WHERE id = $1";

pub(crate) const REMOVE_DEAD_LETTER: &str = "DELETE FROM dacapo_dead_letters WHERE id = $1 \
    RETURNING id, message_type, payload, headers, deduplication_id, correlation_id, causation_id, \
    sent_at, scheduled_for, reason, failures, attempts, first_failure_at, last_failure_at";

/// The letter someone looked at, by its last failure's time: not one written since.
pub(crate) const REMOVE_UNCHANGED_DEAD_LETTER: &str =
    "DELETE FROM dacapo_dead_letters WHERE id = $1 AND last_failure_at = $2";

pub(crate) const PURGE_DEAD_LETTERS: &str = "DELETE FROM dacapo_dead_letters WHERE id IN (\
    SELECT id FROM dacapo_dead_letters \
    WHERE ($1 IS NULL OR message_type = $1) AND ($2 IS NULL OR last_failure_at >= $2) \
    ORDER BY first_failure_at, id LIMIT $3)";

/// This node's own unsettled rows received before `$2`, oldest first.
pub(crate) const OWN_UNSETTLED: &str = "SELECT id FROM dacapo_inbox \
    WHERE owner = $1 AND status IN ('incoming', 'scheduled') AND received_at < $2 \
    ORDER BY received_at LIMIT $3";

/// One of this node's own unsettled rows, as recovery reads them.
pub(crate) const OWN_UNSETTLED_ROW: &str = "SELECT id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for, attempts, execute_at, \
    failures, succeeded, cascaded FROM dacapo_inbox \
    WHERE id = $1 AND owner = $2 AND status IN ('incoming', 'scheduled')";

pub(crate) const DELETE_IDEMPOTENCY_KEYS: &str = "DELETE FROM dacapo_idempotency_keys \
    WHERE recorded_at < $1 \
    AND key IN (SELECT key FROM dacapo_idempotency_keys WHERE recorded_at < $1 LIMIT $2)";

/// HTTP responses kept for idempotency keys whose retention ended.
pub(crate) const DELETE_EXPIRED_HTTP_KEYS: &str = "DELETE FROM dacapo_http_keys \
    WHERE expires_at <= $1 \
    AND id IN (SELECT id FROM dacapo_http_keys WHERE expires_at <= $1 LIMIT $2)";

pub(crate) const INBOX_STATUS: &str = "SELECT status FROM dacapo_inbox WHERE id = $1";

/// The claims table, created only when a runtime enables deduplication: with the feature off
/// the schema does not change at all.
pub(crate) const PROVISION_CLAIMS: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS dacapo_deduplication (\
        handler TEXT NOT NULL, key_hash TEXT NOT NULL, key TEXT NOT NULL, \
        fingerprint TEXT NOT NULL, envelope_id TEXT NOT NULL, node TEXT NOT NULL, \
        completed INTEGER NOT NULL, \
        claimed_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, \
        PRIMARY KEY (handler, key_hash))",
    "CREATE INDEX IF NOT EXISTS dacapo_deduplication_expires ON dacapo_deduplication (expires_at)",
    "CREATE INDEX IF NOT EXISTS dacapo_deduplication_envelope ON dacapo_deduplication (envelope_id)",
];

/// A claim is this one insert: the primary key rejects a held id. The same statement takes
/// over, atomically, a claim whose window ended, or one never completed in an attempt that
/// certainly ended: this node's own earlier attempt of the same envelope (a node runs a
/// delivery once at a time), or any attempt of a node whose heartbeat expired — the rule by
/// which a delivery itself is taken over. That node's envelope may never come back (it was
/// acknowledged into an inbox of that node's own), so a new envelope of the same intent takes
/// the claim too; should the dead node's delivery be resumed after all, it finds the claim
/// held, and the intent ran once (a node only paused past its heartbeat may run it a second
/// time, as it may its own delivery taken over: a handler transaction's completion of the
/// lost claim fails instead). A claim of a version before the `node` column (node `''`)
/// names no node to judge: only its own envelope takes it over, as that version did. A live
/// node's running attempt keeps its claim.
pub(crate) const CLAIM: &str = "INSERT INTO dacapo_deduplication \
    (handler, key_hash, key, fingerprint, envelope_id, node, completed, claimed_at, expires_at) \
    VALUES ($1, $2, $3, $4, $5, $8, 0, $6, $7) \
    ON CONFLICT (handler, key_hash) DO UPDATE SET key = excluded.key, \
    fingerprint = excluded.fingerprint, envelope_id = excluded.envelope_id, \
    node = excluded.node, completed = 0, \
    claimed_at = excluded.claimed_at, expires_at = excluded.expires_at \
    WHERE dacapo_deduplication.expires_at <= excluded.claimed_at \
    OR (dacapo_deduplication.completed = 0 \
        AND ((dacapo_deduplication.envelope_id = excluded.envelope_id \
                AND dacapo_deduplication.node = excluded.node) \
            OR (dacapo_deduplication.node NOT IN \
                (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $9 OR alive_until >= $10) \
                AND (dacapo_deduplication.node <> '' \
                    OR dacapo_deduplication.envelope_id = excluded.envelope_id))))";

pub(crate) const CLAIM_HOLDER: &str = "SELECT fingerprint, envelope_id, completed, node \
    FROM dacapo_deduplication WHERE handler = $1 AND key_hash = $2";

/// Whether the claims table has its `node` column (an earlier version created it without).
#[cfg(feature = "sqlite")]
pub(crate) const CLAIMS_HAVE_NODE_SQLITE: &str = "SELECT count(*) AS present \
    FROM pragma_table_info('dacapo_deduplication') WHERE name = 'node'";

/// Whether the claims table has its `node` column (an earlier version created it without).
#[cfg(feature = "postgres")]
pub(crate) const CLAIMS_HAVE_NODE_POSTGRES: &str = "SELECT count(*) AS present \
    FROM information_schema.columns WHERE table_schema = current_schema() \
    AND table_name = 'dacapo_deduplication' AND column_name = 'node'";

/// Nodes starting together apply the schema once: the first holds this lock.
#[cfg(feature = "postgres")]
pub(crate) const LOCK_MIGRATIONS_POSTGRES: &str = "SELECT pg_advisory_xact_lock(7215143920911461)";

/// Claims a previous run under this node's name made and never completed: that run is over
/// (one process per node name), so they are released when this run provisions the claims,
/// before it claims anything — another node resuming those deliveries then gets them.
pub(crate) const RELEASE_OWN_UNCOMPLETED_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE node = $1 AND completed = 0";

/// The claims table as an earlier version created it, without the claiming node.
pub(crate) const ADD_CLAIMS_NODE: &str =
    "ALTER TABLE dacapo_deduplication ADD COLUMN node TEXT NOT NULL DEFAULT ''";

// A completed claim stays: the handler's transaction committed its work with it, even if
// the handler failed afterwards.
pub(crate) const RELEASE_CLAIM: &str = "DELETE FROM dacapo_deduplication \
    WHERE handler = $1 AND key_hash = $2 AND envelope_id = $3 AND completed = 0 AND node = $4";

/// Fenced on the node: a node whose claim was taken over (it was taken for dead) completes
/// nothing, and its handler transaction fails instead of committing a second effect.
pub(crate) const COMPLETE_CLAIM: &str = "UPDATE dacapo_deduplication SET completed = 1 \
    WHERE handler = $1 AND key_hash = $2 AND envelope_id = $3 AND node = $4";

pub(crate) const REAP_CLAIMS: &str = "DELETE FROM dacapo_deduplication \
    WHERE expires_at <= $1 \
    AND (handler, key_hash) IN (SELECT handler, key_hash FROM dacapo_deduplication \
    WHERE expires_at <= $1 LIMIT $2)";

/// The columns of an outbox row, and one row's values.
macro_rules! enlist {
    (columns) => {
        "INSERT INTO dacapo_outbox (id, message_type, payload, headers, deduplication_id, \
         correlation_id, causation_id, sent_at, scheduled_for, enlisted_at) VALUES "
    };
    (row) => {
        "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
    };
}

pub(crate) const ENLIST: &str = concat!(enlist!(columns), enlist!(row));

/// An outbox row by envelope id, published or not: a replayed dead letter is enlisted again
/// in its place, at the outbox's end.
pub(crate) const DELETE_OUTBOX_ROW: &str = "DELETE FROM dacapo_outbox WHERE id = $1";

/// Many envelopes enlisted in one statement; an id the outbox holds already is kept once (the
/// cascades of a handler that reran after a crash carry the ids of its first run).
pub(crate) const ENLIST_ROWS: Rows = Rows {
    head: enlist!(columns),
    fixed: 0,
    row: enlist!(row),
    width: 10,
    between: ", ",
    tail: " ON CONFLICT (id) DO NOTHING",
};

pub(crate) const ENLIST_ONCE: &str = concat!(
    enlist!(columns),
    enlist!(row),
    " ON CONFLICT (id) DO NOTHING"
);

pub(crate) const BACKLOG: &str = "SELECT count(*) AS depth, min(enlisted_at) AS oldest \
    FROM dacapo_outbox \
    WHERE published_at IS NULL";

pub(crate) const DELETE_PUBLISHED: &str = "DELETE FROM dacapo_outbox WHERE seq IN \
    (SELECT seq FROM dacapo_outbox WHERE published_at < $1 LIMIT $2)";

pub(crate) const LEASE: &str = "INSERT INTO dacapo_outbox_lease (id, owner, expires_at) \
    VALUES (1, $1, $3) ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, \
    expires_at = excluded.expires_at \
    WHERE dacapo_outbox_lease.owner = excluded.owner OR dacapo_outbox_lease.expires_at <= $2";

/// Ends this node's relay lease at once.
pub(crate) const RELEASE_LEASE: &str =
    "UPDATE dacapo_outbox_lease SET expires_at = 0 WHERE owner = $1";

pub(crate) const UNPUBLISHED: &str = "SELECT seq, id, message_type, payload, headers, \
    deduplication_id, correlation_id, causation_id, sent_at, scheduled_for \
    FROM dacapo_outbox WHERE published_at IS NULL AND seq > $2 ORDER BY seq LIMIT $1";

/// `UPDATE … WHERE seq IN ($2, $3, …)` for `count` positions.
pub(crate) fn mark_published(count: usize) -> String {
    let positions: Vec<String> = (2..count + 2).map(|n| format!("${n}")).collect();
    format!(
        "UPDATE dacapo_outbox SET published_at = $1 WHERE seq IN ({})",
        positions.join(", ")
    )
}

pub(crate) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS dacapo_migrations (\
    version BIGINT PRIMARY KEY NOT NULL, description TEXT NOT NULL, applied_at BIGINT NOT NULL)";

pub(crate) const APPLIED_MIGRATION: &str =
    "SELECT count(*) AS applied FROM dacapo_migrations WHERE version = $1";

/// The newest schema version applied, 0 when none is.
pub(crate) const SCHEMA_VERSION: &str =
    "SELECT coalesce(max(version), 0) AS version FROM dacapo_migrations";

/// Whether the migrations table exists.
#[cfg(feature = "sqlite")]
pub(crate) const HAS_SCHEMA_SQLITE: &str = "SELECT count(*) AS present FROM sqlite_master \
    WHERE type = 'table' AND name = 'dacapo_migrations'";

/// Whether the migrations table exists in the connection's schema.
#[cfg(feature = "postgres")]
pub(crate) const HAS_SCHEMA_POSTGRES: &str = "SELECT count(*) AS present \
    FROM information_schema.tables WHERE table_schema = current_schema() \
    AND table_name = 'dacapo_migrations'";

pub(crate) const RECORD_MIGRATION: &str =
    "INSERT INTO dacapo_migrations (version, description, applied_at) VALUES ($1, $2, $3)";

/// The rows a claim may take: released (no owner), or, when `$5` is 1, owned by a node that
/// has not heartbeaten within the node timeout *and* older than that — a node that just
/// started may receive before its first heartbeat is written, and its fresh rows must not
/// look orphaned.
macro_rules! claimable {
    () => {
        "(owner IS NULL OR ($5 = 1 AND owner <> $1 AND received_at < $2 \
         AND owner NOT IN (SELECT id FROM dacapo_nodes WHERE heartbeat_at >= $2 \
         OR alive_until >= $6)))"
    };
}

/// A claim's candidates: ready rows (no time to wait for) oldest first, and rows due before
/// `$4` (scheduled, or a retry's cooldown) soonest first, each read from its own index — so
/// that rows due far ahead are never walked — then the oldest `$3` of both. `$lock` locks
/// each candidate (PostgreSQL: skipping those another node is claiming at this moment), so
/// that a row another node locked does not count against a branch's limit; the candidates
/// of the branch left out stay locked until the claim commits, a moment, in which another
/// node's claim passes over them too.
macro_rules! claim {
    ($lock:literal) => {
        concat!(
            "UPDATE dacapo_inbox SET owner = $1 WHERE id IN (SELECT id FROM (\
             SELECT id, received_at FROM (SELECT id, received_at FROM dacapo_inbox \
             WHERE status IN ('incoming', 'scheduled') AND execute_at IS NULL AND ",
            claimable!(),
            " ORDER BY received_at LIMIT $3",
            $lock,
            ") AS ready UNION ALL \
             SELECT id, received_at FROM (SELECT id, received_at FROM dacapo_inbox \
             WHERE status IN ('incoming', 'scheduled') AND execute_at IS NOT NULL \
             AND execute_at < $4 AND ",
            claimable!(),
            " ORDER BY execute_at LIMIT $3",
            $lock,
            ") AS due) AS claimable ORDER BY received_at LIMIT $3) \
             RETURNING id, message_type, payload, headers, deduplication_id, correlation_id, \
             causation_id, sent_at, scheduled_for, attempts, execute_at, failures, succeeded, \
             cascaded"
        )
    };
}

/// Claims unsettled rows with plain `UPDATE … RETURNING`; the caller's `BEGIN IMMEDIATE`
/// already holds SQLite's single write lock.
#[cfg(feature = "sqlite")]
pub(crate) const CLAIM_SQLITE: &str = claim!("");

/// Claims unsettled rows, skipping those another node is claiming at this moment.
#[cfg(feature = "postgres")]
pub(crate) const CLAIM_POSTGRES: &str = claim!(" FOR UPDATE SKIP LOCKED");

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of `plan` that read `dacapo_inbox` whole or by an index in full, except the
    /// ready rows' index, which a claim reads oldest first and stops at its limit.
    #[cfg(feature = "testing")]
    fn walks(plan: &str) -> Vec<&str> {
        plan.lines()
            .filter(|line| {
                let line = line.trim();
                (line.starts_with("SCAN dacapo_inbox") || line.contains("Seq Scan on dacapo_inbox"))
                    && !line.contains("dacapo_inbox_ready")
            })
            .collect()
    }

    /// A claim and the schedule's listing read rows due later by their time, from the index
    /// of due rows: a backlog scheduled far ahead is never walked, on SQLite under its write
    /// lock, to find that none of it is due.
    #[cfg(all(feature = "sqlite", feature = "testing"))]
    #[tokio::test]
    async fn due_rows_are_read_by_their_time_on_sqlite() {
        use sqlx::Row as _;
        let db = crate::testing::ScratchDatabase::sqlite();
        let store = db.sqlite_store().await.unwrap();
        for statement in [CLAIM_SQLITE, LIST_SCHEDULED] {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                "EXPLAIN QUERY PLAN {statement}"
            )))
            .fetch_all(store.pool())
            .await
            .unwrap();
            let plan: String = rows
                .iter()
                .map(|row| row.get::<String, _>(3) + "\n")
                .collect();
            assert!(
                plan.contains("SEARCH dacapo_inbox USING INDEX dacapo_inbox_due (execute_at"),
                "{statement}\n{plan}"
            );
            assert!(walks(&plan).is_empty(), "{statement}\n{plan}");
        }
    }

    /// As on SQLite, with sequential scans discouraged so that the indexes show on an empty
    /// table.
    #[cfg(all(feature = "postgres", feature = "testing"))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn due_rows_are_read_by_their_time_on_postgres() {
        let admin = std::env::var("DACAPO_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let db = crate::testing::ScratchDatabase::postgres(&admin)
            .await
            .unwrap();
        let store = db.postgres_store().await.unwrap();
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query("SET LOCAL enable_seqscan = off")
            .execute(&mut *tx)
            .await
            .unwrap();
        let claim = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {CLAIM_POSTGRES}")))
            .bind("node")
            .bind(0_i64)
            .bind(10_i64)
            .bind(0_i64)
            .bind(1_i64)
            .bind(0_i64)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        let list = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {LIST_SCHEDULED}")))
            .bind(10_i64)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        for (statement, plan) in [(CLAIM_POSTGRES, claim), (LIST_SCHEDULED, list)] {
            let plan: String = plan
                .iter()
                .map(|line: &String| line.clone() + "\n")
                .collect();
            assert!(plan.contains("dacapo_inbox_due"), "{statement}\n{plan}");
            assert!(walks(&plan).is_empty(), "{statement}\n{plan}");
        }
    }

    #[test]
    fn rows_are_numbered_after_the_head_and_the_rows_before() {
        assert_eq!(
            MARK_HANDLED_ROWS.text(3),
            "UPDATE dacapo_inbox SET status = 'handled', handled_at = $1, owner = NULL \
             WHERE status <> 'handled' AND owner = $2 AND ((id = $3 AND attempts <= $4) \
             OR (id = $5 AND attempts <= $6) OR (id = $7 AND attempts <= $8)) RETURNING id"
        );
        assert_eq!(
            BEGIN_ATTEMPT_ROWS.text(2),
            "UPDATE dacapo_inbox SET status = 'incoming', attempts = $1, execute_at = NULL \
             WHERE status <> 'handled' AND owner = $2 AND attempts = $3 AND id IN ($4, $5) \
             RETURNING id"
        );
        let two = ENLIST_ROWS.text(2);
        assert!(
            two.ends_with(
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10), \
                 ($11, $12, $13, $14, $15, $16, $17, $18, $19, $20) ON CONFLICT (id) DO NOTHING"
            ),
            "{two}"
        );
        assert_eq!(ENLIST_ROWS.text(1), ENLIST_ONCE);
        assert_eq!(RECEIVE_ROWS.text(1), format!("{RECEIVE} RETURNING id"));
        let last = RECEIVE_ROWS.text(Rows::MOST);
        assert!(last.contains("'incoming', $766, $767, $768)"), "{last}");
    }

    #[test]
    fn a_run_is_cut_into_few_statement_sizes() {
        let sizes = |count| Rows::sizes(count).collect::<Vec<_>>();
        assert_eq!(sizes(0), Vec::<usize>::new());
        assert_eq!(sizes(1), [1]);
        assert_eq!(sizes(100), [64, 32, 4]);
        assert_eq!(sizes(128), [64, 64]);
        assert_eq!(sizes(71), [64, 4, 2, 1]);
        for count in 0..300 {
            assert_eq!(sizes(count).iter().sum::<usize>(), count);
        }
    }
}
