-- USE (broker/caps.py), after now.lua and caps_cap_fn.lua.
-- KEYS: clock, hold, live limits, quadruples per cap
-- The slots held of each cap by holders whose lease is live (status, metrics), one number per
-- cap. Reads only: a status never sweeps, nor stamps the caps' clock.
local out = {}
for i = 1, ncaps() do
  local z, h = cap(i)
  local used = 0
  local counts = redis.call('HGETALL', h)
  for j = 1, #counts, 2 do
    if tonumber(redis.call('ZSCORE', z, counts[j]) or '0') > now then used = used + tonumber(counts[j + 1]) end
  end
  out[i] = used
end
return out
