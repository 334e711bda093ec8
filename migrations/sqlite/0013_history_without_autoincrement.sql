-- The history tables number their rows without AUTOINCREMENT.
--
-- With AUTOINCREMENT every insert also rewrote the table's row in
-- `sqlite_sequence`: one more page in the write-ahead log of every commit
-- that records a transition (each commit of an effectful call), written and
-- synced for nothing. A plain INTEGER PRIMARY KEY takes the largest `seq`
-- plus one, so a row's `seq` is still above every row kept before it. A
-- number can come back only once every row above it is gone, and nothing
-- orders rows by `seq` across operations: an operation's history and its
-- decisions are read in `seq` order, and their newest rows are never
-- deleted before its older ones.
--
-- Rows, numbers and indexes are kept as they were.

CREATE TABLE transitions_renumbered (
    seq           INTEGER PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    from_state    TEXT,
    to_state      TEXT    NOT NULL,
    version       INTEGER NOT NULL,
    fence         INTEGER NOT NULL,
    actor         TEXT    NOT NULL,
    reason        TEXT    NOT NULL,
    at            INTEGER NOT NULL
);
INSERT INTO transitions_renumbered
    (seq, tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at)
    SELECT seq, tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at
    FROM transitions;
DROP TABLE transitions;
ALTER TABLE transitions_renumbered RENAME TO transitions;
CREATE INDEX transitions_by_operation ON transitions (tenant_id, operation_id, seq);

CREATE TABLE policy_decisions_renumbered (
    seq           INTEGER PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    fingerprint   TEXT    NOT NULL,
    policy        TEXT    NOT NULL,
    content_hash  TEXT    NOT NULL,
    decision      TEXT    NOT NULL,
    reason        TEXT,
    duration_us   INTEGER NOT NULL,
    at            INTEGER NOT NULL,
    unreserved    INTEGER NOT NULL DEFAULT 1
);
INSERT INTO policy_decisions_renumbered
    (seq, tenant_id, operation_id, fingerprint, policy, content_hash, decision, reason,
     duration_us, at, unreserved)
    SELECT seq, tenant_id, operation_id, fingerprint, policy, content_hash, decision, reason,
           duration_us, at, unreserved
    FROM policy_decisions;
DROP TABLE policy_decisions;
ALTER TABLE policy_decisions_renumbered RENAME TO policy_decisions;
CREATE INDEX policy_decisions_by_operation ON policy_decisions (tenant_id, operation_id, seq);
CREATE INDEX policy_decisions_unreserved ON policy_decisions (at) WHERE unreserved;

DELETE FROM sqlite_sequence WHERE name IN ('transitions', 'policy_decisions');
