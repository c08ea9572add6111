-- broker/caps.py: lapsed holders of a cap swept (lease expired: count and lease gone), unless
-- ``held`` (right after an outage, ledger_outage_fn.lua), then its slots in use.
local function sweep(z, h, held)
  if not held then
    local lapsed = redis.call('ZRANGEBYSCORE', z, '-inf', now)
    for _, m in ipairs(lapsed) do redis.call('HDEL', h, m) end
    if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  end
  local used = 0
  for _, v in ipairs(redis.call('HVALS', h)) do used = used + tonumber(v) end
  return used
end
