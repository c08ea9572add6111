-- RENEW: an attempt's lease extended; tells the attempt when its job was cancelled.
-- KEYS: lease, running, state, attempt_ids, job cancel
-- ARGV: token, ttl_ms, member, episode, "<attempt>:<attempt_id>"
-- Extends a lease this attempt holds (or takes back one that lapsed, by the rule above).
-- 1: held, 0: lost (another attempt, or the sweeper, has the episode), 2: held, and its job was
-- cancelled (broker/cancel.py): the attempt stops at its next call and closes as cancelled, still
-- holding its lease to do so. The renewal is how a running attempt learns of a cancel.
local h = holds(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if not h then return 0 end
if h == 'held' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
if redis.call('EXISTS', KEYS[5]) == 1 then return 2 end
return 1
