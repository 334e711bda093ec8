-- The inbox: provider webhooks, received once. The primary key is the
-- dedupe: a redelivery of (tenant, source, event id) inserts nothing
-- (INSERT … ON CONFLICT DO NOTHING). Rows are swept after the source's
-- dedupe window.
CREATE TABLE inbox (
    tenant_id        TEXT    NOT NULL,
    source           TEXT    NOT NULL,
    event_id         TEXT    NOT NULL,
    event_type       TEXT,
    state            TEXT    NOT NULL,           -- accepted, stale, held, quarantined, dropped
    sequence_key     TEXT,
    sequence         INTEGER,
    gap              INTEGER NOT NULL DEFAULT 0, -- delivered although an earlier sequence never came
    payload          TEXT    NOT NULL,
    received_at      INTEGER NOT NULL,
    held_until       INTEGER,
    outbox_event_id  TEXT,
    operation_id     TEXT,                       -- the operation a `resolves` rule named
    resolution       TEXT,                       -- what the event did to it
    decided_by       TEXT,                       -- the operator who released or dropped it
    decided_at       INTEGER,
    PRIMARY KEY (tenant_id, source, event_id)
);
CREATE INDEX inbox_by_state ON inbox (tenant_id, source, state, received_at);
CREATE INDEX inbox_sweep ON inbox (received_at);
CREATE INDEX inbox_held ON inbox (state, held_until);
CREATE INDEX inbox_by_operation ON inbox (tenant_id, operation_id);

-- The last applied sequence per sequence key of a source.
CREATE TABLE inbox_sequences (
    tenant_id     TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    sequence_key  TEXT    NOT NULL,
    last_applied  INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, source, sequence_key)
);

-- Outbox events of one ordering key are delivered one after another.
ALTER TABLE outbox ADD COLUMN ordering_key TEXT;
CREATE INDEX outbox_by_ordering_key ON outbox (ordering_key) WHERE ordering_key IS NOT NULL;

-- A `resolves` rule finds the operation an event names by provider key
-- or provider reference, within the source's tenant.
CREATE INDEX operations_by_provider_key ON operations (tenant_id, provider_key);
CREATE INDEX operations_by_reference ON operations (tenant_id, provider_reference);
