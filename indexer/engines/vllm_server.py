"""Where vLLM's OpenAI server describes its KV event publishers, shared by the adapters
of every vLLM release that answers it: ``GET /kv_event_sources``, each data-parallel
rank's events config, already in the shape :mod:`indexer.discovery.served` reads."""

from __future__ import annotations

from typing import Any

PATH = "/kv_event_sources"


def read_sources(answer: Any) -> Any:
    """vLLM's answer is the shape kvindex reads: as it is."""
    return answer
