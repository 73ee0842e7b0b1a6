"""A vLLM KV cache group as kvindex declares it (``kv_groups``), from vLLM's own spec.

vLLM is imported here only inside functions: kvindex never depends on it.
"""

from __future__ import annotations

from typing import Any


def group_of(kv_cache_spec: Any) -> dict[str, Any]:
    """One KV cache group as kvindex's ``kv_groups`` declares it."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    kind = get_kv_cache_spec_kind(kv_cache_spec).value
    window = getattr(kv_cache_spec, "sliding_window", None) if kind == "sliding_window" else None
    return {"kind": kind, "sliding_window": window, "block_size": kv_cache_spec.block_size}
