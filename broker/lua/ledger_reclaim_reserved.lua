-- RECLAIM_RESERVED: a lapsed reservation dropped; 1 if its episode is still queued, to be sent again.
-- KEYS: reserved, state   ARGV: member, episode
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > now then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[2]) ~= $QUEUED then return 0 end
return 1
