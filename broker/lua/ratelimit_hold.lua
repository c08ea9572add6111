-- HOLD (broker/ratelimit.py), after now.lua.
-- KEYS: hold   ARGV: ms from now. Moves the mark later, never earlier. Returns 0.
local due = now + tonumber(ARGV[1])
local hold = tonumber(redis.call('GET', KEYS[1]) or '0')
if due > hold then redis.call('SET', KEYS[1], due, 'PX', tonumber(ARGV[1]) + 1000) end
return 0
