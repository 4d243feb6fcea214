-- Tollgate configuration schema, version 6 (issue 43 item 1; decisions 333-336): a key's label,
-- its scopes (routes, products, methods, client networks: the admin API's JSON object; NULL
-- restricts nothing) and when a decision last authenticated it (unix seconds, to the minute,
-- written in batches off the request path). An older sidecar reads none of them: it would not
-- enforce a scope: upgrade every sidecar before scoping keys (decision 333).
ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS label text;
ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS scopes jsonb;
ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS last_used_at bigint;
