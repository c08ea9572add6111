-- FINISH: an attempt's record and its episode's next state, all or nothing.
-- KEYS: lease, state, counts, running, stream, retry, dlq, dlq_index, attempt_ids, progress, progress_seq
-- ARGV: token, episode, new_state, member, record, retry_at_ms, dead_letter, now_s, ttl_ms,
--       "<attempt>:<attempt_id>", keep_progress ('1': handed back with its instance kept for a successor),
--       snapshot, "<trajectory> <seq>" (with keep_progress: where it stopped, written as it is)
-- Only while the attempt holds its episode (``holds``: a lapsed lease counts as held).
if not holds(KEYS[1], KEYS[4], KEYS[2], KEYS[9], ARGV[1], ARGV[9], ARGV[4], ARGV[2], ARGV[10]) then return 0 end
redis.call('XADD', KEYS[5], '*', 'r', ARGV[5])
local old = redis.call('HGET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
move(KEYS[3], old, ARGV[3])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[4], ARGV[4])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[6], ARGV[6], ARGV[4]) end
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[7], ARGV[4], ARGV[7])
  redis.call('ZADD', KEYS[8], ARGV[8], ARGV[4])
end
if ARGV[11] ~= '1' then
  redis.call('HDEL', KEYS[10], ARGV[2])
  redis.call('HDEL', KEYS[11], ARGV[2])
elseif ARGV[12] ~= '' then  -- the attempt's last word on where it stopped: no call in flight
  redis.call('HSET', KEYS[10], ARGV[2], ARGV[12])
  redis.call('HSET', KEYS[11], ARGV[2], ARGV[13] .. ' ' .. now)
end
return 1
