-- holds(...): whether an attempt holds its episode, taking a lapsed lease back (renew, publish, finish).
-- The one rule by which an attempt holds its episode, shared by renew, publish and finish:
-- the lease key carries its token; or the key is gone (it lapsed: a Redis outage longer than
-- the TTL, a stalled worker the sweeper has not reached yet) while the episode is still
-- ``running`` under this very attempt ("<attempt>:<attempt_id>" matches), and then the lease is
-- taken back. Nobody else took the episode in that case: the sweeper's reclaim moves it out of
-- ``running`` and a new START changes the attempt id. So a lease is lost only when another
-- token holds it, or the episode moved on. Returns 'held' | 'resumed' | false.
local function holds(lease, running, state, attempt_ids, token, ttl_ms, mem, episode, value)
  local holder = redis.call('GET', lease)
  if holder == token then return 'held' end
  if holder then return false end
  if redis.call('HGET', state, episode) ~= $RUNNING then return false end
  if redis.call('HGET', attempt_ids, episode) ~= value then return false end
  redis.call('SET', lease, token, 'PX', ttl_ms)
  redis.call('ZADD', running, now + tonumber(ttl_ms), mem)
  return 'resumed'
end
