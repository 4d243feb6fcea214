-- complete.lua — reconcile one completed request: settle its token reservation and free its
-- concurrency slot.
--
-- KEYS: when ARGV[5] = '1': KEYS[1] month counter (q:tokens:…), KEYS[2] reservation
--       (q:reserved:…); then, when ARGV[6] = '1', the in-flight zset (q:conc:…). All keys share
--       the tenant's hash tag, so the script runs on Redis Cluster.
-- (A money budget's counter, q:spend:…, is settled alike, in micro-units: ARGV[1] its real cost.)
-- ARGV[1] actual tokens used (0..2^53: exact as a Lua number)
-- ARGV[2] the estimate that was reserved at decide time
-- ARGV[3] request id (the slot's member)
-- ARGV[4] counter TTL in ms (re-applied on write; the counter's own: a day's money counter's is shorter)
-- ARGV[5] '1' if the request reserved budget, else '0'
-- ARGV[6] '1' if the request took a concurrency slot, else '0'
-- ARGV[7] TTL in ms of the settled marker: at least the reservation's, and until the ticket expires
-- ARGV[8] '1' if the last of KEYS is the decision's record (dec:…, issue 15.2): it is deleted,
--         so a refund of a completed decision finds nothing to give back
-- returns {delta charged to the counter, 1 reconciled now | 0 reservation had expired |
--          2 already settled (a retried report: nothing done)}
--
-- Never under-charge: with the reservation present, the counter moves by actual − reserved
-- (a refund or an overrun). When it already expired (5 min), the estimate stayed charged, so
-- only an overrun (actual − estimate, if positive) is added; nothing is refunded.
-- Idempotent: a settled reservation is replaced by the marker 'settled' (same TTL), so a report
-- delivered twice (the filter retries failed batches) is counted once.

local actual = tonumber(ARGV[1])
local estimate = tonumber(ARGV[2])
local delta = 0
local found = 0
local k = 1
if ARGV[5] == '1' then
  local reserved = redis.call('GET', KEYS[2])
  if reserved == 'settled' then
    found = 2
  elseif reserved then
    found = 1
    delta = actual - tonumber(reserved)
  else
    delta = math.max(0, actual - estimate)
  end
  if found ~= 2 then
    redis.call('SET', KEYS[2], 'settled', 'PX', tonumber(ARGV[7]))
  end
  if delta ~= 0 then
    -- pcall: an INCRBY that would overflow the counter (only after ~1000 reports of 2^53, the
    -- most the sidecar passes) leaves it where it is, far beyond any budget, instead of failing
    -- the completion batch and having it resent forever
    redis.pcall('INCRBY', KEYS[1], delta)
    redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
  end
  k = 3
end
if ARGV[6] == '1' then
  redis.call('ZREM', KEYS[k], ARGV[3])
end
if ARGV[8] == '1' then
  redis.call('DEL', KEYS[#KEYS])
end
return { delta, found }
