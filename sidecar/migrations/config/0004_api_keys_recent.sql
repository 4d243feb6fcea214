-- Tollgate configuration schema, version 4 (decision 197): every sidecar re-copies the keys
-- revoked in the last minutes into Redis at each resync (a revocation Redis acknowledged and
-- then lost in a failover is restored); this serves that look-up without a scan.
CREATE INDEX IF NOT EXISTS api_keys_revoked_at ON api_keys (revoked_at) WHERE revoked_at IS NOT NULL;
