-- Which policies ran for an operation's request, with their content hash
-- and decision: the answer to "why was this allowed or denied".
CREATE TABLE policy_decisions (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    fingerprint   TEXT    NOT NULL,
    policy        TEXT    NOT NULL,
    content_hash  TEXT    NOT NULL,
    decision      TEXT    NOT NULL,
    reason        TEXT,
    duration_us   INTEGER NOT NULL,
    at            INTEGER NOT NULL
);

CREATE INDEX policy_decisions_by_operation ON policy_decisions (tenant_id, operation_id, seq);
