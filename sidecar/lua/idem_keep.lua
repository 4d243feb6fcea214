-- idem_keep.lua — keep an idempotency claim in flight while its request still runs (decision 186).
--
-- The claim is kept only while it is still this request's: the memo holds its in-flight marker
-- ('inflight:' .. token). A claim settled (stored, released), expired or another request's is
-- left as it is. Running it twice (a Cluster client's re-send) sets the same TTL again.
--
-- KEYS[1] idem:api:{tenant}:{keyId}:{digest}:{idemKey} (memo)
-- KEYS[2] idem:key:{tenant}:{keyId}:{idemKey}          (owner: the digest holding the key)
-- ARGV[1] claim token      ARGV[2] the in-flight TTL ms, from now      ARGV[3] digest
-- returns 1 kept, 0 the claim is no longer this request's (nothing changed)
--
-- The owner (24 h from the claim) lives at least as long as the memo it guards, so a request
-- running past a day still finds another body under its key refused (422), not run.

if redis.call('GET', KEYS[1]) ~= 'inflight:' .. ARGV[1] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] and redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
