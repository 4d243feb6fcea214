-- Tollgate configuration schema, version 2 (decision 174): a plan is not deleted while active
-- keys name it, counted by plan on each such delete.
CREATE INDEX IF NOT EXISTS api_keys_plan ON api_keys (plan_id);
