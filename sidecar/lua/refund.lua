-- refund.lua — give back everything one abandoned decision took (issue 15.2).
--
-- decide.lua records, in the call that takes, what an allowed decision took (its contract lists
-- the lines) in dec:{tenant}:<decisionId>. When the filter gave up on that decision's answer (the
-- client never saw it admitted), the sidecar reads the record, and runs this script with it and
-- the keys it names: each line is given back, then the record is deleted. Hence:
-- - idempotent: a refund delivered twice finds no record the second time and does nothing;
-- - a refund of a denied or unknown decision (no record was written) does nothing;
-- - after a completion of the same decision (a budget reservation of it already 'settled'), the
--   request was served: nothing is given back, the record is deleted (and complete.lua deletes the
--   record itself, so a refund after any completion finds nothing).
-- What is given back, per line:
--   fixed, sliding: the units, from the counter they were added to, if it still exists (its key
--     names its window, so a window that rolled is not touched), never below 0;
--   bucket: the units, capped at capacity, and no more than the refill since the take could not
--     have absorbed (tokens a full bucket would have dropped are not made up): never over-admits;
--   log: the members rid:1..n;   conc: the slot (member rid);
--   budget: the reservation's tokens from the month counter, and the reservation, unless settled;
--   idem: the claim (memo and owner), only while the memo is still this claim's in-flight marker.
-- All keys share the tenant's hash tag (one Cluster slot).
--
-- KEYS[1] the record; KEYS[2..] the keys its lines name, in the record's order
-- ARGV[1] the record as the sidecar read it    ARGV[2] now_ms (the sidecar's clock)
-- ARGV[3] the decision id (the log members' prefix, the concurrency slot's member)
-- returns {outcome, lines given back}: outcome 1 refunded | 0 no record (already refunded,
--   expired, never written, or not the one read) | 2 completed (nothing given back)

local rec = redis.call('GET', KEYS[1])
if not rec or rec ~= ARGV[1] then
  return { 0, 0 }
end
local now = tonumber(ARGV[2])
local rid = ARGV[3]

local lines, taken_at = {}, now
local k = 2
local width = { fixed = 1, sliding = 1, bucket = 1, log = 1, conc = 1, budget = 2, idem = 2 }
for line in string.gmatch(rec, '[^\n]+') do
  local f = {}
  for w in string.gmatch(line, '%S+') do f[#f + 1] = w end
  if f[1] == 'v1' then
    taken_at = tonumber(f[2])
  else
    local n = width[f[1]]
    if not n then return redis.error_reply('refund.lua: unknown record line ' .. tostring(f[1])) end
    for j = 1, n do
      if KEYS[k + j - 1] ~= f[1 + j] then return redis.error_reply('refund.lua: KEYS do not follow the record') end
    end
    f.k = k
    k = k + n
    lines[#lines + 1] = f
  end
end

-- A settled reservation means the request completed: it was served, nothing is given back.
for _, f in ipairs(lines) do
  if f[1] == 'budget' and redis.call('GET', KEYS[f.k + 1]) == 'settled' then
    redis.call('DEL', KEYS[1])
    return { 2, 0 }
  end
end

local function give_counter(key, units)
  if redis.call('EXISTS', key) == 1 then
    local left = redis.call('DECRBY', key, units)
    if left < 0 then redis.call('INCRBY', key, -left) end
  end
end

for _, f in ipairs(lines) do
  local key = KEYS[f.k]
  local kind = f[1]
  if kind == 'fixed' or kind == 'sliding' then
    give_counter(key, tonumber(f[3]))
  elseif kind == 'bucket' then
    local units, cap, refill, after = tonumber(f[3]), tonumber(f[4]), tonumber(f[5]), tonumber(f[6])
    local h = redis.call('HMGET', key, 'tokens', 'ts')
    if h[1] then
      -- Without the take the bucket would hold `units` more, until a refill to capacity cut the
      -- difference: the bucket has been at most after + refill since the take (less whatever
      -- was taken since), so at least this much of the difference is left.
      local room = cap - (after + math.max(0, now - taken_at) * cap / refill)
      local back = math.max(0, math.min(units, room))
      if back > 0 then
        redis.call('HSET', key, 'tokens', tostring(math.min(cap, tonumber(h[1]) + back)))
      end
    end
  elseif kind == 'log' then
    for j = 1, tonumber(f[3]) do
      redis.call('ZREM', key, rid .. ':' .. j)
    end
  elseif kind == 'conc' then
    redis.call('ZREM', key, rid)
  elseif kind == 'budget' then
    local reserved = redis.call('GET', KEYS[f.k + 1])
    if reserved then
      give_counter(key, tonumber(reserved))
      redis.call('DEL', KEYS[f.k + 1])
    end
  elseif kind == 'idem' then
    if redis.call('GET', KEYS[f.k + 1]) == 'inflight:' .. f[4] then
      redis.call('DEL', KEYS[f.k + 1])
      if redis.call('GET', key) == f[5] then
        redis.call('DEL', key)
      end
    end
  end
end
redis.call('DEL', KEYS[1])
return { 1, #lines }
