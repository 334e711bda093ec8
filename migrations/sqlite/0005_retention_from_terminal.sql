-- Key retention counts from the moment an operation became terminal, not
-- from its creation: an operation that sat UNKNOWN for days keeps its key
-- for the full window after it resolved.
ALTER TABLE operations ADD COLUMN retention_ms INTEGER NOT NULL DEFAULT 86400000;
UPDATE operations SET retention_ms = expires_at - created_at;
