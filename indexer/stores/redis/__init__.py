"""The Redis store (standalone or Cluster), shared by indexer workers and API replicas."""

from indexer.stores.redis.store import OwnedRank, RedisConfig, RedisStore, check_redis_url

__all__ = ["OwnedRank", "RedisConfig", "RedisStore", "check_redis_url"]
