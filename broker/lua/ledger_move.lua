-- MOVE: a guarded state change (re-drive, reconcile).
-- KEYS: state, counts   ARGV: episode, new_state, allowed_old...
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return 0 end
for i = 3, #ARGV do
  if st == ARGV[i] then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    move(KEYS[2], st, ARGV[2])
    return 1
  end
end
return 0
