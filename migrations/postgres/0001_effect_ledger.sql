-- The effect ledger on PostgreSQL, shared by every gateway instance.
-- Times are milliseconds since the Unix epoch from the database's clock
-- (effectgate_now_ms()): instances never compare their own wall clocks.
-- Columns match the SQLite ledger after its migrations, one for one.

-- A shift added to the database clock; 0 except in tests and drills that
-- move time forward for every instance at once.
CREATE TABLE clock_shift (
    id        BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (id),
    shift_ms  BIGINT  NOT NULL DEFAULT 0
);
INSERT INTO clock_shift DEFAULT VALUES;

-- Now, in ms since the Unix epoch: clock_timestamp() (the real time, not
-- the transaction's start) plus the shift.
CREATE FUNCTION effectgate_now_ms() RETURNS BIGINT LANGUAGE sql VOLATILE AS $$
    SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT
         + (SELECT shift_ms FROM clock_shift)
$$;

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
    version                BIGINT  NOT NULL,
    attempts               BIGINT  NOT NULL DEFAULT 0,
    lease_owner            TEXT,
    lease_expires_at       BIGINT,
    fence                  BIGINT  NOT NULL DEFAULT 0,
    request_content_type   TEXT,
    request_body           BYTEA   NOT NULL,
    principal              TEXT    NOT NULL,
    response_status        BIGINT,
    response_headers       TEXT,
    response_body          BYTEA,
    response_body_bytes    BIGINT,
    response_body_omitted  BOOLEAN NOT NULL DEFAULT FALSE,
    error_kind             TEXT,
    error_detail           TEXT,
    created_at             BIGINT  NOT NULL,
    updated_at             BIGINT  NOT NULL,
    expires_at             BIGINT  NOT NULL,
    request_headers        TEXT    NOT NULL DEFAULT '[]',
    reconcile_attempts     BIGINT  NOT NULL DEFAULT 0,
    next_reconcile_at      BIGINT,
    dead_letter            BOOLEAN NOT NULL DEFAULT FALSE,
    dead_letter_reason     TEXT,
    operator_check         TEXT,
    provider_reference     TEXT,
    requeues               BIGINT  NOT NULL DEFAULT 0,
    settle_until           BIGINT,
    retention_ms           BIGINT  NOT NULL DEFAULT 86400000,
    -- The reconciler instance that picked the row in its current scan
    -- (FOR UPDATE SKIP LOCKED), and until when.
    scan_owner             TEXT,
    scan_expires_at        BIGINT,
    PRIMARY KEY (tenant_id, operation_id)
);

CREATE INDEX operations_by_state ON operations (state, tenant_id, updated_at);
CREATE INDEX operations_by_expiry ON operations (expires_at);
CREATE INDEX operations_dead_letters ON operations (tenant_id, dead_letter, updated_at);
CREATE INDEX operations_terminal_by_change ON operations (updated_at)
    WHERE state IN ('COMPLETED', 'FAILED', 'COMPENSATED') AND NOT dead_letter;
CREATE INDEX operations_by_scan_owner ON operations (scan_owner) WHERE scan_owner IS NOT NULL;

CREATE TABLE transitions (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    from_state    TEXT,
    to_state      TEXT    NOT NULL,
    version       BIGINT  NOT NULL,
    fence         BIGINT  NOT NULL,
    actor         TEXT    NOT NULL,
    reason        TEXT    NOT NULL,
    at            BIGINT  NOT NULL
);
CREATE INDEX transitions_by_operation ON transitions (tenant_id, operation_id, seq);

CREATE TABLE meta (
    name   TEXT PRIMARY KEY,
    value  BYTEA NOT NULL
);

CREATE TABLE attempts (
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    attempt       BIGINT  NOT NULL,
    fence         BIGINT  NOT NULL,
    status        BIGINT,
    outcome       TEXT    NOT NULL,
    detail        TEXT,
    at            BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, operation_id, attempt)
);

CREATE TABLE policy_decisions (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    operation_id  TEXT    NOT NULL,
    fingerprint   TEXT    NOT NULL,
    policy        TEXT    NOT NULL,
    content_hash  TEXT    NOT NULL,
    decision      TEXT    NOT NULL,
    reason        TEXT,
    duration_us   BIGINT  NOT NULL,
    at            BIGINT  NOT NULL
);
CREATE INDEX policy_decisions_by_operation ON policy_decisions (tenant_id, operation_id, seq);

CREATE TABLE approvals (
    seq                BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id                 TEXT    PRIMARY KEY,
    tenant_id          TEXT    NOT NULL,
    operation_id       TEXT    NOT NULL,
    kind               TEXT    NOT NULL,
    method             TEXT    NOT NULL,
    route              TEXT    NOT NULL,
    path               TEXT    NOT NULL,
    fingerprint        TEXT    NOT NULL,
    policy             TEXT    NOT NULL,
    policy_hash        TEXT    NOT NULL,
    reason             TEXT    NOT NULL,
    requested_by       TEXT    NOT NULL,
    status             TEXT    NOT NULL,
    created_at         BIGINT  NOT NULL,
    expires_at         BIGINT  NOT NULL,
    decided_by         TEXT,
    decided_at         BIGINT,
    comment            TEXT,
    used_at            BIGINT,
    operation_version  BIGINT
);
CREATE INDEX approvals_by_tenant ON approvals (tenant_id, status, created_at);
CREATE INDEX approvals_by_operation ON approvals (tenant_id, operation_id);
CREATE INDEX approvals_pending_expiry ON approvals (status, expires_at);

CREATE TABLE outbox (
    seq              BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    event_id         TEXT    PRIMARY KEY,
    tenant_id        TEXT    NOT NULL,
    event_type       TEXT    NOT NULL,
    payload          TEXT    NOT NULL,
    created_at       BIGINT  NOT NULL,
    attempts         BIGINT  NOT NULL DEFAULT 0,
    next_attempt_at  BIGINT  NOT NULL,
    delivered_at     BIGINT,
    last_error       TEXT,
    lease_owner      TEXT,
    lease_expires_at BIGINT
);
CREATE INDEX outbox_due ON outbox (delivered_at, next_attempt_at);
