-- PUBLISH_MANY: records and progress snapshots of many attempts, each fenced by its own lease.
-- KEYS: stream, running, then per item: lease, state, attempt_ids, progress, progress_seq
-- ARGV: ttl_ms, then per item: token, record, member, episode, "<attempt>:<attempt_id>", snapshot,
--       "<trajectory> <seq>"
-- Each item (a record, a progress snapshot, or both) is written only while its own attempt holds
-- its episode (``holds``: a lapsed lease is taken back): one round trip for the items of many episodes.
-- Several items of one attempt in a batch (a record and the prompt snapshot after it) are fenced
-- once: nothing else runs while the script does, so the first answer holds for the rest.
-- Returns {ok_1 .. ok_n, xlen}; xlen is -1 when no record was added (snapshots alone leave the
-- stream as it was: no XLEN for them).
local n = (#KEYS - 2) / 5
local out = {}
local added = false
local fenced = {}  -- token -> whether its attempt holds its episode
for i = 1, n do
  local k, a = 2 + (i - 1) * 5, 1 + (i - 1) * 7
  local ok = fenced[ARGV[a + 1]]
  if ok == nil then
    ok = holds(KEYS[k + 1], KEYS[2], KEYS[k + 2], KEYS[k + 3], ARGV[a + 1], ARGV[1], ARGV[a + 3], ARGV[a + 4],
               ARGV[a + 5]) and true or false
    fenced[ARGV[a + 1]] = ok
  end
  if ok then
    if ARGV[a + 2] ~= '' then
      redis.call('XADD', KEYS[1], '*', 'r', ARGV[a + 2])
      added = true
    end
    if ARGV[a + 6] ~= '' then progress(KEYS[k + 4], KEYS[k + 5], ARGV[a + 4], ARGV[a + 6], ARGV[a + 7]) end
    out[i] = 1
  else
    out[i] = 0
  end
end
out[n + 1] = added and redis.call('XLEN', KEYS[1]) or -1
return out
