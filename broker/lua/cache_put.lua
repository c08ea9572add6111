-- PUT (broker/cache.py): one model answer stored under its request's key, the oldest evicted
-- beyond the cap, in one step (the bound holds whatever the number of writers).
-- KEYS: answers (hash key -> answer), order (zset key -> stored at, ms), stats (hash)
-- ARGV: key, answer, max_entries
-- Returns the number of answers evicted. ``stats``' ``bytes`` is the answers' total size:
-- kept here, beside each write and eviction, so that `interactor cache stats` reads one hash.
local old = redis.call('HSTRLEN', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HINCRBY', KEYS[3], 'bytes', string.len(ARGV[2]) - old)
local max = tonumber(ARGV[3])
local over = redis.call('ZCARD', KEYS[2]) - max
if over <= 0 then return 0 end
local gone = redis.call('ZPOPMIN', KEYS[2], over)
local freed, n = 0, 0
for i = 1, #gone, 2 do
  freed = freed + redis.call('HSTRLEN', KEYS[1], gone[i])
  redis.call('HDEL', KEYS[1], gone[i])
  n = n + 1
end
redis.call('HINCRBY', KEYS[3], 'bytes', -freed)
redis.call('HINCRBY', KEYS[3], 'evicted', n)
return n
