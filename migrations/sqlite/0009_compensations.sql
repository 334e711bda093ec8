-- Compensations: which operation a compensating operation
-- (`<id>#compensation`) undoes, who asked and why. Written in the same
-- transaction as the compensation's reservation; read when it completes,
-- to move the original COMPLETED -> COMPENSATED in that transaction.
CREATE TABLE compensations (
    tenant_id        TEXT    NOT NULL,
    operation_id     TEXT    NOT NULL,   -- the original operation
    compensation_id  TEXT    NOT NULL,   -- its compensating operation
    requested_by     TEXT    NOT NULL,
    reason           TEXT    NOT NULL,
    reference        TEXT,               -- the original's provider reference used
    created_at       INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, operation_id)
) WITHOUT ROWID;
