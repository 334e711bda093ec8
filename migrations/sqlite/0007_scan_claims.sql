-- The reconciler instance that picked an operation in its current scan
-- (or the retention sweeper's batch mark), and until when (ms since
-- epoch): two scans never hand out the same row.
ALTER TABLE operations ADD COLUMN scan_owner TEXT;
ALTER TABLE operations ADD COLUMN scan_expires_at INTEGER;
CREATE INDEX operations_by_scan_owner ON operations (scan_owner) WHERE scan_owner IS NOT NULL;
CREATE INDEX operations_terminal_by_change ON operations (updated_at)
    WHERE state IN ('COMPLETED', 'FAILED', 'COMPENSATED') AND NOT dead_letter;
