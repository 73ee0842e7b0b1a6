"""Lua scripts of the Redis store: every read-modify-write it does, atomically.

Each script touches keys of one hash slot only when the store runs against a
Redis Cluster (the caller groups keys by bucket, and a bucket is one slot), so
atomicity never needs a cross-slot transaction. The key layout and the
exactly-once argument are in :mod:`indexer.stores.redis.layout` and
:mod:`indexer.stores.redis.store`. The cluster layer's scripts (leases,
heartbeats, the engine registry) are :mod:`indexer.cluster.scripts`.

The writes of the index (block operations, metadata changes) go through
scripts that first check the written hash's *anchor* fields: ``#store`` must
hold the identity the writer knows and ``#w``, the hash's write counter, must
not be below the highest value the writer has seen. Either failing means the
hash lost data since (a flush, a restart, a failover): the script writes
nothing and answers -3, and the writer finds out what was lost.
"""

from __future__ import annotations

from indexer.stores.redis.client import Script

#: Apply one batch's block operations to one or more buckets, exactly once per
#: (bucket, generation): a bucket records the last batch each generation applied
#: there, and a re-delivered batch skips the generations that already ran.
#: Block keys are not passed as KEYS (one argument per block made the client the
#: bottleneck): each is its bucket key plus ":" and the hash, so it carries the
#: bucket's hash tag and always lives in the declared key's slot.
APPLY_OPS = Script(
    """
-- KEYS: one bucket hash per section
-- ARGV[1]: the batch mark "epoch:seq"; ARGV[2]: the rank id (bucket field "u<rid>" counts
--   its unknown removals)
-- ARGV[3]: msgpack tiers, each {field, gid, sibling fields...} (siblings: the other tiers of
--   the same rank medium generation, for distinct counting)
-- ARGV[4]: msgpack sections, one per KEYS entry, in order: a flat list in event order of
--   markers (number t: +1 per following hash in tier t; -t: -1; t + 16777216, a hold: +1
--   per following hash that holds no reference in tier t) and hashes (strings, each
--   operated on under the last marker before it); block key = KEYS[i] .. ":" .. hash
-- ARGV[5], ARGV[6]: the store identity the writer knows, and msgpack: per KEYS entry the
--   lowest "#w" it may hold (-1: not checked, nor counted); when any checked one does not
--   hold that identity or holds a lower "#w", nothing is written and {-3} is returned: the
--   store lost data.
-- ARGV[7], ARGV[8]: the rank's fence field and the writer's lease token ("" and "": unfenced);
--   when any bucket (or the metadata hash) holds a newer token in that field, nothing is
--   written and {-2} is returned: another owner has claimed the rank.
-- ARGV[9], ARGV[10], ARGV[11] (only on a standalone server, where one call can hold a whole
--   batch): the rank's metadata field, its expected and its new value; the metadata hash is
--   then the last KEYS entry. The batch is applied and committed together, or, when the
--   metadata changed, not at all (returns {-1}).
-- Bucket field "g<gid>" = "epoch:seq:n": the last batch applied there by the generation and
-- n, its distinct resident hashes in the bucket; "#top": the highest id any field of the
-- bucket or of its blocks is named after (what a new identity must allocate above).
-- Returns {block operations applied, then each KEYS entry's "#w" after the call (0: not
-- counted)}.
local call = redis.call
local mark = ARGV[1]
local e, s = string.match(mark, '^(%d+):(%d+)$')
e, s = tonumber(e), tonumber(s)
local tiers = cmsgpack.unpack(ARGV[3])
local sections = cmsgpack.unpack(ARGV[4])

local function covers(v)
  local ve, vs = string.match(v, '^(%d+):(%d+):')
  ve, vs = tonumber(ve), tonumber(vs)
  return ve > e or (ve == e and vs >= s)
end

local function shared(key, tier)
  if #tier < 3 then return false end
  local found = call('HMGET', key, unpack(tier, 3))
  for i = 1, #found do
    if found[i] then return true end
  end
  return false
end

local identity, floors, tops = ARGV[5], cmsgpack.unpack(ARGV[6]), {}
for i = 1, #KEYS do
  if floors[i] >= 0 then
    local anchor = call('HMGET', KEYS[i], '#store', '#w', '#top')
    if anchor[1] ~= identity or (tonumber(anchor[2]) or 0) < floors[i] then return {-3} end
    tops[i] = tonumber(anchor[3]) or 0
  end
end

local fence, token = ARGV[7], tonumber(ARGV[8])
local function fenced(key)
  if fence == '' then return false end
  local newest = call('HGET', key, fence)
  return newest and tonumber(newest) > token
end

local buckets = #KEYS
if ARGV[9] then
  buckets = buckets - 1
  if fenced(KEYS[#KEYS]) then return {-2} end
  if (call('HGET', KEYS[#KEYS], ARGV[9]) or '') ~= ARGV[10] then return {-1} end
end
for i = 1, buckets do
  if fenced(KEYS[i]) then return {-2} end
end

local top = tonumber(ARGV[2])
for t = 1, #tiers do
  top = math.max(top, tonumber(tiers[t][1]), tonumber(tiers[t][2]))
end

-- Numbers go to redis.call as strings ('1', not 1): Redis formats a number argument with
-- snprintf("%.17g") on every call, which cost ~15% of this script's time; a held count is
-- compared as the string '1' first for the same reason (tonumber parses with strtod).
local applied = 0
for i = 1, buckets do
  local bucket, section = KEYS[i], sections[i]
  local prefix, gens, unknown = KEYS[i] .. ':', {}, 0
  local tier, field, g, stores, holds, siblings
  for x = 1, #section do
    local v = section[x]
    if type(v) == 'number' then
      holds = v > 16777216
      if holds then v = v - 16777216 end
      stores = v > 0
      tier = tiers[stores and v or -v]
      field, siblings = tier[1], #tier >= 3
      g = gens[tier[2]]
      if g == nil then
        local m = call('HGET', bucket, 'g' .. tier[2])
        g = {skip = m and covers(m), n = m and tonumber(string.match(m, '(%d+)$')) or 0}
        gens[tier[2]] = g
      end
    elseif not g.skip then
      local key = prefix .. v
      if holds and call('HEXISTS', key, field) == 1 then  -- held already: no second reference
      elseif stores then
        if call('HINCRBY', key, field, '1') == 1 and not (siblings and shared(key, tier)) then
          g.n = g.n + 1
        end
      else  -- read first: most removals drop the last reference, some an unknown one
        local held = call('HGET', key, field)
        local c = held == '1' and 1 or held and tonumber(held) or 0
        if c > 1 then
          call('HINCRBY', key, field, '-1')
        else
          if held then call('HDEL', key, field) end
          if c < 1 then
            unknown = unknown + 1
          elseif not (siblings and shared(key, tier)) then
            g.n = g.n - 1
          end
        end
      end
      applied = applied + 1
    end
  end
  for gid, gen in pairs(gens) do
    if not gen.skip then call('HSET', bucket, 'g' .. gid, mark .. ':' .. gen.n) end
  end
  if unknown > 0 then call('HINCRBY', bucket, 'u' .. ARGV[2], unknown) end
  if tops[i] and top > tops[i] then call('HSET', bucket, '#top', top) end
end
if ARGV[9] then call('HSET', KEYS[#KEYS], ARGV[9], ARGV[11]) end
local counters = {applied}
for i = 1, #KEYS do
  counters[i + 1] = floors[i] >= 0 and call('HINCRBY', KEYS[i], '#w', '1') or 0
end
return counters
"""
)

