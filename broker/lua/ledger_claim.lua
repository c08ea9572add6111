-- CLAIM: a new job's id taken, with its submitting marker.
-- KEYS: jobs, job spec, submitting   ARGV: job_id, created_at, marker_ttl_ms.
-- 1: the id is ours now; 0: it exists. The submitting marker (with a TTL, refreshed while the
-- submit writes) tells housekeeping that an indexed job without a spec yet is being written,
-- not gone; a submit that died leaves it to expire, and then housekeeping forgets the job.
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 1
