-- Webhook events whose delivery gave up (attempts or age past the budget):
-- kept, out of the relay's way, for operators to see and resend.
ALTER TABLE outbox ADD COLUMN dead_lettered_at INTEGER;
CREATE INDEX outbox_dead_letters ON outbox (tenant_id, dead_lettered_at);
