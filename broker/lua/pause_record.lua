-- RECORD (broker/pause.py): an attempt that ended counted in its job's streak.
-- KEYS: streak, pause   ARGV: reason ('' = a success), threshold, now_s, detail, episode
-- The streak hash: reason, count, and a field ``e:<episode>`` per episode counted.
-- Returns {count, paused_now}: the streak after this attempt, and 1 when this attempt paused the job.
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
  return {0, 0}
end
local count
if redis.call('HGET', KEYS[1], 'reason') == ARGV[1] then
  if redis.call('HSETNX', KEYS[1], 'e:' .. ARGV[5], 1) == 1 then
    count = redis.call('HINCRBY', KEYS[1], 'count', 1)
  else
    count = tonumber(redis.call('HGET', KEYS[1], 'count'))
  end
else
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'reason', ARGV[1], 'count', 1, 'e:' .. ARGV[5], 1)
  count = 1
end
local threshold = tonumber(ARGV[2])
if threshold > 0 and count >= threshold and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'reason', ARGV[1], 'streak', count, 'since', ARGV[3], 'detail', ARGV[4])
  return {count, 1}
end
return {count, 0}
