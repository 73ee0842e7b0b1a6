"""The Redis store (standalone or Cluster), shared by indexer workers and API replicas.

Modules, one job each: ``config`` (where Redis is), ``client`` (the one
gateway every command goes through), ``layout`` (key and field names, the
metadata codec), ``scripts`` (the store's Lua), ``plan`` (a batch resolved to
ids and per-bucket writes), ``store`` (the fenced write path), ``reads``
(answers), ``losses`` (noticing lost data), ``sweeper`` (garbage).
"""

from indexer.stores.redis.client import RedisClient, Script
from indexer.stores.redis.config import RedisConfig, check_redis_url
from indexer.stores.redis.layout import Layout
from indexer.stores.redis.store import RedisStore

__all__ = ["Layout", "RedisClient", "RedisConfig", "RedisStore", "Script", "check_redis_url"]
