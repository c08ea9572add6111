-- The prelude of every script that reads the time (the ledger's, the caps', the rate limits'): it
-- sets ``now``, Redis' clock in ms.
-- Time in the scripts is Redis' own clock (TIME), never a worker's: a worker whose clock runs
-- behind cannot make a live lease look expired to the sweeper, or a dead one look alive
-- (workers' clocks drift apart). Effects replication keeps TIME usable before writes on Redis 6.
redis.replicate_commands()
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
