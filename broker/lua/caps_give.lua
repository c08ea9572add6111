-- GIVE (broker/caps.py), after caps_cap_fn.lua.
-- KEYS: clock, hold, live limits, quadruples per cap   ARGV: holder, count
-- Gives ``count`` slots back (all: the holder is gone). Returns 0.
for i = 1, ncaps() do
  local z, h = cap(i)
  if redis.call('HINCRBY', h, ARGV[1], -tonumber(ARGV[2])) <= 0 then
    redis.call('HDEL', h, ARGV[1])
    redis.call('ZREM', z, ARGV[1])
  end
end
return 0
