-- Tollgate configuration schema, version 3 (decision 184): key listings are paged in key-id byte
-- order (`key_id COLLATE "C"`), which the primary key's index serves only when the database's
-- collation is C; these serve it under any collation, for all keys and for a tenant's.
CREATE INDEX IF NOT EXISTS api_keys_id_c ON api_keys (key_id COLLATE "C");
CREATE INDEX IF NOT EXISTS api_keys_tenant_id_c ON api_keys (tenant_id, key_id COLLATE "C");
