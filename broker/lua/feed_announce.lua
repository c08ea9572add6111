-- ANNOUNCE (broker/feed.py): a settled group put on its job's feed, once.
-- KEYS: stream, seen, stats   ARGV: group, packed group, counter
-- The stream entry id; false when the group was announced before (``seen`` has it).
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return false end
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], id)
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return id
