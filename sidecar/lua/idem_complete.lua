-- idem_complete.lua — settle an idempotency claim once its request is over (issue 7, seed 002).
--
-- Only the request that claimed the key may settle it: the memo must still hold its in-flight
-- marker ('inflight:' .. token). A late report after the marker expired (and maybe another request
-- claimed the key since) changes nothing. Both keys share the tenant's hash tag (Cluster).
--
-- KEYS[1] idem:key:{tenant}:{keyId}:{idemKey}          (owner: the digest holding the key)
-- KEYS[2] idem:api:{tenant}:{keyId}:{digest}:{idemKey} (memo)
-- ARGV[1] claim token      ARGV[2] digest      ARGV[3] 'store' | 'release'
-- ARGV[4] store: the response JSON             ARGV[5] store: TTL ms of memo and owner (24 h)
-- returns 1 settled (stored / released), 0 the claim is no longer this request's (nothing changed)

local memo = redis.call('GET', KEYS[2])
if memo ~= 'inflight:' .. ARGV[1] then
  return 0
end
local owner = redis.call('GET', KEYS[1])
if ARGV[3] == 'store' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
  if not owner or owner == ARGV[2] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[5])
  end
else
  -- not memoized (IETF draft: a failed request may be retried, with any body)
  redis.call('DEL', KEYS[2])
  if owner == ARGV[2] then
    redis.call('DEL', KEYS[1])
  end
end
return 1
