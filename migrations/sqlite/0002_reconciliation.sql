-- Reconciliation, dead letters and the stored request headers.
ALTER TABLE operations ADD COLUMN request_headers TEXT NOT NULL DEFAULT '[]';
ALTER TABLE operations ADD COLUMN reconcile_attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN next_reconcile_at INTEGER;
ALTER TABLE operations ADD COLUMN dead_letter INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN dead_letter_reason TEXT;
ALTER TABLE operations ADD COLUMN operator_check TEXT;
ALTER TABLE operations ADD COLUMN provider_reference TEXT;
ALTER TABLE operations ADD COLUMN requeues INTEGER NOT NULL DEFAULT 0;

CREATE INDEX operations_dead_letters ON operations (tenant_id, dead_letter, updated_at);
-- "Absent" from a read-back is trusted only at or after this time (ms).
ALTER TABLE operations ADD COLUMN settle_until INTEGER;
