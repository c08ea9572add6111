-- progress(...): an episode's progress snapshot, never overwritten by an older one.
-- A progress snapshot (broker/records.py Progress) replaces the episode's only if it is of
-- another trajectory or later in this one ("<trajectory> <seq>"): the writes of one attempt go
-- through the process's publisher in order, but a snapshot must never be overwritten by an
-- older one, whatever the order it reached Redis in. Fencing is the caller's (``holds``).
-- The order mark is kept with Redis' time of the write ("<trajectory> <seq> <ms>"): START
-- compares it with the outages the sweep clock recorded (lua/ledger_outage_fn.lua), since a
-- snapshot written before a failover or a restart may have been followed by one that was lost.
local function progress(prog, seqs, episode, snapshot, mark)
  local cur = redis.call('HGET', seqs, episode)
  if cur then
    local ct, cs = string.match(cur, '^(%S+) (%d+)')
    local nt, ns = string.match(mark, '^(%S+) (%d+)')
    if ct == nt and tonumber(cs) >= tonumber(ns) then return end
  end
  redis.call('HSET', prog, episode, snapshot)
  redis.call('HSET', seqs, episode, mark .. ' ' .. now)
end
