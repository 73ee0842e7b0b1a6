"""The Lua scripts of :class:`~indexer.routed.redis.RedisRouted`, one call each.

Every key carries one hash tag, so on a Redis Cluster all routed entries live
in one slot and every script (``route`` reads every candidate and records for
one in a single atomic step) runs where its keys are. ``KEYS[1]`` is the set
of ranks holding entries, ``KEYS[2]`` the hash of counters; ``ARGV[1]`` the
prefix of the per-rank sorted sets (``<prefix>engine|dp_rank``: member the
block hash, score its deadline in ms of the server's clock), ``ARGV[2]``
how long after its last deadline Redis itself expires a sorted set nobody
touched.

The rules restated here are :mod:`indexer.core.routed`'s: deadlines a
microsecond apart along a chain (later blocks first to go), the entries
whose deadline comes first evicted past the bound, routed blocks extending
the exact GPU run, scored with the routed weight beyond the exact prefix, a
rank's other live entries weighed as its queue (indexer.core.load.queued_blocks),
ties to the rank with the fewest live entries, then to the first candidate.
"""

from __future__ import annotations

_PRELUDE = """
local R, S, zp, grace = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function count(name, n)
  if n > 0 then redis.call('HINCRBY', S, name, n) end
end
local function expire(rank)
  local z = zp .. rank
  local gone = redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  if redis.call('EXISTS', z) == 0 then redis.call('SREM', R, rank) end
  return gone
end
local function run(rank, start, first, n)
  local z, e = zp .. rank, start
  while e < n and redis.call('ZSCORE', z, ARGV[first + e]) do e = e + 1 end
  return e
end
local function record(rank, ttl, bound, first, last)
  local z, new, args = zp .. rank, 0, {}
  for i = first, last do
    args[#args + 1] = now + ttl - (i - first) * 0.001
    args[#args + 1] = ARGV[i]
    if #args >= 2000 then
      new = new + redis.call('ZADD', z, unpack(args))
      args = {}
    end
  end
  if #args > 0 then new = new + redis.call('ZADD', z, unpack(args)) end
  local evicted = redis.call('ZCARD', z) - bound
  if evicted > 0 then redis.call('ZPOPMIN', z, evicted) else evicted = 0 end
  local top = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if top[2] then redis.call('PEXPIREAT', z, math.ceil(tonumber(top[2]) + grace)) end
  redis.call('SADD', R, rank)
  count('recorded', new)
  count('evicted', evicted)
  return new, evicted
end
"""

#: ARGV[3..]: rank, ttl_ms, bound, then the chain. Returns {expired, new, evicted}.
RECORD = (
    _PRELUDE
    + """
local rank = ARGV[3]
local expired = expire(rank)
count('expired', expired)
local new, evicted = record(rank, tonumber(ARGV[4]), tonumber(ARGV[5]), 6, #ARGV)
return {expired, new, evicted}
"""
)

#: ARGV[3..]: n engines, the engines, n starts, (rank, start) pairs, then the chain.
#: Returns {expired, {rank, routed_blocks, ...}}.
LOOKUP = (
    _PRELUDE
    + """
local i, wanted, starts = 3, {}, {}
local ne = tonumber(ARGV[i])
for k = 1, ne do wanted[ARGV[i + k]] = true end
i = i + ne + 1
local ns = tonumber(ARGV[i])
for k = 0, ns - 1 do starts[ARGV[i + 1 + 2 * k]] = tonumber(ARGV[i + 2 + 2 * k]) end
local first = i + 2 * ns + 1
local n, out, expired = #ARGV - first + 1, {}, 0
for _, rank in ipairs(redis.call('SMEMBERS', R)) do
  if wanted[string.match(rank, '^(.*)|')] then
    expired = expired + expire(rank)
    local start = starts[rank] or 0
    local e = run(rank, start, first, n)
    if e > start then
      out[#out + 1] = rank
      out[#out + 1] = e
    end
  end
end
count('expired', expired)
return {expired, out}
"""
)

