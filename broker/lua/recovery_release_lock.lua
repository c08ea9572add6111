-- RELEASE_LOCK (broker/recovery.py): the sweep lock given up.
-- KEYS: lock   ARGV: token
-- Deletes the lock only while it is still this holder's: 1 deleted, 0 not (another's, or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
