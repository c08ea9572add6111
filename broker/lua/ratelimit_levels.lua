-- LEVELS (broker/ratelimit.py), after now.lua and ratelimit_refill_fn.lua.
-- KEYS: bucket hash, hold   ARGV: rpm, tpm, rpm_burst_s
-- For status: {requests left, tokens left, hold ms}; -1 for a limit that is off. Reads only.
local h = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local r, t = -1, -1
if rpm > 0 then r = refill(tonumber(h[1]), tonumber(h[2]), rpm, math.max(1, rpm / 60 * tonumber(ARGV[3]))) end
if tpm > 0 then t = refill(tonumber(h[3]), tonumber(h[4]), tpm, math.max(1, tpm / 60)) end
local hold = tonumber(redis.call('GET', KEYS[2]) or '0')
return {tostring(r), tostring(t), math.max(0, hold - now)}
