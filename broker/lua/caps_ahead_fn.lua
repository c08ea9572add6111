-- broker/caps.py, the queue: holders that wait for a cap holding none of it, in the order they
-- began to. Each has a slot set aside: a take gets only the room left after those ahead of it
-- (all of them when the taker holds some), so that the longest waiter is served first. Waiters
-- that stopped asking, or hold slots now, leave the queue here.
local function ahead(h, w, q, holder)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGE', q, 0, -1)) do
    if tonumber(redis.call('ZSCORE', w, m) or '0') <= now or redis.call('HEXISTS', h, m) == 1 then
      redis.call('ZREM', q, m)
    elseif m == holder then
      return n
    else
      n = n + 1
    end
  end
  return n
end
-- A waiter's place in the queue: after everyone queued before it, also within one millisecond
-- (equal scores would be ordered by name, not by arrival).
local function queue_place(q)
  local last = redis.call('ZRANGE', q, -1, -1, 'WITHSCORES')
  if last[2] and tonumber(last[2]) >= now then return tonumber(last[2]) + 1 end
  return now
end
