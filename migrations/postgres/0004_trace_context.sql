-- W3C Trace Context of the request that created an operation: attempts and
-- read-backs made later link their spans to it. Never forwarded as a
-- header (each attempt sends a fresh traceparent of its own).
ALTER TABLE operations ADD COLUMN trace_context TEXT;
-- The x-request-id of the caller's request an attempt was made for (none
-- for attempts of the reconciler).
ALTER TABLE attempts ADD COLUMN request_id TEXT;
