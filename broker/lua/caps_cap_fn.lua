-- broker/caps.py: every caps script takes the caps' clock, hold and live limits (hash cap key ->
-- limit), then each cap's keys as a quadruple: lease zset, held hash, wanted zset, queue zset.
-- ``cap(i)``: the i-th quadruple; ``ncaps()``: how many there are.
local function cap(i)
  return KEYS[4 * i], KEYS[4 * i + 1], KEYS[4 * i + 2], KEYS[4 * i + 3]
end
local function ncaps()
  return (#KEYS - 3) / 4
end
-- The limit in force of the i-th cap: its live limit (set at submit, by `interactor job JOB set`
-- or by the adaptive rule, broker/adaptive.py), else ``fallback`` (the job spec's, as ARGV).
local function live_limit(i, fallback)
  local v = tonumber(redis.call('HGET', KEYS[3], KEYS[4 * i]) or '')
  if v and v >= 1 then return v end
  return tonumber(fallback)
end
