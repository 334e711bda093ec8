-- Approvals: a human decision bound to the exact immutable intent
-- (tenant, operation id, method, route, path, fingerprint). Single-use.
CREATE TABLE approvals (
    id             TEXT    PRIMARY KEY,
    tenant_id      TEXT    NOT NULL,
    operation_id   TEXT    NOT NULL,
    kind           TEXT    NOT NULL,           -- 'request' or 'replay'
    method         TEXT    NOT NULL,
    route          TEXT    NOT NULL,
    path           TEXT    NOT NULL,
    fingerprint    TEXT    NOT NULL,
    policy         TEXT    NOT NULL,
    policy_hash    TEXT    NOT NULL,
    reason         TEXT    NOT NULL,
    requested_by   TEXT    NOT NULL,
    status         TEXT    NOT NULL,           -- pending, approved, rejected, expired, used
    created_at     INTEGER NOT NULL,
    expires_at     INTEGER NOT NULL,
    decided_by     TEXT,
    decided_at     INTEGER,
    comment        TEXT,
    used_at        INTEGER
);

CREATE INDEX approvals_by_tenant ON approvals (tenant_id, status, created_at);
CREATE INDEX approvals_by_operation ON approvals (tenant_id, operation_id);
CREATE INDEX approvals_pending_expiry ON approvals (status, expires_at);

-- Outbox: events written in the same transaction as the change they
-- announce, delivered at least once by the relay.
CREATE TABLE outbox (
    event_id         TEXT    PRIMARY KEY,
    tenant_id        TEXT    NOT NULL,
    event_type       TEXT    NOT NULL,
    payload          TEXT    NOT NULL,
    created_at       INTEGER NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    delivered_at     INTEGER,
    last_error       TEXT,
    lease_owner      TEXT,
    lease_expires_at INTEGER
);

CREATE INDEX outbox_due ON outbox (delivered_at, next_attempt_at);
