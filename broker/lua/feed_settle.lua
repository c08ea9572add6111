-- SETTLE (broker/feed.py): a feed entry acknowledged and counted why, once.
-- KEYS: stream, stats, redo, failures
-- ARGV: consumer group (trainers), entry id, counter, redo payload, failure payload, failures kept.
-- 1: settled now (a redo payload queued, a failure kept, the failures list trimmed);
-- 0: settled before (XACK found it acknowledged), nothing counted.
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('HINCRBY', KEYS[2], 'settled', 1)
if ARGV[4] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[4]) end
if ARGV[5] ~= '' then
  redis.call('LPUSH', KEYS[4], ARGV[5])
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[6]) - 1)
end
return 1
