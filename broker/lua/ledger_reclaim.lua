-- RECLAIM: a running episode with no live lease moved to queued or failed (the sweeper).
-- KEYS: state, counts, lease, running, stream, dlq, dlq_index, clock, hold, outages, attempt_limit,
--       progress, progress_seq, primary
-- ARGV: episode, member, new_state, record, dead_letter, now_s, gap_ms, hold_ms, grant_default
-- With gap_ms '' the outage check is skipped (a caller that is no sweeper). -1: held.
-- grant_default: the attempt is not counted (its lease lapsed in an outage): the episode's attempt
-- limit, ``grant_default`` if it has none yet, goes up by one (Ledger.grant_extra_attempt's rule).
if ARGV[7] ~= '' and reclaim_held(KEYS[8], KEYS[9], ARGV[7], ARGV[8], KEYS[10], KEYS[14]) == 1 then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local st = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[2])
if st ~= $RUNNING then return 0 end
if ARGV[9] ~= '' then
  redis.call('HSETNX', KEYS[11], ARGV[1], ARGV[9])
  redis.call('HINCRBY', KEYS[11], ARGV[1], 1)
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
move(KEYS[2], st, ARGV[3])
if ARGV[4] ~= '' then redis.call('XADD', KEYS[5], '*', 'r', ARGV[4]) end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[2], ARGV[5])
  redis.call('ZADD', KEYS[7], ARGV[6], ARGV[2])
end
if ARGV[3] ~= $QUEUED then  -- re-queued, its snapshot stays for the next attempt to continue from
  redis.call('HDEL', KEYS[12], ARGV[1])
  redis.call('HDEL', KEYS[13], ARGV[1])
end
return 1
