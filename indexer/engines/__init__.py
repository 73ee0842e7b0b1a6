"""Engine adapters: everything that is specific to one inference engine.

:mod:`indexer.engines.vllm` holds vLLM's: its KV event wire and its block hashing.
"""
