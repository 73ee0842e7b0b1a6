"""Golden wire batches and hash vectors from the vLLM release in this venv.

The inputs are those of vLLM 0.33.0's golden data (``shared/fixtures/vllm-0.33.0``:
each hash vector's prompt and engine, each wire batch's events); the outputs are
this release's own: its ``Request`` hasher after ``init_none_hash`` (through
:func:`tests.vllm_tier.lookahead_vectors.vllm_case`, with no lookahead), and its
``KVEventBatch`` built from the events and encoded as its ZMQ publisher encodes.
Where the KV event wire and the hashing did not change, the files are byte for byte
0.33's: the cheapest proof that they did not. The legacy positional batch is left
out: no release of vLLM this tier runs publishes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.vllm_tier.conftest import SHARED
from tests.vllm_tier.lookahead_vectors import vllm_case

BASE = SHARED / "fixtures" / "vllm-0.33.0"
#: The inputs' fields of a hash vector, in the file's order; the rest are vLLM's answers.
_INPUTS = ("algo", "PYTHONHASHSEED", "block_size", "case", "tokens", "lora_name",
           "lora_path", "cache_salt", "mm")  # fmt: skip
_ANSWERS = ("none_hash_hex", "block_hashes_hex", "block_hashes_int64")
_LEGACY = "legacy_positional"


def hash_vectors_text(base: Path = BASE) -> str:
    """``hash_vectors.json``: each of ``base``'s cases hashed by this venv's vLLM."""
    out = []
    for case in json.loads((base / "hash_vectors.json").read_text()):
        inputs = {field: case[field] for field in _INPUTS}
        answered = vllm_case(inputs | {"lookahead_tokens": 0})
        out.append(inputs | {field: answered[field] for field in _ANSWERS})
    return json.dumps(out)


def wire_files(base: Path = BASE) -> dict[str, bytes]:
    """``wire/NAME.msgpack`` and ``wire/NAME.json``: ``base``'s batches as this venv's
    vLLM encodes them, and decoded by a plain msgpack decoder."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    encoder = msgspec.msgpack.Encoder()  # as vLLM's ZmqEventPublisher has it
    files = {}
    for plain in sorted((base / "wire").glob("*.json")):
        if plain.stem == _LEGACY:
            continue
        batch = msgspec.convert(_from_plain(json.loads(plain.read_text())), KVEventBatch)
        payload = encoder.encode(batch)
        files[f"wire/{plain.stem}.msgpack"] = payload
        decoded = _to_plain(msgspec.msgpack.decode(payload))
        files[f"wire/{plain.stem}.json"] = json.dumps(decoded, indent=1).encode()
    return files


def _from_plain(value: Any) -> Any:
    """A decoded batch as JSON shows it, its ``{"bytes_hex": ...}`` made bytes again."""
    if isinstance(value, dict):
        if set(value) == {"bytes_hex"}:
            return bytes.fromhex(value["bytes_hex"])
        return {k: _from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_plain(v) for v in value]
    return value


def _to_plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value
