-- store_response.lua — store one cached response where none is, within its tenant's bound of
-- stored bytes (issue 7, seed 000; decision 185). Run with ledger.lua before it.
--
-- KEYS[1] cache:exact:{tenant}:… (the entry)
-- KEYS[2] responses:live:{tenant}     KEYS[3] responses:bytes:{tenant} (the tenant's ledger)
-- ARGV[1] the response JSON   ARGV[2] its TTL ms (the route's cache_ttl)   ARGV[3] now ms
-- ARGV[4] the tenant's bound for cache fills: bytes of stored responses it may hold at once
--         when this one is counted (three quarters of its whole bound: the rest is kept for its
--         idempotency outcomes)
-- returns 1 stored; 0 an entry is there (nothing changed: never over an entry, decision 89);
--         -1 the tenant's bound would be passed (nothing stored: a later miss)

local now, ttl, bound = tonumber(ARGV[3]), tonumber(ARGV[2]), tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local bytes = ledger_cost(KEYS[1], ARGV[1])
if ledger_sweep(KEYS[2], KEYS[3], now) + bytes > bound then
  return -1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
ledger_add(KEYS[2], KEYS[3], KEYS[1], bytes, now, ttl)
return 1
