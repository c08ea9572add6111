-- MARK: a progress snapshot that must be in Redis before the attempt goes on (a ``stepping``
-- snapshot before a ``step`` call, a fresh trajectory naming itself before its reset:
-- broker/resume.py), sent on its own and waited for, once everything the attempt queued before
-- it has landed (workers/attempt.py ``Attempt.mark``), so it needs no order mark of its own.
-- KEYS: lease, running, state, attempt_ids, progress
-- ARGV: token, ttl_ms, member, episode, "<attempt>:<attempt_id>", snapshot
-- Fenced like every write of an attempt (``holds``): a worker whose episode was taken over never
-- writes it, and so never sends the step. The common case, the lease held, costs a GET and an
-- HSET; only a lapsed lease reads Redis' time, to take it back by the rule. Returns 1 or 0 (lost).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  redis.replicate_commands()
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if not holds(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
end
redis.call('HSET', KEYS[5], ARGV[4], ARGV[6])
return 1
