-- CANCEL_WAITING (broker/cancel.py), after ledger_counts_fn.lua: a cancelled job's waiting episodes
-- cancelled.
-- KEYS: state, counts, retry, reserved, stream, cancel   ARGV: record, job_id, episode...
-- The given episodes still waiting (queued, retrying) -> cancelled, off the retry schedule and
-- the reservations; the record (EpisodesCancelled of those episodes) into the results stream in
-- the same step, so the store learns exactly what the ledger did. Only in a job marked cancelled:
-- then no START can take an episode meanwhile (the caller read them as waiting after the mark),
-- so each is still waiting here, or cancelled already by another pass (the store takes a second
-- cancel of an episode as the first). Returns how many it cancelled; -1: the job is not marked.
if redis.call('EXISTS', KEYS[6]) == 0 then return -1 end
local n = 0
for i = 3, #ARGV do
  local st = redis.call('HGET', KEYS[1], ARGV[i])
  if st == $QUEUED or st == $RETRYING then
    redis.call('HSET', KEYS[1], ARGV[i], $CANCELLED)
    move(KEYS[2], st, $CANCELLED)
    local m = ARGV[2] .. ' ' .. ARGV[i]
    redis.call('ZREM', KEYS[3], m)
    redis.call('ZREM', KEYS[4], m)
    n = n + 1
  end
end
if n > 0 then redis.call('XADD', KEYS[5], '*', 'r', ARGV[1]) end
return n
