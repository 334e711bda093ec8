-- The effect ledger: one row per operation, scoped by tenant.
-- Times are milliseconds since the Unix epoch, from the gateway's clock.
CREATE TABLE operations (
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
    PRIMARY KEY (tenant_id, operation_id)
) WITHOUT ROWID;

CREATE INDEX operations_by_state ON operations (state, tenant_id, updated_at);
CREATE INDEX operations_by_expiry ON operations (expires_at);

-- Append-only history: one row per state change, written in the same
-- transaction as the change.
CREATE TABLE transitions (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
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

CREATE INDEX transitions_by_operation ON transitions (tenant_id, operation_id, seq);

-- Gateway-wide values that must survive restarts (the provider-key secret).
CREATE TABLE meta (
    name   TEXT PRIMARY KEY,
    value  BLOB NOT NULL
);

-- One row per provider attempt of an operation, written with the attempt's
-- outcome under the attempt's fencing token.
CREATE TABLE attempts (
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    attempt       INTEGER NOT NULL,
    fence         INTEGER NOT NULL,
    status        INTEGER,
    outcome       TEXT    NOT NULL,
    detail        TEXT,
    at            INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, operation_id, attempt)
) WITHOUT ROWID;