#: What APPLY_OPS adds to a tier's marker for a hold (``delta`` 0: a reference only
#: for a hash holding none); tiers of one script call are far fewer.
HOLD_MARKER = 16777216

#: Compare-and-set fields of one hash: the rank metadata's only writer, so that
#: concurrent indexers, clears and id allocations never overwrite each other.
COMPARE_AND_SET = Script(
    """
-- KEYS[1]: the hash
-- ARGV[1], ARGV[2]: the store identity the writer knows and the lowest "#w" the hash may
--   hold (else -3: the store lost data, nothing is written)
-- ARGV[3]: n, the number of fields compared; ARGV[4 .. 2n+3]: field, expected value pairs
--   ("" expects the field absent); ARGV[2n+4 ..]: field, new value pairs ("" deletes it)
-- Returns the hash's "#w" after the write when every field held its expected value and
-- the new values were written, else 0.
local anchor = redis.call('HMGET', KEYS[1], '#store', '#w')
if anchor[1] ~= ARGV[1] or (tonumber(anchor[2]) or 0) < tonumber(ARGV[2]) then return -3 end
local n = tonumber(ARGV[3])
for i = 4, 2 * n + 2, 2 do
  if (redis.call('HGET', KEYS[1], ARGV[i]) or '') ~= ARGV[i + 1] then return 0 end
end
for i = 2 * n + 4, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return redis.call('HINCRBY', KEYS[1], '#w', 1)
"""
)

