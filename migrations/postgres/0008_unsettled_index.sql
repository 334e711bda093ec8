-- The reconciler's scan (every reconcile.interval_ms, on each instance)
-- wants the operations still in flight: RESERVED, EXECUTING and UNKNOWN.
-- Through operations_by_state it was a bitmap scan, and every completed
-- operation leaves the index entry of its EXECUTING version there until a
-- vacuum removes it: after 43,842 calls, before autovacuum's first pass,
-- one scan read 43,842 entries and visited 6,446 heap pages to find no
-- row (12 ms), and with autovacuum's default threshold a ledger of N
-- operations may carry about N / 5 such entries. This index holds those
-- three states alone, in the order the scan wants, so the scan is a plain
-- index scan that stops at its limit and marks the dead entries it passes:
-- the next scan skips them without visiting the table. The scan names the
-- states in its text (store/reads.rs, due_scan) for the planner to prove
-- that this index holds every row it wants.
CREATE INDEX operations_unsettled ON operations (updated_at)
    WHERE state IN ('RESERVED', 'EXECUTING', 'UNKNOWN');
