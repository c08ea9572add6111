-- PARK (broker/pause.py): a delivered episode parked while its job is paused.
-- KEYS: pause, parked, reserved, state   ARGV: episode, member
-- 1 parked (kept to send again only while still queued), 0 the job is not paused (run it).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[3], ARGV[2])
local st = redis.call('HGET', KEYS[4], ARGV[1])
if st == $QUEUED then redis.call('SADD', KEYS[2], ARGV[1]) end
return 1
