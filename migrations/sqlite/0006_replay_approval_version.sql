-- A replay approval authorises the replay of the operation as it was when
-- the operator asked: if the operation changed since, approving it runs nothing.
ALTER TABLE approvals ADD COLUMN operation_version INTEGER;
