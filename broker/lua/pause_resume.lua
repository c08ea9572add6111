-- RESUME (broker/pause.py): a job's pause lifted, and its streak forgotten.
-- KEYS: pause, streak, parked
-- Returns the parked episode ids (now to be sent).
redis.call('DEL', KEYS[1], KEYS[2])
local parked = redis.call('SMEMBERS', KEYS[3])
redis.call('DEL', KEYS[3])
return parked
