"""Lua scripts of the cluster layer: leases, worker heartbeats, the engine registry.

Each runs in one hash slot: a lease is one key, the worker set one key, and
the registry shares the store metadata's slot (its hash is named
``{P:meta}:engines``) so that a deregistration can forget the engine's ranks
and raise their fence tokens in the same step. Rank fields of ``P:meta``:
``r:<dp>:<engine>`` (metadata), ``a:<dp>:<engine>`` (ids held), ``f:<dp>:<engine>``
(the fence token), as :mod:`indexer.stores.redis.layout` names them.
"""

from __future__ import annotations

from indexer.stores.redis.client import Script

#: Register an engine (``indexer.cluster.redis_registry``); readers poll "#version".
REGISTER = Script(
    """
-- KEYS[1]: the engine registry hash; ARGV[1]: the engine's name; ARGV[2]: its spec (JSON)
-- Returns 1 when registered, 0 when the name is taken.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], '#version', 1)
return 1
"""
)

#: Deregister an engine and forget its ranks in one step, bumping each rank's
#: fence so that whoever still consumes it has its next write refused.
DEREGISTER = Script(
    """
-- KEYS[1]: the engine registry hash; KEYS[2]: the metadata hash; ARGV[1]: the engine's name
-- Rank fields: "r:<dp>:<engine>" (metadata), "a:..." (ids held), "f:..." (fence).
-- Returns the spec it removed, or nil when none was registered.
local spec = redis.call('HGET', KEYS[1], ARGV[1])
if not spec then return nil end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[1], '#version', 1)
for dp = 0, (cjson.decode(spec)['dp_ranks'] or 1) - 1 do
  local rank = dp .. ':' .. ARGV[1]
  redis.call('HDEL', KEYS[2], 'r:' .. rank, 'a:' .. rank)
  redis.call('HINCRBY', KEYS[2], 'f:' .. rank, 1)
end
return spec
"""
)

#: Keep a lease (``indexer.cluster.leases``) only while it is still the caller's.
RENEW_LEASE = Script(
    """
-- KEYS[1]: the lease; ARGV[1]: the holder's value; ARGV[2]: the new time to live, ms
-- Returns 1 when the lease held that value (its time to live restarts), else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
)

#: Give a lease back, unless it is someone else's by now.
RELEASE_LEASE = Script(
    """
-- KEYS[1]: the lease; ARGV[1]: the holder's value. Returns 1 when it was deleted.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
)

#: The live indexer workers, by Redis's clock (workers' clocks may disagree).
HEARTBEAT = Script(
    """
-- KEYS[1]: sorted set of worker ids, scored by the time (ms) their heartbeat expires
-- ARGV[1]: the caller's worker id ("" to only look); ARGV[2]: its time to live, ms
-- Drops expired members and returns the live ones.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
)
