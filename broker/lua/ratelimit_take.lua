-- TAKE (broker/ratelimit.py), after now.lua and ratelimit_refill_fn.lua.
-- KEYS: bucket hash, hold   ARGV: rpm, tpm, rpm_burst_s (0 = that limit is off)
-- 0: go (one request taken); else: milliseconds to wait before asking again.
local hold = tonumber(redis.call('GET', KEYS[2]) or '0')
if hold > now then return hold - now end
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local h = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local wait = 0
local r, t
if rpm > 0 then
  r = refill(tonumber(h[1]), tonumber(h[2]), rpm, math.max(1, rpm / 60 * tonumber(ARGV[3])))
  if r < 1 then wait = math.ceil((1 - r) * 60000 / rpm) end
end
if tpm > 0 then
  t = refill(tonumber(h[3]), tonumber(h[4]), tpm, math.max(1, tpm / 60))
  if t <= 0 then wait = math.max(wait, math.ceil((1 - t) * 60000 / tpm)) end
end
if wait > 0 then return wait end
if rpm > 0 then redis.call('HSET', KEYS[1], 'r', r - 1, 'rt', now) end
if tpm > 0 then redis.call('HSET', KEYS[1], 't', t, 'tt', now) end
redis.call('PEXPIRE', KEYS[1], 120000)
return 0
