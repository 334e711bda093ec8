-- The reconciler instance that picked an operation in its current scan,
-- and until when (ms since epoch): two scans never hand out the same row.
ALTER TABLE operations ADD COLUMN scan_owner TEXT;
ALTER TABLE operations ADD COLUMN scan_expires_at INTEGER;
CREATE INDEX operations_terminal_by_change ON operations (updated_at)
    WHERE state IN ('COMPLETED', 'FAILED', 'COMPENSATED') AND dead_letter = 0;
