-- decide.lua — check every limit of one request, then take from all of them only if all pass.
--
-- Atomic: Redis runs the script alone, so check-then-take is never raced, and a denied request
-- consumes nothing (no limit is touched unless every non-shadow limit passes). Every key this
-- script writes gets its TTL in the same call (never a key without expiry).
-- All KEYS share the tenant's hash tag ({tenant}), so the script runs unchanged on Redis Cluster.
--
-- KEYS: the limits' keys, in order. Per kind: fixed 1 (counter), sliding 2 (current, previous
--       bucket), bucket 1 (hash tokens/ts), log 1 (zset), budget 2 (month counter, reservation),
--       conc 1 (zset of in-flight request ids scored by the ms each slot frees itself).
-- ARGV[1] now_ms (the sidecar's clock, so tests can drive time)
-- ARGV[2] request id (log/conc member, reservation value owner)
-- ARGV[3] n, the number of limits
-- then 6 ARGV per limit i (base = 4 + (i-1)*6):
--   kind      fixed | sliding | bucket | log | budget | conc
--   limit     max per window / bucket capacity / monthly budget / max in flight
--   window_ms window / bucket refill time from empty / reservation TTL / slot timeout
--   cost      units this request takes (budget: the estimate; a money budget's counter, q:spend:…,
--             is the same kind in micro-units: its reservation is the request's most cost)
--   shadow    1 = count would-deny, never block
--   aux_ms    kind-specific: budget → counter TTL and ms to the period's end (encoded "ttl:reset")
-- then, optional (leased limits; absent = no lease; present, as 0 0 2, whenever a lookup follows):
--   ARGV[4 + 6n] lease_want: lease units asked (0 = none)
--   ARGV[5 + 6n] renewal: 1 = no request is admitted by this call (its own cost is 0)
--   ARGV[6 + 6n] share: a lease takes at most 1/share of what each limit has left after the request
-- returns {allowed (1|0), denied_index (0 if none), then per limit: remaining, reset_ms, would_deny,
--          then granted}
--   remaining: units left after this request and its lease (or now, when denied); reset_ms: ms
--   until the limit frees up (for a denial: the Retry-After); granted: lease units taken from
--   every limit beyond the request's own cost (0 unless every limit is fixed or bucket and the
--   request is allowed). A renewal that is granted nothing writes nothing.
-- then, optionally, one response lookup (issue 7), at a = 7 + n*6; its KEYS follow the limits':
--   ARGV[a]   'cache' → KEYS: cache:exact:… (GET, only when the limits allow)
--             'idem'  → KEYS: idem:key:… (owner: the digest holding the idempotency key),
--                       idem:api:… (memo: in-flight marker or stored response),
--                       responses:live:{tenant}, responses:bytes:{tenant} (the tenant's ledger
--                       of stored bytes, ledger.lua: loaded before this script)
--   ARGV[a+1] idem: the request's digest      ARGV[a+2] idem: the claim token
--   ARGV[a+3] idem: in-flight TTL ms           ARGV[a+4] idem: owner TTL ms (24 h)
--   ARGV[a+5] idem: the tenant's bound of stored bytes: a new claim is refused while its ledger
--             holds that much (decision 185; the outcome could not be stored whole)
--   With a lookup and the limits passing, two more after granted: outcome, value —
--     'hit' <json> | 'miss' ''            (cache; limits taken either way)
--     'replay' <json> | 'claimed' ''      (idem; limits taken; claimed = owner + in-flight marker set)
--     'in_flight' '' | 'conflict' ''      (idem; nothing taken or written: 409 / 422)
--     'full' <ms>                         (idem; nothing taken or claimed: the tenant's stored
--                                          responses are at its bound, room in <ms> at the soonest)
--   ARGV[a] may also be 'none': no lookup, only a placeholder for what follows.
-- then, optionally, the decision record (issue 15.2): its key, dec:{tenant}:<decisionId>, is the
--   last of KEYS; ARGV[r] its TTL ms, r = a + 6 after an 'idem' lookup, else a + 1. An allowed
--   decision that took anything (or claimed an idempotency key) writes there, in this call, what
--   it took — one line per limit, so refund.lua can give it back if the filter abandons it:
--     v1 <now_ms>                                  (first line: when it was taken)
--     fixed <key> <units>       sliding <key> <units>      log <key> <members rid:1..n>
--     bucket <key> <units> <capacity> <refill_ms> <tokens left after the take>
--     budget <counter> <reservation> <tokens>      conc <key>
--     idem <owner> <memo> <claim token> <digest>
--   Units include a lease granted in the call. Keys never contain spaces or newlines.
--   Idempotent per call: a call that finds its record already there, taken at its own now_ms
--   (the same call sent again, as a Redis Cluster client does after a connection error; a reused
--   decision id at another time is a new decision), takes and writes nothing, and
--   answers allowed: remaining as left now, granted as recorded, its own idempotency claim
--   'claimed' (a cache lookup reads again), would_deny 0 (decision 164).

local now = tonumber(ARGV[1])
-- The longest a lease lives (ms): crate::decision::limits::LEASE_MAX_TTL_MS.
local LEASE_EPOCH = 500
local rid = ARGV[2]
local n = tonumber(ARGV[3])

local nkeys = { fixed = 1, sliding = 2, bucket = 1, log = 1, budget = 2, conc = 1 }
local lease_want = tonumber(ARGV[4 + 6 * n] or '0')
local renewal = ARGV[5 + 6 * n] == '1'
local share = tonumber(ARGV[6 + 6 * n] or '2')
if share < 1 then share = 1 end

local specs = {}
local k = 1
for i = 1, n do
  local b = 4 + (i - 1) * 6
  local s = {
    kind = ARGV[b], limit = tonumber(ARGV[b + 1]), window = tonumber(ARGV[b + 2]),
    cost = tonumber(ARGV[b + 3]), shadow = ARGV[b + 4] == '1', aux = ARGV[b + 5], k = k,
  }
  -- unit: what one leased request takes; cost: what this call's own request takes
  s.unit = s.cost
  if renewal then s.cost = 0 end
  s.take = s.cost
  k = k + nkeys[s.kind]
  specs[i] = s
end

-- Phase 1: read state and check (writes here only prune entries that already expired).
local function check(s)
  local key = KEYS[s.k]
  if s.kind == 'fixed' then
    local used = tonumber(redis.call('GET', key) or '0')
    local reset = s.window - (now % s.window)
    s.apply = function()
      redis.call('INCRBY', key, s.take)
      redis.call('PEXPIRE', key, 2 * s.window)
    end
    s.room = s.limit - used
    return used + s.cost <= s.limit, s.limit - used, reset
  elseif s.kind == 'sliding' then
    local cur = tonumber(redis.call('GET', key) or '0')
    local prev = tonumber(redis.call('GET', KEYS[s.k + 1]) or '0')
    local elapsed = now % s.window
    local est = prev * (s.window - elapsed) / s.window + cur
    local reset = s.window - elapsed
    local ok = est + s.cost <= s.limit
    if not ok and prev > 0 and s.limit - cur - s.cost >= 0 then
      -- the previous bucket's weight falls linearly: wait until it has fallen enough
      local t = math.ceil(s.window * (1 - (s.limit - cur - s.cost) / prev) - elapsed)
      if t > 0 and t < reset then reset = t end
    end
    s.apply = function()
      redis.call('INCRBY', key, s.cost)
      redis.call('PEXPIRE', key, 2 * s.window)
    end
    return ok, math.floor(s.limit - est), reset
  elseif s.kind == 'bucket' then
    local h = redis.call('HMGET', key, 'tokens', 'ts', 'le', 'lc', 'lp')
    local rate = s.limit / s.window -- tokens per ms
    -- Units leased from the bucket and maybe not spent yet (decision 187): a lease lives at most
    -- LEASE_EPOCH ms, so those of this epoch (lc) and the one before (lp) may be alive. While
    -- they are, the bucket refills to its capacity less them: a lease keeps no refill a full
    -- bucket would have dropped, so lease + bucket never pass the capacity.
    local epoch = math.floor(now / LEASE_EPOCH)
    local le = tonumber(h[3] or '-2')
    local lc, lp = 0, 0
    if le == epoch then
      lc, lp = tonumber(h[4] or '0'), tonumber(h[5] or '0')
    elseif le == epoch - 1 then
      lp = tonumber(h[4] or '0')
    end
    local cap = math.max(0, s.limit - lc - lp)
    local tokens = cap
    -- The stamp never goes back: a sidecar whose clock is behind another's refills nothing until
    -- its clock passes the stamp, and so never makes the one ahead refill the same span again
    -- (alternating sidecars would otherwise add the skew's refill at every turn; decision 158).
    local stamp = now
    if h[1] then
      local last = tonumber(h[2])
      tokens = math.min(cap, tonumber(h[1]) + math.max(0, now - last) * rate)
      if last > now then stamp = last end
    end
    local ok = tokens >= s.cost
    local reset
    if ok then reset = math.ceil((s.limit - tokens + s.cost) / rate) else reset = math.ceil((s.cost - tokens) / rate) end
    s.room = tokens
    s.apply = function()
      s.after = tokens - s.take
      local leased = s.take - s.cost
      if leased > 0 then
        redis.call('HSET', key, 'tokens', tostring(tokens - s.take), 'ts', stamp, 'le', string.format('%d', epoch), 'lc', string.format('%.17g', lc + leased), 'lp', string.format('%.17g', lp))
      else
        redis.call('HSET', key, 'tokens', tostring(tokens - s.take), 'ts', stamp)
      end
      redis.call('PEXPIRE', key, 2 * s.window)
    end
    return ok, math.floor(tokens), reset
  elseif s.kind == 'log' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - s.window)
    local count = redis.call('ZCARD', key)
    local reset = s.window
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if oldest[2] then reset = tonumber(oldest[2]) + s.window - now end
    s.apply = function()
      for j = 1, s.cost do
        redis.call('ZADD', key, now, rid .. ':' .. j)
      end
      redis.call('PEXPIRE', key, s.window)
    end
    return count + s.cost <= s.limit, s.limit - count, reset
  elseif s.kind == 'budget' then
    local used = tonumber(redis.call('GET', key) or '0')
    local sep = string.find(s.aux, ':', 1, true)
    local ttl = tonumber(string.sub(s.aux, 1, sep - 1))
    local reset = tonumber(string.sub(s.aux, sep + 1))
    s.apply = function()
      redis.call('INCRBY', key, s.cost)
      redis.call('PEXPIRE', key, ttl)
      -- the reservation, with its TTL on this (and every) write
      redis.call('SET', KEYS[s.k + 1], s.cost, 'PX', s.window)
    end
    return used + s.cost <= s.limit, s.limit - used, reset
  elseif s.kind == 'conc' then
    -- crash-safe: slots of requests that never completed free themselves after the timeout.
    -- A slot is scored by that moment (its start + this limit's window), so limits of one name
    -- with two windows (two plans, a route's override) share the set without either freeing
    -- the other's slots early; the set lives as long as its longest slot (decision 180).
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    local count = redis.call('ZCARD', key)
    s.apply = function()
      redis.call('ZADD', key, now + s.window, rid)
      if redis.call('PTTL', key) < s.window then redis.call('PEXPIRE', key, s.window) end
    end
    return count + 1 <= s.limit, s.limit - count, 1000
  end
  return redis.error_reply('unknown limit kind ' .. tostring(s.kind))
end

local a = 7 + n * 6
local lookup = ARGV[a]
local outcome, value = nil, ''
local record_ttl = tonumber(ARGV[a + ((lookup == 'idem') and 6 or 1)] or '0')

-- The same call again (decision 164): its record exists and was taken at this call's own clock
-- reading (its first line, 'v1 <now_ms>'; a decision id reused at another time is a new
-- decision). A Redis Cluster client sends a script again after a connection error, and the first
-- run may have taken before the connection dropped. Take nothing again: answer allowed with what
-- is left now (the first run's take included), the lease the record shows, and the lookup as the
-- first run left it (its own idempotency claim is 'claimed' again, not in flight).
local function num(x) return string.format('%.17g', x) end
local taken = nil -- the record, when this call is the same call again
if record_ttl > 0 then
  local rec = redis.call('GET', KEYS[#KEYS])
  local first = 'v1 ' .. num(now) .. '\n'
  if rec and string.sub(rec, 1, #first) == first then taken = rec end
end
local again = taken ~= nil

local out = { 1, 0 }
local denied = 0
for i = 1, n do
  local s = specs[i]
  if again then s.cost, s.take = 0, 0 end
  local ok, remaining, reset = check(s)
  s.ok, s.remaining, s.reset = ok or again, remaining, reset
  if not s.ok and not s.shadow and denied == 0 then denied = i end
end

-- The response lookup (issue 7). An idempotency key held by another operation, or still in
-- flight, answers without taking from any limit (the request does no work).
if denied == 0 and lookup == 'idem' then
  local owner_key, memo_key = KEYS[k], KEYS[k + 1]
  local digest = ARGV[a + 1]
  local owner = redis.call('GET', owner_key)
  if owner and owner ~= digest then
    outcome = 'conflict'
  else
    local memo = redis.call('GET', memo_key)
    if again and memo == 'inflight:' .. ARGV[a + 2] then
      outcome = 'claimed'
    elseif memo and string.sub(memo, 1, 9) == 'inflight:' then
      outcome = 'in_flight'
    elseif memo then
      outcome, value = 'replay', memo
    elseif ledger_sweep(KEYS[k + 2], KEYS[k + 3], now) >= tonumber(ARGV[a + 5]) then
      -- the tenant's stored responses are at its bound: its outcome could not be kept whole
      local first = redis.call('ZRANGE', KEYS[k + 2], 0, 0, 'WITHSCORES')
      outcome, value = 'full', string.format('%.0f', math.max(0, tonumber(first[2] or now) - now))
    else
      outcome = 'claimed'
      redis.call('SET', owner_key, digest, 'PX', ARGV[a + 4])
      redis.call('SET', memo_key, 'inflight:' .. ARGV[a + 2], 'PX', ARGV[a + 3])
    end
  end
  if outcome == 'conflict' or outcome == 'in_flight' or outcome == 'full' then
    for i = 1, n do
      local s = specs[i]
      out[#out + 1] = math.max(0, math.floor(s.remaining))
      out[#out + 1] = math.max(0, math.ceil(s.reset))
      out[#out + 1] = s.ok and 0 or 1
    end
    out[#out + 1] = 0 -- granted: no lease
    out[#out + 1] = outcome
    out[#out + 1] = value
    return out
  end
elseif denied == 0 and lookup == 'cache' then
  local hit = redis.call('GET', KEYS[k])
  if hit then outcome, value = 'hit', hit else outcome = 'miss' end
end

-- The lease: the largest grant every limit can give (at most 1/share of what it has left after
-- this request), only for fixed windows and buckets, only when the request is allowed.
local granted = 0
if again then
  -- the lease the first run took: its units on a fixed or bucket line, less the request's own
  for i = 1, n do
    local s = specs[i]
    local units = string.match(taken, '\n' .. s.kind .. ' ' .. string.gsub(KEYS[s.k], '%p', '%%%0') .. ' (%S+)')
    if units and (s.kind == 'fixed' or s.kind == 'bucket') and s.unit > 0 then
      granted = math.max(0, math.floor((tonumber(units) - s.unit) / s.unit))
      break
    end
  end
elseif denied == 0 and lease_want > 0 then
  granted = lease_want
  for i = 1, n do
    local s = specs[i]
    if (s.kind ~= 'fixed' and s.kind ~= 'bucket') or s.shadow then
      granted = 0
    else
      local can = math.floor((s.room - s.cost) / s.unit / share)
      if can < granted then granted = can end
    end
  end
  if granted < 0 then granted = 0 end
end

-- What one limit took, as a line of the decision record (see the contract).
local function took(s)
  local key = KEYS[s.k]
  if s.kind == 'fixed' then return 'fixed ' .. key .. ' ' .. num(s.take)
  elseif s.kind == 'sliding' then return 'sliding ' .. key .. ' ' .. num(s.cost)
  elseif s.kind == 'bucket' then
    return 'bucket ' .. key .. ' ' .. num(s.take) .. ' ' .. num(s.limit) .. ' ' .. num(s.window) .. ' ' .. num(s.after)
  elseif s.kind == 'log' then return 'log ' .. key .. ' ' .. num(s.cost)
  elseif s.kind == 'budget' then return 'budget ' .. key .. ' ' .. KEYS[s.k + 1] .. ' ' .. num(s.cost)
  elseif s.kind == 'conc' then return 'conc ' .. key
  end
end

-- Phase 2: take from every limit, only when nothing (non-shadow) denied.
if denied == 0 and not again and not (renewal and granted == 0) then
  local rec = { 'v1 ' .. num(now) }
  for i = 1, n do
    local s = specs[i]
    s.take = s.cost + granted * s.unit
    s.apply()
    s.remaining = s.remaining - s.take
    if s.take > 0 then rec[#rec + 1] = took(s) end
  end
  if outcome == 'claimed' then
    rec[#rec + 1] = 'idem ' .. KEYS[k] .. ' ' .. KEYS[k + 1] .. ' ' .. ARGV[a + 2] .. ' ' .. ARGV[a + 1]
  end
  if record_ttl > 0 and #rec > 1 then
    redis.call('SET', KEYS[#KEYS], table.concat(rec, '\n'), 'PX', record_ttl)
  end
elseif denied ~= 0 then
  out[1] = 0
  out[2] = denied
end
for i = 1, n do
  local s = specs[i]
  local r = s.remaining
  if r < 0 then r = 0 end
  out[#out + 1] = math.floor(r)
  out[#out + 1] = math.max(0, math.ceil(s.reset))
  out[#out + 1] = s.ok and 0 or 1
end
out[#out + 1] = granted
if outcome then
  out[#out + 1] = outcome
  out[#out + 1] = value
end
return out