#: ARGV[3..]: routed weight, ttl_ms, n candidates, per candidate (rank, gpu_blocks,
#: prefix_blocks, exact score, bound, miss factor, load cost, per_block), then the chain. The
#: pick is indexer.core.routed.best's: lowest cost (indexer.core.load.cost, the queue the
#: rank's live entries not of the chain's routed run), then best score, then fewest live
#: entries, then the first candidate.
#: Returns {expired, pick (0-based, -1: none), new, evicted, {rank, routed_blocks, ...},
#: {rank, queued, ...}}, as they were before the pick's record.
ROUTE = (
    _PRELUDE
    + """
local w, ttl, nc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local first = 6 + 8 * nc
local n, runs, queues, expired = #ARGV - first + 1, {}, {}, 0
local pick, pc, ps, pl = -1, 0, 0, 0
local function micro(x) return math.floor(x * 1e6 + 0.5) end
for k = 0, nc - 1 do
  local b = 6 + 8 * k
  local rank, start, prefix = ARGV[b], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  expired = expired + expire(rank)
  local e = run(rank, start, first, n)
  if e > start then runs[rank] = e end
  local live = redis.call('ZCARD', zp .. rank)
  local queued = math.max(0, live - (e - start))
  if queued > 0 then queues[rank] = queued end
  local score = tonumber(ARGV[b + 3]) + math.max(0, e - prefix) * w
  local c = micro(math.max(0, n - score) * tonumber(ARGV[b + 5]) + tonumber(ARGV[b + 6])
    + tonumber(ARGV[b + 7]) * queued)
  local s = micro(score)
  if pick < 0 or c < pc or (c == pc and (s > ps or (s == ps and live < pl))) then
    pick, pc, ps, pl = k, c, s, live
  end
end
count('expired', expired)
local new, evicted = 0, 0
if pick >= 0 then
  local b = 6 + 8 * pick
  local rank, start = ARGV[b], tonumber(ARGV[b + 1])
  if start < n then
    new, evicted = record(rank, ttl, tonumber(ARGV[b + 4]), first + start, first + n - 1)
  end
end
local function flat(by_rank)
  local out = {}
  for rank, x in pairs(by_rank) do
    out[#out + 1] = rank
    out[#out + 1] = x
  end
  return out
end
return {expired, pick, new, evicted, flat(runs), flat(queues)}
"""
)

#: ARGV[3..]: per rank (rank, clear 1/0, n, n hashes stored on GPU).
#: Returns {expired, confirmed, cleared}.
SETTLE = (
    _PRELUDE
    + """
local i, expired, confirmed, cleared = 3, 0, 0, 0
while i <= #ARGV do
  local rank, clear, m = ARGV[i], ARGV[i + 1] == '1', tonumber(ARGV[i + 2])
  local z = zp .. rank
  if redis.call('EXISTS', z) == 1 then
    expired = expired + expire(rank)
    if clear then
      cleared = cleared + redis.call('ZCARD', z)
      redis.call('DEL', z)
    end
    for j = i + 3, i + 2 + m, 1000 do
      confirmed = confirmed + redis.call('ZREM', z, unpack(ARGV, j, math.min(j + 999, i + 2 + m)))
    end
    if redis.call('EXISTS', z) == 0 then redis.call('SREM', R, rank) end
  end
  i = i + 3 + m
end
count('expired', expired)
count('confirmed', confirmed)
count('cleared', cleared)
return {expired, confirmed, cleared}
"""
)

#: ARGV[3]: an engine. Ends every entry of its ranks. Returns {expired, cleared}.
FORGET = (
    _PRELUDE
    + """
local expired, cleared = 0, 0
for _, rank in ipairs(redis.call('SMEMBERS', R)) do
  if string.match(rank, '^(.*)|') == ARGV[3] then
    expired = expired + expire(rank)
    cleared = cleared + redis.call('ZCARD', zp .. rank)
    redis.call('DEL', zp .. rank)
    redis.call('SREM', R, rank)
  end
end
count('expired', expired)
count('cleared', cleared)
return {expired, cleared}
"""
)

#: Returns {expired, live, counter, value, ...} after dropping what has expired.
COUNTS = (
    _PRELUDE
    + """
local expired, live = 0, 0
for _, rank in ipairs(redis.call('SMEMBERS', R)) do
  expired = expired + expire(rank)
  live = live + redis.call('ZCARD', zp .. rank)
end
count('expired', expired)
return {expired, live, redis.call('HGETALL', S)}
"""
)
