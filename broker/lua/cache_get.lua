-- GET (broker/cache.py): the answer stored under a request's key, or false; the hit or miss
-- counted in the fleet's cache stats and in the job's own, in the same round trip.
-- KEYS: answers (hash key -> answer), stats (hash), the job's cache counts (hash)
-- ARGV: key. The job's counts are one of its keys (Keys.job_keys): they expire with the job.
local answer = redis.call('HGET', KEYS[1], ARGV[1])
local field = answer and 'hits' or 'misses'
redis.call('HINCRBY', KEYS[2], field, 1)
redis.call('HINCRBY', KEYS[3], field, 1)
return answer
