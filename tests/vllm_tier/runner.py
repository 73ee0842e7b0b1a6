"""The model runner's output of one step, as the scheduler of the vLLM release in this
venv takes it: the tier's stand-in for a forward pass, on every release it runs."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

#: vLLM 0.33's output also maps each request to its row (0.34 dropped the field).
_INDEXED = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}


def runner_output(
    req_ids: list[str], sampled: list[list[int]], connector: KVConnectorOutput | None = None
) -> Any:
    """The output of a step that ran ``req_ids`` and sampled ``sampled`` (row by row)."""
    rows = {"req_id_to_index": {r: n for n, r in enumerate(req_ids)}} if _INDEXED else {}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=connector, **rows
    )
