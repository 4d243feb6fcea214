-- ledger.lua — a tenant's bytes of stored responses (decision 185). Not a script of its own: the
-- prelude of store_response.lua and idem_complete.lua, put before each when it is loaded (one
-- script each, so a store and its accounting are one atomic step).
--
-- A tenant's ledger is two keys with its hash tag (same Cluster slot as its responses):
--   responses:live:{tenant}   zset: one member per stored response, '<bytes>:<its key>',
--                             scored by the time (ms) its TTL ends
--   responses:bytes:{tenant}  string: the sum of the members' bytes
-- Both live as long as the longest entry they count. A member whose time has passed is taken out
-- (its bytes given back) by the next store of the tenant, at most SWEEP per call: the work of a
-- call is bounded, and a backlog leaves the sum too high for a while — fewer stores, never more.
-- An entry gone before its time (deleted by hand, evicted) stays counted until its time: the
-- same, fewer stores. The zset lost (evicted, deleted) while the sum stays: the sum is dropped
-- with it (else it would never be given back); the sum lost while the zset stays: counted anew
-- from the next store, with the zset's TTL (the older entries uncounted until they expire).
-- A response costs its JSON, its key three times (the key, the member in the zset's two
-- indexes) and OVERHEAD for Redis' own structures: what it takes of Redis, roughly, not only
-- what the client sent.

local SWEEP = 256
local OVERHEAD = 128

-- The bytes a stored response of `json` at `key` is counted for.
local function ledger_cost(key, json)
  return #json + 3 * #key + OVERHEAD
end

-- Takes out the members whose time is at or before now (ms); returns the bytes still counted.
local function ledger_sweep(live, total, now)
  if redis.call('EXISTS', live) == 0 then
    redis.call('DEL', total)
    return 0
  end
  local gone = redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, SWEEP)
  if #gone == 0 then
    return tonumber(redis.call('GET', total) or '0')
  end
  local freed = 0
  for _, m in ipairs(gone) do
    freed = freed + (tonumber(string.match(m, '^(%d+):')) or 0)
  end
  redis.call('ZREM', live, unpack(gone))
  local left = redis.call('DECRBY', total, freed)
  if left < 0 then
    -- the sum was lost while its members stayed (never written so by these scripts)
    redis.call('SET', total, 0, 'KEEPTTL')
    left = 0
  end
  return left
end

-- Counts one stored response of `bytes` at `key`, whose TTL (ms) ends at now + ttl.
local function ledger_add(live, total, key, bytes, now, ttl)
  local added = redis.call('ZADD', live, string.format('%.0f', now + ttl), bytes .. ':' .. key)
  if added == 1 then
    redis.call('INCRBY', total, bytes)
  end
  if redis.call('PTTL', live) < ttl then
    redis.call('PEXPIRE', live, ttl)
  end
  -- the sum lives as its zset does (a sum made anew by INCRBY has no TTL of its own)
  redis.call('PEXPIRE', total, redis.call('PTTL', live))
end
