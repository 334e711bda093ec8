-- The partial index of terminal rows, with its condition spelled as
-- comparisons joined by OR instead of `state IN (...)`. SQLite checks a
-- partial index's condition on every insert and update of a row, and it
-- evaluates an IN list of more than two values through a temporary b-tree
-- built for that check: three of them for every effectful call (its
-- reservation and each change of its state). The rows the index holds are
-- the same.
DROP INDEX operations_terminal_by_change;
CREATE INDEX operations_terminal_by_change ON operations (updated_at)
    WHERE (state = 'COMPLETED' OR state = 'FAILED' OR state = 'COMPENSATED') AND NOT dead_letter;
