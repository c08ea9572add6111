-- RESERVE: delivered messages' reservations written or extended.
-- KEYS: reserved   ARGV: ttl_ms, xx, member...  (xx = '1': only extend those still there)
local gone = {}
for i = 3, #ARGV do
  if ARGV[2] == '1' then
    if redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[i]) == 0
       and not redis.call('ZSCORE', KEYS[1], ARGV[i]) then
      table.insert(gone, ARGV[i])
    end
  else
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  end
end
return gone
