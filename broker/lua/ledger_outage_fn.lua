-- reclaim_held(...): the sweep clock, and whether reclaims are held after an outage or a failover.
-- Outage detection, for the sweeper. Every sweep (in every worker and the consumer) stamps the
-- sweep clock with Redis' time. A gap longer than gap_ms since the last stamp means no sweeper
-- reached Redis meanwhile: Redis was away (stopped, restarting, frozen: its own clock jumps
-- too), so every lease may have lapsed with its holder alive and unable to renew. Reclaims are
-- then held for hold_ms, time for the renewers (and publishes, finishes) to take their leases
-- back. A gap can also mean no sweeper ran at all; then reclaims come hold_ms later, no harm.
-- Returns 1 while reclaims are held. The fleet-wide caps apply the same rule to their slots'
-- leases, on a clock of their own (broker/caps.py).
-- The gap itself is kept when ``outages`` is given (Keys.outages keeps the last OUTAGES_KEPT, a
-- number broker/ledger.py writes in as it loads this file): a lease that lapsed in it and that
-- nobody took back during the hold had a holder that died while Redis was away - killed at its
-- shutdown deadline while it waited to hand its episode back, say - and is reclaimed uncounted.
-- A failover is an outage too, however quick: the promoted replica may lack the primary's last
-- writes (renewals, FINISHes: docs/guarantees.md), and its leases then lapse under holders that
-- are alive or finished. With ``primary`` given (Keys.primary), the primary's replication id
-- (INFO replication's master_replid, which a promotion changes) is kept, and a change counts as
-- a gap from the last stamp to now. A server that does not answer INFO to a script skips this.
local function primary_changed(primary)
  local info = redis.pcall('INFO', 'replication')
  local id = type(info) == 'string' and string.match(info, 'master_replid:(%x+)')
  if not id then return false end
  local before = redis.call('GET', primary)
  if before == id then return false end
  redis.call('SET', primary, id)
  return before ~= false
end
local function reclaim_held(clock, hold, gap_ms, hold_ms, outages, primary)
  local last = tonumber(redis.call('GET', clock) or '')
  redis.call('SET', clock, now)
  local failover = primary and primary_changed(primary)
  if last and (failover or now - last > tonumber(gap_ms)) then
    redis.call('SET', hold, '1', 'PX', hold_ms)
    if outages then
      redis.call('ZADD', outages, now, string.format('%d:%d', last, now))
      redis.call('ZREMRANGEBYRANK', outages, 0, -($OUTAGES_KEPT + 1))
    end
    return 1
  end
  return redis.call('EXISTS', hold)
end
