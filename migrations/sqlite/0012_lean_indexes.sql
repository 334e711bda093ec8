-- Indexes that every write of an operation kept up for queries that read
-- only a few rows, or none.
--
-- No query reads operations by `expires_at` (key retention counts from
-- `updated_at + retention_ms`).
DROP INDEX operations_by_expiry;

-- Dead letters are a handful of rows: the index holds only them, so a
-- write of any other operation leaves it alone (it was rewritten on every
-- change of `updated_at`).
DROP INDEX operations_dead_letters;
CREATE INDEX operations_dead_letters ON operations (tenant_id, updated_at) WHERE dead_letter;

-- A provider reference arrives with the outcome, if at all: a
-- reservation has none to index.
DROP INDEX operations_by_reference;
CREATE INDEX operations_by_reference ON operations (tenant_id, provider_reference)
    WHERE provider_reference IS NOT NULL;

-- Decisions of a call that policies refused before it was reserved (or of
-- a refused compensation) have no operation; the sweeper deletes them
-- after the shortest key retention. Marked, and indexed by time, so that
-- its pass reads those rows only, not every decision kept. The gateway
-- sets the mark on every row it writes; the default marks those that a
-- gateway of an earlier version, still running beside this one on a shared
-- ledger, writes (the sweep keeps any row whose operation exists).
ALTER TABLE policy_decisions ADD COLUMN unreserved INTEGER NOT NULL DEFAULT 1;
UPDATE policy_decisions SET unreserved = 0 WHERE EXISTS (
    SELECT 1 FROM operations o
    WHERE o.tenant_id = policy_decisions.tenant_id AND o.operation_id = policy_decisions.operation_id);
CREATE INDEX policy_decisions_unreserved ON policy_decisions (at) WHERE unreserved;
