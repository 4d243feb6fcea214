-- alert_fire.lua — a budget threshold crossed: the alert exists once per threshold and period,
-- across every replica (issue 42 item 5).
--
-- Any replica that sees a budget's usage at or past a threshold runs this; only the first run for
-- that (tenant, limit, subject, period, threshold) creates the alert, later ones (other replicas,
-- the same replica after a restart) find the marker and do nothing. The alert is then due for
-- delivery at once (any replica's delivery loop may take it) and its creation is logged.
-- All keys share the `{alerts}` hash tag (one Cluster slot: alerts are rare, never on a hot path).
--
-- KEYS[1] the marker   {alerts}:fired:<tenant>:<limit>:<subject>:<period>:<threshold>
-- KEYS[2] the alert    {alerts}:alert:<id>      (hash: alert, tenant, status, attempts, created_ms)
-- KEYS[3] the due set  {alerts}:due             (zset: id -> next attempt, ms)
-- KEYS[4] the log      {alerts}:log:<tenant>    (list of JSON entries, newest first)
-- ARGV[1] ttl_ms of marker and alert (past the period's end and the delivery's give-up time)
-- ARGV[2] the alert (JSON)   ARGV[3] its id   ARGV[4] tenant   ARGV[5] now_ms
-- ARGV[6] the log entry (JSON)   ARGV[7] the log's length bound
-- Every key written gets the TTL (the due set's is renewed by each alert).
-- returns 1 created | 0 it existed already

if not redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[2], 'alert', ARGV[2], 'tenant', ARGV[4], 'status', 'pending', 'attempts', 0, 'created_ms', ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
redis.call('LPUSH', KEYS[4], ARGV[6])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[7]) - 1)
redis.call('PEXPIRE', KEYS[4], ARGV[1])
return 1
