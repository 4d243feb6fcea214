-- alert_claim.lua — take the alerts due for delivery, so that one replica delivers each at a
-- time (issue 42 item 5).
--
-- Alerts due now are moved forward to `until`: no other replica's delivery loop sees them before
-- then. The taker settles each (delivered: removed; failed: due again after its backoff) within
-- that time; a replica that dies holding some leaves them due again at `until` (delivered once
-- more, same idempotency id, if it had delivered before dying).
--
-- KEYS[1] the due set {alerts}:due (zset: alert id -> next attempt, ms)
-- ARGV[1] now_ms   ARGV[2] until_ms   ARGV[3] the most to take
-- returns the ids taken

local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[2], id)
end
return ids
