-- broker/caps.py: every caps script takes the caps' clock and hold, then each cap's keys as a
-- quadruple: lease zset, held hash, wanted zset, queue zset. ``cap(i)``: the i-th quadruple.
local function cap(i)
  return KEYS[4 * i - 1], KEYS[4 * i], KEYS[4 * i + 1], KEYS[4 * i + 2]
end
