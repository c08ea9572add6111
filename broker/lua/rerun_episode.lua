-- RERUN: a completed episode queued to run again as a new attempt (broker/rerun.py), with the
-- record that tells the results store to set its trajectory aside, in one step.
-- KEYS: state, counts, attempts, attempt_limit, results, job cancel, progress, progress_seq
-- ARGV: episode, record (an EpisodeRerun, broker/control_records.py), attempts counted when it
--       was made, the job's max_attempts
-- Returns 'queued_again', 'job_cancelled', 'changed' (another attempt was counted meanwhile: made again),
-- or the episode's state when it is not done ('' when the ledger has no such episode).
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return '' end
if redis.call('EXISTS', KEYS[6]) == 1 then return 'job_cancelled' end
if st ~= $DONE then return st end
local attempts = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
if attempts ~= tonumber(ARGV[3]) then return 'changed' end
-- the record first: the store reads it before any step of the new attempt (one stream)
redis.call('XADD', KEYS[5], '*', 'r', ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], $QUEUED)
move(KEYS[2], st, $QUEUED)
-- a fresh budget of attempts on top of those used, as a re-drive's
redis.call('HSET', KEYS[4], ARGV[1], attempts + tonumber(ARGV[4]))
-- from a fresh reset: nothing of the completed trajectory is continued
redis.call('HDEL', KEYS[7], ARGV[1])
redis.call('HDEL', KEYS[8], ARGV[1])
return 'queued_again'
