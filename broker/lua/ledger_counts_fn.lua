-- move(counts, old, new): a job's count of episodes per state follows each state change (also
-- broker/cancel.py's).
local function move(counts, old, new)
  if old == new then return end
  if old then redis.call('HINCRBY', counts, old, -1) end
  if new then redis.call('HINCRBY', counts, new, 1) end
end
