-- CHARGE (broker/ratelimit.py), after now.lua and ratelimit_refill_fn.lua.
-- KEYS: bucket hash   ARGV: tpm, tokens used
-- The tokens a call used taken from the bucket (it may go below zero). Returns 0.
local h = redis.call('HMGET', KEYS[1], 't', 'tt')
local tpm = tonumber(ARGV[1])
local t = refill(tonumber(h[1]), tonumber(h[2]), tpm, math.max(1, tpm / 60))
redis.call('HSET', KEYS[1], 't', t - tonumber(ARGV[2]), 'tt', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 0
