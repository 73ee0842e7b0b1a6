"""Engine adapters: everything that is specific to one inference engine.

:mod:`.base` says what kvindex needs of an engine (:class:`~.base.EngineAdapter`);
each package here with an ``adapter`` module is one engine type, found by
name by :mod:`.catalog`: :mod:`indexer.engines.vllm` (vLLM 0.33's wire and
block hashing) and :mod:`indexer.engines.vllm_legacy` (older vLLM's
positional events). :mod:`.zmq_framing` is the framing both share.
"""
