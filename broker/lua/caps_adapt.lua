-- ADAPT (broker/adaptive.py), after now.lua: one report of a cap's outcomes, and the AIMD rule.
-- KEYS: live limits (hash cap key -> limit), the cap's adaptive state (hash), its change log (list)
-- ARGV: cap key, successes, overload reason ('' = none), demand (1: calls waited for the cap),
--       cooldown_ms, log_max, start (the limit when the hash has none)
-- The state holds min, max, successes (counted since the last change), cut_at (ms of the
-- last cut), at (ms of the last change) and reason. Without a state the cap is not adaptive
-- (a fixed limit was set since): nothing changes, {-1, 0} is returned.
-- Overload: limit x0.8 (floor, at least min), at most once per cooldown, so that the 429s of one
-- burst cut once; any overload restarts the window of successes. Else, while demand reaches the
-- limit and no cut was made within the cooldown, successes count (a server's metrics, read once a
-- second, cut at most once a second: fast answers must not grow the limit back faster): +1 per window of ``limit`` successes, at most max. Returns {limit in force, 1 when it changed}.
local st = redis.call('HMGET', KEYS[2], 'min', 'max', 'successes', 'cut_at')
if not st[1] then return {-1, 0} end
local lo, hi = tonumber(st[1]), tonumber(st[2])
local ok, cut_at = tonumber(st[3] or '0') or 0, tonumber(st[4] or '0') or 0
local limit = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '') or tonumber(ARGV[7])
local successes, reason, demand = tonumber(ARGV[2]), ARGV[3], ARGV[4] == '1'
local new, why = limit, nil
if reason ~= '' then
  ok = 0  -- the window of successes starts again after any overload, cut or not
  if now - cut_at >= tonumber(ARGV[5]) then
    new = math.max(lo, math.floor(limit * 0.8))
    why = 'x0.8: ' .. reason
    cut_at = now
  end
elseif demand and limit < hi and now - cut_at >= tonumber(ARGV[5]) then
  ok = ok + successes
  if ok >= limit then
    why = '+1: ' .. ok .. ' ok at ' .. limit
    new, ok = limit + 1, 0
  end
end
new = math.min(hi, math.max(lo, new))
redis.call('HSET', KEYS[2], 'successes', ok, 'cut_at', cut_at)
if why then
  redis.call('HSET', KEYS[2], 'at', now, 'reason', why)
  if new ~= limit then
    redis.call('HSET', KEYS[1], ARGV[1], new)
    redis.call('RPUSH', KEYS[3], now .. ' ' .. new .. ' ' .. why)
    redis.call('LTRIM', KEYS[3], -tonumber(ARGV[6]), -1)
  end
end
if new ~= limit then return {new, 1} end
return {new, 0}
