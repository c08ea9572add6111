-- broker/ratelimit.py, after now.lua: a token bucket's level now, refilled at ``per_min`` a
-- minute since ``at`` (ms), up to ``cap``; a bucket with no level yet is full.
local function refill(level, at, per_min, cap)
  if not level then return cap end
  return math.min(cap, level + (now - at) * per_min / 60000)
end
