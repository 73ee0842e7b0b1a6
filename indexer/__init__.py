"""kvindex's library: the core rules, engine adapters, stores, ingest and scale-out.

- :mod:`indexer.core`: events, residency rules and prefix matching (pure logic);
- :mod:`indexer.engines`: what is specific to an engine (vLLM's wire and hashing);
- :mod:`indexer.stores`: where the counts live (in process, Redis);
- :mod:`indexer.ingest`: ZMQ consumers per engine rank, the subscriber, trace replay;
- :mod:`indexer.cluster`: leases, registry, status board and workers over Redis;
- :mod:`indexer.engine_registry`: the engines followed, their declared configuration.
"""
