-- idem_complete.lua — settle an idempotency claim once its request is over (issue 7, seed 002).
-- Run with ledger.lua before it (decision 185).
--
-- Only the request that claimed the key may settle it: the memo must still hold its in-flight
-- marker ('inflight:' .. token). A late report after the marker expired (and maybe another request
-- claimed the key since) changes nothing. Every key shares the tenant's hash tag (Cluster).
--
-- KEYS[1] idem:key:{tenant}:{keyId}:{idemKey}          (owner: the digest holding the key)
-- KEYS[2] idem:api:{tenant}:{keyId}:{digest}:{idemKey} (memo)
-- KEYS[3] responses:live:{tenant}   KEYS[4] responses:bytes:{tenant}  (the tenant's ledger)
-- ARGV[1] claim token      ARGV[2] digest      ARGV[3] 'store' | 'release'
-- ARGV[4] store: the response JSON             ARGV[5] store: TTL ms of memo and owner (24 h)
-- ARGV[6] store: the response without its body ('' when it has none to drop)
-- ARGV[7] now ms           ARGV[8] the tenant's bound: bytes of stored responses it may hold
-- returns 1 settled (stored whole / released), 2 stored without its body (the whole response
--         would pass the tenant's bound: the outcome is kept all the same, so a retry replays
--         it and never runs the operation again — counted, past the bound), 0 the claim is no
--         longer this request's (nothing changed)

local memo = redis.call('GET', KEYS[2])
if memo ~= 'inflight:' .. ARGV[1] then
  return 0
end
local owner = redis.call('GET', KEYS[1])
if ARGV[3] == 'store' then
  local ttl, now, bound = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[8])
  local json, done = ARGV[4], 1
  if ledger_sweep(KEYS[3], KEYS[4], now) + ledger_cost(KEYS[2], json) > bound and ARGV[6] ~= '' then
    json, done = ARGV[6], 2
  end
  redis.call('SET', KEYS[2], json, 'PX', ttl)
  ledger_add(KEYS[3], KEYS[4], KEYS[2], ledger_cost(KEYS[2], json), now, ttl)
  if not owner or owner == ARGV[2] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
  end
  return done
else
  -- not memoized (IETF draft: a failed request may be retried, with any body)
  redis.call('DEL', KEYS[2])
  if owner == ARGV[2] then
    redis.call('DEL', KEYS[1])
  end
end
return 1
