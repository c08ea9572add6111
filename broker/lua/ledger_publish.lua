-- PUBLISH: one record into the results stream, only while its attempt holds its episode.
-- KEYS: lease, stream, running, state, attempt_ids
-- ARGV: token, record, ttl_ms, member, episode, "<attempt>:<attempt_id>"
-- XADD only while the attempt holds its episode (``holds``: a lapsed lease is taken back).
if not holds(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[3], ARGV[4], ARGV[5], ARGV[6]) then return -1 end
redis.call('XADD', KEYS[2], '*', 'r', ARGV[2])
return redis.call('XLEN', KEYS[2])