#: Allocate ids for one rank and record them under the rank until its metadata
#: takes them, so that the sweeper, reading the hash atomically, sees every id
#: in use or about to be.
RESERVE_IDS = Script(
    """
-- KEYS[1]: the metadata hash ("#ids" holds the last id allocated)
-- ARGV[1]: the rank's field for ids not yet in its metadata; ARGV[2]: how many ids
-- Sets ARGV[1] to "first:last" and returns the last new id.
local last = redis.call('HINCRBY', KEYS[1], '#ids', ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], (last - tonumber(ARGV[2]) + 1) .. ':' .. last)
return last
"""
)

#: A new owner's claim on a rank: the next fence token, if the engine is still
#: registered as the owner read it (the registry shares the metadata's slot).
CLAIM = Script(
    """
-- KEYS[1]: the engine registry hash; KEYS[2]: the metadata hash
-- ARGV[1]: the engine's name; ARGV[2]: its spec as the claimant read it; ARGV[3]: the rank's
--   fence field
-- Returns the rank's new fence token, or 0 when the engine is not registered with that spec.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
return redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
"""
)

#: Write a claim's token into buckets, so that they refuse older owners' writes.
RAISE_FENCE = Script(
    """
-- KEYS: bucket hashes; ARGV[1]: the rank's fence field; ARGV[2]: the new token
-- Each bucket's field becomes the larger of its value and the token.
local token = tonumber(ARGV[2])
for i = 1, #KEYS do
  local newest = redis.call('HGET', KEYS[i], ARGV[1])
  if not newest or tonumber(newest) < token then redis.call('HSET', KEYS[i], ARGV[1], token) end
end
return 1
"""
)

#: Give a store its identity at first use: kept if one is there already.
ESTABLISH_IDENTITY = Script(
    """
-- KEYS[1]: the metadata hash; ARGV[1]: a new random identity. Returns the identity it holds.
redis.call('HSETNX', KEYS[1], '#store', ARGV[1])
return redis.call('HGET', KEYS[1], '#store')
"""
)

#: Replace a store's identity after a loss: the metadata forgets every rank, so that
#: each starts again empty (its counts in the surviving buckets become garbage).
SWAP_IDENTITY = Script(
    """
-- KEYS[1]: the metadata hash; ARGV[1]: the identity the caller saw ("" none); ARGV[2]: the
--   new identity; ARGV[3]: the lowest id the new identity may allocate (every surviving
--   bucket's "#top" is below it)
-- Only when the hash still holds ARGV[1]: drops every rank's "r:" and "a:" fields (fence
-- tokens stay, so they keep rising), raises "#ids" to ARGV[3] and takes ARGV[2].
-- Returns the identity the hash holds now (ARGV[2], or another caller's).
local current = redis.call('HGET', KEYS[1], '#store') or ''
if current ~= ARGV[1] then return current end
local drop = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  local kind = string.sub(name, 1, 2)
  if kind == 'r:' or kind == 'a:' then drop[#drop + 1] = name end
end
for i = 1, #drop, 1000 do redis.call('HDEL', KEYS[1], unpack(drop, i, math.min(i + 999, #drop))) end
if tonumber(ARGV[3]) > (tonumber(redis.call('HGET', KEYS[1], '#ids')) or 0) then
  redis.call('HSET', KEYS[1], '#ids', ARGV[3])
end
redis.call('HSET', KEYS[1], '#store', ARGV[2])
redis.call('HINCRBY', KEYS[1], '#w', 1)
return ARGV[2]
"""
)

#: Put a store's identity into one bucket, dropping its fence tokens: they may belong
#: to an older identity whose tokens restart below them.
MARK_BUCKET = Script(
    """
-- KEYS[1]: a bucket hash; ARGV[1]: the identity. A bucket holding it already is left alone.
if redis.call('HGET', KEYS[1], '#store') == ARGV[1] then return 0 end
local drop = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(name, 1, 2) == 'f:' then drop[#drop + 1] = name end
end
for i = 1, #drop, 1000 do redis.call('HDEL', KEYS[1], unpack(drop, i, math.min(i + 999, #drop))) end
redis.call('HSET', KEYS[1], '#store', ARGV[1])
return 1
"""
)
