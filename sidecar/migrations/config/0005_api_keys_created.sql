-- Tollgate configuration schema, version 5 (decision 209): every sidecar re-copies the keys
-- created in the last minutes into Redis at each resync (a key Redis acknowledged and then lost
-- in a failover works again without a restart), as version 4 serves the revocations; this
-- serves that look-up without a scan. An older sidecar ignores the index.
CREATE INDEX IF NOT EXISTS api_keys_created_at ON api_keys (created_at);
