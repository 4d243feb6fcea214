-- copy_key.lua — copy one API-key record from the store of record (PostgreSQL) into Redis,
-- never undoing a revocation (decision 130).
--
-- Two writers copy records read from PostgreSQL some time before they write them: a sidecar's
-- start (the re-warm: every key, read in one snapshot, written one by one while requests are
-- served) and the completion of a revocation whose first Redis write failed. A key's status only
-- ever goes active -> revoked, so a revoked record in Redis is never older than an active copy:
-- a revocation that landed between the copy's read and this write (the admin API of another
-- replica, `tollgate-sidecar keys revoke`) must stay. Hence: when Redis holds the record revoked
-- and the copy is not, nothing is written. Anything else is written over (a revoked copy over an
-- active record is the revocation itself).
--
-- KEYS[1] apikey:{sha256}
-- ARGV    the record's fields as field/value pairs (KeyRecord::to_fields), `status` among them
-- returns 1 written | 0 kept (Redis holds the key revoked and the copy is not)

local status
for i = 1, #ARGV - 1, 2 do
  if ARGV[i] == 'status' then status = ARGV[i + 1] end
end
if status ~= 'revoked' and redis.call('HGET', KEYS[1], 'status') == 'revoked' then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
