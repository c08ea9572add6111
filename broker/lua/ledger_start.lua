-- START: a delivered episode becomes a running attempt under a fresh lease.
-- KEYS: state, attempts, counts, lease, running, reserved, episodes, attempt_ids, attempt_previous,
--       reclaim_hold, job cancel, progress, progress_seq, outages, primary
-- ARGV: episode, token_prefix, ttl_ms, member, attempt_id, the prompted phase's place in a seq
-- Returns {$START_OK, attempt, token, episode spec, previous attempt, progress, outage since} so that
-- starting costs one round trip (progress: the predecessor's snapshot, broker/resume.py decides
-- on it; outage since: '1' when the sweep clock recorded an outage or a failover after the
-- snapshot was written, so that writes after it may have been lost).
-- "<attempt>:<attempt_id>" is kept per episode: the renewer checks it before
-- resuming a lease that lapsed during a Redis outage, the sweeper names the attempt it
-- reclaims, and the next attempt closes the env instances of those before it.
--
-- attempt_previous holds, comma-separated, the earlier attempts whose env instance may still be
-- open, so that a repeated START can name them too. With a progress snapshot kept, that is the
-- latest attempt alone: the snapshot names the instance that lives on, and a fresh trajectory
-- names itself in it before its reset (after closing those before it). Without one, the list
-- grows by the latest attempt: an attempt killed in its first step writes no snapshot, and its
-- successor killed before closing that instance must not leave it unknown to the next one.
-- The list keeps its last MAX_EARLIER (each costs a fresh attempt one close).
local MAX_EARLIER = 16
--
-- A START is idempotent per attempt_id: sent again with the same attempt_id (its reply was lost,
-- and redis-py or the runtime sent it again), it finds its own attempt - under its own lease, or
-- running with the lease lapsed and nobody else holding it - and returns that attempt again
-- instead of finding it "busy" and counting another one.
--
-- Nothing starts in a cancelled job (broker/cancel.py): a stale message of a cancelled episode
-- finds it finished, and any other episode of the job is refused - except the START sent
-- again for an attempt that is already running, which gets its attempt back and learns of the
-- cancel from its first renewal.
-- Asked only of a snapshot (a first attempt's START pays nothing for it). A failover no sweep
-- has seen yet counts too: the primary answering is not the one the last
-- sweep reached (its replication id, Keys.primary). Asked only where it matters, for a
-- ``prompted`` snapshot (seq = 4 * step + ARGV[6], broker/records.py Progress.seq).
local function outage_since(episode)
  local mark = redis.call('HGET', KEYS[13], episode)
  local seq, written = nil, nil
  if mark then seq, written = string.match(mark, '^%S+ (%d+) (%d+)$') end
  if not written then return '' end
  if #redis.call('ZRANGEBYSCORE', KEYS[14], '(' .. written, '+inf', 'LIMIT', 0, 1) > 0 then return '1' end
  if tonumber(seq) % 4 == tonumber(ARGV[6]) then
    local info = redis.pcall('INFO', 'replication')
    local id = type(info) == 'string' and string.match(info, 'master_replid:(%x+)')
    local known = redis.call('GET', KEYS[15])
    if id and known and known ~= id then return '1' end
  end
  return ''
end
redis.call('ZREM', KEYS[6], ARGV[4])
local st = redis.call('HGET', KEYS[1], ARGV[1])
if not st then return {$START_UNKNOWN, ''} end
if st == $DONE or st == $FAILED or st == $CANCELLED then return {$START_FINISHED, st} end
local holder = redis.call('GET', KEYS[4])
local latest = redis.call('HGET', KEYS[8], ARGV[1]) or ''
local mine_attempt, mine_id = string.match(latest, '^(%d+):(.*)$')
if st == $RUNNING and mine_id == ARGV[5] then
  local token = ARGV[2] .. ':' .. mine_attempt
  if holder and holder ~= token then return {$START_BUSY, holder} end
  redis.call('SET', KEYS[4], token, 'PX', ARGV[3])  -- a full TTL from this call, which the worker counts from
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[3]), ARGV[4])
  local kept = redis.call('HGET', KEYS[12], ARGV[1]) or ''
  return {$START_OK, mine_attempt, token, redis.call('HGET', KEYS[7], ARGV[1]) or '',
          redis.call('HGET', KEYS[9], ARGV[1]) or '', kept, kept ~= '' and outage_since(ARGV[1]) or ''}
end
if redis.call('EXISTS', KEYS[11]) == 1 then return {$START_REFUSED, 'its job was cancelled'} end
if holder then return {$START_BUSY, holder} end
-- Running with its lease lapsed right after an outage: its attempt is alive and about to take
-- the lease back; another delivery takes over only as the sweeper would, once the hold is over.
if st == $RUNNING and redis.call('EXISTS', KEYS[10]) == 1 then return {$START_BUSY, 'lease lapsed in an outage'} end
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local token = ARGV[2] .. ':' .. attempt
redis.call('SET', KEYS[4], token, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], $RUNNING)
move(KEYS[3], st, $RUNNING)
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[3]), ARGV[4])
local progress = redis.call('HGET', KEYS[12], ARGV[1]) or ''
local earlier = latest
if latest ~= '' and progress == '' then
  local kept = redis.call('HGET', KEYS[9], ARGV[1]) or ''
  if kept ~= '' then
    earlier = kept .. ',' .. latest
    local _, commas = string.gsub(earlier, ',', '')
    if commas >= MAX_EARLIER then earlier = string.match(earlier, '^[^,]*,(.*)$') end
  end
end
if earlier ~= '' then redis.call('HSET', KEYS[9], ARGV[1], earlier) else redis.call('HDEL', KEYS[9], ARGV[1]) end
redis.call('HSET', KEYS[8], ARGV[1], attempt .. ':' .. ARGV[5])
return {$START_OK, tostring(attempt), token, redis.call('HGET', KEYS[7], ARGV[1]) or '', earlier, progress,
        progress ~= '' and outage_since(ARGV[1]) or ''}
