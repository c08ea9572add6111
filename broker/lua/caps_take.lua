-- TAKE (broker/caps.py), after now.lua, ledger_outage_fn.lua, caps_cap_fn.lua, caps_sweep_fn.lua
-- and caps_ahead_fn.lua.
-- KEYS: clock, hold, live limits, quadruples per cap
-- ARGV: holder, ttl_ms, want, wanted_ttl_ms, gap_ms, hold_ms, limit per cap (its live limit wins)
-- Grants up to ``want`` slots of every cap (the same number of each: what the fullest has
-- room for, the queue's share set aside), and extends the holder's lease. In each cap that
-- had less room than it wanted, the holder is noted as waiting (and queued when it holds
-- none of it); in the others, not. Returns {granted, held before} (held before: the holder's
-- count of the first cap as Redis had it, so that a holder learns its slots lapsed).
local holder, ttl, want = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local held = reclaim_held(KEYS[1], KEYS[2], ARGV[5], ARGV[6]) == 1
local n = ncaps()
local grant, rooms = want, {}
for i = 1, n do
  local z, h, w, q = cap(i)
  rooms[i] = live_limit(i, ARGV[6 + i]) - sweep(z, h, held) - ahead(h, w, q, holder)
  if rooms[i] < grant then grant = rooms[i] end
end
if grant < 0 then grant = 0 end
local _, h1 = cap(1)
local before = tonumber(redis.call('HGET', h1, holder) or '0')
for i = 1, n do
  local z, h, w, q = cap(i)
  if grant > 0 then
    redis.call('HINCRBY', h, holder, grant)
    redis.call('ZADD', z, now + ttl, holder)
    redis.call('ZREM', q, holder)
  end
  if rooms[i] < want then
    redis.call('ZADD', w, now + tonumber(ARGV[4]), holder)
    if redis.call('HEXISTS', h, holder) == 0 and not redis.call('ZSCORE', q, holder) then
      redis.call('ZADD', q, queue_place(q), holder)
    end
  else
    redis.call('ZREM', w, holder)
  end
end
return {grant, before}
