-- CANCEL_WAITING (broker/cancel.py), after ledger_counts_fn.lua: a cancelled job's waiting episodes
-- cancelled.
-- KEYS: state, counts, retry, reserved, stream, cancel, orphans, progress, progress_seq
-- ARGV: record, job_id, then per episode: episode, n, n orphan entries
-- The given episodes still waiting (queued, retrying) -> cancelled, off the retry schedule and
-- the reservations; the record (EpisodesCancelled of those episodes) into the results stream in
-- the same step, so the store learns exactly what the ledger did. An episode waiting with an env
-- instance kept for its next attempt (its progress snapshot names it) will have no next attempt:
-- its orphan entries (made by the caller from the snapshot) go to the orphan closers, and the
-- snapshot goes. Only in a job marked cancelled: then no START can take an episode meanwhile
-- (the caller read them as waiting after the mark), so each is still waiting here, or cancelled
-- already by another pass (the store takes a second cancel of an episode as the first). Returns
-- how many it cancelled; -1: the job is not marked.
if redis.call('EXISTS', KEYS[6]) == 0 then return -1 end
local n = 0
local i = 3
while i <= #ARGV do
  local episode, count = ARGV[i], tonumber(ARGV[i + 1])
  local st = redis.call('HGET', KEYS[1], episode)
  if st == $QUEUED or st == $RETRYING then
    redis.call('HSET', KEYS[1], episode, $CANCELLED)
    move(KEYS[2], st, $CANCELLED)
    local m = ARGV[2] .. ' ' .. episode
    redis.call('ZREM', KEYS[3], m)
    redis.call('ZREM', KEYS[4], m)
    for j = 1, count do redis.call('RPUSH', KEYS[7], ARGV[i + 1 + j]) end
    redis.call('HDEL', KEYS[8], episode)
    redis.call('HDEL', KEYS[9], episode)
    n = n + 1
  end
  i = i + 2 + count
end
if n > 0 then redis.call('XADD', KEYS[5], '*', 'r', ARGV[1]) end
return n
