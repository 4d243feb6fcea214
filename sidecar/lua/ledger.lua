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
-- same, fewer stores.

local SWEEP = 256

-- Takes out the members whose time is at or before now (ms); returns the bytes still counted.
local function ledger_sweep(live, total, now)
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
    redis.call('PEXPIRE', total, ttl)
  end
end
