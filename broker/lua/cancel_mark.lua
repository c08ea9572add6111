-- MARK (broker/cancel.py): a job marked cancelled, once.
-- KEYS: spec, cancel, pause, streak, parked   ARGV: now_s
-- -1: no such job; 0: cancelled before; 1: cancelled now. The pause goes with it: a paused job
-- that is cancelled has nothing left to resume, and its parked episodes are cancelled below.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[2], 'at', ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
return 1
