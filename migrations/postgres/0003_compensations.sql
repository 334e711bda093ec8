-- Compensations: which operation a compensating operation
-- (`<id>#compensation`) undoes, who asked and why. Written in the same
-- transaction as the compensation's reservation; read when it completes,
-- to move the original COMPLETED -> COMPENSATED in that transaction.
CREATE TABLE compensations (
    tenant_id        TEXT    NOT NULL,
    operation_id     TEXT    NOT NULL,
    compensation_id  TEXT    NOT NULL,
    requested_by     TEXT    NOT NULL,
    reason           TEXT    NOT NULL,
    reference        TEXT,
    created_at       BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, operation_id)
);
