-- Operations get a number of their own (`op_seq`), and their history is
-- filed under it instead of under the caller's idempotency key.
--
-- Callers draw idempotency keys at random (UUIDv4 and the like). Every
-- B-tree ordered by `(tenant_id, operation_id)` then takes each new
-- operation on a random page, and each of those pages is written to the
-- write-ahead log at every commit: the operations table itself (it was a
-- WITHOUT ROWID table, whole rows in key order), the transitions' index and
-- the attempts' primary key. Now:
--
-- - `operations` is a rowid table whose `op_seq` (INTEGER PRIMARY KEY,
--   kept across VACUUM) grows with every new operation; the key stays
--   unique through a separate index of key and number only;
-- - `transitions` and `attempts` are ordered by `op_seq`, so a commit's new
--   rows share the B-trees' last pages whatever the keys are;
-- - deleting an operation deletes its transitions and attempts in the same
--   statement (trigger `operations_history_forgotten`), so a number that
--   comes back (SQLite reuses the largest rowid once its row is gone) never
--   finds an earlier operation's history.
--
-- Rows, states and transition numbers are kept; existing operations are
-- numbered in the order of their key, new ones after them. Transitions and
-- attempts of no operation (none are written; a forgotten operation's are
-- deleted with it) are not carried over. The tables are copied in one
-- transaction when the gateway (or `effectgate migrate`) first opens the
-- ledger: it takes about the tables' size again in free disk space and
-- holds the ledger while it runs.

CREATE TABLE operations_numbered (
    op_seq                 INTEGER PRIMARY KEY,
    tenant_id              TEXT    NOT NULL,
    operation_id           TEXT    NOT NULL,
    route                  TEXT    NOT NULL,
    method                 TEXT    NOT NULL,
    path                   TEXT    NOT NULL,
    query                  TEXT,
    fingerprint            TEXT    NOT NULL,
    provider_key           TEXT    NOT NULL,
    effect_class           TEXT,
    state                  TEXT    NOT NULL,
    version                INTEGER NOT NULL,
    attempts               INTEGER NOT NULL DEFAULT 0,
    lease_owner            TEXT,
    lease_expires_at       INTEGER,
    fence                  INTEGER NOT NULL DEFAULT 0,
    request_content_type   TEXT,
    request_body           BLOB    NOT NULL,
    principal              TEXT    NOT NULL,
    response_status        INTEGER,
    response_headers       TEXT,
    response_body          BLOB,
    response_body_bytes    INTEGER,
    response_body_omitted  INTEGER NOT NULL DEFAULT 0,
    error_kind             TEXT,
    error_detail           TEXT,
    created_at             INTEGER NOT NULL,
    updated_at             INTEGER NOT NULL,
    expires_at             INTEGER NOT NULL,
    request_headers        TEXT    NOT NULL DEFAULT '[]',
    reconcile_attempts     INTEGER NOT NULL DEFAULT 0,
    next_reconcile_at      INTEGER,
    dead_letter            INTEGER NOT NULL DEFAULT 0,
    dead_letter_reason     TEXT,
    operator_check         TEXT,
    provider_reference     TEXT,
    requeues               INTEGER NOT NULL DEFAULT 0,
    settle_until           INTEGER,
    retention_ms           INTEGER NOT NULL DEFAULT 86400000,
    scan_owner             TEXT,
    scan_expires_at        INTEGER,
    trace_context          TEXT,
    UNIQUE (tenant_id, operation_id)
);
INSERT INTO operations_numbered
    (tenant_id, operation_id, route, method, path, query, fingerprint, provider_key, effect_class,
     state, version, attempts, lease_owner, lease_expires_at, fence, request_content_type,
     request_body, principal, response_status, response_headers, response_body,
     response_body_bytes, response_body_omitted, error_kind, error_detail, created_at,
     updated_at, expires_at, request_headers, reconcile_attempts, next_reconcile_at,
     dead_letter, dead_letter_reason, operator_check, provider_reference, requeues,
     settle_until, retention_ms, scan_owner, scan_expires_at, trace_context)
    SELECT tenant_id, operation_id, route, method, path, query, fingerprint, provider_key,
     effect_class, state, version, attempts, lease_owner, lease_expires_at, fence,
     request_content_type, request_body, principal, response_status, response_headers,
     response_body, response_body_bytes, response_body_omitted, error_kind, error_detail,
     created_at, updated_at, expires_at, request_headers, reconcile_attempts,
     next_reconcile_at, dead_letter, dead_letter_reason, operator_check, provider_reference,
     requeues, settle_until, retention_ms, scan_owner, scan_expires_at, trace_context
    FROM operations;

CREATE TABLE transitions_numbered (
    seq           INTEGER PRIMARY KEY,
    op_seq        INTEGER NOT NULL,
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
INSERT INTO transitions_numbered
    (seq, op_seq, tenant_id, operation_id, from_state, to_state, version, fence, actor, reason, at)
    SELECT t.seq, o.op_seq, t.tenant_id, t.operation_id, t.from_state, t.to_state, t.version,
     t.fence, t.actor, t.reason, t.at
    FROM transitions t
    JOIN operations_numbered o ON o.tenant_id = t.tenant_id AND o.operation_id = t.operation_id;

CREATE TABLE attempts_numbered (
    op_seq        INTEGER NOT NULL,
    attempt       INTEGER NOT NULL,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    fence         INTEGER NOT NULL,
    status        INTEGER,
    outcome       TEXT    NOT NULL,
    detail        TEXT,
    at            INTEGER NOT NULL,
    request_id    TEXT,
    PRIMARY KEY (op_seq, attempt)
) WITHOUT ROWID;
INSERT INTO attempts_numbered
    (op_seq, attempt, tenant_id, operation_id, fence, status, outcome, detail, at, request_id)
    SELECT o.op_seq, a.attempt, a.tenant_id, a.operation_id, a.fence, a.status, a.outcome,
     a.detail, a.at, a.request_id
    FROM attempts a
    JOIN operations_numbered o ON o.tenant_id = a.tenant_id AND o.operation_id = a.operation_id;

DROP TABLE operations;
DROP TABLE transitions;
DROP TABLE attempts;
ALTER TABLE operations_numbered RENAME TO operations;
ALTER TABLE transitions_numbered RENAME TO transitions;
ALTER TABLE attempts_numbered RENAME TO attempts;

CREATE INDEX operations_by_state ON operations (state, tenant_id, updated_at);
CREATE INDEX operations_by_scan_owner ON operations (scan_owner) WHERE scan_owner IS NOT NULL;
CREATE INDEX operations_by_provider_key ON operations (tenant_id, provider_key);
CREATE INDEX operations_dead_letters ON operations (tenant_id, updated_at) WHERE dead_letter;
CREATE INDEX operations_by_reference ON operations (tenant_id, provider_reference)
    WHERE provider_reference IS NOT NULL;
CREATE INDEX operations_terminal_by_change ON operations (updated_at)
    WHERE (state = 'COMPLETED' OR state = 'FAILED' OR state = 'COMPENSATED') AND NOT dead_letter;
CREATE INDEX transitions_by_operation ON transitions (op_seq, seq);

CREATE TRIGGER operations_history_forgotten AFTER DELETE ON operations
BEGIN
    DELETE FROM transitions WHERE op_seq = OLD.op_seq;
    DELETE FROM attempts WHERE op_seq = OLD.op_seq;
END;
