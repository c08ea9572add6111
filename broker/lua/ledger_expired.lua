-- EXPIRED: the running members whose lease expired, for the sweeper.
-- KEYS: running   ARGV: grace_ms, limit. Members whose lease expiry passed grace_ms ago.
return redis.call('ZRANGEBYSCORE', KEYS[1], 0, now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
