-- copy_key.lua — copy one API-key record from the store of record (PostgreSQL) into Redis,
-- never undoing a revocation (decision 130).
--
-- Two writers copy records read from PostgreSQL some time before they write them: a sidecar's
-- start (the re-warm: every key, read in one snapshot, written one by one while requests are
-- served) and the completion of a revocation whose first Redis write failed. A key's status only
-- ever goes active -> revoked, so a revoked record in Redis is never older than an active copy:
-- a revocation that landed between the copy's read and this write (the admin API of another
-- replica, `tollgate-sidecar keys revoke`) must stay. Hence: when Redis holds the record revoked
-- and the copy is not, the record is not written. Anything else is written over (a revoked copy
-- over an active record is the revocation itself).
--
-- KEYS[1] apikey:{sha256}
-- KEYS[2] apikey-id:{keyId}, KEYS[3] apikey-index:{tenant} — only where one node holds every
--         key (not Cluster: there the sidecar writes them after this script, record first)
-- ARGV[1] the key hash (KEYS[2]'s value)   ARGV[2] the key id (a member of KEYS[3])
-- ARGV[3..] the record's fields as field/value pairs (KeyRecord::to_fields), `status` among them
-- returns 1 written | 2 written, and Redis held no record or one of another status (a write
--   it had lost: decision 197) | 0 kept (Redis holds the key revoked and the copy is not); the id
--   mapping and the index are written either way (they only point at the record)

local status
for i = 3, #ARGV - 1, 2 do
  if ARGV[i] == 'status' then status = ARGV[i + 1] end
end
local written = 0
local held = redis.call('HGET', KEYS[1], 'status')
if status == 'revoked' or held ~= 'revoked' then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  written = 1
  if held ~= status then written = 2 end
end
if KEYS[3] then
  redis.call('SET', KEYS[2], ARGV[1])
  redis.call('SADD', KEYS[3], ARGV[2])
end
return written
