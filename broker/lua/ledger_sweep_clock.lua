-- SWEEP_CLOCK: the sweep clock stamped; 1 while reclaims are held.
-- KEYS: clock, hold, outages, primary   ARGV: gap_ms, hold_ms
return reclaim_held(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], KEYS[4])
