"""The leases of self-registered engines in Redis, shared by every API replica.

An engine may renew through any replica behind a load balancer, so its lease
cannot live in the replica that took the first announcement. Two keys in the
registry's hash slot hold them: ``{P:meta}:announced`` (engine name -> the
announcement and granted lease, JSON) and ``{P:meta}:announced:deadlines`` (a
sorted set, score: the deadline in ms on the Redis server's clock, so replicas'
clocks never disagree about it). Taking out lapsed leases is one script: each
goes to exactly one replica's sweep, which deregisters the engine, logs and
counts it once.
"""

from __future__ import annotations

import time

import msgspec

from indexer.announcements import Held, Lease, lease_at
from indexer.stores.redis.client import RedisClient, Script

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: Keep a lease, its deadline on the server's clock.
HOLD = Script(
    """
-- KEYS[1]: the announced hash; KEYS[2]: the deadlines; ARGV: name, record (JSON), lease ms
-- Returns nothing."""
    + _NOW
    + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

#: Take out every lapsed lease: removed here, so one caller gets each.
LAPSED = Script(
    """
-- KEYS[1]: the announced hash; KEYS[2]: the deadlines
-- Returns the server's time (ms), then the records of the leases whose deadline has passed."""
    + _NOW
    + """
local out = {tostring(now)}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('ZREM', KEYS[2], name)
  local record = redis.call('HGET', KEYS[1], name)
  redis.call('HDEL', KEYS[1], name)
  if record then table.insert(out, record) end
end
return out
"""
)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Held).decode


class RedisBook:
    """Implements :class:`~indexer.announcements.LeaseBook` over Redis.

    :meth:`lease` answers from the copy the last sweep read (every
    ``sweep_seconds``), with the deadline converted to this machine's clock.
    """

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._keys = [
            f"{{{client.layout.meta_key}}}:announced",
            f"{{{client.layout.meta_key}}}:announced:deadlines",
        ]
        self._seen: dict[str, tuple[Held, float]] = {}  # name -> (lease, local deadline)

    async def held(self, name: str) -> Held | None:
        (record,) = await self._client.execute([("HGET", self._keys[0], name)])
        return _decode(record) if record is not None else None

    async def hold(self, held: Held) -> None:
        args = [held.announcement.spec.name, _encode(held), round(held.lease_seconds * 1000)]
        await self._client.execute([self._client.script(HOLD, self._keys, args)])
        self._seen[held.announcement.spec.name] = (held, time.time() + held.lease_seconds)

    async def release(self, name: str) -> None:
        await self._client.execute([("HDEL", self._keys[0], name), ("ZREM", self._keys[1], name)])
        self._seen.pop(name, None)

    async def lapsed(self) -> list[Held]:
        (now, *records), fields, deadlines = await self._client.execute(
            [
                self._client.script(LAPSED, self._keys, []),
                ("HGETALL", self._keys[0]),
                ("ZRANGE", self._keys[1], 0, -1, "WITHSCORES"),
            ]
        )
        skew = time.time() - int(now) / 1000  # this machine's clock minus the server's
        due = dict(_pairs(deadlines))
        self._seen = {
            name.decode(): (_decode(raw), float(due[name]) / 1000 + skew)
            for name, raw in fields.items()
            if name in due
        }
        return [_decode(record) for record in records]

    def lease(self, name: str) -> Lease | None:
        return lease_at(self._seen.get(name), time.time)


def _pairs(reply: list) -> list:
    """``ZRANGE ... WITHSCORES`` as (member, score) pairs: redis-py gives pairs or,
    for a raw command, the flat list Redis sends."""
    if reply and isinstance(reply[0], list | tuple):
        return [tuple(pair) for pair in reply]
    return list(zip(reply[::2], reply[1::2], strict=True))
