-- SET_VERSION (broker/feed.py): the trainer's version published, never moved back.
-- KEYS: version   ARGV: version (an integer, broker/feed.py checked_version)
-- {1, what it was ('' before the first)}: set (the same version again too); {0, what it is}:
-- refused, the version is behind the current one. What Redis holds and is no number reads as -1.
local raw = redis.call('GET', KEYS[1])
local cur = tonumber(raw or '-1')
if cur == nil then cur = -1 end
local new = tonumber(ARGV[1])
if new < cur then return {0, raw} end
redis.call('SET', KEYS[1], ARGV[1])
return {1, raw or ''}
