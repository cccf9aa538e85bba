//! A backlog already published: pending envelopes written straight into a fresh inbox.
#![allow(dead_code, unreachable_pub)]

/// `$1` released envelopes of pings, received long ago, in a fresh inbox: a backlog already
/// published, waiting for a node.
pub const SEED_SQLITE: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
    WHERE i < $1) INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
    attempts, owner, received_at) SELECT printf('%032x', i), 'bench.ping', \
    CAST('{\"n\":' || i || '}' AS BLOB), '{}', 0, 'incoming', 0, NULL, i FROM n";
pub const SEED_POSTGRES: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
    WHERE i < $1) INSERT INTO dacapo_inbox (id, message_type, payload, headers, sent_at, status, \
    attempts, owner, received_at) SELECT lpad(to_hex(i), 32, '0'), 'bench.ping', \
    convert_to('{\"n\":' || i || '}', 'UTF8'), '{}', 0, 'incoming', 0, NULL, i FROM n";
