-- RENEW (broker/caps.py), after now.lua, ledger_outage_fn.lua and caps_cap_fn.lua.
-- KEYS: clock, hold, live limits, then quadruples, per holder its caps' in turn
-- ARGV: ttl_ms, gap_ms, hold_ms, then per holder: name, number of caps, limit per cap (its live
-- limit wins).
-- Stamps the caps' clock (a renewal after an outage holds the sweeps, as a take does). Per
-- holder: when a cap no longer counts its slots (swept), whatever is left of it is removed
-- and {-1, 0, 0} returned; else its lease is extended (also one that lapsed but was not
-- swept: nobody took those slots) and {held, contended, share} returned: contended 1 when
-- another holder waits for one of its caps, share the fewest slots a cap's limit gives each
-- of those taking part in it (holders and waiters), 0 when there are more of them than slots.
-- A cap whose holders hold more than its limit (it was lowered while they held) is contended
-- too: each holder keeps its share and gives the rest back as its calls end.
local ttl = tonumber(ARGV[1])
reclaim_held(KEYS[1], KEYS[2], ARGV[2], ARGV[3])
local out = {}
local k, a = 0, 4
while a <= #ARGV do
  local holder, n = ARGV[a], tonumber(ARGV[a + 1])
  local gone = false
  for i = 1, n do
    local _, h = cap(k + i)
    if redis.call('HEXISTS', h, holder) == 0 then gone = true end
  end
  if gone then
    for i = 1, n do
      local z, h = cap(k + i)
      redis.call('ZREM', z, holder)
      redis.call('HDEL', h, holder)
    end
    table.insert(out, {-1, 0, 0})
  else
    local contended, share = 0, nil
    for i = 1, n do
      local z, h, w = cap(k + i)
      redis.call('ZADD', z, now + ttl, holder)
      local limit = live_limit(k + i, ARGV[a + 1 + i])
      local parts, sum = redis.call('HLEN', h), 0
      for _, v in ipairs(redis.call('HVALS', h)) do sum = sum + tonumber(v) end
      if sum > limit then contended = 1 end
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', w, now, '+inf')) do
        if m ~= holder then contended = 1 end
        if redis.call('HEXISTS', h, m) == 0 then parts = parts + 1 end
      end
      local sh = math.floor(limit / math.max(1, parts))
      if share == nil or sh < share then share = sh end
    end
    local _, h1 = cap(k + 1)
    table.insert(out, {tonumber(redis.call('HGET', h1, holder)), contended, share})
  end
  k = k + n
  a = a + 2 + n
end
return out
