-- touch_key.lua — record when an API key was last used (issue 43 item 1; decision 336).
--
-- Called off the request path by the sidecar's last-use flusher, once per key per flush (at most
-- once a minute per key and replica), never per request. Writes only an existing record (a
-- record deleted meanwhile — a creation undone — is not brought back as a partial hash) and
-- never moves the time back (replicas flush in any order).
--
-- KEYS[1] apikey:{sha256}
-- ARGV[1] unix seconds (to the minute)
-- returns 1 written | 0 left (no record, or a later time already there)

if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local held = tonumber(redis.call('HGET', KEYS[1], 'last_used_at') or '')
local at = tonumber(ARGV[1])
if held ~= nil and held >= at then return 0 end
redis.call('HSET', KEYS[1], 'last_used_at', ARGV[1])
return 1
